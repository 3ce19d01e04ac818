//! The cluster version: raised only once every member said it runs it, learners promoted only
//! once they run it, and a node that stops at an entry beyond its own version.

use super::drive_halves::Cluster;
use crate::lock::CLUSTER_VERSION;
use crate::node::*;
use crate::raft::EntryPayload;

fn versions(c: &Cluster) -> Vec<u32> {
    c.cores
        .values()
        .map(|core| core.state_machine().cluster_version())
        .collect()
}

#[test]
fn the_leader_raises_the_version_only_once_every_member_said_it_runs_it() {
    let mut c = Cluster::new();
    c.elect_node_1();
    c.tick_leader(5);
    assert_eq!(versions(&c), [1, 1, 1], "nobody said anything yet");

    // One member of three said it; the other could be an older RaftLock.
    c.core(1).peer_version(2, CLUSTER_VERSION);
    c.core(1).peer_version(3, 1);
    c.tick_leader(5);
    assert_eq!(versions(&c), [1, 1, 1]);

    // Both did (node 3 restarted with this RaftLock): the version is raised on every node,
    // and written with the rest of the applied state.
    c.core(1).peer_version(3, CLUSTER_VERSION);
    c.tick_leader(5);
    assert_eq!(versions(&c), [CLUSTER_VERSION; 3]);
    let kv = c.core(2).state_machine().to_kv();
    assert!(kv
        .iter()
        .any(|(k, v)| k == b"meta/cluster_version" && v == &CLUSTER_VERSION.to_be_bytes()));
    let reread = LockStateMachine::from_kv(kv).unwrap();
    assert_eq!(reread.cluster_version(), CLUSTER_VERSION);

    // Proposed once: more ticks add no entry.
    let last = c.core(1).raft().last_index();
    c.tick_leader(5);
    let now_last = c.core(1).raft().last_index();
    let entries = c.core(1).storage().entries(last + 1, now_last + 1);
    let raised = entries
        .unwrap()
        .iter()
        .filter(|e| {
            matches!(&e.payload, EntryPayload::Command(b)
                if matches!(Command::decode(b), Ok(Command::SetClusterVersion { .. })))
        })
        .count();
    assert_eq!(raised, 0);
}

#[test]
fn a_learner_is_promoted_only_once_it_said_it_runs_the_clusters_version() {
    let mut c = Cluster::new();
    c.elect_node_1();
    c.core(1).peer_version(2, CLUSTER_VERSION);
    c.core(1).peer_version(3, CLUSTER_VERSION);
    c.tick_leader(5);
    assert_eq!(versions(&c), [CLUSTER_VERSION; 3]);

    // Node 4 joins with an empty log and catches up as a learner, but has said nothing.
    let raft = Raft::new(
        crate::raft::Config::new(4, 11),
        crate::raft::InitialState::default(),
    )
    .unwrap();
    let sm = LockStateMachine::new(crate::lock::Limits::default());
    c.cores.insert(
        4,
        NodeCore::new(
            raft,
            crate::storage::MemStorage::new(),
            sm,
            NodeSettings::default(),
            0,
        ),
    );
    c.core(1).join(4, MemberInfo::default()).unwrap();
    c.tick_leader(10);
    let membership = c.core(1).raft().membership().clone();
    assert!(membership.learners.contains(&4), "{membership:?}");
    assert_eq!(c.core(4).state_machine().cluster_version(), CLUSTER_VERSION);

    // Once it said so (its stream's header), it is promoted.
    c.core(1).peer_version(4, CLUSTER_VERSION);
    c.tick_leader(10);
    let membership = c.core(1).raft().membership().clone();
    assert!(membership.voters.contains(&4), "{membership:?}");
}

#[test]
fn a_node_stops_at_an_entry_that_raises_the_version_beyond_its_own() {
    let mut c = Cluster::new();
    c.elect_node_1();
    let newer = Command::SetClusterVersion {
        version: CLUSTER_VERSION + 1,
    };
    c.core(1)
        .raft
        .propose(vec![Bytes::from(newer.encode())])
        .unwrap();
    let index = c.core(1).raft().last_index();
    let stopped = c.core(1).drive().and_then(|()| c.try_settle([])).err();
    match stopped {
        Some(StorageError::NewerClusterVersion {
            index: at,
            version,
            supported,
        }) => {
            assert_eq!(
                (at, version, supported),
                (index, CLUSTER_VERSION + 1, CLUSTER_VERSION)
            );
        }
        other => panic!("expected the node to stop at entry {index}, got {other:?}"),
    }
    assert!(versions(&c).iter().all(|v| *v <= CLUSTER_VERSION));
}
