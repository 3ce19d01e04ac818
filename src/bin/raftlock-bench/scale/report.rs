//! The Markdown report of a scale run.

use serde_json::{json, Value};

fn mib(v: &Value) -> String {
    v.as_f64()
        .map_or("–".into(), |b| format!("{:.1} MiB", b / 1048576.0))
}

fn num(v: &Value, decimals: usize) -> String {
    v.as_f64().map_or("–".into(), |x| format!("{x:.decimals$}"))
}

pub(super) fn markdown(r: &Value) -> String {
    let mut s = format!(
        "# RaftLock at scale\n\n{} · {} · open-file limit {}\n\nCommand: `{}`\n\n\
         Three `lock-node`s on 127.0.0.1 (release build, fsync on), started by the benchmark; \
         the benchmark's own client runs on the same machine and shares its CPUs. \
         Memory is the leader's resident set (VmRSS from /proc), CPU its utime + stime.\n",
        r["date"].as_str().unwrap_or(""),
        r["machine"].as_str().unwrap_or(""),
        r["open_files_limit"],
        r["command"].as_str().unwrap_or(""),
    );
    let c = &r["connections"];
    if !c.is_null() {
        s.push_str("\n## 1. Connections holding and renewing locks\n\n");
        if let Some(e) = c["error"].as_str() {
            s.push_str(&format!("**Failed:** {e}\n"));
        } else {
            s.push_str(&format!(
                "{} WebSocket connections to the leader, each with its own lock (own key and \
                 client id, {} s lease) renewed every {} s, renewals spread evenly; measured over \
                 a {:.0} s window once all held their lock.\n\n",
                c["connections"],
                c["ttl_ms"].as_u64().unwrap_or(0) / 1000,
                c["renew_period_s"],
                c["window_s"].as_f64().unwrap_or(0.0)
            ));
            s.push_str("| measure | value | what it means |\n|---|---:|---|\n");
            let rows: Vec<(&str, String, String)> = vec![
                ("connections holding a lock", format!("{} of {}", c["holding"], c["connections"]),
                 format!("opened at most {}/s, {} at a time, in {:.1} s; the leader's connection gauge said {}", num(&c["connect_rate_limit_per_s"], 0), c["connect_concurrency"], c["connect_seconds"].as_f64().unwrap_or(0.0), num(&c["leader_connections_metric"], 0))),
                ("leader RSS before", mib(&c["leader_rss_before_bytes"]), "idle cluster, no client connected".into()),
                ("leader RSS holding", mib(&c["leader_rss_holding_bytes"]), format!("all connected and holding, at the window's start ({} at its end)", mib(&c["leader_rss_end_bytes"]))),
                ("bytes per connection + held lock", num(&c["bytes_per_connection"], 0), "(holding − before) / connections: socket, WebSocket task and buffers, client session, lock and its remembered answer".into()),
                ("renewals per second", num(&c["renewals_per_s"], 0), format!("successful renewals sent in the window / window; the schedule asks for {}/s", num(&c["renewals_target_per_s"], 0))),
                ("leader CPU in the window", format!("{} s", num(&c["leader_cpu_s_in_window"], 2)), format!("{}% of one core; idle it used {}% of a core", num(&c["leader_cpu_percent_of_core"], 1), num(&json!(c["leader_idle_cpu_s_per_s"].as_f64().unwrap_or(0.0) * 100.0), 1))),
                ("CPU per renewal", format!("{} µs", num(&c["cpu_us_per_renewal"], 0)), format!("leader CPU in the window / renewals ({} µs after subtracting the idle rate); includes the replication of each renewal to two followers and its fsync", num(&c["cpu_us_per_renewal_net_of_idle"], 0))),
                ("renewal latency p50 / p99", format!("{} / {} ms", num(&c["renew_p50_ms"], 2), num(&c["renew_p99_ms"], 2)), format!("renew sent → answer received (p99.9 {} ms, max {} ms)", num(&c["renew_p999_ms"], 2), num(&c["renew_max_ms"], 2))),
                ("renewals over 25 ms", format!("{} / {}", num(&c["renew_over_25ms_client"], 0), num(&c["renew_over_25ms_leader"], 0)),
                 format!("as the client saw them / as the leader saw them (`raftlock_request_duration_seconds{{op=\"renew\"}}`: from the driver's queue to the answer, the WebSocket read and write left out; {} renewals counted there in the window, which starts a little after the client's); the leader's commits over 25 ms: {}, its flushes: {}", num(&c["renewals_seen_by_leader"], 0), num(&c["commits_over_25ms_leader"], 0), num(&c["flushes_over_25ms_leader"], 0))),
                ("failed operations", format!("{}", c["failed_operations_total"]), format!("connects, acquires and renewals that failed, whole run ({} renewals failed in the window; {} succeeded in total): {}", c["renewals_failed_in_window"], c["renewals_ok_total"], c["errors"])),
            ];
            for (what, value, means) in rows {
                s.push_str(&format!("| {what} | {value} | {means} |\n"));
            }
            s.push_str(&format!(
                "\nLeader changes seen by the leader (`raftlock_leader_changes_total`, the first election included): {}; {}.\n",
                c["leader_changes_total"],
                if c["leader_unchanged"] == true { "it was still leader at the end" } else { "it was NOT leader at the end" }
            ));
        }
    }
    let l = &r["locks"];
    if !l.is_null() {
        s.push_str("\n## 2. Held locks\n\n");
        if let Some(e) = l["error"].as_str() {
            s.push_str(&format!("**Failed:** {e}\n"));
        } else {
            s.push_str(&format!(
                "{} distinct locks acquired ({} h lease) over {} connections to the leader with \
                 {} acquires in flight on each; snapshot threshold set to {} entries so that the \
                 log is compacted right after the fill (the gap closed with {} padding writes); \
                 a snapshot is encoded when the wiped follower joins.\n\n",
                l["locks"],
                l["ttl_ms"].as_u64().unwrap_or(0) / 3_600_000,
                l["fill_connections"],
                l["fill_window_per_connection"],
                l["snapshot_threshold_entries"],
                l["padding_entries"],
            ));
            if l["fill_complete"] != true {
                s.push_str(&format!(
                    "**The fill did not complete: {} of {} locks held.**\n\n",
                    l["granted"], l["locks"]
                ));
            }
            let rs = &l["restart"];
            let wf = &l["wiped_follower"];
            let rows: Vec<(&str, String, String)> = vec![
                ("locks held", format!("{} of {}", l["granted"], l["locks"]), format!("the leader's /status said {}; {} given up", l["leader_locks_held"], l["gave_up"])),
                ("acquire throughput", format!("{}/s", num(&l["acquires_per_s"], 0)), format!("granted / fill time ({} s); acquire latency p50 {} ms, p99 {} ms", num(&l["fill_seconds"], 1), num(&l["acquire_p50_ms"], 1), num(&l["acquire_p99_ms"], 1))),
                ("refused answers", format!("{}", l["refusals"]), format!("answers other than a grant, by code, each retried with the same request id ({} retries)", l["retries"])),
                ("leader RSS before / after fill", format!("{} / {}", mib(&l["leader_rss_before_bytes"]), mib(&l["leader_rss_after_fill_bytes"])), format!("after the compaction: {}; a follower: {} / {}", mib(&l["leader_rss_after_snapshot_bytes"]), mib(&l["follower_rss_before_bytes"]), mib(&l["follower_rss_after_fill_bytes"]))),
                ("bytes per held lock", num(&l["bytes_per_lock"], 0), "(after fill − before) / locks: the lock, its lease timer, the exactly-once answer kept for the acquire, and the log entries not yet compacted".into()),
                ("snapshot size", mib(&l["snapshot_bytes"]), "the encoded state the leader sent the joining follower (from its `snapshot encoded` log line); the state itself lives in the sled data directory, and a snapshot is encoded only when a follower needs one".into()),
                ("snapshot time", if l["snapshot_seconds"].is_null() { "not measured".into() } else { format!("{} s", num(&l["snapshot_seconds"], 2)) }, "the leader's own timing (`raftlock_snapshot_duration_seconds`) of the snapshot it encoded for the joining follower: reading the state and encoding it, on its own thread while the node goes on serving".into()),
                ("log compaction", if l["compaction_seconds"].is_null() { "not measured".into() } else { format!("{} s", num(&l["compaction_seconds"], 3)) }, "from the applied index crossing the threshold (seen by polling every 25 ms) to `raftlock_snapshots_total{kind=\"taken\"}` counting it: the applied state written and the log compacted to it, no snapshot encoded".into()),
                ("leader data directory", format!("{} / {}", mib(&l["leader_data_dir_after_fill_bytes"]), mib(&l["leader_data_dir_after_snapshot_bytes"])), "on disk (allocated blocks) after the fill / 5 s after the compaction".into()),
                ("follower restart", format!("{} s", num(&rs["caught_up_s"], 2)), format!("SIGKILL, start again → its /status shows a leader and applied index ≥ the leader's commit index at the kill ({}); first /status answer after {} s. {}", rs["commit_index_at_kill"], num(&rs["first_status_answer_s"], 2), rs["error"].as_str().unwrap_or(""))),
                ("wiped follower, same flags", if wf["same_id_without_removal"]["refused_to_start"] == true { format!("refused to start ({} s)", num(&wf["same_id_without_removal"]["after_s"], 2)) } else if wf["same_id_without_removal"]["caught_up"] == true { format!("{} s", num(&wf["same_id_without_removal"]["caught_up_s"], 2)) } else { "never caught up".into() }, format!("SIGKILL, data directory deleted, started again with its old flags (same id, --initial-cluster): a voter that forgot the entries it acknowledged must not vote, so the node refuses to start and says why: {}", wf["same_id_without_removal"])),
                ("follower catch-up from empty", format!("{} s", num(&wf["caught_up_s"], 2)), format!("the documented way: wiped node removed from the members through the leader's peer port, started again with `--join` → caught up to {} (snapshots installed: {}; locks held there: {}; its data directory then {}; its RSS then {}, at most {} since it started, the snapshot install included). {}", wf["commit_index_at_join"], wf["snapshots_installed"], wf["locks_held"], mib(&wf["data_dir_bytes"]), mib(&wf["rss_bytes"]), mib(&wf["peak_rss_bytes"]), wf["error"].as_str().unwrap_or(""))),
            ];
            s.push_str("| measure | value | what it means |\n|---|---:|---|\n");
            for (what, value, means) in rows {
                s.push_str(&format!("| {what} | {value} | {means} |\n"));
            }
            if l["padding_errors"]
                .as_object()
                .is_some_and(|m| !m.is_empty())
            {
                s.push_str(&format!(
                    "\nPadding writes refused: {}\n",
                    l["padding_errors"]
                ));
            }
            s.push_str(&format!(
                "\nLeader changes seen by the first leader (node {}'s `raftlock_leader_changes_total`, the first election included): {} by the end of the fill, {} by the end of the run; {}.\n",
                l["leader_node"], l["leader_changes_seen_by_fill_end"], l["leader_changes_seen_by_end"],
                if l["leader_unchanged"] == true { "it was leader again at the end" } else { "it was not leader at the end, so the \"leader\" memory figures above are that node's, whatever its role" }
            ));
        }
    }
    s
}
