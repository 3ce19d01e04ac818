//! A timeline of one client's requests through the cluster, from the nodes' own clocks, for
//! `scripts/latency-timeline.sh`. Compiled in only with the `latency-probe` feature; without it
//! every function here is an empty inline function.
//!
//! Each node keeps two open records: the request a client sent to it (from the WebSocket
//! connection handing it to the driver until the answer is back at the connection) and the
//! append it is writing as a follower (from the driver taking the leader's entries until its
//! answer leaves). Events are the wall clock in nanoseconds, so the records of the three
//! processes on one machine line up. Every 64th record (by log index) is appended as one line
//! to the file named by `RAFTLOCK_PROBE_FILE`:
//!
//! ```text
//! L <log index> <pid> enqueued=<ns> picked=<ns> append=<ns> ...   (the node that answered)
//! F <log index> <pid> recv-io=<ns> recv=<ns> append=<ns> ...      (a follower)
//! ```
//!
//! The records assume one request at a time (one client, as `raftlock-bench latency` runs it):
//! with several, the events of overlapping requests mix.

#[cfg(feature = "latency-probe")]
mod on {
    use std::io::Write;
    use std::sync::Mutex;

    /// Events kept per record; more are dropped.
    const MAX_EVENTS: usize = 64;
    /// One record in this many (by log index) is written.
    const SAMPLE_EVERY: u64 = 64;

    struct Record {
        open: bool,
        key: u64,
        events: Vec<(&'static str, u64)>,
    }

    const CLOSED: Record = Record {
        open: false,
        key: 0,
        events: Vec::new(),
    };

    impl Record {
        /// A record that takes events, for the request or append at log index `key` (0: not
        /// known yet).
        fn opened(key: u64) -> Record {
            Record {
                open: true,
                key,
                events: Vec::with_capacity(MAX_EVENTS),
            }
        }

        fn push(&mut self, name: &'static str) {
            if self.open && self.events.len() < MAX_EVENTS {
                self.events.push((name, now()));
            }
        }
    }

    struct Probe {
        leader: Record,
        follower: Record,
        /// When the last entry-carrying append arrived from the network.
        recv_io: u64,
    }

    static PROBE: Mutex<Probe> = Mutex::new(Probe {
        leader: CLOSED,
        follower: CLOSED,
        recv_io: 0,
    });
    static FILE: Mutex<Option<std::fs::File>> = Mutex::new(None);

    fn now() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    }

    fn with(f: impl FnOnce(&mut Probe)) {
        if let Ok(mut p) = PROBE.lock() {
            f(&mut p);
        }
    }

    fn write(role: &str, record: &Record) {
        if record.key == 0 || !record.key.is_multiple_of(SAMPLE_EVERY) {
            return;
        }
        let mut line = format!("{role} {} {}", record.key, std::process::id());
        for (name, at) in &record.events {
            line.push_str(&format!(" {name}={at}"));
        }
        line.push('\n');
        let Ok(mut file) = FILE.lock() else { return };
        if file.is_none() {
            let Ok(path) = std::env::var("RAFTLOCK_PROBE_FILE") else {
                return;
            };
            *file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .ok();
        }
        if let Some(f) = file.as_mut() {
            // One write per line: lines of the three nodes do not interleave.
            let _ = f.write_all(line.as_bytes());
        }
    }

    pub fn client_enqueued() {
        with(|p| {
            // A node that answers clients is not in the middle of a follower's append.
            p.follower.open = false;
            p.leader = Record::opened(0);
            p.leader.push("enqueued");
        });
    }

    pub fn client_answered() {
        with(|p| {
            p.leader.push("answered");
            write("L", &p.leader);
            p.leader.open = false;
        });
    }

    pub fn event(name: &'static str) {
        with(|p| {
            if p.follower.open {
                p.follower.push(name);
            } else {
                p.leader.push(name);
            }
        });
    }

    pub fn appended(last_index: u64) {
        with(|p| {
            if !p.follower.open && p.leader.open && p.leader.key == 0 {
                p.leader.key = last_index;
            }
        });
    }

    /// A follower's answer that covers the log up to `match_index`: recorded on the request's
    /// timeline once its entry was appended, and when it covers that entry.
    pub fn acknowledged(name: &'static str, match_index: u64) {
        with(|p| {
            if !p.follower.open && p.leader.key != 0 && match_index >= p.leader.key {
                p.leader.push(name);
            }
        });
    }

    pub fn append_received_io() {
        with(|p| p.recv_io = now());
    }

    pub fn append_stepped(last_index: u64) {
        with(|p| {
            p.follower = Record::opened(last_index);
            p.follower.events.push(("recv-io", p.recv_io));
            p.follower.push("recv");
        });
    }

    pub fn ack_sent() {
        with(|p| {
            if p.follower.open {
                p.follower.push("ack-sent");
            }
        });
    }

    /// A peer stream took a message from its queue (on the driver's thread): on a follower that
    /// answered an append, its answer leaving; the follower's record ends there.
    pub fn peer_stream_took() {
        with(|p| {
            if p.follower.open {
                if p.follower.events.iter().any(|(n, _)| *n == "ack-sent") {
                    p.follower.push("ack-taken");
                    write("F", &p.follower);
                    p.follower.open = false;
                }
            } else {
                p.leader.push("sent-io");
            }
        });
    }
}

#[cfg(feature = "latency-probe")]
pub use on::*;

use crate::raft::{Message, MessageBody};

/// A peer message read from the network, before it is queued for the driver.
#[inline(always)]
pub fn peer_message_received(msg: &Message) {
    match &msg.body {
        MessageBody::Append { entries, .. } if !entries.is_empty() => append_received_io(),
        MessageBody::AppendResponse {
            success: true,
            match_index,
            ..
        } => acknowledged("ack-io", *match_index),
        _ => {}
    }
}

/// A peer message the driver takes.
#[inline(always)]
pub fn peer_message_stepped(msg: &Message) {
    match &msg.body {
        MessageBody::Append { entries, .. } => {
            if let Some(last) = entries.last() {
                append_stepped(last.index);
            }
        }
        MessageBody::AppendResponse {
            success: true,
            match_index,
            ..
        } => acknowledged("ack", *match_index),
        _ => {}
    }
}

#[cfg(not(feature = "latency-probe"))]
mod off {
    #[inline(always)]
    pub fn client_enqueued() {}
    #[inline(always)]
    pub fn client_answered() {}
    #[inline(always)]
    pub fn event(_name: &'static str) {}
    #[inline(always)]
    pub fn appended(_last_index: u64) {}
    #[inline(always)]
    pub fn acknowledged(_name: &'static str, _match_index: u64) {}
    #[inline(always)]
    pub fn append_received_io() {}
    #[inline(always)]
    pub fn append_stepped(_last_index: u64) {}
    #[inline(always)]
    pub fn ack_sent() {}
    #[inline(always)]
    pub fn peer_stream_took() {}
}

#[cfg(not(feature = "latency-probe"))]
pub use off::*;
