//! The watch stream: lock events as this node applies them, kept in a bounded buffer so that a
//! watcher that reconnects can resume from the last log index it saw.
//!
//! Every replica applies the same log, so any node serves watches with the same events and
//! indexes. The buffer keeps the last [`WATCH_BUFFER`] events; a watcher asking to resume from an
//! index older than that (or older than this node's start, or a snapshot it installed) is told to
//! resynchronise from the lock listing. Leader changes are sent live only (they are not log
//! entries). A watcher that cannot keep up is told so and its watch ends with the index to resume
//! from: the node never buffers without bound for a slow reader.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use serde::Serialize;
use tokio::sync::broadcast;

use crate::node::events::LockEvent;

/// Events kept for resuming watchers.
pub const WATCH_BUFFER: usize = 10_000;
/// Events a live watcher may fall behind before its watch ends (`lagged`).
pub const WATCH_CHANNEL: usize = 4096;
/// Watches one connection may hold at once.
pub const MAX_WATCHES_PER_CONNECTION: usize = 16;

/// One item of the stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum WatchItem {
    Lock(LockEvent),
    Leader(LeaderEvent),
}

/// The node learned of a new leader.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaderEvent {
    /// Always `leader`.
    pub event: &'static str,
    pub leader_id: u64,
    pub term: u64,
    /// The node's applied index when it saw the change.
    pub index: u64,
}

impl WatchItem {
    pub fn index(&self) -> u64 {
        match self {
            WatchItem::Lock(e) => e.index,
            WatchItem::Leader(e) => e.index,
        }
    }

    /// Whether a watch of keys starting with `prefix` shows this item (leader changes: always).
    pub fn matches(&self, prefix: &str) -> bool {
        match self {
            WatchItem::Lock(e) => e.key.starts_with(prefix),
            WatchItem::Leader(_) => true,
        }
    }
}

struct Buffer {
    events: VecDeque<Arc<WatchItem>>,
    /// Every lock event with an index above this is in `events` (or came after).
    complete_after: u64,
    /// The highest index seen.
    last_index: u64,
}

/// Where events are published (by the driver) and watched (by client connections).
pub struct WatchHub {
    buffer: Mutex<Buffer>,
    live: broadcast::Sender<Arc<WatchItem>>,
}

impl std::fmt::Debug for WatchHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WatchHub")
    }
}

/// Why a watch cannot start where asked.
#[derive(Debug, PartialEq, Eq)]
pub struct TooOld {
    /// Resume from this index or later (or resynchronise from the lock listing).
    pub oldest: u64,
}

/// A started watch: the buffered events to send first, then the live receiver.
pub struct Subscription {
    pub backlog: Vec<Arc<WatchItem>>,
    pub live: broadcast::Receiver<Arc<WatchItem>>,
    /// The highest index this node had seen when the watch started: the live receiver's lock
    /// events at or below it were in the buffer (sent as `backlog`, or before `from`) and are
    /// skipped.
    pub index: u64,
}

impl WatchHub {
    /// A hub on a node whose applied index is `applied` (events at or below it are not known).
    pub fn new(applied: u64) -> WatchHub {
        let (live, _) = broadcast::channel(WATCH_CHANNEL);
        WatchHub {
            buffer: Mutex::new(Buffer {
                events: VecDeque::new(),
                complete_after: applied,
                last_index: applied,
            }),
            live,
        }
    }

    /// Publishes lock events applied at one index.
    pub fn publish(&self, events: Vec<LockEvent>) {
        let Ok(mut b) = self.buffer.lock() else {
            return;
        };
        for e in events {
            let item = Arc::new(WatchItem::Lock(e));
            b.last_index = b.last_index.max(item.index());
            if b.events.len() == WATCH_BUFFER {
                if let Some(old) = b.events.pop_front() {
                    // Events of `old.index()` may remain, but not all of them: complete only
                    // after it.
                    b.complete_after = b.complete_after.max(old.index());
                }
            }
            b.events.push_back(item.clone());
            let _ = self.live.send(item);
        }
    }

    /// A leader change, sent live.
    pub fn leader_changed(&self, leader_id: u64, term: u64) {
        let Ok(b) = self.buffer.lock() else {
            return;
        };
        let item = Arc::new(WatchItem::Leader(LeaderEvent {
            event: "leader",
            leader_id,
            term,
            index: b.last_index,
        }));
        let _ = self.live.send(item);
    }

    /// This node installed a snapshot up to `index`: the events before it are not known here.
    pub fn reset(&self, index: u64) {
        if let Ok(mut b) = self.buffer.lock() {
            b.events.clear();
            b.complete_after = b.complete_after.max(index);
            b.last_index = b.last_index.max(index);
        }
    }

    /// Starts a watch. `from`: send every event with an index above it (`None`: only new ones).
    pub fn subscribe(&self, prefix: &str, from: Option<u64>) -> Result<Subscription, TooOld> {
        let b = self
            .buffer
            .lock()
            .map_err(|_| TooOld { oldest: u64::MAX })?;
        let live = self.live.subscribe();
        let Some(from) = from else {
            return Ok(Subscription {
                backlog: Vec::new(),
                live,
                index: b.last_index,
            });
        };
        if from < b.complete_after {
            return Err(TooOld {
                oldest: b.complete_after,
            });
        }
        let backlog = b
            .events
            .iter()
            .filter(|e| e.index() > from && e.matches(prefix))
            .cloned()
            .collect();
        Ok(Subscription {
            backlog,
            live,
            index: b.last_index,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::events::LockEventKind;

    fn ev(index: u64, key: &str) -> LockEvent {
        LockEvent {
            index,
            event: LockEventKind::Granted,
            key: key.into(),
            client: "c".into(),
            token: Some(index),
            position: None,
            value: None,
        }
    }

    #[test]
    fn resume_replays_what_came_after_and_refuses_what_is_gone() {
        let hub = WatchHub::new(10);
        assert_eq!(
            hub.subscribe("", Some(9)).err(),
            Some(TooOld { oldest: 10 })
        );
        hub.publish(vec![ev(11, "a/1"), ev(11, "b/1")]);
        hub.publish(vec![ev(12, "a/2")]);
        let s = hub.subscribe("a/", Some(10)).unwrap();
        let idx: Vec<u64> = s.backlog.iter().map(|e| e.index()).collect();
        assert_eq!(idx, vec![11, 12]);
        assert_eq!(s.index, 12);
        let s = hub.subscribe("", Some(11)).unwrap();
        assert_eq!(s.backlog.len(), 1);
        let mut s = hub.subscribe("", None).unwrap();
        assert!(s.backlog.is_empty());
        hub.publish(vec![ev(13, "a/3")]);
        assert_eq!(s.live.try_recv().unwrap().index(), 13);
        // The buffer is bounded: the oldest events go, and resuming before them is refused.
        for i in 0..WATCH_BUFFER as u64 {
            hub.publish(vec![ev(100 + i, "x")]);
        }
        assert!(hub.subscribe("", Some(12)).is_err());
        assert!(hub.subscribe("", Some(100)).is_ok());
        hub.reset(50_000);
        assert_eq!(
            hub.subscribe("", Some(100)).err(),
            Some(TooOld { oldest: 50_000 })
        );
    }
}
