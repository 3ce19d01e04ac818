//! Lock events for watchers: what one applied command did to a lock, in the order it happened.
//!
//! Derived from the command and its [`Applied`] result on every replica (followers included), so a
//! watcher on any node sees the same events with the same log indexes. A replayed retry (answered
//! from the exactly-once table) changed nothing and yields no event.

use serde::Serialize;

use crate::lock::{Applied, Command, Event, Outcome};

/// What happened to a lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LockEventKind {
    /// `client` now holds the lock with `token` (directly, or handed on from the queue).
    Granted,
    /// `client` joined the queue at `position` (1 = next).
    Queued,
    /// `client` gave the lock back.
    Released,
    /// `client`'s lease ran out.
    Expired,
    /// `client`'s lease was extended.
    Renewed,
    /// `client`'s queued wait ended without a grant (cancelled, timed out, disconnected).
    Cancelled,
    /// The election's leader (holder of `token`) shows `value`: elected with its campaign
    /// value, or a value it proclaimed.
    Proclaimed,
}

/// One event on one lock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LockEvent {
    /// The log index of the command that caused it (several events may share one).
    pub index: u64,
    pub event: LockEventKind,
    pub key: String,
    pub client: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub position: Option<u32>,
    /// The election's value (`proclaimed` events; UTF-8, invalid bytes replaced).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

/// The events of one applied command.
pub fn lock_events(command: &Command, applied: &Applied) -> Vec<LockEvent> {
    let mut out = Vec::new();
    if applied.replayed {
        return out;
    }
    let index = applied.index;
    let event = |event, key: &str, client: &str, token, position| LockEvent {
        index,
        event,
        key: key.to_string(),
        client: client.to_string(),
        token,
        position,
        value: None,
    };
    use LockEventKind as K;
    match (command, &applied.outcome) {
        (
            Command::Acquire { key, client_id, .. }
            | Command::Campaign { key, client_id, .. }
            | Command::AcquireShared { key, client_id, .. },
            Outcome::Granted { token, .. } | Outcome::SharedGranted { token, .. },
        ) => out.push(event(K::Granted, key, client_id, Some(token.value), None)),
        (
            Command::Acquire { key, client_id, .. }
            | Command::Campaign { key, client_id, .. }
            | Command::AcquireShared { key, client_id, .. },
            Outcome::Queued { position },
        ) => out.push(event(K::Queued, key, client_id, None, Some(*position))),
        (
            Command::Release {
                key,
                client_id,
                token,
                ..
            },
            Outcome::Released,
        ) => out.push(event(K::Released, key, client_id, Some(token.value), None)),
        (Command::ReleaseHeld { key, client_id, .. }, Outcome::Released) => {
            out.push(event(K::Released, key, client_id, None, None))
        }
        (Command::Renew { key, client_id, .. }, Outcome::Renewed { token, .. }) => {
            out.push(event(K::Renewed, key, client_id, Some(token.value), None))
        }
        (
            Command::Expire { key, token } | Command::ExpireLease { key, token, .. },
            Outcome::Expired { client_id },
        ) => out.push(event(K::Expired, key, client_id, Some(*token), None)),
        (Command::CancelWait { key, client_id, .. }, Outcome::WaitCancelled) => {
            out.push(event(K::Cancelled, key, client_id, None, None))
        }
        _ => {}
    }
    for e in &applied.events {
        match e {
            Event::Granted {
                client_id, token, ..
            }
            | Event::SharedGranted {
                client_id, token, ..
            } => out.push(event(
                K::Granted,
                &token.key,
                client_id,
                Some(token.value),
                None,
            )),
            Event::WaiterRemoved { key, client_id, .. } => {
                // A CancelWait's own waiter is reported above, from its outcome.
                let own = matches!(command, Command::CancelWait { client_id: c, key: k, .. }
                    if c == client_id && k == key)
                    && matches!(applied.outcome, Outcome::WaitCancelled);
                if !own {
                    out.push(event(K::Cancelled, key, client_id, None, None))
                }
            }
            // Reported above from the Expire command's outcome.
            Event::Expired { .. } => {}
            // Not lock events of the watch stream (its grant after the delay is).
            Event::LockDelayStarted { .. } | Event::LockDelayEnded { .. } => {}
            Event::Proclaimed {
                client_id,
                token,
                value,
            } => {
                let mut e = event(
                    K::Proclaimed,
                    &token.key,
                    client_id,
                    Some(token.value),
                    None,
                );
                e.value = Some(String::from_utf8_lossy(value).into_owned());
                out.push(e);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lock::{FencingToken, LockStateMachine};

    fn acquire(key: &str, client: &str, req: &str) -> Command {
        Command::Acquire {
            key: key.into(),
            client_id: client.into(),
            request_id: req.into(),
            ttl_ms: 1000,
            wait_timeout_ms: None,
        }
    }

    /// a releases k with token 1, request id r3.
    fn release_by_a() -> Command {
        Command::Release {
            key: "k".into(),
            client_id: "a".into(),
            request_id: "r3".into(),
            token: FencingToken {
                key: "k".into(),
                value: 1,
            },
        }
    }

    #[test]
    fn a_hand_off_reads_released_then_granted() {
        let mut sm = LockStateMachine::new(crate::lock::Limits::default());
        let mut all = Vec::new();
        let mut apply = |index: u64, c: Command| {
            let applied = sm.apply(index, &c);
            all.extend(lock_events(&c, &applied));
        };
        apply(1, acquire("k", "a", "r1"));
        apply(2, acquire("k", "b", "r2"));
        apply(3, release_by_a());
        // A retry of the release changes nothing and says nothing.
        apply(4, release_by_a());
        let kinds: Vec<(u64, LockEventKind, &str)> = all
            .iter()
            .map(|e| (e.index, e.event, e.client.as_str()))
            .collect();
        assert_eq!(
            kinds,
            vec![
                (1, LockEventKind::Granted, "a"),
                (2, LockEventKind::Queued, "b"),
                (3, LockEventKind::Released, "a"),
                (3, LockEventKind::Granted, "b"),
            ]
        );
        assert_eq!(all[3].token, Some(2));
        let json = serde_json::to_value(&all[1]).unwrap();
        assert_eq!(json["event"], "queued");
        assert_eq!(json["position"], 1);
        assert!(json.get("token").is_none());
    }
}
