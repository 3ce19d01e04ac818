#!/usr/bin/env python3
"""Does a follower that installs a large snapshot hold up the election after the leader dies?

Three lock-node processes on 127.0.0.1. Once (the template):
  1. start nodes 1..3 with a small --snapshot-entries, SIGKILL one follower C,
  2. fill the two others with N held locks (1 h TTL) over WebSocket,
  3. stop them (SIGTERM) and copy the three data directories to DIR/template.
Each trial then restores the template and:
  install: starts the two full nodes, then C (same data directory and flags); the leader sends C
           a snapshot. Once C logs that its install began (the chunks were kept on disk as they
           arrived; with --install-mb N > 0: once C's process has written N MB since it
           started, how releases that staged the snapshot only when it was whole were timed),
           wait --delay seconds, SIGKILL the leader and poll the two survivors' /status until
           one says it is leader.
  control: restarts the killed node, waits until all three hold everything, then SIGKILLs the
           leader and measures the same way (no install running).

  pip install websockets      # the fill's WebSocket client
  python3 scripts/install-election.py --locks 300000 --trials 2 --dir /tmp/install-election/r300k

Writes DIR/results.json and prints a summary; node logs (JSON lines) stay in DIR/trial-K/.
Every wait is bounded; every process started is killed at the end (by pid).
"""
import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import datetime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "lock-node")
STARTED = []  # Popen objects of every lock-node started, for the final cleanup


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_ports(n):
    held = [socket.socket() for _ in range(n)]
    for s in held:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in held]
    for s in held:
        s.close()
    return ports


def http_get(addr, path, timeout=0.5):
    try:
        with urllib.request.urlopen(f"http://{addr}{path}", timeout=timeout) as r:
            return r.read().decode()
    except Exception:
        return None


def status(addr, timeout=0.5):
    body = http_get(addr, "/status", timeout)
    if body is None:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def metric(addr, name, labels=None):
    body = http_get(addr, "/metrics", 2.0)
    if body is None:
        return None
    want = name + ("{" + labels + "}" if labels else "")
    for line in body.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return None


def peak_rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def parse_ts(ts):
    # 2026-11-29T01:09:14.481765Z
    return datetime.strptime(ts.rstrip("Z")[:26], "%Y-%m-%dT%H:%M:%S.%f").replace(
        tzinfo=__import__("datetime").timezone.utc).timestamp()


def log_lines(path):
    out = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    if line:
                        out.append({"raw": line})
                    continue
                try:
                    j = json.loads(line)
                except ValueError:
                    out.append({"raw": line})
                    continue
                try:
                    j["t"] = parse_ts(j.get("timestamp", ""))
                except ValueError:
                    j["t"] = None
                out.append(j)
    except FileNotFoundError:
        pass
    return out


def msg_of(j):
    return j.get("fields", {}).get("message", j.get("raw", ""))


def proc_io(pid):
    d = {}
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                k, v = line.split(":")
                d[k.strip()] = int(v)
    except (OSError, ValueError):
        pass
    return d


class Cluster:
    def __init__(self, cfg, live_dir, log_dir, args):
        self.cfg = cfg  # ids, peer ports, client ports
        self.live = live_dir
        self.logs = log_dir
        self.args = args
        self.procs = {}

    def client(self, i):
        return f"127.0.0.1:{self.cfg['client'][str(i)]}"

    def start(self, i, note=""):
        initial = ",".join(f"{j}=127.0.0.1:{self.cfg['peer'][str(j)]}" for j in (1, 2, 3))
        argv = [BIN, "--node-id", str(i), "--data-dir", os.path.join(self.live, f"n{i}"),
                "--peer-listen", f"127.0.0.1:{self.cfg['peer'][str(i)]}",
                "--client-listen", self.client(i), "--initial-cluster", initial,
                "--snapshot-entries", str(self.args.snapshot_entries), "--log-format", "json",
                "--raft-log-engine", self.args.raft_log_engine]
        env = dict(os.environ, RAFTLOCK_MAX_ANSWERS="2000000", RUST_LOG=os.environ.get("RUST_LOG", "info"))
        os.makedirs(self.logs, exist_ok=True)
        f = open(os.path.join(self.logs, f"n{i}.log"), "a")
        f.write(json.dumps({"script": f"start node {i} {note}", "t": time.time()}) + "\n")
        f.flush()
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
        STARTED.append(p)
        self.procs[i] = p
        return p

    def kill(self, i, sig=signal.SIGKILL):
        p = self.procs.get(i)
        if p and p.poll() is None:
            p.send_signal(sig)
        return time.time()

    def wait_exit(self, i, limit):
        p = self.procs.get(i)
        if not p:
            return
        try:
            p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)

    def stop_all(self):
        for i, p in self.procs.items():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def wait_leader(self, ids, limit, cond=None):
        end = time.monotonic() + limit
        while time.monotonic() < end:
            for i in ids:
                s = status(self.client(i))
                if s and s.get("role") == "leader" and (cond is None or cond(s)):
                    return i, s
            time.sleep(0.1)
        return None, None


# ----- fill -----------------------------------------------------------------------------------

async def fill_conn(c, addr, keys, stats, deadline, window):
    import websockets
    from websockets.asyncio.client import connect
    client = f"ie-fill{c}"
    pending = {}  # key number -> attempts
    queue = list(keys)
    queue.reverse()
    retry = []
    sem = asyncio.Semaphore(window)
    pause_until = [0.0]
    done = asyncio.Event()
    remaining = [len(keys)]
    async with connect(f"ws://{addr}/ws", compression=None, max_queue=None,
                       open_timeout=10, ping_interval=None) as ws:
        async def sender():
            while remaining[0] > 0 and time.monotonic() < deadline:
                now = time.monotonic()
                if now < pause_until[0]:
                    await asyncio.sleep(pause_until[0] - now)
                    continue
                if retry:
                    i = retry.pop()
                elif queue:
                    i = queue.pop()
                else:
                    await asyncio.sleep(0.05)
                    continue
                await sem.acquire()
                pending[i] = pending.get(i, 0) + 1
                await ws.send(f'{{"commandType":3,"key":"ie/lock/{i:08d}","clientId":"{client}",'
                              f'"requestId":"k{i}","ttl":3600000,"waitTimeout":0}}')
            done.set()

        async def receiver():
            while remaining[0] > 0 and time.monotonic() < deadline:
                try:
                    frame = await asyncio.wait_for(ws.recv(), timeout=30)
                except asyncio.TimeoutError:
                    stats["errors"]["no reply in 30 s"] = stats["errors"].get("no reply in 30 s", 0) + 1
                    return
                r = json.loads(frame)
                rid = r.get("requestId") or ""
                if not rid.startswith("k"):
                    continue
                i = int(rid[1:])
                sem.release()
                if r.get("success"):
                    stats["granted"] += 1
                    remaining[0] -= 1
                    continue
                code = (r.get("error") or {}).get("code", "?")
                stats["errors"][code] = stats["errors"].get(code, 0) + 1
                if code == "ALREADY_HELD":
                    stats["granted"] += 1
                    remaining[0] -= 1
                elif code in ("BUSY", "UNAVAILABLE", "NOT_LEADER", "NO_LEADER"):
                    if code == "BUSY":
                        pause_until[0] = time.monotonic() + 0.25
                    retry.append(i)
                else:
                    stats["gave_up"] += 1
                    remaining[0] -= 1

        s = asyncio.create_task(sender())
        try:
            await receiver()
        finally:
            s.cancel()


async def fill(addr, n, conns, window, limit):
    stats = {"granted": 0, "gave_up": 0, "errors": {}}
    deadline = time.monotonic() + limit
    per = [list(range(c, n, conns)) for c in range(conns)]
    t0 = time.monotonic()

    async def progress():
        while True:
            await asyncio.sleep(10)
            log(f"  fill: {stats['granted']} granted, {stats['granted'] / (time.monotonic() - t0):.0f}/s, refusals {stats['errors']}")

    p = asyncio.create_task(progress())
    results = await asyncio.gather(*(fill_conn(c, addr, per[c], stats, deadline, window)
                                     for c in range(conns)), return_exceptions=True)
    p.cancel()
    for r in results:
        if isinstance(r, Exception):
            stats["errors"][f"conn: {r!r}"] = stats["errors"].get(f"conn: {r!r}", 0) + 1
    stats["seconds"] = time.monotonic() - t0
    return stats


# ----- template -------------------------------------------------------------------------------

def prepare(args):
    tdir = os.path.join(args.dir, "template")
    meta_path = os.path.join(args.dir, "template.json")
    if os.path.exists(meta_path):
        meta = json.load(open(meta_path))
        if meta.get("locks") == args.locks and meta.get("snapshot_entries") == args.snapshot_entries \
                and meta.get("raft_log_engine") == args.raft_log_engine:
            log(f"reusing template {tdir} ({args.locks} locks)")
            return meta
        shutil.rmtree(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    ports = free_ports(6)
    cfg = {"peer": {str(i): ports[i - 1] for i in (1, 2, 3)},
           "client": {str(i): ports[i + 2] for i in (1, 2, 3)}}
    cl = Cluster(cfg, tdir, os.path.join(args.dir, "prepare"), args)
    try:
        for i in (1, 2, 3):
            cl.start(i, "(prepare)")
        leader, _ = cl.wait_leader((1, 2, 3), 60)
        if not leader:
            raise SystemExit("no leader within 60 s")
        c = max(i for i in (1, 2, 3) if i != leader)
        time.sleep(1)
        cl.kill(c)
        cl.wait_exit(c, 10)
        log(f"leader {leader}; SIGKILLed follower {c} before the fill")
        s = status(cl.client(c)) or {}
        t0 = time.monotonic()
        stats = asyncio.run(fill(cl.client(leader), args.locks, args.fill_connections,
                                 args.fill_window, args.fill_limit))
        log(f"fill: {stats}")
        full = [i for i in (1, 2, 3) if i != c]
        # Wait until both hold everything and the log was compacted on both.
        end = time.monotonic() + 120
        while time.monotonic() < end:
            st = {i: status(cl.client(i)) for i in full}
            taken = {i: metric(cl.client(i), "raftlock_snapshots_total", 'kind="taken"') for i in full}
            if all(st[i] and st[i]["locksHeld"] >= stats["granted"] and
                   st[i]["appliedIndex"] >= st[i]["commitIndex"] for i in full) and all((taken[i] or 0) > 0 for i in full):
                break
            time.sleep(0.5)
        log(f"before stop: { {i: (st[i] or {}).get('locksHeld') for i in full} } held; compactions {taken}")
        for i in full:
            cl.kill(i, signal.SIGTERM)
        for i in full:
            cl.wait_exit(i, 120)
        meta = {"locks": args.locks, "granted": stats["granted"], "fill": stats,
                "snapshot_entries": args.snapshot_entries, "raft_log_engine": args.raft_log_engine,
                "behind": c, "full": full, "cfg": cfg,
                "du_mb": {i: dir_mb(os.path.join(tdir, f"n{i}")) for i in (1, 2, 3)}}
        json.dump(meta, open(meta_path, "w"), indent=1)
        return meta
    finally:
        cl.stop_all()


def dir_mb(path):
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return round(total / 2**20, 1)


# ----- trials ---------------------------------------------------------------------------------

def poll_new_leader(cl, ids, t_kill_mono, old_term, limit):
    """Polls the survivors until one reports itself leader in a later term."""
    end = time.monotonic() + limit
    polls = 0
    while time.monotonic() < end:
        for i in ids:
            s = status(cl.client(i), 0.3)
            polls += 1
            if s and s.get("role") == "leader" and s.get("term", 0) > old_term:
                return {"leader": i, "after_s": round(time.monotonic() - t_kill_mono, 3),
                        "term": s["term"], "polls": polls, "wall": time.time()}
        time.sleep(0.02)
    return {"leader": None, "after_s": None, "polls": polls}


def events_after(path, t_from, words):
    out = []
    for j in log_lines(path):
        if j.get("t") is None or j["t"] < t_from - 0.001:
            continue
        m = msg_of(j)
        if any(w in m for w in words):
            f = dict(j.get("fields", {}))
            f.pop("message", None)
            out.append({"at_s": round(j["t"] - t_from, 3), "level": j.get("level"), "msg": m, **f})
    return out


WORDS = ["installed snapshot", "snapshot encoded", "slow driver turn", "election timeout",
         "became leader", "no longer leader", "stepping down", "storage failure", "error",
         "finishing a snapshot install", "recovered", "transferring"]


def trial(args, meta, k):
    cfg = meta["cfg"]
    tdir = os.path.join(args.dir, "template")
    live = os.path.join(args.dir, "live")
    logs = os.path.join(args.dir, f"trial-{k}")
    shutil.rmtree(live, ignore_errors=True)
    shutil.rmtree(logs, ignore_errors=True)
    t = time.monotonic()
    subprocess.run(["cp", "-a", tdir, live], check=True)
    log(f"trial {k}: restored the template in {time.monotonic() - t:.1f} s")
    cl = Cluster(cfg, live, logs, args)
    c = meta["behind"]
    full = meta["full"]
    res = {"trial": k, "behind": c}
    try:
        for i in full:
            cl.start(i, "(template)")
        leader, s = cl.wait_leader(full, 120, lambda s: s["locksHeld"] >= meta["granted"])
        if not leader:
            res["error"] = "no leader holding every lock within 120 s"
            return res
        other = [i for i in full if i != leader][0]
        time.sleep(3)  # let the new leader's lease walk (16,384 locks per tick) finish
        res.update(leader=leader, other=other, term_before=status(cl.client(leader))["term"])
        log(f"trial {k}: leader {leader}, other {other}; starting {c}")
        t_c_start = time.time()
        pc = cl.start(c, "(behind; same data dir and flags)")
        base = None
        timeline = []
        t_detect = t_kill = None
        kill_mono = None
        new = None
        end = time.monotonic() + args.trial_limit
        c_log = os.path.join(logs, f"n{c}.log")
        installed_at = None
        while time.monotonic() < end:
            io = proc_io(pc.pid)
            now = time.time()
            if base is None and io and status(cl.client(c), 0.2):
                base = io
            if io and base:
                wmb = (io["wchar"] - base["wchar"]) / 2**20
                rmb = (io["rchar"] - base["rchar"]) / 2**20
                timeline.append((round(now - t_c_start, 3), round(rmb, 1), round(wmb, 1)))
                if t_detect is None and args.install_mb > 0 and wmb >= args.install_mb:
                    t_detect = now
                    log(f"trial {k}: node {c} wrote {wmb:.0f} MB (read {rmb:.0f} MB): install under way, "
                        f"{now - t_c_start:.2f} s after its start")
            lines = log_lines(c_log) if installed_at is None or t_detect is None else []
            if t_detect is None and args.install_mb <= 0:
                if any("installing a snapshot from the leader" in msg_of(j) for j in lines):
                    t_detect = now
                    log(f"trial {k}: node {c} logged its install's start, "
                        f"{now - t_c_start:.2f} s after its start")
            for j in lines:
                if "installed snapshot" in msg_of(j) and j.get("t"):
                    installed_at = j["t"]
            if t_detect and t_kill is None and now >= t_detect + args.delay:
                if installed_at is not None:
                    res["error"] = "install finished before the kill; lower --delay"
                    break
                kill_mono = time.monotonic()
                t_kill = cl.kill(leader)
                log(f"trial {k}: SIGKILLed leader {leader}")
                new = poll_new_leader(cl, [other, c], kill_mono, res["term_before"], args.trial_limit)
                log(f"trial {k}: new leader {new}")
                # wait (bounded) for the install's log line
                end2 = time.monotonic() + 120
                while installed_at is None and time.monotonic() < end2:
                    for j in log_lines(c_log):
                        if "installed snapshot" in msg_of(j) and j.get("t"):
                            installed_at = j["t"]
                    time.sleep(0.2)
                break
            time.sleep(0.025)
        res["c_start_to_install_detected_s"] = round(t_detect - t_c_start, 3) if t_detect else None
        res["kill_after_c_start_s"] = round(t_kill - t_c_start, 3) if t_kill else None
        res["installed_after_c_start_s"] = round(installed_at - t_c_start, 3) if installed_at else None
        res["installed_after_kill_s"] = round(installed_at - t_kill, 3) if installed_at and t_kill else None
        res["install_seconds_est"] = round(installed_at - t_detect, 3) if installed_at and t_detect else None
        res["install"] = new
        if new and new.get("wall") and installed_at:
            res["new_leader_after_installed_s"] = round(new["wall"] - installed_at, 3)
        enc = [e for e in events_after(os.path.join(logs, f"n{leader}.log"), t_c_start, ["snapshot encoded"])]
        res["encoded"] = enc
        res["timeline_c_io_mb"] = timeline[:: max(1, len(timeline) // 200)]
        if t_kill:
            res["events_after_kill"] = {i: events_after(os.path.join(logs, f"n{i}.log"), t_kill, WORDS)
                                        for i in (other, c)}
        res["events_c_from_start"] = events_after(c_log, t_c_start, WORDS)
        res["snapshots_c"] = metric(cl.client(c), "raftlock_snapshots_total", 'kind="installed"')
        # The behind node's peak resident memory since it started: the transfer's buffer and
        # the install included (read once the install has ended).
        res["c_peak_rss_mib"] = peak_rss_mib(pc.pid) if installed_at else None
        if not (new and new.get("leader")):
            return res

        # ----- control: the same cluster, everyone caught up, no install running -----------
        cl.start(leader, "(restart after the install trial)")
        end = time.monotonic() + 180
        ok = False
        while time.monotonic() < end:
            st = {i: status(cl.client(i)) for i in (1, 2, 3)}
            ld = [i for i, s in st.items() if s and s["role"] == "leader"]
            if ld and all(st[i] and st[i]["locksHeld"] >= meta["granted"] and
                          st[i]["appliedIndex"] >= st[ld[0]]["commitIndex"] - 2 for i in (1, 2, 3)):
                ok = True
                break
            time.sleep(0.5)
        if not ok:
            res["control_error"] = "cluster did not catch up within 180 s"
            return res
        time.sleep(3)
        ctl_leader = ld[0]
        term = st[ctl_leader]["term"]
        rest = [i for i in (1, 2, 3) if i != ctl_leader]
        kill_mono = time.monotonic()
        t_kill2 = cl.kill(ctl_leader)
        log(f"trial {k} control: SIGKILLed leader {ctl_leader}")
        ctl = poll_new_leader(cl, rest, kill_mono, term, 60)
        log(f"trial {k} control: new leader {ctl}")
        res["control"] = {"killed": ctl_leader, **ctl,
                          "events_after_kill": {i: events_after(os.path.join(logs, f"n{i}.log"), t_kill2, WORDS)
                                                for i in rest}}
        return res
    finally:
        cl.stop_all()
        shutil.rmtree(live, ignore_errors=True)


def main():
    global BIN
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=BIN, help="the lock-node to run (default: this checkout's release build)")
    ap.add_argument("--locks", type=int, default=300000)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/install-election/run")
    ap.add_argument("--snapshot-entries", type=int, default=5000)
    ap.add_argument("--raft-log-engine", default="sled")
    ap.add_argument("--delay", type=float, default=1.0, help="seconds from the install's start to the kill")
    ap.add_argument("--install-mb", type=float, default=0.0,
                    help="count the install as started once the behind node has written this many "
                         "MB (0: once it logs the install's start)")
    ap.add_argument("--fill-connections", type=int, default=16)
    ap.add_argument("--fill-window", type=int, default=128)
    ap.add_argument("--fill-limit", type=float, default=1200.0)
    ap.add_argument("--trial-limit", type=float, default=180.0)
    args = ap.parse_args()
    BIN = args.bin
    if not os.access(BIN, os.X_OK):
        raise SystemExit(f"{BIN} not built")
    out = {"args": vars(args)}
    try:
        meta = prepare(args)
        out["template"] = meta
        log(f"template: {meta['granted']} locks; node {meta['behind']} behind; du {meta['du_mb']}")
        out["trials"] = []
        for k in range(1, args.trials + 1):
            r = trial(args, meta, k)
            out["trials"].append(r)
            json.dump(out, open(os.path.join(args.dir, "results.json"), "w"), indent=1)
            log(f"trial {k}: " + json.dumps({x: r.get(x) for x in (
                "leader", "behind", "install", "installed_after_kill_s", "install_seconds_est",
                "new_leader_after_installed_s", "error")}))
            if r.get("control"):
                log(f"trial {k} control: " + json.dumps({x: r["control"].get(x) for x in ("killed", "leader", "after_s", "term")}))
    finally:
        for p in STARTED:
            if p.poll() is None:
                p.kill()
        for p in STARTED:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        json.dump(out, open(os.path.join(args.dir, "results.json"), "w"), indent=1) if os.path.isdir(args.dir) else None
    summary(out)


def summary(out):
    print("\n==== summary ====")
    t = out.get("template", {})
    print(f"locks held: {t.get('granted')} (fill {t.get('fill', {}).get('seconds', 0):.0f} s); "
          f"template du MB {t.get('du_mb')}")
    for r in out.get("trials", []):
        enc = (r.get("encoded") or [{}])[0]
        print(f"trial {r['trial']}: snapshot {enc.get('bytes', 0) / 2**20:.1f} MiB encoded in {enc.get('took_ms')} ms; "
              f"install ~{r.get('install_seconds_est')} s (C start->installed {r.get('installed_after_c_start_s')} s); "
              f"killed leader {r.get('leader')} {r.get('kill_after_c_start_s')} s after C start; "
              f"new leader {(r.get('install') or {}).get('leader')} after {(r.get('install') or {}).get('after_s')} s "
              f"(install ended {r.get('installed_after_kill_s')} s after the kill; leader "
              f"{r.get('new_leader_after_installed_s')} s after the install line); "
              f"C's peak RSS {r.get('c_peak_rss_mib')} MiB {r.get('error') or ''}")
        turn = [e for e in r.get("events_c_from_start", []) if e["msg"] == "slow driver turn"
                and e.get("took_ms", 0) >= 100]
        won = [e["at_s"] for ev in (r.get("events_after_kill") or {}).values() for e in ev
               if e["msg"] == "became leader"]
        print(f"   C's driver turns of 100 ms or more ('slow driver turn'): "
              f"{[e['took_ms'] for e in turn]} ms; 'became leader' logged {min(won) if won else None} s after the kill")
        c = r.get("control")
        if c:
            won = [e["at_s"] for ev in c.get("events_after_kill", {}).values() for e in ev
                   if e["msg"] == "became leader"]
            print(f"   control: killed {c['killed']}, new leader {c.get('leader')} after {c.get('after_s')} s "
                  f"(polled; 'became leader' logged {min(won) if won else None} s after the kill)")


if __name__ == "__main__":
    main()
