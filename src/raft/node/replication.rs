//! Replication (§5.3): proposals, appends to followers under flow control, heartbeats, and both
//! sides of an append (the follower's checks and truncation, the leader's fast backtracking).

use bytes::Bytes;

use super::{ProposeError, Raft, Role, SNAPSHOT_RETRY_HEARTBEATS};
use crate::raft::message::MessageBody;
use crate::raft::progress::ProgressState;
use crate::raft::types::{Entry, EntryPayload, Index, NodeId, Term};

impl Raft {
    /// Proposes application commands. Returns the index of the last one.
    pub fn propose(&mut self, commands: Vec<Bytes>) -> Result<Index, ProposeError> {
        self.check_can_propose(commands.len())?;
        for data in commands {
            self.append_entry(EntryPayload::Command(data));
        }
        self.broadcast_append();
        Ok(self.log.last_index())
    }

    pub(super) fn check_can_propose(&self, count: usize) -> Result<(), ProposeError> {
        if self.role != Role::Leader {
            return Err(ProposeError::NotLeader {
                leader_id: self.leader_id,
            });
        }
        if self.transfer_target.is_some() {
            return Err(ProposeError::TransferInProgress);
        }
        if self.uncommitted_entries() + count as u64 > self.cfg.max_uncommitted_entries as u64 {
            return Err(ProposeError::Busy);
        }
        Ok(())
    }

    pub(super) fn append_entry(&mut self, payload: EntryPayload) -> Index {
        let index = self.log.last_index() + 1;
        let entry = Entry {
            term: self.term,
            index,
            payload,
        };
        self.append_to_log(entry);
        index
    }

    pub(super) fn broadcast_append(&mut self) {
        let peers: Vec<NodeId> = self.progress.keys().copied().collect();
        for peer in peers {
            self.send_append(peer, false);
        }
    }

    pub(super) fn broadcast_heartbeat(&mut self) {
        self.heartbeat_round += 1;
        let peers: Vec<(NodeId, Index)> = self
            .progress
            .iter()
            .map(|(&id, p)| (id, p.match_index))
            .collect();
        for (peer, match_index) in peers {
            let commit = self.log.committed.min(match_index);
            if let Some(pr) = self.progress.get_mut(&peer) {
                pr.commit_sent = pr.commit_sent.max(commit);
            }
            self.send(
                peer,
                MessageBody::Heartbeat {
                    commit,
                    read_seq: self.read_seq,
                },
            );
        }
    }

    /// Sends as many appends to `to` as flow control allows. With `allow_empty`, sends one even if
    /// there are no new entries (to probe, or to carry the commit index).
    pub(super) fn send_append(&mut self, to: NodeId, allow_empty: bool) {
        let mut allow_empty = allow_empty;
        // Bounded: each round either sends a batch (advancing next_index) or returns.
        for _ in 0..self.cfg.max_inflight_appends.max(1) {
            let Some(pr) = self.progress.get(&to) else {
                return;
            };
            match pr.state {
                ProgressState::Snapshot => return,
                ProgressState::Probe if pr.probe_sent => return,
                ProgressState::Replicate
                    if pr.inflight_full(
                        self.cfg.max_inflight_appends,
                        self.cfg.max_inflight_bytes,
                    ) =>
                {
                    return
                }
                _ => {}
            }
            let prev_log_index = pr.next_index - 1;
            let Some(prev_log_term) = self.log.term(prev_log_index) else {
                self.start_snapshot(to);
                return;
            };
            let entries = self
                .log
                .entries_from(pr.next_index, self.cfg.max_batch_bytes);
            if entries.is_empty() && !allow_empty {
                return;
            }
            allow_empty = false;
            let last = entries.last().map(|e| e.index);
            let bytes = entries.iter().map(|e| e.size_bytes()).sum::<usize>();
            let leader_commit = self.log.committed;
            let pr = self.progress.get_mut(&to).expect("checked above");
            match pr.state {
                ProgressState::Replicate => {
                    if let Some(last) = last {
                        pr.next_index = last + 1;
                        pr.sent(last, bytes);
                    }
                }
                _ => pr.probe_sent = true,
            }
            let probing = pr.state == ProgressState::Probe;
            pr.commit_sent = pr.commit_sent.max(leader_commit);
            self.send(
                to,
                MessageBody::Append {
                    prev_log_index,
                    prev_log_term,
                    entries,
                    leader_commit,
                },
            );
            if probing || last.is_none() {
                return;
            }
        }
    }

    pub(super) fn handle_append(
        &mut self,
        from: NodeId,
        prev_log_index: Index,
        prev_log_term: Term,
        entries: Vec<Entry>,
        leader_commit: Index,
    ) {
        let reject = |recovery_index, recovery_term| MessageBody::AppendResponse {
            success: false,
            match_index: 0,
            rejected_index: prev_log_index,
            recovery_index,
            recovery_term,
        };
        if prev_log_index < self.log.committed {
            // Everything up to our commit index already matches the leader.
            let committed = self.log.committed;
            self.send(
                from,
                MessageBody::AppendResponse {
                    success: true,
                    match_index: committed,
                    rejected_index: 0,
                    recovery_index: 0,
                    recovery_term: 0,
                },
            );
            return;
        }
        if prev_log_index > self.log.last_index() {
            // Seed design case (i): our log is shorter; tell the leader its length.
            let last = self.log.last_index();
            self.send(from, reject(last, 0));
            return;
        }
        let skip_check = self.bug(|b| b.append_without_prev_check);
        let our_term = self.log.term(prev_log_index).unwrap_or(0);
        if our_term != prev_log_term && !skip_check {
            // Seed design case (ii): the conflicting term and the last index before it.
            let mut first_of_term = prev_log_index;
            while first_of_term > self.log.committed + 1
                && self.log.term(first_of_term - 1) == Some(our_term)
            {
                first_of_term -= 1;
            }
            self.send(from, reject(first_of_term - 1, our_term));
            return;
        }
        // Append, truncating from the first conflicting entry (§5.3 step 3).
        let mut last_new = prev_log_index;
        for entry in entries {
            if entry.index != last_new + 1 {
                break; // malformed: entries must be contiguous after prev_log_index
            }
            last_new = entry.index;
            match self.log.term(entry.index) {
                Some(t) if t == entry.term && !skip_check => continue,
                Some(_) => {
                    if entry.index <= self.log.committed {
                        // Only a broken or malicious leader asks us to overwrite committed
                        // entries; refuse instead of destroying them.
                        return;
                    }
                    self.log.truncate_from(entry.index);
                    self.recompute_membership();
                }
                None => {}
            }
            self.append_to_log(entry);
        }
        if skip_check && last_new < self.log.last_index() {
            self.log.truncate_from(last_new + 1);
            self.recompute_membership();
        }
        let commit = leader_commit.min(last_new);
        if commit > self.log.committed {
            self.log.committed = commit;
        }
        self.send(
            from,
            MessageBody::AppendResponse {
                success: true,
                match_index: last_new,
                rejected_index: 0,
                recovery_index: 0,
                recovery_term: 0,
            },
        );
    }

    pub(super) fn handle_append_response(
        &mut self,
        from: NodeId,
        success: bool,
        match_index: Index,
        rejected_index: Index,
        recovery_index: Index,
        recovery_term: Term,
    ) {
        let last_index = self.log.last_index();
        let Some(pr) = self.progress.get_mut(&from) else {
            return;
        };
        pr.recent_active = true;
        if success {
            let match_index = match_index.min(last_index);
            let advanced = pr.update_match(match_index);
            if pr.state == ProgressState::Probe {
                pr.become_replicate();
            }
            if advanced {
                self.maybe_commit();
            }
            if self.transfer_target == Some(from)
                && self
                    .progress
                    .get(&from)
                    .is_some_and(|p| p.match_index == last_index)
            {
                self.send(from, MessageBody::TimeoutNow);
            }
            self.send_append(from, false);
            return;
        }
        // Rejection. Ignore stale ones: for an append at or below what is known to match, or, in
        // Probe, for anything but the probe we are waiting on.
        if rejected_index <= pr.match_index
            || (pr.state == ProgressState::Probe && rejected_index + 1 != pr.next_index)
            || pr.state == ProgressState::Snapshot
        {
            return;
        }
        // Fast backtracking with the seed design's recovery hint.
        let next = if recovery_term == 0 {
            recovery_index + 1
        } else {
            let mut search = rejected_index.min(last_index);
            let mut found = None;
            while search > self.log.snapshot_index() {
                match self.log.term(search) {
                    Some(t) if t == recovery_term => {
                        found = Some(search);
                        break;
                    }
                    Some(t) if t < recovery_term => break,
                    _ => search -= 1,
                }
            }
            match found {
                Some(index) => index + 1,
                None => recovery_index + 1,
            }
        };
        let pr = self.progress.get_mut(&from).expect("checked above");
        pr.become_probe(next.min(rejected_index));
        self.send_append(from, true);
    }

    pub(super) fn handle_heartbeat_response(&mut self, from: NodeId, read_seq: u64) {
        let last_index = self.log.last_index();
        let (max_inflight, max_bytes) =
            (self.cfg.max_inflight_appends, self.cfg.max_inflight_bytes);
        let round = self.heartbeat_round;
        let Some(pr) = self.progress.get_mut(&from) else {
            return;
        };
        pr.recent_active = true;
        pr.read_ack = pr.read_ack.max(read_seq);
        // An answer to a heartbeat stands for "anything sent before may be lost": it lets a
        // probe go again, frees a slot of a full pipeline and counts towards resending a
        // snapshot chunk. Only once per heartbeat round: a follower that was stalled (a long
        // snapshot install, a paused process) answers every heartbeat queued meanwhile at
        // once, and each answer used to send another full append (hundreds of 512 KiB appends
        // built in one turn of the leader's loop).
        let fresh = pr.unblocked_round < round;
        if fresh {
            pr.unblocked_round = round;
            pr.probe_sent = false;
        }
        let state = pr.state;
        if fresh && state == ProgressState::Replicate && pr.inflight_full(max_inflight, max_bytes) {
            pr.free_oldest();
        }
        let behind = pr.match_index < last_index;
        match state {
            ProgressState::Snapshot if !fresh => {}
            ProgressState::Snapshot => {
                // The chunk in flight is answered by its own response; only when that has not
                // come for a few heartbeat rounds is it taken as lost and sent again.
                let pr = self.progress.get_mut(&from).expect("checked above");
                pr.snapshot_waits += 1;
                if pr.snapshot_waits >= SNAPSHOT_RETRY_HEARTBEATS {
                    self.send_snapshot_chunk(from);
                }
            }
            _ if behind => self.send_append(from, true),
            _ => {}
        }
        self.advance_reads();
    }
}
