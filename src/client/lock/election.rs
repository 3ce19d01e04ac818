//! Leader election: [`RaftLockClient::campaign`] waits until this client leads an election and
//! returns a [`Leadership`] (the term's fencing token, proclaim, resign — on drop too);
//! [`RaftLockClient::leader`] reads who leads; [`RaftLockClient::observe`] follows it.
//!
//! An election is a key of its own whose lock holder is the leader: candidates wait in FIFO
//! order, the leader keeps its lease by renewing it (as a lock's), and each term is a fencing
//! token with mode `leader`, whose MAC a resource checks as it checks a lock's.

use std::time::{Duration, Instant};

use super::super::conn::{ReplyKind, Request, TokenRef};
use super::super::error::ClientError;
use super::{check_key, AutoRenewer, LockHandle, RaftLockClient};

/// Who leads an election, as read or observed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderInfo {
    /// The leader's owner id.
    pub leader: String,
    /// The term: the leader's fencing token.
    pub term: u64,
    /// The value it shows (its campaign value, or what it proclaimed since).
    pub value: Option<String>,
}

/// This client leads an election. Renew it ([`Leadership::auto_renew`]) to stay leader;
/// [`Leadership::resign`] (or dropping it) lets the next candidate lead.
#[derive(Debug)]
pub struct Leadership {
    handle: LockHandle,
}

impl Leadership {
    pub fn election(&self) -> &str {
        self.handle.key()
    }

    /// The term: pass it to every resource the leader writes, as a fencing token with mode
    /// `leader` (`"fencingToken": {"key": …, "value": term, "mode": "leader", "mac": …}`).
    pub fn term(&self) -> u64 {
        self.handle.fencing_token()
    }

    /// The term's MAC when the cluster has a fencing key (it covers the mode `leader`).
    pub fn fencing_mac(&self) -> Option<&str> {
        self.handle.fencing_mac()
    }

    /// The owner id the cluster records as the leader.
    pub fn owner_id(&self) -> &str {
        self.handle.owner_id()
    }

    /// Whether acting as leader is still safe (the lease, less the safety margin).
    pub fn is_valid(&self) -> bool {
        self.handle.is_valid()
    }

    pub fn valid_until(&self) -> Instant {
        self.handle.valid_until()
    }

    /// Renews the leader's lease once now.
    pub async fn renew(&self) -> Result<(), ClientError> {
        self.handle.renew().await
    }

    /// Renews in the background; [`AutoRenewer::lost`] resolves before another candidate could
    /// be elected if renewal fails.
    pub fn auto_renew(&self) -> AutoRenewer {
        self.handle.auto_renew()
    }

    /// Shows `value` as the election's value, for this term. Refused (`STALE_TOKEN`) once the
    /// term has ended.
    pub async fn proclaim(&self, value: &str) -> Result<(), ClientError> {
        self.handle
            .client()
            .proclaim_as(self.owner_id(), self.election(), self.term(), value)
            .await
    }

    /// Steps down: the next candidate, if any, is elected at once.
    pub async fn resign(self) -> Result<(), ClientError> {
        self.handle.release().await
    }
}

impl RaftLockClient {
    /// Campaigns to lead `election` with the default TTL, showing `value` once elected; waits
    /// until elected.
    pub async fn campaign(&self, election: &str, value: &str) -> Result<Leadership, ClientError> {
        self.campaign_with(election, value, self.inner.default_ttl, None)
            .await
    }

    /// Campaigns with the leader lease `ttl`, waiting at most `wait` to be elected
    /// (`Some(ZERO)`: only if no one leads; `None`: until elected). A wait that runs out is
    /// `ClientError::WaitTimeout`.
    pub async fn campaign_with(
        &self,
        election: &str,
        value: &str,
        ttl: Duration,
        wait: Option<Duration>,
    ) -> Result<Leadership, ClientError> {
        let policy = self.inner.session.cfg.retry.clone();
        let owner = self.inner.take_owner();
        let number = self.number_request(&owner);
        let result = self
            .grant_request(
                election,
                ttl,
                wait,
                &owner,
                &number,
                &policy,
                super::Grant::Campaign(value),
            )
            .await;
        drop(number);
        self.settle_owner(owner, &result);
        result.map(|handle| Leadership { handle })
    }

    /// Shows `value` as the value of `election`, whose leader is the owner id equal to this
    /// client's id with term `term` (for example a leader `lockctl campaign` elected, its owner
    /// id passed as this client's id). A [`Leadership`] proclaims with [`Leadership::proclaim`].
    pub async fn proclaim(
        &self,
        election: &str,
        term: u64,
        value: &str,
    ) -> Result<(), ClientError> {
        self.proclaim_as(&self.inner.client_id, election, term, value)
            .await
    }

    /// Shows `value` as the value of `election` for the leader `owner` in term `term`.
    pub async fn proclaim_as(
        &self,
        owner: &str,
        election: &str,
        term: u64,
        value: &str,
    ) -> Result<(), ClientError> {
        check_key(election)?;
        let number = self.number_request(owner);
        let request = Request {
            client_id: Some(owner),
            fencing_token: Some(TokenRef {
                key: election,
                value: term,
            }),
            value: Some(value),
            ack_below: number.ack_below,
            ..Request::new(11, election, &number.id)
        };
        self.inner
            .session
            .request(
                &request,
                ReplyKind::Normal,
                None,
                &self.inner.session.cfg.retry,
            )
            .await
            .map(|_| ())
    }

    /// Who leads `election` now (a linearizable read); `None` while no one does.
    pub async fn leader(&self, election: &str) -> Result<Option<LeaderInfo>, ClientError> {
        check_key(election)?;
        let request_id = self.next_request_id();
        let request = Request::new(12, election, &request_id);
        let reply = self
            .inner
            .session
            .request(
                &request,
                ReplyKind::Normal,
                None,
                &self.inner.session.cfg.retry,
            )
            .await?;
        let body = reply.body;
        Ok(
            match (body.leader, body.fencing_token.and_then(|t| t.value)) {
                (Some(leader), Some(term)) => Some(LeaderInfo {
                    leader,
                    term,
                    value: body.value,
                }),
                _ => None,
            },
        )
    }

    /// Follows who leads `election`: the current leader first, then each change (a new term,
    /// a proclaimed value, no leader) as the watch reports it. Reconnects by itself.
    pub async fn observe(&self, election: &str) -> Result<LeaderObserver, ClientError> {
        check_key(election)?;
        // Watch first, then read: a change after the read is then in the watch's stream.
        let watch = self.watch(election, None).await?;
        let current = self.leader(election).await?;
        Ok(LeaderObserver {
            election: election.to_string(),
            watch,
            current: current.clone(),
            first: Some(current),
        })
    }
}

/// A stream of who leads an election ([`RaftLockClient::observe`]).
pub struct LeaderObserver {
    election: String,
    watch: crate::client::Watch,
    current: Option<LeaderInfo>,
    /// The first answer, not yet yielded.
    first: Option<Option<LeaderInfo>>,
}

impl LeaderObserver {
    /// The next leader (`None` inside: no one leads), or `None` once the watch has ended.
    /// Events of terms older than the one shown are skipped.
    pub async fn next(&mut self) -> Option<Result<Option<LeaderInfo>, ClientError>> {
        if let Some(first) = self.first.take() {
            return Some(Ok(first));
        }
        loop {
            let event = match self.watch.next().await? {
                Ok(e) => e,
                Err(e) => return Some(Err(e)),
            };
            if event.key.as_deref() != Some(self.election.as_str()) {
                continue;
            }
            let term = event.token.unwrap_or(0);
            let current_term = self.current.as_ref().map_or(0, |c| c.term);
            let next = match event.event.as_str() {
                // Every election grant comes with a `proclaimed` event of the campaign's value
                // (same index): that one says who leads.
                "proclaimed" if term >= current_term => Some(LeaderInfo {
                    leader: event.client.unwrap_or_default(),
                    term,
                    value: event.value,
                }),
                "released" | "expired" if term == current_term && term > 0 => None,
                _ => continue,
            };
            if next != self.current {
                self.current = next.clone();
                return Some(Ok(next));
            }
        }
    }
}
