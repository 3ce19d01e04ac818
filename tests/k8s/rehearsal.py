#!/usr/bin/env python3
"""The StatefulSet rehearsal: the Helm chart's pods as real containers of the RaftLock image.

Kubernetes is not needed: each "pod" is a container named as the StatefulSet names its pods,
reachable under the headless and client Services' DNS names (Docker network aliases on a private
network made for the run), with one Docker volume per volumeClaimTemplate, and started with
exactly the command, arguments, environment and security settings of the *rendered* chart
(`scripts/check-chart.sh --render-only`), read from the manifests, not retyped.

The rehearsal, with a client workload running throughout (acquire -> fenced write to the data
store -> release, and replicated KV puts, through randomly chosen pods as a client Service
spreads connections):

  1. install 3: a leader is elected; the chart's `helm test` pods pass;
  2. a lock is taken with a long TTL and must keep its holder and token to the end;
  3. scale to 5: pods 3 and 4 join and become voters;
  4. scale back to 3 the way the chart does it: the pre-upgrade hook Job removes members 4 and 5,
     then their pods stop (SIGTERM, then SIGKILL after terminationGracePeriodSeconds);
  5. delete a pod (kill -9, as a node loss) and start it again on its volume;
  6. roll every pod one at a time, highest ordinal first, waiting for /readyz between pods, as a
     RollingUpdate does.

The pods get the cluster token from the rendered token Secret (the chart generates one when the
values set none), as the kubelet would from the Secret the install created.

Checked throughout: the held lock keeps its token; every grant the workload saw carries a token
above the previous one; the data store accepted exactly the writes the workload saw accepted; every
acknowledged KV put is readable at the end; clients saw at most retries (unavailable, no leader,
connection loss), never another error. Exits non-zero on the first failure, printing it.

With --secured the chart runs with everything security turns on, from Secrets made for the run
(as an operator creates them): peer mutual TLS (`tls.peer`, the node Secret for the lock nodes
and the operator certificate's Secret for the scale-down hook), client-port TLS (`tls.client`),
signed client tokens (`clientAuth.jwtKeySecret`, with `lockctl token` for the helm test pods,
the hook and the workload) and the fencing MAC key for the lock nodes and the data store
(`fencingKeySecret`). The workload then speaks wss:// and https with the CA, presents its token,
and sends each grant's MAC with its writes.

Usage: tests/k8s/rehearsal.py --image raftlock/raftlock:0.1.0 [--secured] [--keep]
Needs Docker, PyYAML and websocket-client (pip), and the chart renderer's Python packages.
"""

import argparse
import base64
import json
import os
import random
import re
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import yaml
import websocket

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAMESPACE = "default"
RELEASE = "raftlock"
CLUSTER_DOMAIN = "cluster.local"


# --secured: the CA file, the TLS context and the bearer token the rehearsal's own clients use.
SECURE = None


def urlopen(url_or_request, timeout):
    """urllib's urlopen, over TLS with the run's CA and with its token when --secured."""
    if SECURE is None:
        return urllib.request.urlopen(url_or_request, timeout=timeout)
    req = url_or_request
    if isinstance(req, str):
        req = urllib.request.Request(req)
    req.add_header("Authorization", f"Bearer {SECURE['token']}")
    return urllib.request.urlopen(req, timeout=timeout, context=SECURE["context"])


def log(*args):
    print(time.strftime("%H:%M:%S"), *args, flush=True)


class Failure(Exception):
    pass


def run(cmd, check=True, capture=True, timeout=300):
    result = subprocess.run(cmd, capture_output=capture, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise Failure(f"command failed ({result.returncode}): {' '.join(cmd)}\n"
                      f"{result.stdout}\n{result.stderr}")
    return result


# ---------------------------------------------------------------------------------------------
# The rendered chart


def render(values_files):
    out = tempfile.mkdtemp(prefix="raftlock-render-")
    cmd = [os.path.join(ROOT, "scripts", "check-chart.sh"), "--render-only", out,
           "--release", RELEASE, "--namespace", NAMESPACE] + values_files
    run(cmd)
    with open(os.path.join(out, "manifests.yaml")) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    return docs


def find(docs, kind, predicate=lambda d: True):
    return [d for d in docs if d.get("kind") == kind and predicate(d)]


def one(docs, kind, predicate=lambda d: True):
    found = find(docs, kind, predicate)
    if len(found) != 1:
        raise Failure(f"expected one {kind} in the rendered chart, found {len(found)}")
    return found[0]


def is_hook(doc, hook):
    hooks = (doc.get("metadata", {}).get("annotations") or {}).get("helm.sh/hook", "")
    return hook in [h.strip() for h in hooks.split(",")]


def selects(service, labels):
    selector = service.get("spec", {}).get("selector") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def service_names(name):
    return [name, f"{name}.{NAMESPACE}", f"{name}.{NAMESPACE}.svc",
            f"{name}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}"]


# ---------------------------------------------------------------------------------------------
# Pods as containers


class Pods:
    """Starts pod specs from the rendered manifests as containers on one private network."""

    def __init__(self, docs, prefix):
        self.docs = docs
        self.prefix = prefix
        self.network = f"{prefix}-net"
        self.volumes = set()
        self.containers = set()
        self.files_dir = tempfile.mkdtemp(prefix="raftlock-pod-files-")
        # The Secrets as the cluster holds them: those the install created, among them the
        # chart's <release>-token with the generated cluster token. Every pod, whichever render
        # its spec comes from, reads its secretKeyRefs from here, as the kubelet reads the
        # cluster's Secret. A later render (the upgrade to 5 replicas) carries another random
        # token, because render-only has no cluster for the chart's `lookup`; a real upgrade
        # finds the installed Secret and renders its token again, so the installed one stays.
        self.secrets = {d["metadata"]["name"]: d for d in find(docs, "Secret")}
        run(["docker", "network", "create", self.network])

    def container(self, pod):
        return f"{self.prefix}-{pod}"

    def secret(self, name):
        if name not in self.secrets:
            raise Failure(f"no Secret {name} in the rendered chart")
        return self.secrets[name]

    def secret_keys(self, name):
        secret = self.secret(name)
        return list(secret.get("stringData") or {}) + list(secret.get("data") or {})

    def secret_value(self, name, key):
        secret = self.secret(name)
        if key in (secret.get("stringData") or {}):
            return secret["stringData"][key]
        if key not in (secret.get("data") or {}):
            raise Failure(f"Secret {name} has no key {key}")
        return base64.b64decode(secret["data"][key]).decode()

    def configmap_value(self, name, key):
        cm = one(self.docs, "ConfigMap", lambda d: d["metadata"]["name"] == name)
        return cm["data"][key]

    def env_of(self, container, pod_name, labels):
        env = {}
        for source in container.get("envFrom") or []:
            if "secretRef" in source:
                name = source["secretRef"]["name"]
                for k in self.secret_keys(name):
                    env[k] = self.secret_value(name, k)
            elif "configMapRef" in source:
                cm = one(self.docs, "ConfigMap",
                         lambda d: d["metadata"]["name"] == source["configMapRef"]["name"])
                env.update(cm.get("data") or {})
        for item in container.get("env") or []:
            name = item["name"]
            if "value" in item:
                env[name] = expand(str(item["value"]), env)
            elif "valueFrom" in item:
                src = item["valueFrom"]
                if "fieldRef" in src:
                    path = src["fieldRef"]["fieldPath"]
                    fields = {"metadata.name": pod_name, "metadata.namespace": NAMESPACE,
                              "spec.serviceAccountName": "default"}
                    if path.startswith("metadata.labels['"):
                        env[name] = labels.get(path[len("metadata.labels['"):-2], "")
                    elif path in fields:
                        env[name] = fields[path]
                    else:
                        raise Failure(f"the rehearsal cannot emulate fieldRef {path}")
                elif "secretKeyRef" in src:
                    ref = src["secretKeyRef"]
                    try:
                        env[name] = self.secret_value(ref["name"], ref["key"])
                    except Failure:
                        if not ref.get("optional"):
                            raise
                elif "configMapKeyRef" in src:
                    ref = src["configMapKeyRef"]
                    env[name] = self.configmap_value(ref["name"], ref["key"])
                else:
                    raise Failure(f"the rehearsal cannot emulate env source {src}")
            else:
                env[name] = ""
        return env

    def start(self, pod_name, pod_spec, labels, claims=None, hostname=None, subdomain=None,
              detach=True, remove=False):
        """Starts the pod's first container (the charts' pods have one). `claims` maps a volume
        name to a Docker volume; returns the container name."""
        if len(pod_spec.get("containers", [])) != 1 or pod_spec.get("initContainers"):
            raise Failure(f"{pod_name}: the rehearsal runs pods with exactly one container")
        c = pod_spec["containers"][0]
        env = self.env_of(c, pod_name, labels)
        name = self.container(pod_name)
        cmd = ["docker", "run", "--name", name, "--network", self.network,
               "--hostname", hostname or pod_name]
        cmd += ["--detach"] if detach else []
        cmd += ["--rm"] if remove else []
        # Names the pod answers to: its own, under the headless service, and every Service
        # selecting it (Docker's DNS answers all containers holding an alias, like endpoints).
        aliases = [pod_name]
        if subdomain:
            aliases += [f"{pod_name}.{n}" for n in service_names(subdomain)]
        for svc in find(self.docs, "Service"):
            if selects(svc, labels):
                aliases += service_names(svc["metadata"]["name"])
        for alias in aliases:
            cmd += ["--network-alias", alias]
        pod_sc = pod_spec.get("securityContext") or {}
        sc = {**pod_sc, **(c.get("securityContext") or {})}
        if "runAsUser" in sc:
            cmd += ["--user", f"{sc['runAsUser']}:{sc.get('runAsGroup', sc['runAsUser'])}"]
        if sc.get("readOnlyRootFilesystem"):
            cmd += ["--read-only"]
        if sc.get("allowPrivilegeEscalation") is False:
            cmd += ["--security-opt", "no-new-privileges"]
        for cap in (sc.get("capabilities") or {}).get("drop") or []:
            cmd += ["--cap-drop", cap]
        for cap in (sc.get("capabilities") or {}).get("add") or []:
            cmd += ["--cap-add", cap]
        volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
        for mount in c.get("volumeMounts") or []:
            vname, path = mount["name"], mount["mountPath"]
            ro = ",ro" if mount.get("readOnly") else ""
            if claims and vname in claims:
                self.prepare_volume(claims[vname], pod_sc.get("fsGroup"))
                cmd += ["-v", f"{claims[vname]}:{path}{ro}"]
            elif vname in volumes and "emptyDir" in volumes[vname]:
                cmd += ["--tmpfs", f"{path}:rw,mode=1777"]
            elif vname in volumes and "persistentVolumeClaim" in volumes[vname]:
                vol = f"{self.prefix}-{volumes[vname]['persistentVolumeClaim']['claimName']}"
                self.prepare_volume(vol, pod_sc.get("fsGroup"))
                cmd += ["-v", f"{vol}:{path}{ro}"]
            elif vname in volumes and ("configMap" in volumes[vname] or "secret" in volumes[vname]):
                host_dir = self.materialize(pod_name, vname, volumes[vname])
                cmd += ["-v", f"{host_dir}:{path}:ro"]
            else:
                raise Failure(f"{pod_name}: the rehearsal cannot emulate volume {vname}")
        for k, v in env.items():
            cmd += ["-e", f"{k}={v}"]
        command = [expand(x, env) for x in c.get("command") or []]
        args = [expand(x, env) for x in c.get("args") or []]
        image = c["image"]
        if command:
            cmd += ["--entrypoint", command[0], image] + command[1:] + args
        else:
            cmd += [image] + args
        self.containers.add(name)
        return run(cmd, check=detach, timeout=600)

    def prepare_volume(self, volume, fs_group):
        """A new claim is an empty volume owned by the pod's fsGroup, as the kubelet makes it."""
        if volume in self.volumes:
            return
        run(["docker", "volume", "create", volume])
        self.volumes.add(volume)
        if fs_group is not None:
            image = one(self.docs, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["image"]
            run(["docker", "run", "--rm", "--user", "0:0", "--entrypoint", "/bin/sh", "-v",
                 f"{volume}:/volume", image, "-c",
                 f"chown {fs_group}:{fs_group} /volume && chmod 2775 /volume"])

    def materialize(self, pod_name, vname, volume):
        d = os.path.join(self.files_dir, pod_name, vname)
        os.makedirs(d, exist_ok=True)
        if "configMap" in volume:
            cm = one(self.docs, "ConfigMap",
                     lambda x: x["metadata"]["name"] == volume["configMap"]["name"])
            items = cm.get("data") or {}
        else:
            name = volume["secret"]["secretName"]
            items = {k: self.secret_value(name, k) for k in self.secret_keys(name)}
        # `items` projects only the listed keys, each at its path, as the kubelet does (the hook
        # and the test pods take the client port's CA alone, the hook the operator's files).
        # The kubelet would also apply `defaultMode` (0440, owner root, group fsGroup); the
        # files here stay 0644, owned by whoever runs the rehearsal.
        source = volume.get("configMap") or volume.get("secret")
        if source.get("items"):
            wanted = {i["key"]: i["path"] for i in source["items"]}
            missing = sorted(set(wanted) - set(items))
            if missing:
                raise Failure(f"{pod_name}: volume {vname} needs keys {missing} its source lacks")
            items = {wanted[k]: v for k, v in items.items() if k in wanted}
        for k, v in items.items():
            with open(os.path.join(d, k), "w") as f:
                f.write(v)
            os.chmod(os.path.join(d, k), 0o644)
        os.chmod(d, 0o755)
        return d

    def ip(self, pod_name):
        out = run(["docker", "inspect", "-f",
                   "{{(index .NetworkSettings.Networks \"%s\").IPAddress}}" % self.network,
                   self.container(pod_name)]).stdout.strip()
        if not out:
            raise Failure(f"{pod_name} has no address")
        return out

    def running(self, pod_name):
        r = run(["docker", "inspect", "-f", "{{.State.Running}}", self.container(pod_name)],
                check=False)
        return r.returncode == 0 and r.stdout.strip() == "true"

    def stop(self, pod_name, grace):
        """Deletes a pod: SIGTERM, then SIGKILL after the grace period."""
        run(["docker", "stop", "-t", str(grace), self.container(pod_name)], timeout=grace + 60)
        run(["docker", "rm", self.container(pod_name)])

    def kill(self, pod_name):
        run(["docker", "kill", "--signal", "KILL", self.container(pod_name)])
        run(["docker", "rm", self.container(pod_name)])

    def logs(self, pod_name, lines=30):
        r = run(["docker", "logs", "--tail", str(lines), self.container(pod_name)], check=False)
        return r.stdout + r.stderr

    def cleanup(self):
        for c in self.containers:
            run(["docker", "rm", "-f", c], check=False)
        for v in self.volumes:
            run(["docker", "volume", "rm", "-f", v], check=False)
        run(["docker", "network", "rm", self.network], check=False)


def expand(text, env):
    """Kubernetes' $(VAR) expansion in command, args and env values; $$ escapes."""
    def sub(m):
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)


# ---------------------------------------------------------------------------------------------
# The cluster as the StatefulSet runs it


class Cluster:
    def __init__(self, pods, docs):
        self.pods = pods
        self.docs = docs
        self.sts = one(docs, "StatefulSet")
        self.name = self.sts["metadata"]["name"]
        spec = self.sts["spec"]
        self.headless = spec["serviceName"]
        self.template = spec["template"]
        self.labels = self.template["metadata"]["labels"]
        self.grace = self.template["spec"].get("terminationGracePeriodSeconds", 30)
        self.claims = [t["metadata"]["name"] for t in spec.get("volumeClaimTemplates") or []]
        c = self.template["spec"]["containers"][0]
        self.client_port = port_of(c, "client", 50050)
        probe = c.get("readinessProbe", {}).get("httpGet", {})
        self.ready_path = probe.get("path", "/readyz")
        self.up = set()

    def pod(self, ordinal):
        return f"{self.name}-{ordinal}"

    def start(self, ordinal):
        pod = self.pod(ordinal)
        claims = {c: f"{self.pods.prefix}-{c}-{pod}" for c in self.claims}
        self.pods.start(pod, self.template["spec"], self.labels, claims=claims,
                        subdomain=self.headless)
        self.up.add(ordinal)

    def stop(self, ordinal):
        self.pods.stop(self.pod(ordinal), self.grace)
        self.up.discard(ordinal)

    def kill(self, ordinal):
        self.pods.kill(self.pod(ordinal))
        self.up.discard(ordinal)

    def delete_volumes(self, ordinal):
        """Deletes the pod's PVCs (the pod must be gone): its next start gets empty volumes."""
        for c in self.claims:
            vol = f"{self.pods.prefix}-{c}-{self.pod(ordinal)}"
            run(["docker", "volume", "rm", "-f", vol])
            self.pods.volumes.discard(vol)

    def readyz(self, ordinal):
        """(status, body) of the pod's readiness endpoint; (0, error) when it does not answer."""
        try:
            with urlopen(self.url(ordinal, self.ready_path), timeout=3) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (urllib.error.URLError, OSError, Failure) as e:
            return 0, str(e)

    def url(self, ordinal, path):
        scheme = "https" if SECURE else "http"
        return f"{scheme}://{self.pods.ip(self.pod(ordinal))}:{self.client_port}{path}"

    def ws_urls(self):
        urls = []
        for o in sorted(self.up):
            try:
                scheme = "wss" if SECURE else "ws"
                urls.append(f"{scheme}://{self.pods.ip(self.pod(o))}:{self.client_port}/ws")
            except Failure:
                pass
        return urls

    def get_json(self, ordinal, path):
        with urlopen(self.url(ordinal, path), timeout=3) as r:
            return json.loads(r.read())

    def ready(self, ordinal):
        try:
            with urlopen(self.url(ordinal, self.ready_path), timeout=3) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, Failure):
            return False

    def wait_ready(self, ordinals, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if all(self.ready(o) for o in ordinals):
                return
            time.sleep(0.5)
        for o in ordinals:
            if not self.ready(o):
                log(f"{self.pod(o)} not ready; its log ends:\n{self.pods.logs(self.pod(o))}")
        raise Failure(f"pods {ordinals} not ready within {timeout}s")

    def members(self, ordinal):
        return self.get_json(ordinal, "/members")

    def wait_voters(self, voters, timeout=120):
        """Waits until every running pod reports exactly these voters (node ids) and no learner."""
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            try:
                views = [self.members(o) for o in sorted(self.up)]
                last = views
                ok = all(sorted(m["id"] for m in v["members"] if m["voter"]) == sorted(voters)
                         and not [m for m in v["members"] if not m["voter"]]
                         and v["leaderId"] in voters for v in views)
                if ok:
                    return views[0]
            except (urllib.error.URLError, OSError, Failure, ValueError):
                pass
            time.sleep(0.5)
        raise Failure(f"voters did not become {sorted(voters)} within {timeout}s; last view {last}")


def port_of(container, name, default):
    for p in container.get("ports") or []:
        if p.get("name") == name:
            return p["containerPort"]
    return default


# ---------------------------------------------------------------------------------------------
# Clients


RETRYABLE = {"UNAVAILABLE", "NO_LEADER", "NOT_LEADER", "BUSY"}


class Client:
    """One WebSocket client that reconnects to a random pod (as a Service would) and resends
    the same request id when a request is not answered or is answered with a retryable error."""

    def __init__(self, cluster, client_id, deadline_s=60):
        self.cluster = cluster
        self.client_id = client_id
        self.deadline_s = deadline_s
        self.ws = None
        self.seq = 0
        self.retries = 0

    def connect(self):
        urls = self.cluster.ws_urls()
        random.shuffle(urls)
        for url in urls:
            try:
                if SECURE:
                    # Pods are dialled by IP here: the CA is checked, the name is not (the
                    # pods' own lockctl checks names, dialling the Services' DNS names).
                    self.ws = websocket.create_connection(
                        url, timeout=5,
                        header=[f"Authorization: Bearer {SECURE['token']}"],
                        sslopt={"cert_reqs": ssl.CERT_REQUIRED, "ca_certs": SECURE["ca"],
                                "check_hostname": False})
                else:
                    self.ws = websocket.create_connection(url, timeout=5)
                return
            except (OSError, websocket.WebSocketException):
                continue
        self.ws = None

    def call(self, message):
        """Sends `message` with a fresh request id until answered without a retryable error."""
        self.seq += 1
        message = {**message, "clientId": self.client_id,
                   "requestId": f"{self.client_id}-{self.seq}"}
        deadline = time.time() + self.deadline_s
        while time.time() < deadline:
            if self.ws is None:
                self.connect()
                if self.ws is None:
                    time.sleep(0.3)
                    continue
            try:
                self.ws.settimeout(max(5, message.get("waitTimeout", 0) / 1000 + 10))
                self.ws.send(json.dumps(message))
                while True:
                    reply = json.loads(self.ws.recv())
                    if reply.get("requestId") == message["requestId"]:
                        break
            except (OSError, websocket.WebSocketException, ValueError):
                self.close()
                self.retries += 1
                time.sleep(0.2)
                continue
            code = (reply.get("error") or {}).get("code")
            if not reply.get("success") and code in RETRYABLE:
                self.retries += 1
                self.close()
                time.sleep(0.3)
                continue
            return reply
        raise Failure(f"{self.client_id}: no answer to {message} within {self.deadline_s}s")

    def close(self):
        if self.ws is not None:
            try:
                self.ws.close()
            except (OSError, websocket.WebSocketException):
                pass
        self.ws = None


class Workload(threading.Thread):
    """acquire -> fenced write to the data store -> release, and a KV put, in a loop."""

    KEY = "rehearsal/counter"

    def __init__(self, cluster, data_store_url, index):
        super().__init__(daemon=True)
        self.client = Client(cluster, f"rehearsal-worker-{index}")
        self.data_store_url = data_store_url
        self.index = index
        self.stop = threading.Event()
        self.grants = []          # tokens, in the order this worker got them
        self.writes_accepted = 0
        self.writes_refused = 0
        self.puts = {}            # key -> value, acknowledged
        # (from, until) on this process's monotonic clock: from the grant's answer until the
        # release was sent or the lease, counted from the acquire's sending and shortened by a
        # fifth for clock rates, could have run out, whichever came first. The holder believed
        # it held the lock in between: no two such intervals may overlap.
        self.holds = []
        # Fenced writes refused as stale although their whole round trip fell inside such an
        # interval: another holder's token had reached the data store while this one held.
        self.stale_while_held = []
        self.error = None

    def run(self):
        n = 0
        try:
            while not self.stop.is_set():
                n += 1
                sent = time.monotonic()
                r = self.client.call({"commandType": 3, "key": self.KEY, "ttl": 5000,
                                      "waitTimeout": 20000})
                granted = time.monotonic()
                # The client retries: the lease may have started at the first attempt's apply,
                # never before `sent`.
                believed_until = sent + 5.0 * 0.8
                if not r.get("success"):
                    code = r["error"]["code"]
                    if code == "WAIT_TIMEOUT":
                        continue
                    raise Failure(f"worker {self.index}: acquire answered {r}")
                token = r["fencingToken"]["value"]
                self.grants.append(token)
                status = self.write(token, f"worker {self.index} write {n}",
                                    r["fencingToken"].get("mac"))
                written = time.monotonic()
                if status != 200 and written < believed_until:
                    self.stale_while_held.append((token, status, written - sent))
                if status == 200:
                    self.writes_accepted += 1
                else:
                    # A stale token can only mean this worker's lease lapsed (it paused longer
                    # than the TTL while the cluster moved on); the data store did its job.
                    self.writes_refused += 1
                self.holds.append((granted, min(time.monotonic(), believed_until), token))
                r = self.client.call({"commandType": 4, "key": self.KEY,
                                      "fencingToken": {"key": self.KEY, "value": token}})
                if not r.get("success") and r["error"]["code"] not in ("STALE_TOKEN", "NOT_HOLDER"):
                    raise Failure(f"worker {self.index}: release answered {r}")
                key = f"rehearsal/kv/{self.index}/{n}"
                r = self.client.call({"commandType": 2, "key": key, "value": str(n)})
                if not r.get("success"):
                    raise Failure(f"worker {self.index}: put answered {r}")
                self.puts[key] = str(n)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            self.error = e
        finally:
            self.client.close()

    def write(self, token, data, mac=None):
        fencing = {"key": self.KEY, "value": token}
        if mac:
            fencing["mac"] = mac
        body = json.dumps({"clientID": self.client.client_id, "fencingToken": fencing,
                           "data": data}).encode()
        deadline = time.time() + 30
        while True:
            req = urllib.request.Request(self.data_store_url + "/write", data=body,
                                         headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code
            except (urllib.error.URLError, OSError):
                if time.time() > deadline:
                    raise Failure("the data store does not answer")
                time.sleep(0.3)


# ---------------------------------------------------------------------------------------------
# The rehearsal


def data_store_accepted(ds_url):
    with urllib.request.urlopen(ds_url + "/metrics", timeout=5) as r:
        metrics = r.read().decode()
    m = re.search(r'raftlock_datastore_writes_total\{result="accepted"\} (\d+)', metrics)
    return int(m.group(1)) if m else 0


def values_file(base, **overrides):
    with open(base) as f:
        values = yaml.safe_load(f) or {}
    values.update(overrides)
    fd, path = tempfile.mkstemp(prefix="raftlock-values-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(values, f)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--image", required=True, help="the image to run, repository:tag")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="leave containers and volumes behind")
    ap.add_argument("--secured", action="store_true",
                    help="TLS on both ports, signed client tokens and fencing MACs from Secrets")
    ap.add_argument("--lockctl", default=os.path.join(ROOT, "target", "release", "lockctl"),
                    help="the lockctl that makes certificates and tokens for --secured")
    args = ap.parse_args()
    repo, tag = args.image.rsplit(":", 1)
    base = os.path.join(ROOT, "tests", "k8s", "rehearsal-values.yaml")
    extra = {}
    secrets = {}
    if args.secured:
        extra, secrets = secured_setup(args.lockctl)
    values3 = values_file(base, replicas=3, image={"repository": repo, "tag": tag,
                                                    "pullPolicy": "Never"}, **extra)
    values5 = values_file(base, replicas=5, image={"repository": repo, "tag": tag,
                                                    "pullPolicy": "Never"}, **extra)
    prefix = f"rlk8s{os.getpid()}"
    started = time.time()
    docs3 = render([values3])
    docs5 = render([values5])
    pods = Pods(docs3, prefix)
    # The Secrets an operator created before the install.
    pods.secrets.update(secrets)
    workers = []
    try:
        rehearse(pods, docs3, docs5, workers, args.workers)
        log(f"rehearsal passed in {time.time() - started:.0f}s")
        return 0
    except Failure as e:
        log(f"REHEARSAL FAILED: {e}")
        return 1
    finally:
        for w in workers:
            w.stop.set()
        if args.keep:
            log(f"kept containers and volumes with prefix {prefix}")
        else:
            pods.cleanup()


def secured_setup(lockctl):
    """Certificates, keys and tokens for --secured, made with lockctl as an operator would, as
    (values, Secrets by name)."""
    global SECURE
    d = tempfile.mkdtemp(prefix="raftlock-secured-")
    svc = f"{RELEASE}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}"
    headless = f"*.{RELEASE}-headless.{NAMESPACE}.svc.{CLUSTER_DOMAIN}"
    run([lockctl, "certs", "--out", f"{d}/certs", "--nodes", "1,2,3,4,5",
         "--hosts", f"{svc},{headless},localhost,127.0.0.1"])
    with open(f"{d}/jwt.key", "w") as f:
        f.write(base64.b64encode(os.urandom(48)).decode() + "\n")
    with open(f"{d}/fencing.key", "w") as f:
        f.write(base64.b64encode(os.urandom(32)).decode() + "\n")

    def token(*rights):
        return run([lockctl, "token", "--key-file", f"{d}/jwt.key", "--ttl", "2h", *rights]).stdout.strip()

    def read(name):
        with open(f"{d}/{name}") as f:
            return f.read()

    def secret(name, items):
        return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
                "stringData": items}

    # Each Secret names its files, as docs/kubernetes.md's commands do: no CA key (ca-key.pem,
    # client-ca-key.pem) anywhere, the operator's key only in the operator Secret (the
    # scale-down hook's), every node's key in the node Secret every lock-node pod mounts.
    peer = {"ca.pem": read("certs/ca.pem")}
    for i in range(1, 6):
        peer[f"node-{i}.pem"] = read(f"certs/node-{i}.pem")
        peer[f"node-{i}-key.pem"] = read(f"certs/node-{i}-key.pem")
    operator = {"ca.pem": read("certs/ca.pem"), "operator.pem": read("certs/operator.pem"),
                "operator-key.pem": read("certs/operator-key.pem")}
    secrets = {
        "rehearsal-peer-tls": secret("rehearsal-peer-tls", peer),
        "rehearsal-operator-tls": secret("rehearsal-operator-tls", operator),
        "rehearsal-client-tls": secret("rehearsal-client-tls", {
            "tls.crt": read("certs/client-port.pem"), "tls.key": read("certs/client-port-key.pem"),
            "ca.crt": read("certs/ca.pem")}),
        "rehearsal-jwt": secret("rehearsal-jwt", {"jwt.key": read("jwt.key")}),
        "rehearsal-fencing": secret("rehearsal-fencing", {"fencing.key": read("fencing.key")}),
        # For lockctl in the pods (helm test, the scale-down hook): only helm-test/ keys.
        "rehearsal-lockctl-token": secret("rehearsal-lockctl-token", {"token": token(
            "--sub", "helm-test", "--prefixes", "helm-test/", "--operations", "acquire,release")}),
    }
    values = {
        "tls": {"peer": {"enabled": True, "secretName": "rehearsal-peer-tls",
                         "operatorSecretName": "rehearsal-operator-tls"},
                "client": {"enabled": True, "secretName": "rehearsal-client-tls"}},
        "clientAuth": {"jwtKeySecret": "rehearsal-jwt",
                       "lockctlTokenSecret": "rehearsal-lockctl-token"},
        "fencingKeySecret": "rehearsal-fencing",
    }
    context = ssl.create_default_context(cafile=f"{d}/certs/ca.pem")
    context.check_hostname = False
    SECURE = {"ca": f"{d}/certs/ca.pem", "context": context,
              "token": token("--sub", "rehearsal", "--admin")}
    log(f"secured: TLS on both ports, signed client tokens and fencing MACs (material in {d})")
    return values, secrets


def secret_shapes(docs):
    """Secret name -> its keys: what an upgrade must keep (the values may differ between two
    offline renders, see Pods.secrets)."""
    return {d["metadata"]["name"]: sorted(list(d.get("data") or {}) + list(d.get("stringData") or {}))
            for d in find(docs, "Secret")}


def cluster_token(pods, cluster, ordinal):
    """The cluster token pod `ordinal` gets (RAFTLOCK_CLUSTER_TOKEN from its secretKeyRef)."""
    c = cluster.template["spec"]["containers"][0]
    return pods.env_of(c, cluster.pod(ordinal), cluster.labels).get("RAFTLOCK_CLUSTER_TOKEN", "")


def rehearse(pods, docs3, docs5, workers, n_workers):
    cluster = Cluster(pods, docs3)
    replicas = cluster.sts["spec"]["replicas"]
    if replicas != 3:
        raise Failure(f"the rendered StatefulSet has {replicas} replicas, expected 3")
    grace = cluster.grace

    # The chart always runs the lock nodes with a cluster token (generated into <release>-token
    # when the values name none); lock-node refuses to start without one on a non-loopback peer
    # port. The upgrade's pods must read the same Secret and key.
    if secret_shapes(docs5) != secret_shapes(docs3):
        raise Failure(f"the upgrade renders other Secrets ({secret_shapes(docs5)}) than the "
                      f"install ({secret_shapes(docs3)})")
    token = cluster_token(pods, cluster, 0)
    if not token:
        raise Failure("the rendered StatefulSet gives the pods no RAFTLOCK_CLUSTER_TOKEN")
    if cluster_token(pods, Cluster(pods, docs5), 4) != token:
        raise Failure("the 5-replica StatefulSet's pods would get another cluster token")
    log(f"cluster token: {len(token)} characters, from Secret(s) {sorted(pods.secrets)}")

    # The data store: its Deployment's pod, under its Service's names.
    deploy = one(docs3, "Deployment")
    ds_labels = deploy["spec"]["template"]["metadata"]["labels"]
    ds_pod = f"{deploy['metadata']['name']}-0"
    pods.start(ds_pod, deploy["spec"]["template"]["spec"], ds_labels)
    ds_port = port_of(deploy["spec"]["template"]["spec"]["containers"][0], "http", 8000)
    ds_url = f"http://{pods.ip(ds_pod)}:{ds_port}"

    log("install: 3 pods in parallel (podManagementPolicy Parallel)")
    for o in range(3):
        cluster.start(o)
    cluster.wait_ready(range(3))
    view = cluster.wait_voters([1, 2, 3])
    log(f"leader elected: node {view['leaderId']}; members {[m['id'] for m in view['members']]}")

    log("helm test: the chart's test pods")
    for test in find(docs3, "Pod", lambda d: is_hook(d, "test")):
        name = test["metadata"]["name"]
        r = pods.start(name, test["spec"], test["metadata"].get("labels") or {},
                       detach=False, remove=True)
        if r.returncode != 0:
            raise Failure(f"helm test pod {name} failed:\n{r.stdout}\n{r.stderr}")
        log(f"  {name}: passed")

    holder = Client(cluster, "rehearsal-holder")
    r = holder.call({"commandType": 3, "key": "rehearsal/held", "ttl": 600000})
    if not r.get("success"):
        raise Failure(f"could not take the long-held lock: {r}")
    held_token = r["fencingToken"]["value"]
    log(f"rehearsal/held taken with token {held_token}")

    # The helm test pods wrote to the data store already: count from here.
    accepted_before = data_store_accepted(ds_url)
    for i in range(n_workers):
        w = Workload(cluster, ds_url, i)
        workers.append(w)
        w.start()

    def check_held(step):
        seen = []
        for o in sorted(cluster.up):
            try:
                locks = cluster.get_json(o, "/locks?prefix=rehearsal/held")
            except (urllib.error.URLError, OSError, ValueError):
                continue
            seen.append(json.dumps(locks))
            text = json.dumps(locks)
            if "rehearsal-holder" not in text or str(held_token) not in text:
                raise Failure(f"after {step}: rehearsal/held is not held by rehearsal-holder "
                              f"with token {held_token} on {cluster.pod(o)}: {locks}")
        if not seen:
            raise Failure(f"after {step}: no pod answered /locks")
        for w in workers:
            if w.error:
                raise Failure(f"after {step}: worker {w.index} failed: {w.error}")
        log(f"  after {step}: held lock intact; grants so far "
            f"{sum(len(w.grants) for w in workers)}, client retries "
            f"{sum(w.client.retries for w in workers)}")

    time.sleep(3)
    check_held("install")

    cluster5 = Cluster(pods, docs5)

    def scale_to_5(step):
        cluster5.up = set(cluster.up)
        for o in (3, 4):
            cluster5.start(o)
        cluster5.wait_ready(range(5), timeout=180)
        view = cluster5.wait_voters([1, 2, 3, 4, 5], timeout=180)
        log(f"  members {[m['id'] for m in view['members']]}, all voters")
        cluster.up = cluster5.up
        check_held(step)

    log("scale to 5: pods 3 and 4 start with the 5-replica template")
    scale_to_5("scale to 5")

    log("kubectl scale to 3, no hook: pods 4 and 3 deleted together with their volumes")
    for o in (4, 3):
        cluster5.kill(o)
        cluster5.delete_volumes(o)
    cluster.up = set(cluster5.up)
    t0 = time.time()
    view = cluster.wait_voters([1, 2, 3], timeout=180)
    log(f"  the leader removed the dead members in {time.time() - t0:.0f}s: "
        f"members {[m['id'] for m in view['members']]}")
    check_held("kubectl scale to 3")

    log("kubectl scale back to 5: pods 3 and 4 start on new volumes and join")
    scale_to_5("kubectl scale back to 5")

    log("scale to 3: the pre-upgrade hook removes members 4 and 5, then pods 4 and 3 stop")
    hooks = find(docs3, "Job", lambda d: is_hook(d, "pre-upgrade"))
    if len(hooks) != 1:
        raise Failure(f"expected one pre-upgrade hook Job, found {len(hooks)}")
    job = hooks[0]
    r = pods.start(job["metadata"]["name"], job["spec"]["template"]["spec"],
                   job["spec"]["template"]["metadata"].get("labels") or {},
                   detach=False, remove=True)
    if r.returncode != 0:
        raise Failure(f"the scale-down hook failed:\n{r.stdout}\n{r.stderr}")
    log("  hook output: " + " | ".join((r.stdout + r.stderr).strip().splitlines()[-6:]))
    for o in (4, 3):
        cluster.stop(o)
    view = cluster.wait_voters([1, 2, 3])
    cluster.wait_ready(range(3))
    log(f"  members {[m['id'] for m in view['members']]}")
    check_held("scale to 3")

    victim = random.Random(os.getpid()).choice([0, 1, 2])
    log(f"delete {cluster.pod(victim)} (SIGKILL) and start it again on its volume")
    cluster.kill(victim)
    time.sleep(2)
    cluster.start(victim)
    cluster.wait_ready(range(3))
    cluster.wait_voters([1, 2, 3])
    check_held("pod deleted and restarted")

    log("every pod deleted at once (SIGKILL) and started again on its volume")
    for o in (0, 1, 2):
        cluster.kill(o)
    t0 = time.time()
    for o in (0, 1, 2):
        cluster.start(o)
    cluster.wait_ready(range(3))
    cluster.wait_voters([1, 2, 3])
    log(f"  ready again after {time.time() - t0:.1f}s")
    check_held("every pod deleted at once")

    log(f"{cluster.pod(0)}'s volume deleted while pods 1 and 2 are stopped")
    for o in (1, 2, 0):
        cluster.kill(o)
    cluster.delete_volumes(0)
    cluster.start(0)
    time.sleep(8)
    status, body = cluster.readyz(0)
    if status == 200 or "not starting a new cluster" not in body:
        raise Failure(f"{cluster.pod(0)} on an empty volume with its peers down answers "
                      f"{status} {body!r}; its log ends:\n{pods.logs(cluster.pod(0))}")
    log(f"  {cluster.pod(0)} waits: {body.strip()[:160]}")
    for o in (1, 2):
        cluster.start(o)
    cluster.wait_ready(range(3), timeout=180)
    cluster.wait_voters([1, 2, 3], timeout=180)
    check_held(f"{cluster.pod(0)}'s volume deleted")

    log("rolling update: every pod, highest ordinal first")
    for o in (2, 1, 0):
        t0 = time.time()
        cluster.stop(o)
        stop_s = time.time() - t0
        cluster.start(o)
        cluster.wait_ready(range(3))
        log(f"  {cluster.pod(o)}: stopped in {stop_s:.1f}s (grace {grace}s), ready again "
            f"after {time.time() - t0:.1f}s")
    cluster.wait_voters([1, 2, 3])
    check_held("rolling update")

    time.sleep(3)
    for w in workers:
        w.stop.set()
    for w in workers:
        w.join(timeout=90)
        if w.is_alive():
            raise Failure(f"worker {w.index} did not stop")
        if w.error:
            raise Failure(f"worker {w.index} failed: {w.error}")

    # Grants: each worker's tokens increase (a later grant of the key carries a larger token).
    all_grants = []
    for w in workers:
        if w.grants != sorted(w.grants) or len(set(w.grants)) != len(w.grants):
            raise Failure(f"worker {w.index} saw tokens out of order: {w.grants}")
        all_grants += w.grants
    if len(set(all_grants)) != len(all_grants):
        raise Failure("two grants carried the same token")

    # Mutual exclusion, as the holders saw it: no two believed holds overlap, and no holder's
    # fenced write was refused as stale while it believed it held the lock.
    holds = sorted(h for w in workers for h in w.holds)
    latest = None  # the hold that is believed longest among those granted so far
    for hold in holds:
        if latest is not None and hold[0] < latest[1]:
            raise Failure(f"token {hold[2]} was granted {latest[1] - hold[0]:.3f}s before the "
                          f"holder of token {latest[2]} stopped believing it held the lock")
        if latest is None or hold[1] > latest[1]:
            latest = hold
    stale = [s for w in workers for s in w.stale_while_held]
    if stale:
        raise Failure(f"fenced writes refused while their holder held the lock: {stale[:5]}")
    if not all_grants:
        raise Failure("the workload got no grant at all")

    # The data store accepted exactly the writes the workers saw accepted.
    accepted = data_store_accepted(ds_url) - accepted_before
    seen_accepted = sum(w.writes_accepted for w in workers)
    if accepted != seen_accepted:
        raise Failure(f"the data store accepted {accepted} writes, the workers saw "
                      f"{seen_accepted} accepted")

    # Every acknowledged put is there.
    reader = Client(cluster, "rehearsal-reader")
    puts = {k: v for w in workers for k, v in w.puts.items()}
    for key, value in puts.items():
        r = reader.call({"commandType": 7, "key": key})
        if not r.get("success") or r.get("value") != value:
            raise Failure(f"acknowledged put {key}={value} reads back as {r}")

    # The long-held lock is still ours to release.
    r = holder.call({"commandType": 4, "key": "rehearsal/held",
                     "fencingToken": {"key": "rehearsal/held", "value": held_token}})
    if not r.get("success"):
        raise Failure(f"releasing rehearsal/held failed: {r}")
    retries = sum(w.client.retries for w in workers) + holder.retries + reader.retries
    log(f"checked: {len(all_grants)} grants with increasing tokens, {len(holds)} believed holds "
        f"that never overlap, {seen_accepted} fenced writes "
        f"accepted ({sum(w.writes_refused for w in workers)} refused as stale), "
        f"{len(puts)} acknowledged puts read back, held lock token {held_token} intact; "
        f"client retries {retries}")


if __name__ == "__main__":
    sys.exit(main())
