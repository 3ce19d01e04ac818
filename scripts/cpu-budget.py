#!/usr/bin/env python3
"""CPU budget of one lock cycle (acquire + release), in instructions, by process and component.

Instructions, counted by valgrind's callgrind, do not depend on what else the machine is doing:
the same binary, inputs and flags give nearly the same counts, so this budget can be compared
across commits where wall-clock benchmarks on a shared machine cannot.

How: three lock-nodes run under callgrind (with a slower tick, since valgrind slows them down
about 50x). Once a leader is elected, every node's counters are zeroed, one WebSocket client does
--cycles uncontended acquire + release cycles against the leader, and the counters are dumped.
Then, for the same wall time, an idle window is measured (ticks and heartbeats only) and
subtracted. The per-cycle cost is (busy - idle) / cycles for the leader and for each follower,
broken down by the crate or part of RaftLock that executed the instructions (self cost: each
instruction counted once, in the function that ran it). The client that drives those cycles is
this script; the Rust SDK's own share of a cycle is measured after it: `raftlock-bench cycles`
runs under callgrind against the same cluster once with N cycles and once with none, and the
difference divided by N is what one cycle costs the client (connecting and starting up cancel
out).

Caveat: valgrind runs a process's threads one at a time, so what threads spend waking and
parking each other (the async runtime, futexes) is counted as it happens under that schedule, which
may differ from a real multi-core run. The counts still move only when the code does.

Usage: scripts/cpu-budget.py [--cycles 300] [--top 15] [--bin target/release/lock-node] [--json out.json]
       [--markdown docs/bench/cpu-budget.md --baseline docs/bench/cpu-budget-baseline.json]
(--markdown replaces the tables between the file's `<!-- budget tables -->` markers.)
Needs valgrind (apt-get install valgrind) and websocket-client (pip).
"""

import argparse
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import websocket

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Component of a function, by the first pattern its name matches (order matters).
COMPONENTS = [
    ("storage: sled", r"^sled::|<sled::"),
    ("SDK client (raftlock::client)", r"raftlock::client::"),
    ("storage: RaftLock's log and state", r"raftlock::storage"),
    ("Raft core", r"raftlock::raft::"),
    ("lock state machine", r"raftlock::lock::"),
    ("node core (leader duties, sessions)", r"raftlock::node::"),
    ("server shell (driver, transport, front ends)", r"raftlock::server::|raftlock::telemetry"),
    ("peers: gRPC, HTTP/2, protobuf", r"\bh2::|hyper|tonic|prost|tower|http::"),
    ("clients: WebSocket, JSON", r"tungstenite|axum|serde_json|serde::|ryu|itoa"),
    ("async runtime (tokio)", r"tokio|mio::|futures"),
    ("allocation", r"malloc|free|realloc|calloc|alloc::|__rust_alloc|__rust_dealloc|_int_|^_?mi_|mimalloc"),
    ("memory copies", r"memcpy|memmove|memset|memcmp|bcmp"),
    ("checksums", r"crc32"),
    ("metrics and tracing", r"prometheus|tracing|opentelemetry|hdrhistogram"),
    ("serialization (postcard)", r"postcard"),
]


def free_ports(n):
    """n distinct free ports, all held open until every one is chosen (the kernel may give a
    port it just gave out, and that was closed again, to the next bind)."""
    held = [socket.socket() for _ in range(n)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def get_json(addr, path):
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=10) as r:
        return json.loads(r.read())


def wait_leader(nodes, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for n in nodes:
            try:
                if get_json(n["client"], "/status")["role"] == "leader":
                    return n
            except (OSError, ValueError, KeyError):
                pass
        time.sleep(1)
    raise SystemExit("no leader under valgrind within the timeout")


def control(args):
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, text=True)


def dumps(out_dir, node):
    return sorted(glob.glob(os.path.join(out_dir, f"node{node['id']}.*.*")),
                  key=lambda p: int(p.rsplit(".", 1)[1]))


def dump_all(nodes, out_dir, label):
    """Dumps (and so zeroes) every node's counters; returns ({node id: dump file}, the time the
    dumps were asked for)."""
    before = {n["id"]: set(dumps(out_dir, n)) for n in nodes}
    asked = time.time()
    for n in nodes:
        control(["--dump=" + label, str(n["proc"].pid)])
    files = {}
    deadline = time.time() + 120
    for n in nodes:
        while True:
            new = [f for f in dumps(out_dir, n) if f not in before[n["id"]]]
            if new:
                files[n["id"]] = new[-1]
                break
            if time.time() > deadline:
                raise SystemExit(f"node {n['id']} wrote no dump")
            time.sleep(0.5)
    time.sleep(1)  # let the writes finish
    return files, asked


def self_costs(dump):
    """Self instructions per function in a callgrind dump, read from the file itself: cost lines
    under `fn=` are that function's own; the line after `calls=` is a call's inclusive cost and
    is skipped (so every instruction is counted once)."""
    names = {}
    costs = {}
    current = "?"
    after_call = False

    def resolve(text):
        text = text.strip()
        m = re.match(r"^\((\d+)\)(?:\s+(.*))?$", text)
        if not m:
            return text
        if m.group(2):
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), text)

    total = None
    with open(dump) as f:
        for line in f:
            if line.startswith("fn="):
                current = resolve(line[3:])
            elif line.startswith("cfn="):
                resolve(line[4:])
            elif line.startswith("calls="):
                after_call = True
            elif line.startswith("totals:") or line.startswith("summary:"):
                total = int(line.split()[1])
            elif line[:1].isdigit() or line[:1] in "+-*":
                if after_call:
                    after_call = False
                    continue
                fields = line.split()
                if len(fields) >= 2:
                    costs[current] = costs.get(current, 0) + int(fields[1])
    counted = sum(costs.values())
    return costs, (total if total is not None else counted)


def by_component(dump):
    """Self instructions per component in one callgrind dump, the total, and the functions by
    self cost."""
    costs, total = self_costs(dump)
    totals = {name: 0 for name, _ in COMPONENTS}
    totals["other (std, libc)"] = 0
    for name, count in costs.items():
        for component, pattern in COMPONENTS:
            if re.search(pattern, name):
                totals[component] += count
                break
        else:
            totals["other (std, libc)"] += count
    functions = sorted(((c, n) for n, c in costs.items()), reverse=True)
    return totals, total, functions


# Stages of the request path, each the inclusive cost (the function and everything it calls) of
# the functions that begin it. A function inlined into its caller has no entry of its own; the
# instructions of all stages together are compared with the whole and the rest is reported as
# "runtime and other" (scheduling, parking and waking threads, timers).
def method(path, typ, name):
    """A method of `path::typ` as callgrind names it: `path::typ::name`, or, for a method in an
    `impl` block of a submodule, `path::module::<impl path::typ>::name`."""
    p, t = re.escape(path), re.escape(typ)
    return rf"^{p}::(?:{t}|\w+::<impl {p}::{t}>)::{name}$"


def storage(impl, name):
    """A `Storage` method of `impl` (`<impl as Storage>::name`, or the impl block's name)."""
    i, trait = re.escape(impl), re.escape("raftlock::storage::Storage")
    return rf"^(?:<{i} as {trait}>|[\w:]+::<impl {trait} for {i}>)::{name}$"


DRIVER = ("raftlock::server::driver", "Driver")
NODE = ("raftlock::node", "NodeCore<S,R>")
TIMED = r"raftlock::server::driver::(?:timed_storage::)?TimedStorage<S>"
STAGES = [
    ("client: WebSocket frames, JSON parse, reply",
     [r"^axum::extract::ws::WebSocketUpgrade<F>::on_upgrade::\{\{closure\}\}$",
      r"^raftlock::server::ws::serve_socket::\{\{closure\}\}::\{\{closure\}\}$",
      r"^raftlock::server::ws::start_request::\{\{closure\}\}::\{\{closure\}\}$"]),
    ("driver: take inputs, propose", [method(*DRIVER, "handle_inputs")]),
    # The driver runs a drive in its two halves (NodeCore::drive is the two back to back).
    ("driver: Raft, persistence, apply (NodeCore::drive)",
     [method(*NODE, "drive_until_flush"), method(*NODE, "finish_drive")]),
    ("  of which the Raft log's appends and flushes, hard state",
     [rf"^<{TIMED} as raftlock::storage::Storage>::append$",
      rf"^<{TIMED} as raftlock::storage::Storage>::flush$",
      storage("raftlock::storage::sled_store::SledStorage", "set_hard_state")]),
    ("  of which lock state machine apply",
     [method("raftlock::lock::machine", "LockStateMachine", "apply")]),
    ("driver: send messages, answer clients", [method(*DRIVER, "handle_effects")]),
    ("driver: status and metrics", [method(*DRIVER, "publish_status")]),
    ("driver: ticks (applied-state write every 100 ms)", [method(*NODE, "tick")]),
    ("peers: outgoing gRPC streams (encode, HTTP/2, write)",
     [r"^<hyper::proto::h2::client::H2ClientFuture<B,T,E> as core::future::future::Future>::poll$"]),
    ("peers: incoming gRPC streams (read, HTTP/2, decode)",
     [r"^tonic::transport::server::serve_connection::\{\{closure\}\}$"]),
    # Plain Raft streams (`--peer-stream plain`, the default): the peer port's connection task
    # reads, decodes and hands each message to the driver; the streams' own tasks write what
    # was queued (and heartbeats); the driver's thread frames and writes the rest itself, inside
    # the driver stages above (the row after these, not added to the total again).
    ("peers: incoming plain Raft streams (read, decode, hand to the driver)",
     [r"^raftlock::server::node::(?:listeners::)?sort_peer_connections::\{\{closure\}\}::\{\{closure\}\}$"]),
    ("peers: outgoing stream tasks (queued messages, heartbeats)",
     [method("raftlock::server::transport", "PeerSender", r"run::\{\{closure\}\}")]),
    ("  of the driver stages: Raft messages framed and written on the driver's thread",
     [method("raftlock::server::transport", "PeerTransport", "send")]),
    ("storage: sled background threads", [r"^sled::threadpool::perform_work$"]),
]


def inclusive_costs(dump):
    """Inclusive instructions per function name, from callgrind_annotate. A function inlined
    into others appears once per source file; the largest entry is the function's own."""
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", dump],
                         check=True, capture_output=True, text=True).stdout
    costs = {}
    for line in out.splitlines():
        m = re.match(r"^\s*([\d,]+)\s+\([^)]*\)\s+(?:\S*?\.(?:rs|c|S|h)|\?\?\?):(.*?)(?:\s+\[[^\]]*\])?\s*$", line)
        if not m:
            continue
        name = re.sub(r"'\d+$", "", m.group(2).strip())
        cost = int(m.group(1).replace(",", ""))
        costs[name] = max(costs.get(name, 0), cost)
    return costs


def by_stage(dump):
    costs = inclusive_costs(dump)
    stages = {}
    for stage, patterns in STAGES:
        stages[stage] = sum(max((c for n, c in costs.items() if re.search(p, n)), default=0)
                            for p in patterns)
    return stages


def roles(results):
    """(leader, the followers' mean) of one result, as {section: {row: instructions}}."""
    procs = results["processes"]
    leader = procs["leader"]
    followers = [v for k, v in procs.items() if k != "leader"]

    def mean(section):
        rows = {}
        for f in followers:
            for k, v in f.get(section, {}).items():
                rows[k] = rows.get(k, 0) + v / len(followers)
        return rows

    out = {}
    for section in ("by_stage", "by_component"):
        out[section] = (leader.get(section, {}), mean(section))
    total_f = sum(f["instructions_per_cycle"] for f in followers) / len(followers)
    out["total"] = (leader["instructions_per_cycle"], total_f)
    return out


def markdown(results, baseline, args):
    now, then = roles(results), roles(baseline) if baseline else None

    def num(v):
        return "" if v is None else f"{round(v):,}"

    def table(section, title):
        cols = ["leader", "follower"]
        if then:
            head = f"| {title} | leader, {args.baseline_label} | leader, {args.label} | follower, {args.baseline_label} | follower, {args.label} |"
            lines = [head, "|---|---:|---:|---:|---:|"]
        else:
            lines = [f"| {title} | leader | follower |", "|---|---:|---:|"]
        rows = list(now[section][0].keys())
        if then:
            rows += [r for r in then[section][0] if r not in rows]
        for row in rows:
            cells = []
            for i, _ in enumerate(cols):
                if then:
                    cells.append(num(then[section][i].get(row)))
                cells.append(num(now[section][i].get(row)))
            name = "&nbsp;&nbsp;" + row[2:] if row.startswith("  ") else row
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        cells = []
        for i, _ in enumerate(cols):
            if then:
                cells.append(f"**{num(then['total'][i])}**")
            cells.append(f"**{num(now['total'][i])}**")
        lines.append("| **total per cycle** | " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    return (table("by_stage", "stage") + "\n" + table("by_component", "component")
            + client_table(results, baseline, args))


def client_budget(args, leader_client, work):
    """The Rust SDK's instructions per cycle: `raftlock-bench cycles` under callgrind with N
    cycles and with none, against the running cluster; (with - without) / N."""
    n = max(30, args.cycles // 3)
    runs = {}
    for count in (0, n):
        out = os.path.join(work, f"client-{count}.out")
        subprocess.run(["valgrind", "--tool=callgrind", "--quiet", f"--callgrind-out-file={out}",
                        args.client_bin, "cycles", "--endpoint", leader_client,
                        "--count", str(count)], check=True, timeout=1800)
        runs[count] = by_component(out)
    (c0, t0, _), (cn, tn, functions) = runs[0], runs[n]
    return {
        "cycles": n,
        "instructions_per_cycle": round((tn - t0) / n),
        "by_component": {k: round(max(0, cn[k] - c0[k]) / n)
                         for k in sorted(cn, key=lambda k: -(cn[k] - c0[k]))},
        "top_functions": [[round(c / n), f[:160]] for c, f in functions[:args.top]],
    }


def client_table(results, baseline, args):
    """The SDK client's share, by component (empty when it was not measured)."""
    now = results.get("client")
    if not now:
        return ""
    then = (baseline or {}).get("client")
    lines = ["", f"The client's share: one Rust SDK client (`raftlock-bench cycles`, {now['cycles']} cycles), self cost by component:", ""]
    if then:
        lines += [f"| component | client, {args.baseline_label} | client, {args.label} |", "|---|---:|---:|"]
    else:
        lines += [f"| component | client, {args.label} |", "|---|---:|"]
    for k, v in now["by_component"].items():
        if v == 0 and not (then and then["by_component"].get(k)):
            continue
        cells = ([f"{then['by_component'].get(k, 0):,}"] if then else []) + [f"{v:,}"]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    total = ([f"**{then['instructions_per_cycle']:,}**"] if then else []) + [f"**{now['instructions_per_cycle']:,}**"]
    lines.append("| **total per cycle** | " + " | ".join(total) + " |")
    return "\n".join(lines) + "\n"


def cycles(leader_client, n, tag):
    ws = websocket.create_connection(f"ws://{leader_client}/ws", timeout=120)
    started = time.time()
    for i in range(n):
        key = f"budget/{i % 16}"
        ws.send(json.dumps({"commandType": 3, "key": key, "clientId": "budget",
                            "requestId": f"{tag}-a{i}", "ttl": 60000, "waitTimeout": 0}))
        r = json.loads(ws.recv())
        if not r.get("success"):
            raise SystemExit(f"acquire {i}: {r}")
        token = r["fencingToken"]["value"]
        ws.send(json.dumps({"commandType": 4, "key": key, "clientId": "budget",
                            "requestId": f"{tag}-r{i}",
                            "fencingToken": {"key": key, "value": token}}))
        r = json.loads(ws.recv())
        if not r.get("success"):
            raise SystemExit(f"release {i}: {r}")
    ws.close()
    return time.time() - started


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=300)
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "lock-node"))
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--top", type=int, default=15, help="costliest functions listed per process")
    ap.add_argument("--markdown", help="write the budget as markdown tables here")
    ap.add_argument("--baseline", help="an earlier --json result to set beside this one")
    ap.add_argument("--client-bin", default=os.path.join(ROOT, "target", "release", "raftlock-bench"),
                    help="raftlock-bench, for the SDK client's share (skipped if missing)")
    ap.add_argument("--baseline-label", default="before")
    ap.add_argument("--label", default="after")
    args = ap.parse_args()
    if not shutil.which("valgrind"):
        raise SystemExit("valgrind is missing (apt-get install valgrind)")
    work = tempfile.mkdtemp(prefix="raftlock-cpu-budget-")
    ports = free_ports(6)
    nodes = [{"id": i, "peer": f"127.0.0.1:{ports[i - 1]}", "client": f"127.0.0.1:{ports[i + 2]}"}
             for i in (1, 2, 3)]
    initial = ",".join(f"{n['id']}={n['peer']}" for n in nodes)
    for n in nodes:
        log = open(os.path.join(work, f"node{n['id']}.log"), "w")
        n["proc"] = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--quiet",
             f"--callgrind-out-file={work}/node{n['id']}.%p",
             args.bin, "--node-id", str(n["id"]), "--data-dir", f"{work}/data{n['id']}",
             "--peer-listen", n["peer"], "--client-listen", n["client"],
             "--initial-cluster", initial,
             # valgrind runs the node ~50x slower: a 100 ms tick keeps elections quiet.
             "--tick", "100ms", "--election-ticks", "30", "--heartbeat-ticks", "3"],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        leader = wait_leader(nodes)
        print(f"leader: node {leader['id']}; warming up", flush=True)
        cycles(leader["client"], 20, "warmup")
        _, t0 = dump_all(nodes, work, "warmup")
        elapsed = cycles(leader["client"], args.cycles, "busy")
        busy, t1 = dump_all(nodes, work, "busy")
        # An idle window exactly as long as the busy one (both from one dump request to the
        # next), whose ticks, heartbeats and timers are then subtracted.
        window = t1 - t0
        time.sleep(max(0.0, t1 + window - time.time()))
        idle, t2 = dump_all(nodes, work, "idle")
        scale = window / (t2 - t1)
        if get_json(leader["client"], "/status")["role"] != "leader":
            raise SystemExit("the leader changed during the measurement: run again")
        results = {"cycles": args.cycles, "seconds_under_valgrind": round(elapsed, 1),
                   "window_seconds": round(window, 2),
                   "processes": {}}
        for n in nodes:
            role = "leader" if n is leader else f"follower (node {n['id']})"
            b, b_total, b_functions = by_component(busy[n["id"]])
            i, i_total, _ = by_component(idle[n["id"]])
            per = {k: max(0, b[k] - i[k] * scale) / args.cycles for k in b}
            bs, is_ = by_stage(busy[n["id"]]), by_stage(idle[n["id"]])
            stages = {k: round(max(0, bs[k] - is_[k] * scale) / args.cycles) for k in bs}
            whole = (b_total - i_total * scale) / args.cycles
            counted = sum(v for k, v in stages.items() if not k.startswith("  "))
            stages["runtime and other (scheduling, wakeups, timers)"] = round(max(0, whole - counted))
            results["processes"][role] = {
                "instructions_per_cycle": round((b_total - i_total * scale) / args.cycles),
                "idle_instructions_per_second": round(i_total / (t2 - t1)),
                "by_component": {k: round(v) for k, v in sorted(per.items(), key=lambda kv: -kv[1])},
                "by_stage": stages,
                # The busy window's costliest functions (idle not subtracted), per cycle.
                "top_functions": [[round(c / args.cycles), f[:160]]
                                  for c, f in b_functions[:args.top]],
            }
        if os.path.exists(args.client_bin):
            try:
                results["client"] = client_budget(args, leader["client"], work)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
                print(f"the client's share was not measured: {e}", file=sys.stderr)
        print(json.dumps(results, indent=2))
        if args.markdown:
            baseline = json.load(open(args.baseline)) if args.baseline else None
            tables = markdown(results, baseline, args)
            begin, end = "<!-- budget tables -->\n", "<!-- end budget tables -->"
            text = open(args.markdown).read() if os.path.exists(args.markdown) else ""
            if begin in text and end in text:
                # Only the tables between the markers are replaced; the prose around them stays.
                text = text[:text.index(begin) + len(begin)] + tables + text[text.index(end):]
            else:
                text = begin + tables + end + "\n"
            with open(args.markdown, "w") as f:
                f.write(text)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    finally:
        for n in nodes:
            if n["proc"].poll() is None:
                n["proc"].send_signal(signal.SIGTERM)
        for n in nodes:
            try:
                n["proc"].wait(timeout=60)
            except subprocess.TimeoutExpired:
                n["proc"].kill()
        if os.environ.get("CPU_BUDGET_KEEP"):
            print(f"kept {work}", file=sys.stderr)
        else:
            if not os.environ.get("CPU_BUDGET_KEEP"): shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
