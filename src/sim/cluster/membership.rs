//! Membership operations the fault schedule makes: adding, promoting and removing
//! members, and leadership transfers.

use rand::seq::IndexedRandom;
use rand::Rng;

use super::{sim_identity, Cluster, Core, MAX_MEMBERS};
use crate::raft::{Membership, NodeId};

impl Cluster {
    fn leader_core(&mut self) -> Option<(NodeId, &mut Core)> {
        let leader = self.running_leader()?;
        let core = self.nodes.get_mut(&leader)?.core.as_mut()?;
        Some((leader, core))
    }

    pub(super) fn change_membership(&mut self) {
        let Some(leader) = self.running_leader() else {
            return;
        };
        // No operator removes members while a lost volume is still on its way back: that would
        // take the configuration below a majority of intact disks.
        let volume_lost = self.volume_on_its_way_back();
        let membership = self.membership_of(leader);
        let live_members = membership.voters.len() + membership.learners.len();
        let choice = self.rng.random_range(0..3);
        let new_id = self.next_node_id;
        let result = match choice {
            0 if live_members < MAX_MEMBERS && new_id < 64 => {
                let (_, core) = self.leader_core().expect("leader");
                core.join(new_id, sim_identity(new_id, 0))
                    .map(|_| Some(new_id))
                    .map_err(|_| ())
            }
            1 if membership.voters.len() > self.min_voters && !volume_lost => {
                let followers: Vec<NodeId> = membership
                    .voters
                    .iter()
                    .copied()
                    .filter(|&v| v != leader)
                    .collect();
                let Some(&f) = followers.choose(&mut self.rng) else {
                    return;
                };
                let (_, core) = self.leader_core().expect("leader");
                core.remove(f).map(|()| None).map_err(|_| ())
            }
            2 if membership.voters.len() > self.min_voters && !volume_lost => {
                let (_, core) = self.leader_core().expect("leader");
                core.remove(leader).map(|()| None).map_err(|_| ())
            }
            _ => return,
        };
        let Ok(added) = result else { return };
        self.stats.membership_changes += 1;
        if self.cfg.trace {
            eprintln!(
                "t={} leader {leader} changes membership (choice {choice}, added {added:?})",
                self.now_us
            );
        }
        if let Some(id) = added {
            self.next_node_id += 1;
            self.add_node(id, Membership::default());
        }
        let result = self
            .nodes
            .get_mut(&leader)
            .and_then(|n| n.core.as_mut())
            .map(|c| c.drive());
        if let Some(result) = result {
            self.after_core(leader, result);
        }
    }

    pub(super) fn transfer_leadership(&mut self) {
        let Some((leader, core)) = self.leader_core() else {
            return;
        };
        if core.transfer_leadership().is_some() {
            let result = core.drive();
            self.stats.transfers += 1;
            self.after_core(leader, result);
        }
    }
}
