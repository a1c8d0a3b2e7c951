"""Checks deploy/ (run by deploy/check.sh, which installs the tools): lint, render every shape,
validate the rendered objects, test the alerts, lint the Dockerfile, then run the cpu-2 shape's
own command and env with the release binary, probe the health services its manifests name the way
kubelet does, scrape every metrics port it declares, and check that every epserve_* metric the
dashboard and the alerts name is exported (or, by the binary's own table, `epserve metrics
--list`, exported by GPU ranks only), and that each rank's page passes `promtool check metrics`. Every alert must be shown firing by rules.test.yaml. Last, it breaks copies of the
manifests the ways CI must catch (an unserved probe service, an unexported metric, a GPU limit
that is not --ranks, a rank's gRPC port not exposed, an alert no test shows firing, a GPU shape
without its node knobs, a policy finding, a pod of a two-pod group not told its node) and
asserts each is caught. Then the lws-2 shape's two pods run as two launchers with their pods'
env: one group, served at every rank, drained by SIGTERM. The KEDA and KServe
examples are validated too, and checkov (findings justified in checkov.yaml) runs over all."""

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import grpc
import jsonschema
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEPLOY = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DEPLOY)
SHAPES = ["overlays/cpu-2", "overlays/h200-4", "overlays/h200-4-ingress-all", "overlays/h200-8", "lws", "lws-2",
          "lws-2-rdma"]
# Shapes whose pods talk NCCL over RDMA (components/rdma).
RDMA = {"lws-2-rdma"}
EXAMPLES = ["examples/keda", "examples/kserve"]
CORE = {"StatefulSet", "Service", "PodDisruptionBudget", "ConfigMap", "NetworkPolicy", "PriorityClass", "PersistentVolumeClaim"}
SCHEMAS = {
    "PodMonitor": "podmonitor.json",
    "PrometheusRule": "prometheusrule.json",
    "LeaderWorkerSet": "leaderworkerset.json",
    "ScaledObject": "scaledobject.json",
    "ServingRuntime": "servingruntime.json",
    "InferenceService": "inferenceservice.json",
}
# Images are pinned by digest.
DIGEST = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")
GRPC_PORT = 50051
HTTP_PORT = 8000


class Failed(Exception):
    pass


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise Failed(f"{' '.join(cmd)}:\n{r.stdout}{r.stderr}")
    return r.stdout


def render(deploy, shape):
    out = run(["kubectl", "kustomize", os.path.join(deploy, "k8s", shape)])
    return [d for d in yaml.safe_load_all(out) if d]


def pod_spec(obj):
    if obj["kind"] == "StatefulSet":
        return obj["spec"]["template"]["spec"]
    return obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]


def group(docs):
    (g,) = [d for d in docs if d["kind"] in ("StatefulSet", "LeaderWorkerSet")]
    return g


def env_of(container):
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def check_objects(shape, docs, tmp):
    """Strict schema validation: core objects against Kubernetes' own, the rest against ours."""
    files = []
    for i, d in enumerate(docs):
        if d["kind"] in CORE:
            files.append(d)
        elif d["kind"] in SCHEMAS:
            with open(os.path.join(DEPLOY, "schemas", SCHEMAS[d["kind"]])) as f:
                jsonschema.validate(d, json.load(f))
        else:
            raise Failed(f"{shape}: no schema for kind {d['kind']}")
        if d["kind"] == "LeaderWorkerSet":
            tmpl = d["spec"]["leaderWorkerTemplate"]["workerTemplate"]
            files.append({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "lws-leader", **tmpl.get("metadata", {})}, "spec": tmpl["spec"]})
        if d["kind"] == "ServingRuntime":
            pod = {"containers": d["spec"]["containers"], "volumes": d["spec"].get("volumes", [])}
            files.append({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "runtime"}, "spec": pod})
    paths = []
    for i, d in enumerate(files):
        p = os.path.join(tmp, f"{shape.replace('/', '-')}-{i}.yaml")
        with open(p, "w") as f:
            yaml.safe_dump(d, f)
        paths.append(p)
    run(["kubernetes-validate", "--strict", "--quiet", *paths])


def check_shape(shape, docs):
    """Ranks, metrics ports, scrape endpoints and GPUs agree per pod; probes are gRPC on the
    service port; a group of several pods is a LeaderWorkerSet that places them as its nodes."""
    g = group(docs)
    spec = pod_spec(g)
    (c,) = spec["containers"]
    env = env_of(c)
    total = int(env["EPSERVE_RANKS"])
    nodes = int(env.get("EPSERVE_NODES", "1"))
    if total % nodes:
        raise Failed(f"{shape}: --ranks {total} do not split evenly over --nodes {nodes}")
    ranks = total // nodes  # this pod's
    if nodes > 1:
        check_nodes(shape, docs, g, c, env, nodes)
    want = {f"metrics-{r}": 9400 + r for r in range(ranks)}
    have = {p["name"]: p["containerPort"] for p in c["ports"] if p["name"].startswith("metrics-")}
    if have != want:
        raise Failed(f"{shape}: {ranks} ranks per pod but metrics ports {sorted(have.items())}")
    # --ingress all: rank r serves gRPC on 50051 + r, and the Service exposes every rank's port.
    entry = ranks if env.get("EPSERVE_INGRESS", "leader") == "all" else 1
    want_grpc = {("grpc" if r == 0 else f"grpc-{r}"): GRPC_PORT + r for r in range(entry)}
    have_grpc = {p["name"]: p["containerPort"] for p in c["ports"] if p["name"].startswith("grpc")}
    if have_grpc != want_grpc:
        raise Failed(f"{shape}: {entry} ingress rank(s) but gRPC ports {sorted(have_grpc.items())}")
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    # Every entry rank's gRPC port and, where REST is on, its REST port (8000 + r).
    want_ports = set(want_grpc.values())
    if env.get("EPSERVE_HTTP_LISTEN", "off") != "off":
        want_ports |= {HTTP_PORT + r for r in range(entry)}
    exposed = {p["port"] for p in svc["spec"]["ports"]}
    if exposed != want_ports:
        raise Failed(f"{shape}: the Service exposes ports {sorted(exposed)}, not {sorted(want_ports)}")
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    for p in svc["spec"]["ports"]:
        if named.get(p["targetPort"], p["targetPort"]) != p["port"]:
            raise Failed(f"{shape}: Service port {p['port']} targets {p['targetPort']}, another port")
    if env.get("EPSERVE_METRICS_PER_EXPERT", "off") not in ("off", "false", "no", "0"):
        raise Failed(f"{shape}: per-expert metrics on (layers x experts series per rank): leave them off")
    check_rdma(shape, c, env)
    (pm,) = [d for d in docs if d["kind"] == "PodMonitor"]
    scraped = sorted(e["port"] for e in pm["spec"]["podMetricsEndpoints"])
    if scraped != sorted(want):
        raise Failed(f"{shape}: --ranks {ranks} but the PodMonitor scrapes {scraped}")
    for kind in ("PodMonitor", "PrometheusRule"):
        (o,) = [d for d in docs if d["kind"] == kind]
        if "release" not in o["metadata"].get("labels", {}):
            raise Failed(f"{shape}: the {kind} carries no release label for kube-prometheus-stack's selectors")
    gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    backend = env.get("EPSERVE_BACKEND", "cpu")
    if backend == "cpu":
        if gpus is not None:
            raise Failed(f"{shape}: the cpu backend asks for {gpus} GPUs")
    elif int(gpus or 0) != ranks:
        raise Failed(f"{shape}: {ranks} ranks per pod but nvidia.com/gpu is {gpus} (one GPU per rank)")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c.get(probe, {}).get("grpc")
        if p is None or p["port"] != GRPC_PORT:
            raise Failed(f"{shape}: {probe} is not a gRPC probe on {GRPC_PORT}")
    if env.get("EPSERVE_LISTEN", "").split(":")[0] != "0.0.0.0":
        raise Failed(f"{shape}: gRPC must listen on 0.0.0.0 for the kubelet's probes")
    secs = lambda v: float(v.rstrip("s"))
    grace = secs(env.get("EPSERVE_DRAIN_TIMEOUT", "30s")) + secs(env.get("EPSERVE_SHUTDOWN_GRACE", "1s"))
    if spec.get("terminationGracePeriodSeconds", 30) <= grace:
        raise Failed(f"{shape}: terminationGracePeriodSeconds must exceed drain + shutdown grace ({grace}s)")
    shm = [v for v in spec["volumes"] if v["name"] == "shm"]
    if not shm or shm[0].get("emptyDir", {}).get("medium") != "Memory":
        raise Failed(f"{shape}: /dev/shm must be an emptyDir of medium Memory")
    if spec.get("automountServiceAccountToken") is not False:
        raise Failed(f"{shape}: the pod mounts a service-account token it never uses")
    if not DIGEST.match(c["image"]):
        raise Failed(f"{shape}: image {c['image']} is not pinned by digest")
    if not [d for d in docs if d["kind"] == "NetworkPolicy"]:
        raise Failed(f"{shape}: no NetworkPolicy")
    res = c.get("resources", {})
    for r in ("cpu", "memory"):
        if res.get("requests", {}).get(r) != res.get("limits", {}).get(r):
            raise Failed(f"{shape}: {r} requests and limits differ (not Guaranteed QoS)")
    if backend != "cpu":
        check_gpu_pod(shape, g, spec, c, env)


def check_nodes(shape, docs, g, c, env, nodes):
    """A group of several pods: a LeaderWorkerSet of that size, each pod told its node by its
    worker index, the rendezvous on the leader's address and every interface, nccl between
    nodes (nccl-ep refuses them), and a Service that reaches every pod."""
    if g["kind"] != "LeaderWorkerSet" or g["spec"]["leaderWorkerTemplate"]["size"] != nodes:
        raise Failed(f"{shape}: --nodes {nodes} needs a LeaderWorkerSet of size {nodes}")
    index = [e for e in c["env"] if e["name"] == "EPSERVE_NODE_INDEX"]
    field = index[0].get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") if index else None
    if field != "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']":
        raise Failed(f"{shape}: EPSERVE_NODE_INDEX must come from the pod's LWS worker index, not {index}")
    if "EPSERVE_RENDEZVOUS" in env or "MASTER_ADDR" in env:
        raise Failed(f"{shape}: the rendezvous must be the leader's (LWS_LEADER_ADDRESS), not set")
    port = env.get("MASTER_PORT", "29500")
    if env.get("EPSERVE_RENDEZVOUS_BIND") != f"0.0.0.0:{port}":
        raise Failed(f"{shape}: rank 0 must accept the rendezvous on 0.0.0.0:{port} (EPSERVE_RENDEZVOUS_BIND)")
    if env.get("EPSERVE_BACKEND", "auto") in ("nccl-ep", "auto"):
        raise Failed(f"{shape}: a group across pods runs --backend nccl (nccl-ep refuses nodes)")
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    if any("worker-index" in k for k in svc["spec"].get("selector", {})):
        raise Failed(f"{shape}: the Service reaches one pod of the group only")


def check_rdma(shape, c, env):
    """A shape in RDMA asks for an RDMA device (requests equal limits), may lock memory, and names
    NCCL's HCAs and bootstrap interface; no other shape adds a capability."""
    res = c.get("resources", {})
    devices = {k: v for k, v in res.get("limits", {}).items() if k.startswith("rdma/")}
    added = c.get("securityContext", {}).get("capabilities", {}).get("add", [])
    if shape.split(" ")[0] not in RDMA:  # "lws-2-rdma (broken)" in the self-test is still that shape
        if added or devices:
            raise Failed(f"{shape}: adds {added} / asks for {devices} outside the RDMA component")
        return
    if not devices or any(res.get("requests", {}).get(k) != v for k, v in devices.items()):
        raise Failed(f"{shape}: no RDMA device in limits equal to requests ({res})")
    if added != ["IPC_LOCK"]:
        raise Failed(f"{shape}: NCCL over RDMA needs IPC_LOCK (and nothing more), not {added}")
    for knob in ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME"):
        if not env.get(knob):
            raise Failed(f"{shape}: {knob} is not set")
    if env.get("NCCL_IB_DISABLE", "0") != "0":
        raise Failed(f"{shape}: NCCL_IB_DISABLE turns RDMA off")


def check_gpu_pod(shape, g, spec, c, env):
    """A GPU group's node and scheduler knobs (components/gpu), and NCCL EP's JIT cache kept
    where it runs NCCL EP."""
    if "nvidia.com/gpu.product" not in spec.get("nodeSelector", {}):
        raise Failed(f"{shape}: no GPU product in the nodeSelector")
    if not any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations", [])):
        raise Failed(f"{shape}: does not tolerate the nvidia.com/gpu taint")
    for knob in ("runtimeClassName", "priorityClassName"):
        if not spec.get(knob):
            raise Failed(f"{shape}: no {knob}")
    if env.get("EPSERVE_BACKEND", "auto") not in ("nccl-ep", "auto"):
        return
    cache = env.get("NCCL_EP_JIT_CACHE_DIR")
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    claims = {t["metadata"]["name"] for t in g["spec"].get("volumeClaimTemplates", [])}
    claims |= {v["name"] for v in spec.get("volumes", []) if "persistentVolumeClaim" in v}
    if cache is None or mounts.get(cache) not in claims:
        raise Failed(f"{shape}: NCCL_EP_JIT_CACHE_DIR ({cache}) is not on a persistent volume")


def check_examples(shapes, examples):
    """The KEDA and KServe examples agree with the shapes they serve."""
    (so,) = [d for d in examples["examples/keda"] if d["kind"] == "ScaledObject"]
    target = so["spec"]["scaleTargetRef"]
    base = group(shapes["overlays/h200-4"])
    if (target["kind"], target["name"]) != (base["kind"], base["metadata"]["name"]):
        raise Failed(f"the ScaledObject scales {target}, not the group's {base['kind']}")
    rt, isvc = (next(d for d in examples["examples/kserve"] if d["kind"] == k) for k in ("ServingRuntime", "InferenceService"))
    model = isvc["spec"]["predictor"]["model"]
    if model["runtime"] != rt["metadata"]["name"]:
        raise Failed(f"the InferenceService names runtime {model['runtime']}")
    if model["modelFormat"]["name"] not in {f["name"] for f in rt["spec"]["supportedModelFormats"]}:
        raise Failed(f"the runtime does not serve model format {model['modelFormat']['name']}")
    (c,) = rt["spec"]["containers"]
    ranks = int(env_of(c)["EPSERVE_RANKS"])
    gpus = int(model["resources"]["limits"]["nvidia.com/gpu"])
    if ranks != gpus:
        raise Failed(f"the runtime launches {ranks} ranks for {gpus} GPUs")
    port = {p["name"]: p["containerPort"] for p in c["ports"]}.get("h2c")
    if "grpc-v2" in rt["spec"]["protocolVersions"] and env_of(c)["EPSERVE_LISTEN"] != f"0.0.0.0:{port}":
        raise Failed("KServe routes grpc-v2 to the h2c port: EPSERVE_LISTEN must be it")
    if not DIGEST.match(c["image"]):
        raise Failed(f"the runtime's image {c['image']} is not pinned by digest")
    for probe, service in (("startupProbe", ""), ("readinessProbe", "epserve.v1.MoeService"), ("livenessProbe", "liveness")):
        g = c.get(probe, {}).get("grpc", {})
        if (g.get("port"), g.get("service", "")) != (port, service):
            raise Failed(f"the runtime's {probe} is not gRPC health {service!r} on the h2c port ({g})")


def checkov(rendered, tmp):
    """The pinned policy check over every rendered object; skips are justified in checkov.yaml."""
    out = os.path.join(tmp, "checkov")
    os.makedirs(out, exist_ok=True)
    for name, docs in rendered.items():
        with open(os.path.join(out, name.replace("/", "-") + ".yaml"), "w") as f:
            yaml.safe_dump_all(docs, f)
    cfg = os.path.join(DEPLOY, "checkov.yaml")
    r = subprocess.run(["checkov", "--config-file", cfg, "-d", out, "--framework", "kubernetes", "--compact", "--quiet"], capture_output=True, text=True)
    if r.returncode != 0:
        failed = sorted(set(re.findall(r"Check: (CKV\w+)", r.stdout)))
        raise Failed(f"checkov findings {failed}:\n{r.stdout[-4000:]}{r.stderr[-2000:]}")


def probe_services(docs):
    (c,) = pod_spec(group(docs))["containers"]
    return {p: c[p]["grpc"].get("service", "") for p in ("startupProbe", "readinessProbe", "livenessProbe")}


def named_metrics(deploy):
    """Every epserve_* series the dashboard and the alerts use, histogram suffixes removed."""
    with open(os.path.join(deploy, "monitoring", "dashboard.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v.get("query", "") for v in dash.get("templating", {}).get("list", [])]
    with open(os.path.join(deploy, "monitoring", "prometheusrule.yaml")) as f:
        rules = yaml.safe_load(f)
    exprs += [r["expr"] for g in rules["spec"]["groups"] for r in g["rules"]]
    with open(os.path.join(deploy, "k8s", "examples", "keda", "scaledobject.yaml")) as f:
        exprs += [t["metadata"]["query"] for t in yaml.safe_load(f)["spec"]["triggers"]]
    names = set()
    for e in exprs:
        for m in re.findall(r"\bepserve_[a-z0-9_]+", e):
            names.add(re.sub(r"_(bucket|sum|count)$", "", m))
    return names


def binary():
    return os.environ.get("EPSERVE_BIN", os.path.join(ROOT, "target", "release", "epserve"))


def metric_table():
    """The binary's own table of metrics (`epserve metrics --list --format json`), by name."""
    out = run([binary(), "metrics", "--list", "--format", "json"])
    return {m["name"]: m for m in map(json.loads, out.splitlines())}


def check_metrics(deploy, exported, table):
    """Every metric the dashboard and alerts name is exported by the cpu-2 scrape, or is one the
    table says only GPU ranks export (a CPU scrape cannot show those), or one it says only
    `--metrics-per-expert` turns on (off in every manifest)."""
    missing = []
    for m in sorted(named_metrics(deploy)):
        row = table.get(m, {})
        if m in exported or row.get("gpu_only") or "--metrics-per-expert" in row.get("help", ""):
            continue
        missing.append(m)
    if missing:
        raise Failed(f"the dashboard or alerts name metrics the binary does not export: {missing}")


def check_rules(deploy, tmp):
    with open(os.path.join(deploy, "monitoring", "prometheusrule.yaml")) as f:
        spec = yaml.safe_load(f)["spec"]
    with open(os.path.join(tmp, "rules.yaml"), "w") as f:
        yaml.safe_dump(spec, f)
    shutil.copy(os.path.join(deploy, "monitoring", "rules.test.yaml"), tmp)
    run(["promtool", "check", "rules", os.path.join(tmp, "rules.yaml")])
    run(["promtool", "test", "rules", os.path.join(tmp, "rules.test.yaml")])
    alerts = {r["alert"] for g in spec["groups"] for r in g["rules"] if "alert" in r}
    with open(os.path.join(deploy, "monitoring", "rules.test.yaml")) as f:
        tests = yaml.safe_load(f)["tests"]
    shown = {t["alertname"] for g in tests for t in g.get("alert_rule_test", []) if t.get("exp_alerts")}
    if alerts - shown:
        raise Failed(f"rules.test.yaml never shows these alerts firing: {sorted(alerts - shown)}")


class Smoke:
    """The cpu-2 shape's container, run here with its own args and env (the shm directory in a
    temporary folder), until stopped."""

    def __init__(self, docs, tmp):
        (c,) = pod_spec(group(docs))["containers"]
        env = {k: v for k, v in env_of(c).items() if v is not None}
        env["EPSERVE_SHM_DIR"] = os.path.join(tmp, "shm")
        os.makedirs(env["EPSERVE_SHM_DIR"])
        self.ranks = int(env["EPSERVE_RANKS"])
        exe = binary()
        self.log = open(os.path.join(tmp, "smoke.log"), "w+")
        self.proc = subprocess.Popen([exe, *c["args"]], env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}")
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def status(self, service):
        """What the kubelet's gRPC probe sees: SERVING, NOT_SERVING, or the error's code."""
        try:
            r = self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
        except grpc.RpcError as e:
            return e.code().name

    def wait_serving(self, service, within=120):
        end = time.time() + within
        while time.time() < end:
            if self.proc.poll() is not None:
                raise Failed(f"the service exited ({self.proc.returncode}):\n{self.text()}")
            if self.status(service) == "SERVING":
                return
            time.sleep(0.2)
        raise Failed(f"health service {service!r} never SERVING:\n{self.text()}")

    def bad_request(self):
        """A Forward for a layer the model lacks (field 2 = 999): refused, and counted."""
        forward = self.channel.unary_unary("/epserve.v1.MoeService/Forward")
        try:
            forward(b"\x10\xe7\x07", timeout=5)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                return
            raise Failed(f"a bad request got {e.code().name}: {e.details()}")
        raise Failed("a request for layer 999 was answered")

    def exported(self):
        """Every series name the ranks export; each rank's page passes `promtool check metrics`."""
        names = set()
        for r in range(self.ranks):
            with urllib.request.urlopen(f"http://127.0.0.1:{9400 + r}/metrics", timeout=5) as resp:
                body = resp.read().decode()
            lint = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, text=True)
            if lint.returncode != 0:
                raise Failed(f"rank {r}'s /metrics fails promtool check metrics:\n{lint.stdout}{lint.stderr}")
            for line in body.splitlines():
                if line and not line.startswith("#"):
                    names.add(re.sub(r"_(bucket|sum|count)$", "", re.split(r"[{ ]", line)[0]))
        return names

    def text(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def stop(self):
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Pods:
    """The lws-2 shape's pods, run here as one launcher each with the rendered container's args
    and env and what LWS adds (LWS_LEADER_ADDRESS; the worker index, which the manifest maps to
    EPSERVE_NODE_INDEX; the pod's name as its host name; its own /dev/shm), on the cpu backend
    and a synthetic model (no GPUs here). One host is one network, so pod i's ports move by
    i x SHIFT. The worker pod starts first: the order must not matter."""

    SHIFT = 100

    def __init__(self, docs, tmp):
        g = group(docs)
        (c,) = pod_spec(g)["containers"]
        base = {k: v for k, v in env_of(c).items() if v is not None and not k.startswith("NCCL_")}
        self.nodes = int(base["EPSERVE_NODES"])
        self.per_pod = int(base["EPSERVE_RANKS"]) // self.nodes
        name = g["metadata"]["name"]
        self.names = [f"{name}-0"] + [f"{name}-0-{i}" for i in range(1, self.nodes)]
        base.update(EPSERVE_BACKEND="cpu", EPSERVE_MODEL="synthetic:tiny", LWS_LEADER_ADDRESS="127.0.0.1",
                    LWS_GROUP_SIZE=str(self.nodes))
        exe = binary()
        self.procs, self.logs = [], []
        for i in reversed(range(self.nodes)):
            env = {**base, "EPSERVE_NODE_INDEX": str(i), "LWS_WORKER_INDEX": str(i), "EPSERVE_NODE_ID": self.names[i],
                   "EPSERVE_SHM_DIR": os.path.join(tmp, f"pod-{i}")}
            for k in ("EPSERVE_LISTEN", "EPSERVE_HTTP_LISTEN", "EPSERVE_METRICS_LISTEN", "EPSERVE_DATA_LISTEN"):
                host, port = env[k].rsplit(":", 1)
                env[k] = f"{host}:{int(port) + i * self.SHIFT}"
            os.makedirs(env["EPSERVE_SHM_DIR"])
            log = open(os.path.join(tmp, f"pod-{i}.log"), "w+")
            proc = subprocess.Popen([exe, *c["args"]], env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
            self.procs.insert(0, proc)
            self.logs.insert(0, log)
            time.sleep(0.5)

    def port(self, base, pod, local):
        return base + pod * self.SHIFT + local

    def text(self):
        out = []
        for i, log in enumerate(self.logs):
            log.flush()
            log.seek(0)
            out.append(f"-- pod {i}:\n{log.read()[-3000:]}")
        return "\n".join(out)

    def check(self, docs, client):
        """Every pod's probes SERVING, every rank answers a client, GetModelInfo names each
        rank's pod, every rank counts bytes sent to the other pod, and SIGTERM drains both."""
        for i in range(self.nodes):
            channel = grpc.insecure_channel(f"127.0.0.1:{self.port(GRPC_PORT, i, 0)}")
            health = health_pb2_grpc.HealthStub(channel)
            for probe, service in probe_services(docs).items():
                end = time.time() + 120
                while True:
                    if any(p.poll() is not None for p in self.procs):
                        raise Failed(f"a pod exited:\n{self.text()}")
                    try:
                        r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                        if r.status == health_pb2.HealthCheckResponse.SERVING:
                            break
                    except grpc.RpcError:
                        pass
                    if time.time() > end:
                        raise Failed(f"pod {i}'s {probe} ({service!r}) never SERVING:\n{self.text()}")
                    time.sleep(0.2)
            channel.close()
        want = " ".join(n for n in self.names for _ in range(self.per_pod))
        for i in range(self.nodes):
            for r in range(self.per_pod):
                out = run([client, f"http://127.0.0.1:{self.port(GRPC_PORT, i, r)}", "16"])
                if f"each rank's node: {want}" not in out:
                    raise Failed(f"pod {i} rank {r}: GetModelInfo's nodes are not {want!r}:\n{out}")
        for i in range(self.nodes):
            for r in range(self.per_pod):
                url = f"http://127.0.0.1:{self.port(9400, i, r)}/metrics"
                with urllib.request.urlopen(url, timeout=5) as resp:
                    body = resp.read().decode()
                sent = [float(l.split()[-1]) for l in body.splitlines() if l.startswith("epserve_cross_node_bytes_total")]
                if not sent or sent[0] <= 0:
                    raise Failed(f"pod {i} rank {i * self.per_pod + r} sent no bytes to the other pod: {sent}")
        self.stop()
        for i, p in enumerate(self.procs):
            if p.returncode != 0:
                raise Failed(f"pod {i} exited {p.returncode} after SIGTERM:\n{self.text()}")

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def check_probes(shape, docs, smoke):
    for probe, service in probe_services(docs).items():
        st = smoke.status(service)
        if st not in ("SERVING", "NOT_SERVING"):
            raise Failed(f"{shape}: {probe} asks for health service {service!r}, which the binary does not serve ({st})")


def edit(deploy, path, old, new):
    """Replaces `old` (which must be there: a break that changes nothing tests nothing) in a copy."""
    path = os.path.join(deploy, path)
    with open(path) as f:
        text = f.read()
    if old not in text:
        raise RuntimeError(f"self-test: {old!r} is not in {path}")  # not Failed: not "caught"
    with open(path, "w") as f:
        f.write(text.replace(old, new))


def expect_failure(what, fn):
    try:
        fn()
    except Failed as e:
        print(f"  self-test: {what}: caught ({str(e).splitlines()[0][:120]})")
        return
    raise Failed(f"self-test: {what} was not caught")


def main():
    tmp = tempfile.mkdtemp(prefix="epserve-deploy-")
    step = lambda s: print(f"== deploy: {s}", flush=True)
    step("yamllint")
    run(["yamllint", "--strict", "-c", os.path.join(DEPLOY, ".yamllint"), DEPLOY])
    step("render and validate " + ", ".join(SHAPES))
    rendered = {s: render(DEPLOY, s) for s in SHAPES}
    for s, docs in rendered.items():
        check_objects(s, docs, tmp)
        check_shape(s, docs)
    lws, h4 = pod_spec(group(rendered["lws"])), pod_spec(group(rendered["overlays/h200-4"]))
    # The StatefulSet's JIT cache comes from its volumeClaimTemplates, the LWS's from a claim.
    lws = {**lws, "volumes": [v for v in lws["volumes"] if v["name"] != "nccl-ep-jit"]}
    if lws != h4:
        raise Failed("the LeaderWorkerSet's pod spec differs from the h200-4 overlay's")
    step("render and validate " + ", ".join(EXAMPLES))
    examples = {s: render(DEPLOY, s) for s in EXAMPLES}
    for s, docs in examples.items():
        check_objects(s, docs, tmp)
    check_examples(rendered, examples)
    step("checkov (pinned), findings justified in deploy/checkov.yaml")
    checkov({**rendered, **examples}, tmp)
    step("promtool check rules, test rules")
    check_rules(DEPLOY, tmp)
    step("hadolint")
    run(["hadolint", os.path.join(DEPLOY, "docker", "Dockerfile")])
    step("smoke: the cpu-2 shape's command and env, probed and scraped")
    smoke = Smoke(rendered["overlays/cpu-2"], tmp)
    try:
        for service in probe_services(rendered["overlays/cpu-2"]).values():
            smoke.wait_serving(service)
        for s, docs in rendered.items():
            check_probes(s, docs, smoke)
        # At start, before any request: every series an alert or a panel names is there.
        exported = smoke.exported()
        table = metric_table()
        check_metrics(DEPLOY, exported, table)
        client = os.environ.get("EPSERVE_CLIENT", os.path.join(ROOT, "target", "release", "examples", "client"))
        run([client, f"http://127.0.0.1:{GRPC_PORT}", "16"])
        smoke.bad_request()
        print(f"  {len(named_metrics(DEPLOY))} metrics named by the dashboard and alerts; {len(exported)} exported")

        step("self-test: each break is caught")
        bad = os.path.join(tmp, "bad")
        shutil.copytree(DEPLOY, bad)

        def unserved_probe():
            docs = copy.deepcopy(rendered["overlays/cpu-2"])
            pod_spec(group(docs))["containers"][0]["readinessProbe"]["grpc"]["service"] = "epserve.v1.NoSuchService"
            check_probes("cpu-2 (broken)", docs, smoke)

        def unexported_metric():
            path = os.path.join(bad, "monitoring", "dashboard.json")
            with open(path) as f:
                d = json.load(f)
            d["panels"][0]["targets"][0]["expr"] = "rate(epserve_no_such_metric_total[5m])"
            with open(path, "w") as f:
                json.dump(d, f)
            check_metrics(bad, exported, table)

        def ingress_port_missing():
            path = os.path.join(bad, "k8s", "components", "ingress-all-4", "service.yaml")
            with open(path) as f:
                text = f.read()
            with open(path, "w") as f:
                f.write(text.split("    - name: grpc-3")[0])
            check_shape("h200-4-ingress-all (broken)", render(bad, "overlays/h200-4-ingress-all"))

        def alert_never_tested():
            path = os.path.join(bad, "monitoring", "prometheusrule.yaml")
            with open(path) as f:
                d = yaml.safe_load(f)
            rule = copy.deepcopy(d["spec"]["groups"][0]["rules"][0])
            rule["alert"] = "EpserveUntested"
            d["spec"]["groups"][0]["rules"].append(rule)
            with open(path, "w") as f:
                yaml.safe_dump(d, f)
            check_rules(bad, os.path.join(tmp, "bad-rules"))

        def gpu_knobs_dropped():
            edit(bad, "k8s/overlays/h200-8/kustomization.yaml", "  - ../../components/gpu\n", "")
            check_shape("h200-8 (broken)", render(bad, "overlays/h200-8"))

        def policy_finding():
            edit(bad, "k8s/base/statefulset.yaml", "allowPrivilegeEscalation: false", "allowPrivilegeEscalation: true")
            checkov({"overlays/cpu-2": render(bad, "overlays/cpu-2")}, os.path.join(tmp, "bad-policy"))

        def gpu_limit_not_ranks():
            edit(bad, "k8s/overlays/h200-4/group.yaml", "nvidia.com/gpu: 4", "nvidia.com/gpu: 3")
            check_shape("h200-4 (broken)", render(bad, "overlays/h200-4"))

        def node_index_not_worker_index():
            edit(bad, "k8s/lws-2/group.yaml", "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']", "metadata.name")
            check_shape("lws-2 (broken)", render(bad, "lws-2"))

        def rdma_without_ipc_lock():
            edit(bad, "k8s/components/rdma/group.yaml", "value: [IPC_LOCK]", "value: [NET_RAW]")
            check_shape("lws-2-rdma (broken)", render(bad, "lws-2-rdma"))

        def runtime_without_startup_probe():
            ex = copy.deepcopy(examples)
            (rt,) = [d for d in ex["examples/kserve"] if d["kind"] == "ServingRuntime"]
            del rt["spec"]["containers"][0]["startupProbe"]
            check_examples(rendered, ex)

        expect_failure("a probe names a health service the binary does not serve", unserved_probe)
        expect_failure("RDMA between pods without IPC_LOCK", rdma_without_ipc_lock)
        expect_failure("a KServe runtime without its startup probe (Ready while loading)", runtime_without_startup_probe)
        expect_failure("a pod of a multi-node group not told its node by its worker index", node_index_not_worker_index)
        expect_failure("the dashboard names a metric the binary does not export", unexported_metric)
        os.makedirs(os.path.join(tmp, "bad-rules"))
        expect_failure("an alert no unit test shows firing", alert_never_tested)
        expect_failure("the GPU limit and --ranks disagree", gpu_limit_not_ranks)
        expect_failure("a GPU shape without its node and scheduler knobs", gpu_knobs_dropped)
        expect_failure("a policy finding checkov.yaml does not justify", policy_finding)
        expect_failure("a rank's gRPC port is not exposed under --ingress all", ingress_port_missing)
    finally:
        smoke.stop()
    step("smoke: the lws-2 shape's two pods as two launchers, each with its pod's env")
    pods = Pods(rendered["lws-2"], tmp)
    try:
        pods.check(rendered["lws-2"], client)
        print(f"  {pods.nodes} pods of {pods.per_pod} ranks formed one group, served at every rank, drained")
    finally:
        pods.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    print("deploy: 1 passed, 0 failed")


if __name__ == "__main__":
    try:
        main()
    except Failed as e:
        print(f"deploy check failed: {e}", file=sys.stderr)
        print("deploy: 0 passed, 1 failed")
        sys.exit(1)
