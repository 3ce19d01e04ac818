//! The leader's housekeeping proposals fit in what the log takes: more leases due at once than
//! the bound on uncommitted entries expire over a few ticks, instead of a proposal of all of them
//! refused as busy on every tick and none ever expiring (simulator seed 1008370: seven due, room
//! for six).

use super::drive_halves::Cluster;
use crate::node::api::ClientOp;
use crate::node::*;

fn short_acquire(i: u64) -> ClientOp {
    ClientOp::Acquire {
        key: format!("k{i:02}"),
        client_id: format!("c{i}"),
        request_id: format!("r{i}"),
        ttl_ms: 1_000,
        wait_timeout_ms: Some(0),
    }
}

#[test]
fn more_leases_due_than_the_log_takes_all_expire() {
    let mut c = Cluster::with_configs(NodeSettings::default(), |cfg| {
        cfg.max_uncommitted_entries = 3;
    });
    c.elect_node_1();
    for i in 0..10 {
        let now = c.now;
        c.core(1).client_request(now, short_acquire(i), 1, 100 + i);
        c.core(1).drive().unwrap();
        c.settle([]);
    }
    assert_eq!(c.core(1).state_machine().held_locks().len(), 10);
    assert!(c
        .replies
        .iter()
        .all(|(_, r)| matches!(r, ClientReply::Granted { .. })));
    // Every lease ran out (1 s) by the same tick; within 1 s more all must have expired.
    for _ in 0..200 {
        c.tick(1);
    }
    let held: Vec<String> = c
        .core(1)
        .state_machine()
        .held_locks()
        .into_iter()
        .map(|h| h.key)
        .collect();
    assert!(
        held.is_empty(),
        "still held 2 s after their leases ran out: {held:?}"
    );
    assert!(c.core(1).raft().is_leader());
}
