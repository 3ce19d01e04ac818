//! How a node enters and stays in a cluster: whether a node with an empty data directory starts
//! a new cluster, joins one or waits (`decide_start`), and the leader's side of it (joins, the
//! replacement of a member that lost its data, the cluster id and the member table) in
//! `NodeCore` (src/node/membership.rs). `lock-node` and the simulator run the same decisions:
//! `lock-node` asks its `--join` peers over the network, the simulator answers for its nodes.

use crate::lock::MemberInfo;
use crate::raft::NodeId;

/// What one `--join` peer said about itself when asked (`FetchPeerList`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerAnswer {
    /// No answer: down, not started yet, cut off, or refusing us. Proves nothing.
    Unreachable,
    /// It answered that it has no data (an empty log at term 0) and belongs to no cluster.
    Empty,
    /// It answered that it has data or belongs to a cluster.
    Member {
        /// The cluster's id, once its leader named it.
        cluster_id: Option<u128>,
        /// The `--force-new-cluster` value that started that cluster, if one did.
        forced_by: Option<String>,
    },
}

impl PeerAnswer {
    /// A peer's answer about itself: whether it has data (a RaftLock from before `has_data`
    /// says only its members), the members it knows, its cluster id (hex; empty: none yet) and
    /// the `--force-new-cluster` value that started its cluster (empty: none).
    pub fn answered(
        has_data: bool,
        members: &[NodeId],
        cluster_id: &str,
        forced_by: &str,
    ) -> PeerAnswer {
        if !has_data && members.is_empty() {
            return PeerAnswer::Empty;
        }
        PeerAnswer::Member {
            cluster_id: u128::from_str_radix(cluster_id, 16).ok(),
            forced_by: (!forced_by.is_empty()).then(|| forced_by.to_string()),
        }
    }
}

/// What a node with an empty data directory does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartDecision {
    /// Start a new one-node cluster.
    Bootstrap,
    /// A cluster exists: ask to join it (as a learner, promoted once caught up).
    Join,
    /// Nothing proves that no cluster exists: ask again later. The reason is for the log and
    /// `/readyz`.
    Wait(String),
}

/// The start of a node with an empty data directory that may bootstrap (`--bootstrap-id` names
/// it, or it was told to): it starts a new cluster only on positive evidence that none exists —
/// every other peer *answered* that it has no data — or when the operator forces it once
/// (`force`: the `--force-new-cluster` value, which a cluster started by it remembers, so that
/// the same value never starts a second one). A peer that does not answer proves nothing: the
/// node may have lost its volume while the cluster's other members are down, and a new cluster
/// beside the real one would grant locks that are held, with fencing tokens already used.
///
/// `bootstrap_when_unreachable`: the mutation switch that treats no answer as "no data" (the
/// simulator shows that it splits the cluster).
pub fn decide_start(
    answers: &[(String, PeerAnswer)],
    force: Option<&str>,
    bootstrap_when_unreachable: bool,
) -> StartDecision {
    // A cluster exists (the one a `--force-new-cluster` value started, too): join it.
    if answers
        .iter()
        .any(|(_, a)| matches!(a, PeerAnswer::Member { .. }))
    {
        return StartDecision::Join;
    }
    let unreachable: Vec<&str> = answers
        .iter()
        .filter(|(_, a)| *a == PeerAnswer::Unreachable)
        .map(|(p, _)| p.as_str())
        .collect();
    if unreachable.is_empty() || bootstrap_when_unreachable || force.is_some() {
        return StartDecision::Bootstrap;
    }
    StartDecision::Wait(format!(
        "not starting a new cluster: no answer from {} (a peer that cannot be reached may hold \
         the cluster's data); waiting until every peer answers, or start one node once with \
         --force-new-cluster <a new value>",
        unreachable.join(", ")
    ))
}

/// Whether two cluster ids (as hex text; empty: not named yet) name different clusters. "No id
/// yet" is not "another cluster": a cluster from before cluster ids, or one whose leader has not
/// named it, takes part as before.
pub fn other_cluster(ours: &str, theirs: &str) -> bool {
    !ours.is_empty() && !theirs.is_empty() && ours != theirs
}

/// What a node with data that hears from no leader makes of one `--join` peer's answer
/// (`FetchPeerList`): it may have been removed while it was away.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RejoinVerdict {
    /// The peer knows no leader, or belongs to another cluster: ask the next peer.
    AskAnother,
    /// The leader's configuration has this node: nothing to do.
    Member,
    /// The leader's configuration lacks this node: ask the leader to join again, as a learner
    /// whose stale log the leader replaces.
    Removed,
}

pub fn rejoin_verdict(
    me: NodeId,
    our_cluster: &str,
    leader_known: bool,
    their_cluster: &str,
    their_members: &[NodeId],
) -> RejoinVerdict {
    if !leader_known || other_cluster(our_cluster, their_cluster) {
        RejoinVerdict::AskAnother
    } else if their_members.contains(&me) {
        RejoinVerdict::Member
    } else {
        RejoinVerdict::Removed
    }
}

/// The leader's answer to a join request, as [`crate::node::NodeCore::join`] gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JoinOutcome {
    /// A learner now, or on its way (promoted once caught up); or already this member.
    Accepted,
    /// The id is a voter whose data this incarnation does not have: the leader removes the
    /// old incarnation now; the joiner asks again and is added as a learner.
    Replacing,
}

/// Why a member's old incarnation cannot be replaced yet (for the joiner's log).
pub fn replacement_blocked(id: NodeId, unhealthy: &[NodeId]) -> String {
    format!(
        "node {id} is a voter and this is a new incarnation of it (its data is gone): it is \
         replaced once every other voter is healthy; not heard from recently: {unhealthy:?}"
    )
}

/// Whether the table entry `recorded` already says what `said` says (empty fields and
/// incarnation 0 in `said` mean "not said").
pub fn info_current(recorded: Option<&MemberInfo>, said: &MemberInfo) -> bool {
    let Some(r) = recorded else {
        return false;
    };
    (said.peer_addr.is_empty() || said.peer_addr == r.peer_addr)
        && (said.client_addr.is_empty() || said.client_addr == r.client_addr)
        && (said.incarnation == 0 || said.incarnation == r.incarnation)
}

/// `said` laid over `recorded`: what the table should hold.
pub fn merged_info(recorded: Option<&MemberInfo>, said: &MemberInfo) -> MemberInfo {
    let mut info = recorded.cloned().unwrap_or_default();
    if !said.peer_addr.is_empty() {
        info.peer_addr = said.peer_addr.clone();
    }
    if !said.client_addr.is_empty() {
        info.client_addr = said.client_addr.clone();
    }
    if said.incarnation != 0 {
        info.incarnation = said.incarnation;
    }
    info
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member() -> PeerAnswer {
        PeerAnswer::Member {
            cluster_id: Some(7),
            forced_by: None,
        }
    }

    fn answers(list: &[PeerAnswer]) -> Vec<(String, PeerAnswer)> {
        list.iter()
            .enumerate()
            .map(|(i, a)| (format!("peer-{i}:7000"), a.clone()))
            .collect()
    }

    #[test]
    fn a_fresh_install_bootstraps_once_every_peer_answers_empty() {
        let a = answers(&[PeerAnswer::Empty, PeerAnswer::Empty]);
        assert_eq!(decide_start(&a, None, false), StartDecision::Bootstrap);
        // A single-node cluster has no peers to ask.
        assert_eq!(decide_start(&[], None, false), StartDecision::Bootstrap);
    }

    #[test]
    fn an_unreachable_peer_is_no_evidence() {
        let a = answers(&[PeerAnswer::Empty, PeerAnswer::Unreachable]);
        match decide_start(&a, None, false) {
            StartDecision::Wait(why) => assert!(why.contains("peer-1:7000"), "{why}"),
            other => panic!("expected to wait, got {other:?}"),
        }
        let a = answers(&[PeerAnswer::Unreachable, PeerAnswer::Unreachable]);
        assert!(matches!(
            decide_start(&a, None, false),
            StartDecision::Wait(_)
        ));
        // The mutation switch bootstraps there: the simulator must catch it.
        assert_eq!(decide_start(&a, None, true), StartDecision::Bootstrap);
    }

    #[test]
    fn any_member_means_join_even_when_forced() {
        let a = answers(&[PeerAnswer::Unreachable, member()]);
        assert_eq!(decide_start(&a, None, false), StartDecision::Join);
        assert_eq!(decide_start(&a, Some("n1"), false), StartDecision::Join);
        let forced = PeerAnswer::Member {
            cluster_id: Some(9),
            forced_by: Some("n1".into()),
        };
        let a = answers(&[forced, PeerAnswer::Unreachable]);
        assert_eq!(decide_start(&a, Some("n1"), false), StartDecision::Join);
    }

    #[test]
    fn forcing_bootstraps_past_unreachable_peers() {
        let a = answers(&[PeerAnswer::Unreachable, PeerAnswer::Unreachable]);
        assert_eq!(
            decide_start(&a, Some("n1"), false),
            StartDecision::Bootstrap
        );
    }

    #[test]
    fn a_removed_node_asks_to_join_only_a_leader_of_its_own_cluster() {
        use RejoinVerdict::*;
        assert_eq!(rejoin_verdict(3, "ab", true, "ab", &[1, 2]), Removed);
        assert_eq!(rejoin_verdict(3, "ab", true, "", &[1, 2]), Removed);
        assert_eq!(rejoin_verdict(3, "ab", true, "ab", &[1, 2, 3]), Member);
        assert_eq!(rejoin_verdict(3, "ab", true, "cd", &[1, 2]), AskAnother);
        assert_eq!(rejoin_verdict(3, "ab", false, "ab", &[1, 2]), AskAnother);
    }

    #[test]
    fn member_info_merges_only_what_was_said() {
        let recorded = MemberInfo {
            peer_addr: "a:1".into(),
            client_addr: "a:2".into(),
            incarnation: 5,
        };
        let said = MemberInfo {
            peer_addr: "b:1".into(),
            client_addr: String::new(),
            incarnation: 0,
        };
        assert!(!info_current(Some(&recorded), &said));
        let merged = merged_info(Some(&recorded), &said);
        assert_eq!(merged.peer_addr, "b:1");
        assert_eq!(merged.client_addr, "a:2");
        assert_eq!(merged.incarnation, 5);
        assert!(info_current(Some(&merged), &said));
        assert!(!info_current(None, &said));
    }
}
