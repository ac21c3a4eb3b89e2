"""The trial pod's defenses, measured from inside a real agent container on the node, each with a control.

tests/support/kubenode.py starts the contained one-node cluster (tests/e2e/test_real_node.py shows what it
is). No
operator runs: the trial pods are the operator's own, rendered by its pure `trial_objects` for an RLRun
whose harness is `kind: Custom` and whose command runs PROBE (below) with the task image's python3. So the
probe runs as the agent does — uid 65532, no capabilities, read-only root — after the real init containers
`tools`, `harness-runtime`, `setup` and `egress-lock`, beside the real proxy and `hold`. The probe and its
list of targets reach the agent through the run's `harness.configMapRef` (mounted at /etc/legorl/harness),
the way a user gives a harness its settings. The only changes to what the operator renders: the owner
references are dropped (no RLRun object exists; the garbage collector would delete the pods), and the proxy,
a native sidecar, is made what the 1.20 kubelet runs by tests/kube120's own rewrite (`_emulate_sidecars`,
what the API Downgrade does to every pod in tests/e2e/test_node_run.py).

From the agent container the probe tries every reach a trial must not have, and its own proxy:

- its proxy on loopback (127.0.0.1:4000, `/healthz`), which must answer;
- the fleet: a stand-in pod (the task image's `python3 -m http.server` on the fleet's port, labelled as the
  fleet's engine pods are) by pod IP, by the Service the proxy's upstream URL names (ClusterIP) and by that
  DNS name; what listens does not matter to reachability, only that something answers in the control;
- the API server: the `kubernetes` Service's ClusterIP:443 and the node's address:6443;
- another trial: a third trial pod (of a second run in the namespace) at its pod IP on the proxy's port,
  where the proxy listens (0.0.0.0: the operator reads a trial's results there);
- the node: the kubelet's port 10250 on the node's address;
- DNS: a UDP query for the fleet's Service name to the pod's nameserver (its /etc/resolv.conf), and TCP 53.
  The pool's NetworkPolicy admits DNS for the pod (the proxy resolves the fleet's name); the egress lock
  admits none of it for the agent;
- ICMP echo to the fleet pod (an unprivileged ping socket, where the pod's ping_group_range allows one);
- outside: a public address (1.1.1.1:443) and the cloud metadata address (169.254.169.254:80).

The control is the same run's trial pod rendered with `spec.pool.defenses.egress: Unrestricted`, the
product's own switch: the test checks that it differs from the locked pod by the `egress-lock` init
container and setup's recorded `--egress` flag, nothing else. Every internal target answers in it, so the
lock, not the target or the node, is what refuses them in the locked pod. The NetworkPolicies the operator
renders (the pool's deny-by-default, the run's fleet-only egress) are applied too, but this node's CNI
(bridge) does not enforce NetworkPolicy: the egress lock is the only layer measured here. The node has no
route off the machine, so a public address fails with ENETUNREACH in both pods, before any rule is
consulted: for those rows the control shows nothing about the lock (the lock's own self-test, whose
output the test also checks, reports them as "no route" too).

In the same real pods the probe checks stage 1 of DESIGN §4: the workspace's git history is one commit
with no other ref, tag, reflog, packed refs or unreachable object, no object of the task image's history
(its commits, the fix's blobs, the hidden test's blob) is in the store, the files the hidden test patch
creates are absent, and the hidden tests' text is nowhere the agent can read (workspace, git objects, the
task files). The history control is a plain pod of the pristine task image, where the same probe finds the
whole history, the fix's tag and the hidden test's text.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from legorl.api.kinds import RLRun, SandboxPool
from legorl.api.labels import COMPONENT_LABEL, OWNER_LABEL, fleet_name
from legorl.controller.backend import TrialRequest
from legorl.operator.render.common import RenderContext, owner_key
from legorl.operator.render.fleet import COMPONENT as ENGINE
from legorl.operator.render.fleet import engine_name
from legorl.operator.render.pool import PROXY_PORT, render_pool
from legorl.operator.render.run import fleet_url, render_run
from legorl.operator.render.tree import PLACEHOLDER_UID
from legorl.operator.render.trial import FleetAccess, trial_objects
from legorl.sandbox.task import Task, patch_files
from tests.support.kube120 import _emulate_sidecars
from tests.support.kubenode import (
    API_PORT,
    API_SERVICE_IP,
    CLUSTER_DOMAIN,
    DNS_IP,
    NODE_IP,
    RESTRICTED,
    RESTRICTED_POD,
    Node,
    node,
    skip_unless_node_can_run,
)

PROXY = "ghcr.io/legorl/proxy:0.1.0"
INIT = "ghcr.io/legorl/sandbox-init:0.1.0"
TASK_ID = "tiny-python__intervals-001"
TASK_IMAGE = f"ghcr.io/legorl/tasks/tiny-python:{TASK_ID}"
"""The first bundled task, whose image scripts/build-images.sh builds."""
NS = "defenses"
RUN = "probe"
NEIGHBOUR = "neighbour"
LOCKED, CONTROL, OTHER = "s1-t0-r0", "s1-t0-r1", "s1-t0-r0"
"""Trial ids: the locked and the control trial of run `probe`; the other trial is run `neighbour`'s."""
KUBELET_PORT = 10250
WAIT = 240.0

skip_unless_node_can_run([PROXY, INIT, TASK_IMAGE])

pytestmark = pytest.mark.slow


PROBE = r'''
"""What the agent can reach, and what its workspace holds. One JSON line on stdout."""
import errno, http.client, json, os, socket, ssl, struct, subprocess, sys, time
from pathlib import Path

arg = sys.argv[1]
config = json.loads(arg if arg.startswith("{") else Path(arg).read_text())
TIMEOUT = 3.0


def why(exc):
    if isinstance(exc, socket.gaierror):
        names = {getattr(socket, n): n for n in dir(socket) if n.startswith("EAI_")}
        return names.get(exc.errno, "gaierror %s" % exc.errno)
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, OSError) and exc.errno:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return repr(exc)[:120]


def resolve(name):
    return socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]


def answer(target, ip):
    """The service's answer once connected: an HTTP(S) status, to show something real is there."""
    path = target.get("http")
    if not path:
        return None
    if target.get("tls"):
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        conn = http.client.HTTPSConnection(ip, target["port"], timeout=TIMEOUT, context=context)
    else:
        conn = http.client.HTTPConnection(ip, target["port"], timeout=TIMEOUT)
    try:
        conn.request("GET", path)
        reply = conn.getresponse()
        return "HTTP %d" % reply.status
    except Exception as exc:
        return "no answer: " + why(exc)
    finally:
        conn.close()


def tcp(target):
    ip = resolve(target["host"]) if target.get("resolve") else target["host"]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(TIMEOUT)
        sock.connect((ip, target["port"]))
    return {"ok": True, "detail": "connected", "answer": answer(target, ip), "ip": ip}


def dns_query(name):
    header = struct.pack(">HHHHHH", 0x4C52, 0x0100, 1, 0, 0, 0)
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    return header + labels + b"\0" + struct.pack(">HH", 1, 1)


def skip_name(data, at):
    while True:
        size = data[at]
        if size & 0xC0 == 0xC0:
            return at + 2
        if size == 0:
            return at + 1
        at += size + 1


def dns(target):
    server = target.get("server")
    if server is None:
        lines = Path("/etc/resolv.conf").read_text().splitlines()
        server = next(line.split()[1] for line in lines if line.startswith("nameserver"))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(TIMEOUT)
        sock.sendto(dns_query(target["query"]), (server, 53))
        data, _ = sock.recvfrom(4096)
    count, rcode = struct.unpack(">H", data[6:8])[0], data[3] & 0x0F
    at = skip_name(data, 12) + 4
    addresses = []
    for _ in range(count):
        at = skip_name(data, at)
        kind, _, _, size = struct.unpack(">HHIH", data[at : at + 10])
        at += 10
        if kind == 1 and size == 4:
            addresses.append(socket.inet_ntoa(data[at : at + 4]))
        at += size
    ok = rcode == 0 and bool(addresses)
    return {"ok": ok, "detail": "answered %s" % (addresses or "rcode %d" % rcode), "server": server}


def icmp(target):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP) as sock:
        sock.settimeout(TIMEOUT)
        sock.sendto(struct.pack(">BBHHH", 8, 0, 0, 0, 1) + b"legorl", (target["host"], 0))
        data, _ = sock.recvfrom(1024)
    return {"ok": data[0] == 0, "detail": "echo reply" if data[0] == 0 else "ICMP type %d" % data[0]}


def probe(target):
    start = time.monotonic()
    try:
        result = {"tcp": tcp, "dns": dns, "icmp": icmp}[target["kind"]](target)
    except Exception as exc:
        result = {"ok": False, "detail": why(exc)}
    result["ms"] = round((time.monotonic() - start) * 1000, 1)
    return result


def git(*args):
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "GIT_PAGER": "cat"}
    proc = subprocess.run(["git", *args], cwd=config["workspace"], env=env, capture_output=True)
    return proc.stdout


def workspace():
    root = Path(config["workspace"])
    dot_git = root / ".git"
    listed = set(git("ls-tree", "-r", "--name-only", "HEAD").decode().splitlines())
    stored = git("cat-file", "--batch-all-objects", "--batch-check=%(objectname)").decode().split()
    reachable = {line.split()[0] for line in git("rev-list", "--objects", "--all").decode().splitlines()}
    present = [oid for oid in config["known_objects"] if not subprocess.run(
        ["git", "cat-file", "-e", oid], cwd=root, capture_output=True).returncode]
    contents = git("cat-file", "--batch-all-objects", "--batch")
    readable = {}
    for top in [root, *map(Path, config.get("readable", []))]:
        for path in top.rglob("*"):
            if ".git" not in path.relative_to(top).parts and path.is_file() and not path.is_symlink():
                try:
                    readable[str(path)] = path.read_bytes()
                except OSError:
                    pass
    found = {}
    for marker in config["markers"]:
        where = [p for p, data in readable.items() if marker.encode() in data]
        if marker.encode() in contents:
            where.append("git objects")
        found[marker] = where
    return {
        "commits": git("rev-list", "--all", "--reflog").decode().split(),
        "refs": git("for-each-ref", "--format=%(refname)").decode().split(),
        "tags": git("tag", "-l").decode().split(),
        "reflog": git("reflog", "--all").decode().splitlines(),
        "leftovers": [n for n in ("logs", "packed-refs", "ORIG_HEAD", "FETCH_HEAD", "refs/stash", "shallow")
                      if (dot_git / n).exists()],
        "objects": len(stored),
        "unreachable": len(set(stored) - reachable),
        "known_present": present,
        "hidden_in_tree": [r for r in config["hidden"] if (root / r).exists() or (root / r).is_symlink()],
        "hidden_in_head": [r for r in config["hidden"] if r in listed],
        "markers": found,
    }


report = {"uid": os.getuid(), "results": {t["name"]: probe(t) for t in config.get("targets", [])}}
if config.get("workspace"):
    report["workspace"] = workspace()
print(json.dumps(report), flush=True)
'''


# --- what is rendered ------------------------------------------------------------------------------------


def task_row() -> dict[str, Any]:
    """The first bundled tiny-python row (the set is generated as `legorl run` does)."""
    from legorl.sandbox.bundled import builtin_task_set  # noqa: PLC0415 - the manifest, generated once

    first = builtin_task_set().read_text(encoding="utf-8").splitlines()[0]
    row: dict[str, Any] = json.loads(first)
    assert row["instance_id"] == TASK_ID and row["image"] == TASK_IMAGE, row["instance_id"]
    return row


def rlrun(name: str, harness: dict[str, Any], egress: str = "ProxyOnly") -> RLRun:
    """A stored RLRun (it has a uid, as the operator renders only stored objects) with an inline pool."""
    return RLRun.model_validate(
        {
            "apiVersion": "legorl.dev/v1alpha1",
            "kind": "RLRun",
            "metadata": {"name": name, "namespace": NS, "uid": PLACEHOLDER_UID},
            "spec": {
                "policy": {"checkpoint": {"uri": "pvc://models/tiny-swe"}},
                "fleet": {"replicas": 1, "parallelism": {"gpusPerNode": 0}},
                "pool": {
                    "source": {"taskSet": {"uri": "configmap://tasks/tasks.jsonl"}},
                    # The node's pause image (for `hold`): the default is pulled from registry.k8s.io.
                    "prePull": {"pauseImage": "k8s.gcr.io/pause:3.2"},
                    "defenses": {"egress": egress},
                },
                "harness": harness,
                "tasks": {"source": {"uri": "configmap://tasks/tasks.jsonl"}},
                "algorithm": {"name": "GRPO", "groupSize": 2, "tasksPerStep": 1},
            },
        }
    )


def probe_harness(command: list[str], config_map: str | None) -> dict[str, Any]:
    """A Custom harness running COMMAND in the task image. Its runtime image is sandbox-init, whose
    `install --into=DIR` is the protocol the `harness-runtime` init container speaks (the probe needs
    nothing of it: python3 is the task image's)."""
    harness: dict[str, Any] = {
        "kind": "Custom",
        "image": {"image": INIT},
        "apiFormat": "OpenAIChatCompletions",
        "command": command,
    }
    if config_map:
        harness["configMapRef"] = {"name": config_map}
    return harness


PROBE_HARNESS = probe_harness(
    ["python3", "/etc/legorl/harness/probe.py", "/etc/legorl/harness/config.json"], "probe-harness"
)


def owned_pool(run: RLRun, ctx: RenderContext) -> SandboxPool:
    """The SandboxPool the operator makes of the run's inline pool, as stored."""
    body = next(o for o in render_run(run, ctx, 8000) if o["kind"] == "SandboxPool")
    return SandboxPool.model_validate({**body, "metadata": {**body["metadata"], "uid": PLACEHOLDER_UID}})


def unowned(obj: dict[str, Any]) -> dict[str, Any]:
    """OBJ without owner references (no RLRun exists; the garbage collector would delete it)."""
    obj = copy.deepcopy(obj)
    obj["metadata"].pop("ownerReferences", None)
    return obj


def trial(run: RLRun, trial_id: str, row: dict[str, Any], ctx: RenderContext) -> list[dict[str, Any]]:
    """The trial's task ConfigMap and pod as the operator's `launch` applies them, for this node."""
    assert run.spec.fleet is not None
    request = TrialRequest(
        trial=trial_id, task=Task.from_dict(row), group_id="g1", split="train", step=1, policy_version="v0"
    )
    fleet = FleetAccess(url=fleet_url(run, run.spec.fleet.port))
    config_map, pod = (unowned(o) for o in trial_objects(run, owned_pool(run, ctx), request, fleet, ctx))
    assert _emulate_sidecars(pod)  # the proxy, a native sidecar, as 1.20 can run it
    return [config_map, pod]


def policy_objects(run: RLRun, ctx: RenderContext) -> list[dict[str, Any]]:
    """What the operator applies for the run's trials besides the pods: the pool's ServiceAccount and
    NetworkPolicy, the run's trial egress NetworkPolicy."""
    objects = [
        o
        for o in render_run(run, ctx, 8000)
        if o["kind"] == "NetworkPolicy" and "trials" in o["metadata"]["name"]
    ]
    objects += render_pool(owned_pool(run, ctx), ctx, [])
    return [unowned(o) for o in objects if o["kind"] in ("ServiceAccount", "NetworkPolicy")]


def without_lock(pod: dict[str, Any]) -> dict[str, Any]:
    """POD less what only the egress lock adds: its init container, and setup's recorded flag."""
    pod = copy.deepcopy(pod)
    inits = pod["spec"]["initContainers"]
    pod["spec"]["initContainers"] = [c for c in inits if c["name"] != "egress-lock"]
    setup = next(c for c in pod["spec"]["initContainers"] if c["name"] == "setup")
    setup["command"] = ["--egress=Unrestricted" if a == "--egress=ProxyOnly" else a for a in setup["command"]]
    return pod


# --- history: what the pristine image holds -------------------------------------------------------------


def history_facts(row: dict[str, Any]) -> dict[str, Any]:
    """From the task's own git bundle and patches: every commit of its history (subject by id), the blobs
    the gold patch and the hidden test patch make (by id), the hidden test files and a line of each."""
    from legorl.sandbox.bundled import builtin_task_set  # noqa: PLC0415

    bundle = builtin_task_set().parent / row["source"]
    known: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "repo"
        subprocess.run(["git", "clone", "--quiet", str(bundle), str(clone)], check=True, capture_output=True)
        log = subprocess.run(
            ["git", "log", "--all", "--format=%H %s"], cwd=clone, check=True, capture_output=True, text=True
        ).stdout
        base = subprocess.run(
            ["git", "grep", "-h", "-o", "-E", "def test_[A-Za-z0-9_]+", row["base_commit"]],
            cwd=clone, capture_output=True, text=True, check=False,
        ).stdout.split("\n")  # fmt: skip
    for line in log.splitlines():
        oid, subject = line.split(" ", 1)
        known[oid] = f"commit {oid[:8]} {subject!r}"
    for which in ("patch", "test_patch"):
        for oid in re.findall(r"^index [0-9a-f]+\.\.([0-9a-f]{40})", row[which], flags=re.M):
            known[oid] = f"blob {oid[:8]} of the {which.replace('_', ' ')}"
    hidden = [f.path for f in patch_files(row["test_patch"]) if f.created]
    # Lines only the hidden tests have (a test the base commit already has is no secret).
    added = re.finditer(r"^\+(def test_\w+)\(", row["test_patch"], flags=re.M)
    markers = [f"{m.group(1)}(" for m in added if m.group(1) not in base]
    assert hidden and markers and len(known) >= 3, (hidden, markers, known)
    return {"known": known, "hidden": hidden, "markers": markers}


# --- the node: apply, wait, read -------------------------------------------------------------------------


@dataclass
class Measured:
    """What the probes printed, and what the pods' other containers said."""

    targets: list[dict[str, Any]]
    locked: dict[str, Any]
    control: dict[str, Any]
    pristine: dict[str, Any]
    facts: dict[str, Any]
    pods: dict[str, dict[str, Any]]
    """The applied trial pods by role (`locked`, `control`, `other`), as rendered for this node."""
    rendered_control: dict[str, Any]
    """The control rendered with the locked trial's id, to compare with the locked pod."""
    logs: dict[str, str] = field(default_factory=dict)
    """`<role>/<container>` → its log."""
    statuses: dict[str, dict[str, Any]] = field(default_factory=dict)
    policies: list[str] = field(default_factory=list)
    """The NetworkPolicies in the namespace while the probes ran (applied, not enforced by this CNI)."""
    timings: dict[str, float] = field(default_factory=dict)


def apply(cluster: Node, objects: list[dict[str, Any]]) -> None:
    cluster.kubectl(
        "apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    )


def pod_status(cluster: Node, name: str) -> dict[str, Any]:
    status: dict[str, Any] = cluster.get_json("pod", name, "-n", NS)["status"]
    return status


def container(status: dict[str, Any], name: str) -> dict[str, Any]:
    every = [*status.get("initContainerStatuses", []), *status.get("containerStatuses", [])]
    return next((c for c in every if c["name"] == name), {})


def diagnose(cluster: Node, name: str) -> str:
    status = pod_status(cluster, name)
    parts = [json.dumps(status, indent=1)[:6000]]
    for c in [*status.get("initContainerStatuses", []), *status.get("containerStatuses", [])]:
        if c.get("state", {}).get("terminated") or c.get("lastState", {}).get("terminated"):
            got = cluster.kubectl("logs", "-n", NS, name, "-c", c["name"], check=False)
            parts.append(f"--- {c['name']}\n{got.stdout[-3000:]}{got.stderr[-500:]}")
    events = cluster.kubectl("get", "events", "-n", NS, check=False).stdout
    return "\n".join([*parts, "--- events", events[-4000:], "--- kubelet", cluster.tail("kubelet", 30)])


def wait_for(cluster: Node, name: str, what: str, done: Any, timeout: float = WAIT) -> dict[str, Any]:
    """Poll the pod's status until DONE(status) holds; fail with the pod's story if it never does."""
    deadline = time.monotonic() + timeout
    while True:
        status = pod_status(cluster, name)
        if done(status):
            return status
        if status.get("phase") == "Failed" or time.monotonic() > deadline:
            raise AssertionError(f"pod {name}: not {what} ({status.get('phase')})\n{diagnose(cluster, name)}")
        time.sleep(1)


def agent_done(status: dict[str, Any]) -> bool:
    return bool(container(status, "agent").get("state", {}).get("terminated"))


def proxy_ready(status: dict[str, Any]) -> bool:
    return bool(status.get("podIP")) and container(status, "proxy").get("ready") is True


def last_json(text: str) -> dict[str, Any]:
    lines = [line for line in text.splitlines() if line.startswith("{")]
    assert lines, text
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def targets(fleet_ip: str, fleet_service_ip: str, other_ip: str, fleet_host: str) -> list[dict[str, Any]]:
    """What the probe tries. `scope`: `own` (must answer in both pods), `internal` (refused in the locked
    pod, answering in the control), `outside` (no route off this node: fails in both)."""
    fqdn = f"{fleet_host}.{CLUSTER_DOMAIN}"
    port = 8000
    return [
        {"name": "own proxy 127.0.0.1:4000", "scope": "own", "kind": "tcp", "host": "127.0.0.1",
         "port": PROXY_PORT, "http": "/healthz"},
        {"name": f"fleet pod {fleet_ip}:{port}", "scope": "internal", "kind": "tcp", "host": fleet_ip,
         "port": port, "http": "/"},
        {"name": f"fleet Service {fleet_service_ip}:{port}", "scope": "internal", "kind": "tcp",
         "host": fleet_service_ip, "port": port, "http": "/"},
        {"name": f"fleet by DNS name {fleet_host}:{port}", "scope": "internal", "kind": "tcp",
         "host": fleet_host, "port": port, "resolve": True, "http": "/"},
        {"name": f"API server Service {API_SERVICE_IP}:443", "scope": "internal", "kind": "tcp",
         "host": API_SERVICE_IP, "port": 443, "http": "/version", "tls": True},
        {"name": f"API server on the node {NODE_IP}:{API_PORT}", "scope": "internal", "kind": "tcp",
         "host": NODE_IP, "port": API_PORT, "http": "/version", "tls": True},
        {"name": f"another trial's proxy {other_ip}:{PROXY_PORT}", "scope": "internal", "kind": "tcp",
         "host": other_ip, "port": PROXY_PORT, "http": "/healthz"},
        {"name": f"kubelet {NODE_IP}:{KUBELET_PORT}", "scope": "internal", "kind": "tcp", "host": NODE_IP,
         "port": KUBELET_PORT, "http": "/healthz", "tls": True},
        {"name": f"DNS query (UDP) for {fqdn}", "scope": "internal", "kind": "dns", "query": fqdn},
        {"name": f"cluster DNS {DNS_IP}:53 (TCP)", "scope": "internal", "kind": "tcp", "host": DNS_IP,
         "port": 53},
        {"name": f"ICMP echo to the fleet pod {fleet_ip}", "scope": "internal", "kind": "icmp",
         "host": fleet_ip},
        {"name": "public address 1.1.1.1:443", "scope": "outside", "kind": "tcp", "host": "1.1.1.1",
         "port": 443},
        {"name": "cloud metadata 169.254.169.254:80", "scope": "outside", "kind": "tcp",
         "host": "169.254.169.254", "port": 80},
    ]  # fmt: skip


def fleet_stand_in(run: RLRun, service: str) -> list[dict[str, Any]]:
    """A pod labelled as the run's fleet engine pods are, answering HTTP on the fleet's port, and the
    Service the proxy's upstream URL names."""
    labels = {OWNER_LABEL: owner_key("RolloutFleet", fleet_name(run)), COMPONENT_LABEL: ENGINE}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "fleet-stand-in", "namespace": NS, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": RESTRICTED_POD,
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "http",
                    "image": TASK_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["python3", "-m", "http.server", "8000", "--directory", "/tmp"],
                    "securityContext": {**RESTRICTED, "runAsUser": 65532},
                    "readinessProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 1},
                    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                }
            ],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
        },
    }
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service, "namespace": NS},
        "spec": {"selector": labels, "ports": [{"name": "http", "port": 8000, "targetPort": 8000}]},
    }
    return [pod, svc]


def pristine_pod(config: dict[str, Any]) -> dict[str, Any]:
    """A plain restricted pod of the task image running the probe's workspace part on the image's own
    /testbed: what the agent would see without the setup stage."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "pristine", "namespace": NS},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": RESTRICTED_POD,
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "probe",
                    "image": TASK_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["python3", "-c", PROBE, json.dumps(config)],
                    "securityContext": {**RESTRICTED, "runAsUser": 65532},
                    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                }
            ],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
        },
    }


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Measured]:
    ctx = RenderContext()
    row = task_row()
    facts = history_facts(row)
    probe_run = rlrun(RUN, PROBE_HARNESS)
    open_run = rlrun(RUN, PROBE_HARNESS, egress="Unrestricted")
    # Another run's trial in the namespace: a trial pod whose agent exits at once (its proxy and `hold`
    # keep the pod, as the operator's collection needs).
    neighbour = rlrun(NEIGHBOUR, probe_harness(["python3", "-c", "pass"], None))
    assert probe_run.spec.fleet is not None
    fleet_host = f"{engine_name(fleet_name(probe_run))}.{NS}.svc"
    assert fleet_url(probe_run, probe_run.spec.fleet.port) == f"http://{fleet_host}:8000"
    workspace_config = {
        "workspace": row["workspace_dir"],
        "known_objects": sorted(facts["known"]),
        "hidden": facts["hidden"],
        "markers": facts["markers"],
        "readable": ["/legorl-task"],
    }
    locked_objects = trial(probe_run, LOCKED, row, ctx)
    control_objects = trial(open_run, CONTROL, row, ctx)
    rendered_control = trial(open_run, LOCKED, row, ctx)[1]
    other_objects = trial(neighbour, OTHER, row, ctx)

    with node(tmp_path_factory.mktemp("node")) as cluster:
        started = time.monotonic()
        cluster.create_namespace(NS)
        # The fleet stand-in, the other trial and the pristine image's history first: the probe's
        # targets name their addresses.
        apply(
            cluster,
            [
                *policy_objects(probe_run, ctx),
                *policy_objects(neighbour, ctx),
                *fleet_stand_in(probe_run, engine_name(fleet_name(probe_run))),
                *other_objects,
                pristine_pod({**workspace_config, "workspace": "/testbed", "readable": []}),
            ],
        )
        other_name = other_objects[1]["metadata"]["name"]
        fleet = wait_for(
            cluster,
            "fleet-stand-in",
            "Ready",
            lambda s: (
                bool(s.get("podIP"))
                and all(c.get("ready") for c in s.get("containerStatuses", []))
                and bool(s.get("containerStatuses"))
            ),
        )
        other = wait_for(cluster, other_name, "with its proxy ready", proxy_ready)
        wait_for(cluster, "pristine", "Succeeded", lambda s: s.get("phase") == "Succeeded")
        service_ip = cluster.get_json("service", engine_name(fleet_name(probe_run)), "-n", NS)["spec"][
            "clusterIP"
        ]
        probe_targets = targets(fleet["podIP"], service_ip, other["podIP"], fleet_host)
        config = {**workspace_config, "targets": probe_targets}
        harness_config = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "probe-harness", "namespace": NS},
            "data": {"probe.py": PROBE, "config.json": json.dumps(config, indent=1)},
        }
        t = time.monotonic()
        apply(cluster, [harness_config, *locked_objects, *control_objects])
        pods = {
            "locked": locked_objects[1],
            "control": control_objects[1],
            "other": other_objects[1],
        }
        statuses = {
            role: wait_for(cluster, pods[role]["metadata"]["name"], "done (agent terminated)", agent_done)
            for role in ("locked", "control")
        }
        statuses["other"] = other
        timings = {"targets_up": t - started, "trials": time.monotonic() - t}
        logs = {"pristine/probe": cluster.kubectl("logs", "-n", NS, "pristine").stdout}
        for role, pod in pods.items():
            for c in [*pod["spec"]["initContainers"], *pod["spec"]["containers"]]:
                got = cluster.kubectl("logs", "-n", NS, pod["metadata"]["name"], "-c", c["name"], check=False)
                logs[f"{role}/{c['name']}"] = got.stdout
        timings["total"] = time.monotonic() - started
        policies = [p["metadata"]["name"] for p in cluster.get_json("networkpolicies", "-n", NS)["items"]]
        yield Measured(
            targets=probe_targets,
            locked=last_json(logs["locked/agent"]),
            control=last_json(logs["control/agent"]),
            pristine=last_json(logs["pristine/probe"]),
            facts=facts,
            pods=pods,
            rendered_control=rendered_control,
            logs=logs,
            statuses=statuses,
            policies=sorted(policies),
            timings=timings,
        )


# --- the tests -------------------------------------------------------------------------------------------


def show(result: dict[str, Any]) -> str:
    text = result["detail"] + (f" → {result['answer']}" if result.get("answer") else "")
    return f"{text} ({result['ms']:.0f} ms)"


def test_the_control_differs_from_the_locked_pod_only_by_the_egress_lock(measured: Measured) -> None:
    locked = measured.pods["locked"]
    assert [c["name"] for c in locked["spec"]["initContainers"]] == [
        "tools", "harness-runtime", "setup", "egress-lock",
    ]  # fmt: skip
    assert [c["name"] for c in locked["spec"]["containers"]] == ["proxy", "agent", "hold"]
    assert without_lock(locked) == measured.rendered_control
    agent = next(c for c in locked["spec"]["containers"] if c["name"] == "agent")
    assert agent["securityContext"]["runAsUser"] == 65532 and agent["securityContext"]["capabilities"] == {
        "drop": ["ALL"]
    }


def test_each_trial_pod_ran_its_stages_and_the_lock_proved_itself(measured: Measured) -> None:
    for role in ("locked", "control"):
        status = measured.statuses[role]
        for c in status["initContainerStatuses"]:
            assert c["state"]["terminated"]["exitCode"] == 0, (role, c)
        assert container(status, "agent")["state"]["terminated"]["exitCode"] == 0, role
        # Still serving when the agent was done (the probe's first row got its /healthz).
        assert "running" in container(status, "proxy")["state"], (role, container(status, "proxy"))
        assert "running" in container(status, "hold")["state"], role
        setup = last_json(measured.logs[f"{role}/setup"])
        assert setup["result"] == "Passed", setup
    checks = [
        json.loads(line) for line in measured.logs["locked/egress-lock"].splitlines() if line.startswith("{")
    ]
    print("\negress-lock's self-test in the locked pod:")
    for check in checks:
        print(f"  {check['result']:6} {check['name']}: {check['message']}")
    assert checks and all(c["result"] == "Passed" for c in checks), checks
    enforced = next(c for c in checks if c["name"] == "egress.enforced ipv4")
    assert "REJECT counters" in enforced["message"], enforced
    assert measured.locked["uid"] == measured.control["uid"] == 65532
    print(f"timings (s): {json.dumps({k: round(v, 1) for k, v in measured.timings.items()})}")


def test_from_the_agent_only_its_own_proxy_answers_and_without_the_lock_every_internal_target_does(
    measured: Measured,
) -> None:
    locked, control = measured.locked["results"], measured.control["results"]
    width = max(len(t["name"]) for t in measured.targets)
    lines = [f"{'target (from the agent container)':{width}}  {'locked (egress-lock)':38}  control (no lock)"]
    for t in measured.targets:
        lines.append(f"{t['name']:{width}}  {show(locked[t['name']]):38}  {show(control[t['name']])}")
    print("\n" + "\n".join(lines))
    # The operator's NetworkPolicies were in place; this node's bridge CNI does not enforce them, so the
    # egress lock is the only layer between the two columns.
    assert measured.policies == [
        f"{NEIGHBOUR}-pool-sandbox", f"{NEIGHBOUR}-trials", f"{RUN}-pool-sandbox", f"{RUN}-trials",
    ], measured.policies  # fmt: skip
    for t in measured.targets:
        name, scope, kind = t["name"], t["scope"], t["kind"]
        held, free = locked[name], control[name]
        if scope == "own":
            assert held["ok"] and held["answer"] == "HTTP 200", (name, held)
            assert free["ok"] and free["answer"] == "HTTP 200", (name, free)
        elif scope == "internal":
            assert not held["ok"], (name, held)
            assert free["ok"], f"the control does not reach {name}: {free} (so the locked row proves nothing)"
            if kind == "tcp" and t.get("resolve"):
                assert held["detail"].startswith("EAI_"), (name, held)  # no DNS: the name does not resolve
            elif kind == "tcp":
                assert held["detail"] == "ECONNREFUSED" and held["ms"] < 1000, (
                    name,
                    held,
                )  # the lock's reset
            else:
                assert held["detail"] == "EPERM", (name, held)  # the datagram dropped by the lock, locally
            if t.get("http"):
                assert free["answer"].startswith("HTTP "), (name, free)
        else:
            # No route off this node: refused before any rule, in both pods alike.
            assert held["detail"] == free["detail"] == "ENETUNREACH", (name, held, free)


def test_the_agent_sees_one_commit_and_no_hidden_test_while_the_image_holds_them(measured: Measured) -> None:
    known, hidden = measured.facts["known"], measured.facts["hidden"]
    image = measured.pristine["workspace"]
    print(
        f"\npristine image: {len(image['commits'])} commits, refs {image['refs']}, tags {image['tags']}, "
        f"{image['objects']} objects; of the task's history: {[known[o] for o in image['known_present']]}; "
        f"hidden test text in {sorted({w for ws in image['markers'].values() for w in ws})}"
    )
    # The control: the task image's repository holds the future (the fix's commit and tag, the hidden test).
    assert len(image["commits"]) >= 3 and image["tags"], image
    assert set(image["known_present"]) == set(known), image["known_present"]
    assert all("git objects" in where for where in image["markers"].values()), image["markers"]
    for role in ("locked", "control"):
        seen = (measured.locked if role == "locked" else measured.control)["workspace"]
        print(
            f"{role} agent: commits {seen['commits']}, refs {seen['refs']}, tags {seen['tags']}, reflog "
            f"{seen['reflog']}, leftovers {seen['leftovers']}, {seen['objects']} objects "
            f"({seen['unreachable']} unreachable), of the task's history {seen['known_present']}, hidden "
            f"files in tree {seen['hidden_in_tree']} / in HEAD {seen['hidden_in_head']}, hidden text in "
            f"{seen['markers']}"
        )
        assert len(seen["commits"]) == 1, seen
        assert seen["commits"][0] not in known  # a new root commit, not the task's base commit
        assert seen["refs"] == ["refs/heads/main"] and seen["tags"] == [] and seen["reflog"] == [], seen
        assert seen["leftovers"] == [] and seen["unreachable"] == 0 and seen["objects"] > 0, seen
        assert seen["known_present"] == [], [known[o] for o in seen["known_present"]]
        assert seen["hidden_in_tree"] == seen["hidden_in_head"] == [], (hidden, seen)
        assert all(where == [] for where in seen["markers"].values()), seen["markers"]
