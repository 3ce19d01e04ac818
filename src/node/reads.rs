//! Reads: linearizable `Get`s served once their ReadIndex is applied, and the `/locks` listing.

use super::api::{ClientOp, ClientReply};
use super::{LockInfo, NodeCore, MS};
use crate::lock::FencingToken;
use crate::storage::Storage;

impl<S: Storage, R> NodeCore<S, R> {
    pub(super) fn serve_reads(&mut self) {
        if self.installing.is_some() {
            // The Raft core counts the snapshot as applied; the state is not there yet.
            return;
        }
        let applied = self.raft.applied_index();
        let (ready, later): (Vec<_>, Vec<_>) = self
            .read_indexes
            .drain(..)
            .partition(|(index, _)| *index <= applied);
        self.read_indexes = later;
        for (_, ctx) in ready {
            match self.reads.remove(&ctx) {
                Some((ClientOp::Leader { key }, reply)) => {
                    let answer = self.leader_of(&key);
                    self.reply(reply, answer);
                }
                Some((op, reply)) => {
                    let value = self.sm.get(op.key()).map(|v| v.to_vec());
                    self.reply(reply, ClientReply::Value(value));
                }
                None => {}
            }
        }
    }

    /// Election `key` as the applied state has it now.
    pub fn leader_of(&self, key: &str) -> ClientReply {
        let election = self.sm.election(key);
        let leader = election.as_ref().and_then(|e| e.leader.clone());
        ClientReply::Leader {
            token: leader.as_ref().map(|(_, token)| FencingToken {
                key: key.to_string(),
                value: *token,
            }),
            leader: leader.map(|(client, _)| client),
            value: election.as_ref().and_then(|e| e.value.clone()),
            candidates: election.map_or(0, |e| e.candidates as u32),
        }
    }

    /// Locks and waiters whose key starts with `prefix` (at most `limit`), read-write locks and
    /// semaphores among them, in key order.
    pub fn list_locks(&self, prefix: &str, limit: usize) -> Vec<LockInfo> {
        let mut out = self.list_plain_locks(prefix, limit);
        out.extend(
            self.sm
                .shared_locks_with_prefix(prefix, limit)
                .into_iter()
                .map(|lock| self.shared_lock_info(lock)),
        );
        out.sort_by(|a, b| a.key.cmp(&b.key));
        out.truncate(limit);
        out
    }

    fn shared_lock_info(&self, lock: crate::lock::SharedLockInfo) -> LockInfo {
        let key: std::sync::Arc<str> = std::sync::Arc::from(lock.key.as_str());
        let holders = lock
            .holders
            .iter()
            .map(|h| super::SharedHolderView {
                holder: h.client_id.clone(),
                fencing_token: h.token,
                mode: match h.mode {
                    crate::lock::LockMode::Read => "reader",
                    crate::lock::LockMode::Write => "writer",
                    crate::lock::LockMode::Permit => "permit",
                },
                slot: (h.mode == crate::lock::LockMode::Permit).then_some(h.slot),
                ttl_ms: h.ttl_ms,
                expires_in_ms: self
                    .shared_leases
                    .get(&(key.clone(), h.token))
                    .map(|l| l.deadline.saturating_sub(self.now) / MS),
            })
            .collect();
        LockInfo {
            lock_delay_ms: self
                .sm
                .lock_delay(&lock.key)
                .map(|d| d.delay_ms)
                .filter(|&ms| ms > 0),
            key: lock.key,
            holder: None,
            fencing_token: None,
            ttl_ms: None,
            expires_in_ms: None,
            session: None,
            waiters: lock.waiters.into_iter().map(|w| w.client_id).collect(),
            shared: Some(super::SharedLockView {
                permits: lock.permits,
                holders,
            }),
        }
    }

    fn list_plain_locks(&self, prefix: &str, limit: usize) -> Vec<LockInfo> {
        self.sm
            .locks_with_prefix(prefix, limit)
            .into_iter()
            .map(|(key, held, waiters)| {
                let attached_to = held
                    .as_ref()
                    .filter(|h| h.ttl_ms == 0)
                    .and_then(|h| self.sm.session_lease(&h.client_id));
                let deadline = match &attached_to {
                    Some(s) => self
                        .session_deadlines
                        .get(s.client_id.as_str())
                        .map(|d| d.at),
                    None => held
                        .as_ref()
                        .and_then(|_| self.leases.get(key.as_str()))
                        .map(|l| l.deadline),
                };
                (key, held, waiters, attached_to.map(|s| s.session), deadline)
            })
            .map(|(key, held, waiters, session, deadline)| LockInfo {
                lock_delay_ms: self
                    .sm
                    .lock_delay(&key)
                    .map(|d| d.delay_ms)
                    .filter(|&ms| ms > 0),
                expires_in_ms: deadline.map(|at| at.saturating_sub(self.now) / MS),
                session,
                key,
                holder: held.as_ref().map(|h| h.client_id.clone()),
                fencing_token: held.as_ref().map(|h| h.token),
                ttl_ms: held.as_ref().map(|h| h.ttl_ms),
                waiters: waiters.into_iter().map(|w| w.client_id).collect(),
                shared: None,
            })
            .collect()
    }
}
