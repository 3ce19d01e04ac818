//! A follower behind a snapshot: its chunks staged and flushed as they arrive, and what it does
//! (votes, appends) and does not do (campaign, apply) while the state is being put in place.

use super::drive_halves::{acquire, Cluster};
use crate::node::*;
use crate::raft::Role;

fn granted(c: &Cluster, reply: u64) -> bool {
    c.replies
        .iter()
        .any(|(to, r)| *to == reply && matches!(r, ClientReply::Granted { .. }))
}

/// Node 3 is cut off and misses 80 grants (acquires of `k00`..`k79`, answered to 100..180),
/// and node 1 compacts its log past them (with `snapshot_entries` of 20).
fn leave_node_3_behind_a_snapshot(c: &mut Cluster) {
    c.cut.insert(3);
    for i in 0..80 {
        let now = c.now;
        c.core(1)
            .client_request(now, acquire(&format!("k{i:02}")), 1, 100 + i);
        c.core(1).drive().unwrap();
        c.settle([]);
    }
    assert!((0..80).all(|i| granted(c, 100 + i)));
    assert!(c.core(1).raft().snapshot_index() > c.core(3).raft().last_index());
}

/// Node 3 misses 80 grants that node 1 then compacts into a snapshot, sent in 128-byte
/// chunks once node 3 is back; the transfer is stopped once node 3 has staged `stop_at`
/// bytes, before its install begins. Returns node 3's staged bytes (in its working copy,
/// made durable).
fn stage_part_of_a_transfer(settings: NodeSettings, stop_at: usize) -> (usize, usize) {
    let mut c = Cluster::with_settings(NodeSettings {
        snapshot_entries: 20,
        ..settings
    });
    c.elect_node_1();
    c.core(1).raft.set_snapshot_chunk_bytes(128);
    leave_node_3_behind_a_snapshot(&mut c);
    c.cut.remove(&3);
    let staged = |c: &Cluster| c.cores[&3].storage.staged_len().0 >= stop_at;
    for _ in 0..50 {
        c.now += 10_000;
        let now = c.now;
        c.core(1).tick(now).unwrap();
        if c.try_settle_until([], staged).unwrap() {
            break;
        }
    }
    assert!(staged(&c), "node 3 never staged {stop_at} bytes");
    assert!(
        c.core(3).installing_snapshot().is_none(),
        "the snapshot is larger than {stop_at} bytes"
    );
    c.cores[&3].storage.staged_len()
}

/// The Readies that carry an arriving snapshot's chunks need no flush of their own, so
/// without one every `staged_bytes_per_flush` the install's first flush would sync the
/// whole snapshot at once.
#[test]
fn an_arriving_snapshot_is_flushed_in_parts_as_it_is_staged() {
    let (staged, durable) = stage_part_of_a_transfer(
        NodeSettings {
            staged_bytes_per_flush: 256,
            ..NodeSettings::default()
        },
        2048,
    );
    assert!(
        durable + 256 >= staged && durable >= 256,
        "{durable} of {staged} staged bytes durable"
    );
    // With the default (16 MiB), nothing of this small transfer is flushed yet.
    let (staged, durable) = stage_part_of_a_transfer(NodeSettings::default(), 2048);
    assert!(staged >= 2048);
    assert_eq!(durable, 0);
}

/// The case measured with real processes in docs/bench/snapshot-install.md: the leader
/// dies while a follower installs a large snapshot. The installing follower must still
/// vote and take appends, so that the other two make a leader and commit at once, and it
/// must not campaign itself, or apply anything, before its state is in place.
#[test]
fn a_follower_installing_a_snapshot_votes_and_takes_appends_but_neither_campaigns_nor_applies() {
    let mut c = Cluster::with_settings(NodeSettings {
        snapshot_entries: 20,
        install_slice_keys: 1,
        ..NodeSettings::default()
    });
    c.elect_node_1();
    leave_node_3_behind_a_snapshot(&mut c);

    // Node 3 is back; the leader sends it a snapshot, and its install starts.
    c.cut.remove(&3);
    let mut started = false;
    for _ in 0..50 {
        c.now += 10_000;
        let now = c.now;
        c.core(1).tick(now).unwrap();
        started = c
            .try_settle_until([], |c| c.cores[&3].installing_snapshot().is_some())
            .unwrap();
        if started {
            break;
        }
    }
    assert!(started, "node 3 never began installing a snapshot");
    let index = c.core(3).installing_snapshot().unwrap();
    let applied_before = c.core(3).state_machine().to_kv();

    // The leader dies. Node 3 waits out several election timeouts and does not campaign.
    c.cut.insert(1);
    let term = c.core(3).raft().term();
    for _ in 0..40 {
        c.tick(3);
    }
    assert!(
        c.core(3).installing_snapshot().is_some(),
        "the install outlasts the ticks"
    );
    assert_eq!(c.core(3).raft().role(), Role::Follower);
    assert_eq!(c.core(3).raft().term(), term, "node 3 did not campaign");
    assert_eq!(c.core(3).state_machine().to_kv(), applied_before);

    // Node 2 campaigns and wins with node 3's vote, and commits with its append.
    for _ in 0..100 {
        if c.core(2).raft().is_leader() {
            break;
        }
        c.tick(2);
    }
    assert!(c.core(2).raft().is_leader(), "node 2 never led");
    assert!(
        c.core(3).installing_snapshot().is_some(),
        "node 3 voted while installing"
    );
    let now = c.now;
    c.core(2).client_request(now, acquire("after"), 1, 999);
    c.core(2).drive().unwrap();
    let committed = c.try_settle_until([], |c| granted(c, 999)).unwrap();
    assert!(
        committed,
        "the new leader committed with node 3: {:?}",
        c.replies
            .iter()
            .filter(|(to, _)| *to == 999)
            .collect::<Vec<_>>()
    );
    let after = c.core(2).raft().commit_index();
    // Node 3 learns that the entry committed (the next heartbeat says so).
    for _ in 0..3 {
        c.tick(2);
    }
    assert!(c.core(3).raft().commit_index() >= after);
    assert!(
        c.core(3).installing_snapshot().is_some(),
        "node 3 still installs"
    );
    assert_eq!(
        c.core(3).state_machine().to_kv(),
        applied_before,
        "nothing was applied before the snapshot's state was in place"
    );

    // The install finishes, and what committed meanwhile applies after it.
    for _ in 0..200 {
        if c.core(3).installing_snapshot().is_none() {
            break;
        }
        c.tick(3);
    }
    assert!(c.core(3).installing_snapshot().is_none());
    for _ in 0..20 {
        c.tick(2);
        if c.core(3).raft().applied_index() == c.core(2).raft().applied_index() {
            break;
        }
    }
    assert!(c.core(3).raft().applied_index() > index);
    assert_eq!(
        c.core(3).raft().applied_index(),
        c.core(2).raft().applied_index()
    );
    assert_eq!(
        c.core(3).state_machine().to_kv(),
        c.core(2).state_machine().to_kv()
    );
    assert!(c
        .core(3)
        .state_machine()
        .to_kv()
        .iter()
        .any(|(k, _)| k == b"lock/after"));
}
