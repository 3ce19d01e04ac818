//! Membership and lifecycle in the node: the cluster id and member table, replacement of a voter
//! that lost its data, admission of a new data directory, rolled-back members, dead voters.

use super::drive_halves::Cluster;
use crate::lock::CLUSTER_VERSION;
use crate::node::lifecycle::JoinOutcome;
use crate::node::*;

fn info(id: NodeId, incarnation: u64) -> MemberInfo {
    MemberInfo {
        peer_addr: format!("node-{id}:7000"),
        client_addr: format!("node-{id}:50050"),
        incarnation,
    }
}

/// Node 1 leads a three-node cluster at the current version whose member table knows
/// nodes 2 and 3 as incarnations 2 and 3.
fn named_cluster(settings: NodeSettings) -> Cluster {
    let mut c = Cluster::with_settings(settings);
    c.elect_node_1();
    c.core(1).peer_version(2, CLUSTER_VERSION);
    c.core(1).peer_version(3, CLUSTER_VERSION);
    c.core(1).peer_info(2, info(2, 2));
    c.core(1).peer_info(3, info(3, 3));
    c.tick_leader(30);
    c
}

#[test]
fn the_leader_names_the_cluster_and_records_its_members() {
    let settings = NodeSettings {
        new_cluster_id: 0x5eed,
        identity: info(1, 1),
        ..NodeSettings::default()
    };
    let mut c = named_cluster(settings);
    for id in 1..=3 {
        let core = c.core(id);
        assert_eq!(core.state_machine().cluster_id(), Some(0x5eed), "node {id}");
        let members = core.known_members();
        for m in 1..=3 {
            assert_eq!(
                members.get(&m),
                Some(&info(m, m)),
                "node {id} on member {m}"
            );
        }
    }
    // A member's new address goes through the log; its incarnation does not change that way.
    c.core(1).peer_info(2, info(9, 2));
    c.core(1).peer_info(3, info(3, 77));
    c.tick_leader(30);
    let members = c.core(3).known_members();
    assert_eq!(members[&2].peer_addr, "node-9:7000");
    assert_eq!(
        members[&3].incarnation, 3,
        "a voter's incarnation changed without replacement"
    );
}

#[test]
fn a_voter_that_lost_its_data_is_replaced_by_its_new_incarnation() {
    let mut c = named_cluster(NodeSettings::default());
    // Its own incarnation asking again is the member.
    assert_eq!(c.core(1).join(3, info(3, 3)), Ok(JoinOutcome::Accepted));
    // A new incarnation: the old one is removed first.
    assert_eq!(c.core(1).join(3, info(3, 33)), Ok(JoinOutcome::Replacing));
    c.tick_leader(10);
    assert!(!c.core(1).raft().membership().contains(3));
    // Asked again: a learner now, recorded as the new incarnation.
    assert_eq!(c.core(1).join(3, info(3, 33)), Ok(JoinOutcome::Accepted));
    c.tick_leader(10);
    // (This harness's node 3 kept its log, so it is caught up and promoted at once.)
    assert!(c.core(1).raft().membership().contains(3));
    assert_eq!(c.core(1).known_members()[&3].incarnation, 33);
}

/// Asks node `to` for its PreVote in a later term (which changes no term), from node 2
/// with a long log; returns whether it was granted.
fn grants_vote(c: &mut Cluster, to: NodeId) -> bool {
    let term = c.core(to).raft().term() + 1;
    let now = c.now;
    c.core(to).take_effects();
    c.core(to).step(
        now,
        Message {
            from: 2,
            to,
            term,
            body: crate::raft::MessageBody::Vote {
                pre_vote: true,
                last_log_index: 1_000,
                last_log_term: term,
                leadership_transfer: true,
            },
        },
    );
    c.core(to).drive().unwrap();
    c.core(to).take_effects().into_iter().any(|e| {
        matches!(
            e,
            Effect::Send(Message {
                body: crate::raft::MessageBody::VoteResponse { granted: true, .. },
                ..
            })
        )
    })
}

#[test]
fn a_node_on_a_new_data_directory_votes_only_once_its_log_admits_it() {
    // Every node of this harness says incarnation 77: node 3's record (3) is an earlier
    // incarnation, as after a lost disk.
    let settings = NodeSettings {
        identity: info(0, 77),
        ..NodeSettings::default()
    };
    let mut c = named_cluster(settings);
    c.core(3).set_awaiting_admission(true);
    assert!(c.core(3).is_awaiting_admission());
    assert!(!c.core(3).raft().in_elections());
    assert!(!grants_vote(&mut c, 3), "voted before its admission");
    // The leader replaces the old incarnation and records the new one.
    assert_eq!(c.core(1).join(3, info(3, 77)), Ok(JoinOutcome::Replacing));
    c.tick_leader(10);
    assert_eq!(c.core(1).join(3, info(3, 77)), Ok(JoinOutcome::Accepted));
    c.tick_leader(10);
    c.tick(3);
    assert!(
        !c.core(3).is_awaiting_admission(),
        "its record is in its log"
    );
    assert!(c.core(3).raft().in_elections());
    assert!(grants_vote(&mut c, 3), "an admitted node votes");
    // And the leader promoted it only once its log held that record.
    assert!(c.core(1).raft().membership().voters.contains(&3));
}

#[test]
fn a_member_rolled_back_to_an_older_build_is_not_heard_until_it_runs_a_current_one() {
    let mut c = named_cluster(NodeSettings::default());
    assert_eq!(c.core(1).state_machine().cluster_version(), CLUSTER_VERSION);
    let heard = |c: &mut Cluster| c.core(1).raft().progress(3).map(|p| p.0).unwrap();
    let before = heard(&mut c);
    // Node 3 restarts on a build from before cluster versions: its stream says none.
    c.core(1).peer_version(3, 0);
    assert!(c.core(1).runs_older_version(3));
    let now = c.now;
    c.core(1)
        .client_request(now, super::drive_halves::acquire("rolled-back"), 1, 9);
    c.core(1).drive().unwrap();
    c.settle([]);
    c.tick_leader(5);
    let commit = c.core(1).raft().commit_index();
    assert!(commit > before, "nodes 1 and 2 still commit");
    assert_eq!(
        heard(&mut c),
        before,
        "node 3's acknowledgements were counted"
    );
    // Back on a current build: heard again, and caught up.
    c.core(1).peer_version(3, CLUSTER_VERSION);
    c.tick_leader(5);
    assert!(heard(&mut c) >= commit);
}

#[test]
fn no_replacement_while_another_voter_is_not_heard_from() {
    let mut c = named_cluster(NodeSettings::default());
    c.cut.insert(2);
    c.tick_leader(30);
    let refused = c.core(1).join(3, info(3, 33));
    assert!(
        matches!(&refused, Err(why) if why.contains("[2]")),
        "{refused:?}"
    );
    assert!(c.core(1).raft().membership().voters.contains(&3));
}

#[test]
fn a_dead_voter_is_removed_only_above_min_voters() {
    let settings = NodeSettings {
        dead_member_us: Some(1_000_000),
        min_voters: 3,
        ..NodeSettings::default()
    };
    let mut c = named_cluster(settings.clone());
    c.cut.insert(3);
    c.tick_leader(40);
    assert!(
        c.core(1).raft().membership().voters.contains(&3),
        "went below min_voters"
    );

    let settings = NodeSettings {
        min_voters: 2,
        ..settings
    };
    let mut c = named_cluster(settings);
    c.cut.insert(3);
    c.tick_leader(5);
    assert!(
        c.core(1).raft().membership().voters.contains(&3),
        "removed before the timeout"
    );
    c.tick_leader(40);
    assert!(!c.core(1).raft().membership().voters.contains(&3));
    assert_eq!(c.core(1).raft().membership().voters.len(), 2);
}
