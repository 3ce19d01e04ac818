//! The node's unit tests. The children drive small clusters of [`NodeCore`](super::NodeCore)s
//! over `MemStorage` (`drive_halves::Cluster`) and check one concern each.

mod cluster_version;
mod drive_halves;
mod housekeeping_room;
mod lifecycle_in_the_node;
mod snapshot_install;

use super::staggered_threshold;

#[test]
fn the_members_of_a_cluster_snapshot_at_different_points() {
    let points: Vec<u64> = (1..=5).map(|id| staggered_threshold(100_000, id)).collect();
    assert_eq!(points, [112_500, 125_000, 137_500, 100_000, 112_500]);
    // Three voters never share a point; nor do any four consecutive ids.
    for first in 1..=8 {
        let mut four: Vec<u64> = (first..first + 4)
            .map(|id| staggered_threshold(48, id))
            .collect();
        four.sort_unstable();
        four.dedup();
        assert_eq!(four.len(), 4, "ids {first}..{}", first + 4);
    }
    assert_eq!(staggered_threshold(u64::MAX, 3), u64::MAX);
}
