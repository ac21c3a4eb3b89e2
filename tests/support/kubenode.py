"""A real one-node Kubernetes 1.20 cluster for tests, in a network namespace with no route off the machine.

Everything of the node runs inside a network namespace this module creates (`legorl-node-<random>`),
each program started with `nsenter --net=/run/netns/NS` (not `ip netns exec`, which remounts /sys and
hides the cgroup mounts from dockerd): etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
a dockerd of its own, the kubelet (dockershim), kube-proxy (iptables mode: its rules live in the
namespace), the CNI bridge and every pod, and dnsmasq as the cluster's DNS. The namespace has `lo`
only, with two addresses on it (10.99.0.1, the node and API server; 10.99.0.10, the cluster DNS),
plus what CNI adds (`cni0` and the pods' veths): no default route and no link to the machine, so any
outside address fails with ENETUNREACH before a packet leaves. Pods get routes for 10.244.0.0/24 and
10.0.0.0/8 only. Tests talk to the API server by entering the namespace too (`Node.kubectl`).

Binaries: scripts/get-kube.sh (v1.20.2 from Debian's source package, the static `pause`, etcd) and
scripts/get-node.sh (docker.io, the CNI plugins, dnsmasq, iptables, conntrack). Images: the node's
dockerd runs on the data root of scripts/build-images.sh's private engine
(~/.cache/legorl/images/docker), so legorl's images are there with no copy: saving and loading them
instead would copy 1.5 GB (proxy 699 MB, operator 875 MB; the trainer image is GBs) on every start.
That engine only runs while build-images.sh does. Two engines on one data root must not run (the
second one's containerd waits on the first's bolt database, then gives up): `Node.start` refuses
while any dockerd runs on it, and holds `<data root>.lock` and a machine-wide /run/legorl-node.lock
while the node is up (build-images.sh takes no lock: do not run it then). The node removes the
containers Kubernetes made (by dockershim's label) on start and stop; the kubelet's image GC and disk
eviction are off, so it never deletes the build's images.

With `api_downgrade=True` (tests/e2e/test_node_operator.py) the pods' API server is tests/kube120's
Downgrade: a process of the node (`python -m tests.support.kubenode downgrade`, in the namespace) serves it
behind a TLS front on NODE_IP:DOWNGRADE_PORT with the API server's own certificate, the API server
runs without its endpoint reconciler, and the `kubernetes` Service's one endpoint is that front (the
EndpointSlice mirroring controller copies it for kube-proxy). So a pod that logs in the ordinary way
(`https://kubernetes.default.svc` or KUBERNETES_SERVICE_HOST, the mounted token and CA) sees policy/v1
and the newer Job and Pod fields the operator renders; the node's own programs and the tests' kubectl
still talk to the API server itself.

DNS: Debian has no CoreDNS. dnsmasq (test infrastructure, not product) listens on the clusterDNS
address and answers `<svc>.<ns>.svc.cluster.local` from an addn-hosts file that a small sync loop
(`python -m tests.support.kubenode dns-sync`, in the namespace) rewrites from the cluster's Services every
second, sending dnsmasq SIGHUP on a change. It has no upstream (`--no-resolv`): other names do not
resolve. Headless Services and pod names are not served.

What the kubelet 1.20 does to the machine, and what this module undoes: it sets six kernel sysctls
(vm.overcommit_memory=1, kernel.panic=10, kernel.panic_on_oops=1, …; 1.20 has no way to only warn):
their values are restored on stop. It writes /var/log/pods, /var/log/containers and
/var/lib/kubelet/device-plugins (fixed paths in 1.20): what it added there is removed on stop. Its pods'
cgroups live under a cgroup of the node's own (`cgroupRoot: /legorl-node-<random>`), removed on stop.
A run killed hard leaves its node behind; the next `Node.start` finds it in /run/legorl-node.json
and stops it first.

Measured on this machine (2 CPUs shared with other work, cgroup v1, 2026-12-06; docs/real-node.md has
the table): control plane ready in 5-8 s; node Ready 9-10 s after the kubelet starts
(`nodeStatusUpdateFrequency: 2s`; 17 s with the default 10 s), 16-20 s from nothing; a pod of a
local image Ready 3-4 s after it is created; stop 3 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import hashlib
import io
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.support.kubecluster import Process, kube_bin

REPO = Path(__file__).resolve().parents[2]

NODE_NAME = "legorl-node"
NODE_IP = "10.99.0.1"
DNS_IP = "10.99.0.10"
API_PORT = 6443
SERVICE_CIDR = "10.96.0.0/24"
API_SERVICE_IP = "10.96.0.1"
DOWNGRADE_PORT = 6444
"""Where the `api_downgrade` node's TLS front of tests/kube120's Downgrade listens (on NODE_IP)."""
POD_CIDR = "10.244.0.0/24"
POD_GATEWAY = "10.244.0.1"
CLUSTER_DOMAIN = "cluster.local"
PAUSE_IMAGE = "k8s.gcr.io/pause:3.2"
CNI_BIN = Path("/usr/lib/cni")
LOCK = Path("/run/legorl-node.lock")
STATE = Path("/run/legorl-node.json")
"""What a started node must undo (namespace, folders, cgroup, sysctls), for a later start to clean up
after a run that was killed before it could stop its node."""
KUBELET_SYSCTLS = (
    "vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes",
)  # fmt: skip
"""The host sysctls kubelet 1.20's container manager sets (setupKernelTunables)."""
KUBELET_HOST_DIRS = (Path("/var/log/pods"), Path("/var/log/containers"), Path("/var/lib/kubelet"))
"""Host folders the 1.20 kubelet writes whatever its flags say: pod logs and the device-plugin socket."""
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy")
TOOLS = ("dockerd", "runc", "dnsmasq", "iptables", "conntrack", "ip", "nsenter", "openssl")
K8S_LABEL = "io.kubernetes.docker.type"
"""The label dockershim puts on every container it makes (pod sandboxes and containers)."""


def images_root() -> Path:
    """The data root of scripts/build-images.sh's private engine, where legorl's images are built."""
    return Path(os.environ.get("LEGORL_CACHE", Path.home() / ".cache/legorl")) / "images/docker"


def data_root_lock(data_root: Path) -> Path:
    """The lock file beside a Docker data root: whoever starts an engine on that root holds it (the
    node does; two engines on one root fail at best: the second one's containerd waits on the first's
    bolt database and gives up after 15 s)."""
    return data_root.with_name(data_root.name + ".lock")


def images_missing(names: Sequence[str], root: Path | None = None) -> list[str]:
    """Which of NAMES (`repo:tag`) the engine at ROOT does not hold, read from its image store."""
    path = (root or images_root()) / "image/overlay2/repositories.json"
    try:
        held = json.loads(path.read_text())["Repositories"]
    except (OSError, ValueError, KeyError):
        return list(names)
    return [n for n in names if n not in held.get(n.rsplit(":", 1)[0], {})]


def node_bin() -> Path | None:
    """get-kube.sh's bin directory with the node's binaries: $LEGORL_KUBE_BIN, else the newest build
    that has a kubelet (an older cache may hold the control plane only)."""
    given = kube_bin()
    if given is None or os.environ.get("LEGORL_KUBE_BIN") or (given / "kubelet").exists():
        return given
    built = sorted(given.parent.parent.glob("*/bin/kubelet"), key=lambda p: p.stat().st_mtime)
    return built[-1].parent if built else given


def node_missing() -> str | None:
    """Why a node cannot start here (not root, binaries or tools missing), or None."""
    if os.geteuid() != 0:
        return "a node needs root (network namespaces, dockerd, the kubelet)"
    binary = node_bin()
    if binary is None or not all((binary / b).exists() for b in (*BINARIES, "pause")):
        return "no kubelet built: run `bash scripts/get-kube.sh`"
    tools = [t for t in TOOLS if shutil.which(t) is None]
    tools += [p for p in ("bridge", "host-local", "loopback") if not (CNI_BIN / p).exists()]
    if tools:
        return f"missing {', '.join(tools)}: run `bash scripts/get-node.sh`"
    if not Path("/proc/self/ns/net").exists():
        return "no network namespaces in this kernel"
    if not Path("/sys/fs/cgroup/memory").is_dir():
        return "the kubelet 1.20 here needs cgroup v1 (no /sys/fs/cgroup/memory)"
    return None


RESTRICTED_POD: dict[str, Any] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
"""The restricted Pod Security profile, pod level (no user given: each image's own non-root USER)."""
RESTRICTED: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,
}
"""The restricted Pod Security profile, container level."""


def skip_unless_node_can_run(images: Sequence[str]) -> None:
    """Skip the calling test module when no node can run here or IMAGES are not built; fail instead
    under LEGORL_REQUIRE_KUBE=1 (but for missing images when LEGORL_IMAGES=0 built none on purpose)."""
    import pytest  # noqa: PLC0415  (the module also runs as `python -m tests.support.kubenode`, without pytest)

    why = node_missing()
    required = os.environ.get("LEGORL_REQUIRE_KUBE") == "1"
    if why is None and images_missing(images):
        why = (
            f"{', '.join(images_missing(images))} not built: run "
            "`bash scripts/build-images.sh --only proxy --only operator`"
        )
        required = required and os.environ.get("LEGORL_IMAGES", "1") != "0"
    if why is not None:
        if required:
            raise RuntimeError(f"LEGORL_REQUIRE_KUBE=1 but no node can run here: {why}")
        pytest.skip(why, allow_module_level=True)


def kubectl_binary() -> str:
    binary = shutil.which("kubectl", path=str(REPO / ".cache/tools/bin")) or shutil.which("kubectl")
    if binary is None:
        raise RuntimeError("kubectl not found: run `bash scripts/get-helm.sh .cache/tools`")
    return binary


def docker_cli() -> str:
    """Debian's docker CLI (the engine's own version) where installed, else the one on PATH."""
    return "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"


def _run(*argv: str, check: bool = True, timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` exited {result.returncode}:\n{result.stdout}{result.stderr}")
    return result


def _openssl(*args: str) -> None:
    _run("openssl", *args)


# --- processes, mounts and cgroups (used by stop and by the clean-up of a killed run) ----------


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _pids() -> Iterator[int]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            yield int(entry.name)


def pids_in_netns(inode: tuple[int, int]) -> list[int]:
    """Every process whose network namespace is INODE ((st_dev, st_ino) of its nsfs file)."""
    found = []
    for pid in _pids():
        with contextlib.suppress(OSError):
            st = Path(f"/proc/{pid}/ns/net").stat()
            if (st.st_dev, st.st_ino) == inode:
                found.append(pid)
    return found


def _cgroup_dirs(name: str) -> list[Path]:
    """The cgroup named NAME (a top-level one) in every cgroup v1 hierarchy mounted."""
    base = Path("/sys/fs/cgroup")
    return [
        d / name
        for d in sorted(base.iterdir())
        if d.is_dir() and not d.is_symlink() and d.name != "unified" and (d / "cgroup.procs").exists()
    ]


def pids_in_cgroup(name: str) -> list[int]:
    found: set[int] = set()
    for top in _cgroup_dirs(name):
        if top.is_dir():
            for procs in top.rglob("cgroup.procs"):
                with contextlib.suppress(OSError):
                    found.update(int(p) for p in procs.read_text().split())
    return sorted(found)


def _remove_cgroup(name: str) -> None:
    """Remove the cgroup tree NAME (deepest first) in every hierarchy; the tree must be empty of tasks."""
    for top in _cgroup_dirs(name):
        if top.is_dir():
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()


def _mounts() -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        # The kernel writes a space, tab, newline or backslash in a path as an octal escape (\040).
        points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4]))
    return points


def _unmount_under(roots: Sequence[Path], keep: set[str]) -> None:
    """Lazily unmount every mount under ROOTS that is not in KEEP, deepest first."""
    prefixes = [str(r).rstrip("/") + "/" for r in roots]
    doomed = [m for m in _mounts() if m not in keep and any(m.startswith(p) for p in prefixes)]
    for point in sorted(set(doomed), key=lambda m: -m.count("/")):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False, timeout=30)


def _dockerd_holding(data_root: Path) -> int | None:
    """The PID of a running dockerd whose --data-root is DATA_ROOT, if any."""
    for pid in _pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if not argv or not argv[0].endswith("dockerd"):
            continue
        roots = [b for a, b in itertools.pairwise(argv) if a == "--data-root"]
        roots += [a.split("=", 1)[1] for a in argv if a.startswith("--data-root=")]
        if any(Path(r).resolve() == data_root.resolve() for r in roots):
            return pid
    return None


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name


def _restore_sysctls(saved: dict[str, str]) -> None:
    for name, value in saved.items():
        path = _sysctl_path(name)
        with contextlib.suppress(OSError):
            if path.read_text().strip() != value:
                path.write_text(value + "\n")


def _host_entries() -> dict[str, list[str]]:
    return {str(d): sorted(p.name for p in d.iterdir()) if d.is_dir() else [] for d in KUBELET_HOST_DIRS}


def _clean_host_dirs(before: dict[str, list[str]], existed: dict[str, bool]) -> None:
    """Remove what the kubelet added to its fixed host folders since BEFORE (the folders too if new)."""
    for name in (str(d) for d in KUBELET_HOST_DIRS):
        folder = Path(name)
        if not folder.is_dir():
            continue
        if not existed.get(name, True):
            shutil.rmtree(folder, ignore_errors=True)
            continue
        for entry in folder.iterdir():
            if entry.name not in before.get(name, []):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
    Path("/var/lib/kubelet/device-plugins/kubelet.sock").unlink(missing_ok=True)


def _teardown(state: dict[str, Any]) -> None:
    """Undo what a started node left: every process in its namespace or cgroup killed, its mounts,
    cgroup, namespace and folders removed, the sysctls and host folders put back. Safe to repeat."""
    netns = Path("/run/netns") / state["netns"]
    inode = None
    with contextlib.suppress(OSError, TypeError):
        st = netns.stat()
        # Only the namespace the node made: a freed nsfs inode number may belong to another one now.
        if [st.st_dev, st.st_ino] == state["netns_inode"]:
            inode = (st.st_dev, st.st_ino)
    for _ in range(20):
        pids = pids_in_cgroup(state["cgroup"])
        if inode is not None:
            pids += pids_in_netns(inode)
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            break
        _kill(pids)
        time.sleep(0.25)
    _unmount_under([Path(p) for p in state["folders"]], set(state.get("mounts", [])))
    _remove_cgroup(state["cgroup"])
    if netns.exists():
        subprocess.run(["ip", "netns", "delete", state["netns"]], capture_output=True, check=False)
    _restore_sysctls(state.get("sysctls", {}))
    _clean_host_dirs(state.get("host_entries", {}), state.get("host_existed", {}))
    for folder in state.get("remove", []):
        shutil.rmtree(folder, ignore_errors=True)


# --- the node ------------------------------------------------------------------------------------


@dataclass
class Node:
    """A one-node cluster in its own network namespace; `start()` it, `stop()` it (idempotent)."""

    root: Path
    """Certificates, configuration, logs and the kubelet's root folder."""
    bin: Path
    data_root: Path = field(default_factory=images_root)
    """The node dockerd's data root (build-images.sh's by default: legorl's images are there)."""
    netns: str = field(default_factory=lambda: f"legorl-node-{secrets.token_hex(4)}")
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    api_downgrade: bool = False
    """Pods reach the API server through tests/kube120's Downgrade, so in-cluster clients (the
    operator's pod) see the API of Kubernetes >= 1.30 it renders for: the `kubernetes` Service's one
    endpoint is a TLS front of the Downgrade on NODE_IP:DOWNGRADE_PORT (serving the API server's own
    certificate) instead of the API server itself. The API server's endpoint reconciler is off so that
    it keeps that endpoint; the node's own programs (kubelet, controllers, kubectl) still go straight
    to the API server."""
    procs: list[Process] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds: `control_plane` (etcd + API server ready), `dockerd` (+ the pause image),
    `kubelet_to_ready` (kubelet start → node Ready), `total` (nothing → node Ready), `stop`."""
    seen: dict[int, tuple[int, str]] = field(default_factory=dict)
    """Every process of the node seen while it ran (pid → start time, name): what stop must end."""
    run: Path = field(default_factory=lambda: Path("/nonexistent"))
    """A short folder for sockets (UNIX socket paths are limited to 108 bytes) and runtime state."""
    _state: dict[str, Any] = field(default_factory=dict)
    _locks: list[Any] = field(default_factory=list)
    _tokens: dict[str, str] = field(default_factory=dict)

    # --- paths and clients ---------------------------------------------------------------------

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"

    @property
    def server(self) -> str:
        return f"https://{NODE_IP}:{API_PORT}"

    @property
    def ca(self) -> Path:
        return self.root / "pki/ca.crt"

    @property
    def docker_env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": f"unix://{self.run}/docker.sock"}

    def inside(self, *argv: str) -> list[str]:
        """ARGV run in the node's network namespace."""
        return ["nsenter", f"--net={self.netns_path}", "--", *argv]

    def kubeconfig(self, user: str = "admin") -> Path:
        return self.root / f"{user}.kubeconfig"

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """kubectl as the admin, run inside the node's namespace (the API server is only there)."""
        argv = self.inside(kubectl_binary(), f"--kubeconfig={self.kubeconfig()}", *args)
        result = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
        return result

    def docker(
        self, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """The docker CLI against the node's engine (a UNIX socket: the CLI needs no network)."""
        return _run(docker_cli(), *args, check=check, timeout=timeout, env=self.docker_env)

    def get_json(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def tail(self, name: str, lines: int = 40) -> str:
        log = self.root / f"{name}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    # --- start ---------------------------------------------------------------------------------

    def start(self, timeout: float = 180) -> Node:
        started = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self._take_lock()
            self._netns()
            self._pki()
            t = time.monotonic()
            self._control_plane(timeout)
            self.timings["control_plane"] = time.monotonic() - t
            t = time.monotonic()
            self._dockerd()
            self.timings["dockerd"] = time.monotonic() - t
            self._dns()
            self._kube_proxy()
            t = time.monotonic()
            self._kubelet()
            self._wait_node_ready(timeout)
            self.timings["kubelet_to_ready"] = time.monotonic() - t
            self.timings["total"] = time.monotonic() - started
            (self.root / "timings.json").write_text(json.dumps(self.timings, indent=1) + "\n")
            self.observe()
        except Exception as exc:
            logs = "\n".join(f"--- {p.name}\n{self.tail(p.name)}" for p in self.procs)
            self.stop()
            raise RuntimeError(f"the node did not start: {exc}\nthe logs' tails:\n{logs}") from exc
        return self

    def _take_lock(self) -> None:
        """The machine-wide node lock and the data root's; a node left by a run killed hard is stopped
        first."""
        for path, taken in (
            (LOCK, "another node runs on this machine"),
            (data_root_lock(self.data_root), f"another engine uses {self.data_root}"),
        ):
            lock = path.open("a+")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                raise RuntimeError(f"{taken} ({path} is locked)") from None
            self._locks.append(lock)
        if STATE.exists():
            with contextlib.suppress(ValueError, KeyError, OSError):
                _teardown(json.loads(STATE.read_text()))
            STATE.unlink(missing_ok=True)
        engine = _dockerd_holding(self.data_root)
        if engine is not None:  # build-images.sh's (which takes no lock), or another
            raise RuntimeError(
                f"dockerd {engine} holds {self.data_root} (is scripts/build-images.sh running?)"
            )
        self.run = Path(tempfile.mkdtemp(prefix="legorl-node-", dir="/tmp"))
        self._state = {
            "netns": self.netns,
            "netns_inode": None,
            "cgroup": self.netns,
            "folders": [str(self.root), str(self.run), str(self.data_root)],
            "mounts": _mounts(),
            "sysctls": {n: _sysctl_path(n).read_text().strip() for n in KUBELET_SYSCTLS},
            "host_entries": _host_entries(),
            "host_existed": {str(d): d.is_dir() for d in KUBELET_HOST_DIRS},
            # The kubelet's pod folders hold each trial pod's emptyDirs (a harness runtime copy is
            # ~0.8 GB), and etcd's data: gigabytes a stopped node has no use for, while the logs
            # beside them stay for whoever reads a failure.
            "remove": [str(self.run), str(self.root / "kubelet"), str(self.root / "etcd")],
        }
        self._save_state()

    def _save_state(self) -> None:
        STATE.write_text(json.dumps(self._state) + "\n")

    def _netns(self) -> None:
        _run("ip", "netns", "add", self.netns)
        st = Path(self.netns_path).stat()
        self._state["netns_inode"] = [st.st_dev, st.st_ino]
        self._save_state()
        _run("ip", "-n", self.netns, "link", "set", "lo", "up")
        # The kubelet refuses a loopback node IP, and this kernel has no dummy links: both addresses
        # sit on lo as /32s.
        _run("ip", "-n", self.netns, "addr", "add", f"{NODE_IP}/32", "dev", "lo")
        _run("ip", "-n", self.netns, "addr", "add", f"{DNS_IP}/32", "dev", "lo")
        _run(*self.inside("sysctl", "-q", "-w", "net.ipv4.ip_forward=1"))
        self._assert_no_way_out()
        for d in _cgroup_dirs(self.netns):
            d.mkdir(exist_ok=True)

    def _assert_no_way_out(self) -> None:
        """The namespace has no default route, and an outside address (1.1.1.1) is unreachable in it."""
        default = _run("ip", "-n", self.netns, "route", "show", "default").stdout.strip()
        if default:
            raise RuntimeError(f"{self.netns} has a default route: {default}")
        probe = _run("ip", "-n", self.netns, "route", "get", "1.1.1.1", check=False)
        if probe.returncode == 0 or "unreachable" not in probe.stderr:
            raise RuntimeError(f"{self.netns} routes 1.1.1.1: {probe.stdout}{probe.stderr}")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Process:
        """Start ARGV in the node's namespace (nsenter execs it: the PID is the program's). Every program
        of the node comes through here, and each is checked to enter the namespace made for it."""
        command = self.inside(*argv)
        self._assert_contained(command)
        log = self.root / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, cwd=self.root, start_new_session=True,
                env=env,
            )  # fmt: skip
        p = Process(name, proc, log, argv)
        self.procs.append(p)
        return p

    def _assert_contained(self, command: Sequence[str]) -> None:
        """COMMAND enters the node's namespace (this one: the same nsfs inode as when it was made)."""
        if list(command[:3]) != ["nsenter", f"--net={self.netns_path}", "--"]:
            raise RuntimeError(f"not started in the node's namespace: {command[:4]}")
        st = Path(self.netns_path).stat()
        if [st.st_dev, st.st_ino] != self._state.get("netns_inode"):
            raise RuntimeError(f"{self.netns_path} is not the namespace this node made")

    def _check_alive(self) -> None:
        for p in self.procs:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.tail()}")

    def _wait(self, what: str, ready: Callable[[], bool], timeout: float, every: float = 0.5) -> None:
        """Until READY() says so; a probe that times out (a kubectl call to an API server that has bound
        its port but does not answer yet, seen on a busy machine) is a "not yet", not an error."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if ready():
                    return
            except subprocess.TimeoutExpired:
                pass
            time.sleep(every)
        raise RuntimeError(f"{what} within {timeout:.0f} s")

    def _pki(self) -> None:
        pki = self.root / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=legorl-node-ca",
            "-keyout", str(pki / "ca.key"), "-out", str(self.ca),
        )  # fmt: skip
        sans = [f"IP:{NODE_IP}", f"IP:{API_SERVICE_IP}", "IP:127.0.0.1", "DNS:localhost", "DNS:kubernetes"]
        sans += [f"DNS:kubernetes.default{s}" for s in ("", ".svc", f".svc.{CLUSTER_DOMAIN}")]
        (pki / "server.ext").write_text(
            f"subjectAltName={','.join(sans)}\nbasicConstraints=critical,CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
        )
        _openssl(
            "req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kube-apiserver",
            "-keyout", str(pki / "server.key"), "-out", str(pki / "server.csr"),
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", str(pki / "server.csr"), "-CA", str(self.ca),
            "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "2",
            "-extfile", str(pki / "server.ext"), "-out", str(pki / "server.crt"),
        )  # fmt: skip
        _openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
        _openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))
        # Every client authenticates with a static token; each identity is one the 1.20 API server's
        # bootstrap RBAC (or, for the kubelet, the Node authorizer and NodeRestriction) knows.
        users = {
            "admin": ("admin", "system:masters"),
            "kubelet": (f"system:node:{NODE_NAME}", "system:nodes"),
            "kube-proxy": ("system:kube-proxy", ""),
            "kube-scheduler": ("system:kube-scheduler", ""),
            "kube-controller-manager": ("system:kube-controller-manager", ""),
        }
        rows = []
        for i, (key, (user, group)) in enumerate(users.items()):
            self._tokens[key] = self.admin_token if key == "admin" else secrets.token_hex(16)
            rows.append(f"{self._tokens[key]},{user},uid-{i}" + (f',"{group}"' if group else ""))
            path = self.kubeconfig(key)
            path.write_text(
                "apiVersion: v1\nkind: Config\n"
                f"clusters:\n- name: node\n  cluster:\n    server: {self.server}\n"
                f"    certificate-authority: {self.ca}\n"
                f"users:\n- name: {key}\n  user:\n    token: {self._tokens[key]}\n"
                f"contexts:\n- name: node\n  context:\n    cluster: node\n    user: {key}\n"
                "current-context: node\n"
            )
            path.chmod(0o600)
        (pki / "tokens.csv").write_text("\n".join(rows) + "\n")
        (pki / "tokens.csv").chmod(0o600)

    def _control_plane(self, timeout: float) -> None:
        pki = self.root / "pki"
        self._spawn(
            "etcd",
            [
                str(self.bin / "etcd"), "--name", "node", "--data-dir", str(self.root / "etcd"),
                "--listen-client-urls", "http://127.0.0.1:2379",
                "--advertise-client-urls", "http://127.0.0.1:2379",
                "--listen-peer-urls", "http://127.0.0.1:2380",
                "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
                "--initial-cluster", "node=http://127.0.0.1:2380",
                "--listen-metrics-urls", "", "--log-level", "warn",
            ],
        )  # fmt: skip
        self._spawn(
            "kube-apiserver",
            [
                str(self.bin / "kube-apiserver"), "--etcd-servers=http://127.0.0.1:2379",
                f"--bind-address={NODE_IP}", f"--advertise-address={NODE_IP}",
                f"--secure-port={API_PORT}", "--insecure-port=0",
                f"--tls-cert-file={pki / 'server.crt'}", f"--tls-private-key-file={pki / 'server.key'}",
                f"--client-ca-file={self.ca}", f"--token-auth-file={pki / 'tokens.csv'}",
                "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-account-issuer=https://kubernetes.default.svc.{CLUSTER_DOMAIN}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # logs and exec reach the kubelet by its InternalIP, not its (unresolvable) name; its
                # self-signed serving certificate is not verified (1.20 without a kubelet CA).
                "--kubelet-preferred-address-types=InternalIP",
                "--enable-priority-and-fairness=false", "--profiling=false", "-v=1",
                # With api_downgrade the `kubernetes` Service's endpoint is the Downgrade's, set below.
                *(["--endpoint-reconciler-type=none"] if self.api_downgrade else []),
            ],
        )  # fmt: skip

        def ready() -> bool:
            return self.kubectl("get", "--raw=/readyz", check=False, timeout=10).returncode == 0

        self._wait("the API server was not ready", ready, timeout)
        if self.api_downgrade:
            self._downgrade(timeout)
        self._spawn(
            "kube-controller-manager",
            [
                str(self.bin / "kube-controller-manager"),
                f"--kubeconfig={self.kubeconfig('kube-controller-manager')}", "--leader-elect=false",
                "--bind-address=127.0.0.1", "--secure-port=0", "--port=0",
                f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={self.ca}",
                "--use-service-account-credentials=true",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--controllers=*,-cloud-node-lifecycle,-route,-service,-nodeipam", "-v=1",
            ],
        )  # fmt: skip
        self._spawn(
            "kube-scheduler",
            [
                str(self.bin / "kube-scheduler"), f"--kubeconfig={self.kubeconfig('kube-scheduler')}",
                "--leader-elect=false", "--bind-address=127.0.0.1", "--port=0", "--secure-port=0", "-v=1",
            ],
        )  # fmt: skip

    def _downgrade(self, timeout: float) -> None:
        """tests/kube120's Downgrade in the namespace behind a TLS front on NODE_IP:DOWNGRADE_PORT, and
        the `kubernetes` Service's endpoint pointed at it (the EndpointSlice mirroring controller
        copies it for kube-proxy)."""
        pki = self.root / "pki"
        self._spawn(
            "downgrade",
            [
                sys.executable, "-m", "tests.support.kubenode", "downgrade",
                f"--listen={NODE_IP}:{DOWNGRADE_PORT}", f"--upstream={self.server}", f"--ca={self.ca}",
                f"--cert={pki / 'server.crt'}", f"--key={pki / 'server.key'}",
            ],
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        front = f"--server=https://{NODE_IP}:{DOWNGRADE_PORT}"

        def answers() -> bool:
            return self.kubectl(front, "get", "--raw=/version", check=False, timeout=10).returncode == 0

        self._wait("the Downgrade did not answer", answers, timeout)
        endpoints = {
            "apiVersion": "v1",
            "kind": "Endpoints",
            "metadata": {"name": "kubernetes", "namespace": "default"},
            "subsets": [
                {"addresses": [{"ip": NODE_IP}], "ports": [{"name": "https", "port": DOWNGRADE_PORT}]}
            ],
        }
        self.kubectl("apply", "-f", "-", stdin=json.dumps(endpoints))

    def _dockerd(self) -> None:
        runtime: list[str] = []
        # A negative OOM score needs CAP_SYS_RESOURCE; without it runc cannot start a container
        # (as in scripts/build-images.sh, whose wrapper this is).
        probe = subprocess.run(
            ["sh", "-c", "echo -1 >/proc/self/oom_score_adj"], capture_output=True, check=False
        )
        if probe.returncode != 0:
            wrapper = REPO / "scripts/images/runc-oom-clamp"
            runtime = ["--add-runtime", f"oomclamp={wrapper}", "--default-runtime", "oomclamp"]
        self._spawn(
            "dockerd",
            [
                "dockerd", "--data-root", str(self.data_root), "--exec-root", str(self.run / "exec"),
                "-H", f"unix://{self.run}/docker.sock", "--pidfile", str(self.run / "docker.pid"),
                "--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-masq=false",
                "--exec-opt", "native.cgroupdriver=cgroupfs", "--log-level", "warn", *runtime,
            ],
        )  # fmt: skip
        self._wait("dockerd did not answer", lambda: self.docker("info", check=False).returncode == 0, 60)
        self._remove_k8s_containers()
        self._pause_image()

    def _remove_k8s_containers(self) -> None:
        """Remove every container Kubernetes made on this data root (a killed run's, or ours)."""
        ids = self.docker("ps", "-aq", "--filter", f"label={K8S_LABEL}", check=False).stdout.split()
        if ids:
            self.docker("rm", "-f", "-v", *ids, check=False, timeout=120)

    def _pause_image(self) -> None:
        """k8s.gcr.io/pause:3.2 from get-kube.sh's static `pause`, imported once (per binary)."""
        binary = (self.bin / "pause").read_bytes()
        digest = hashlib.sha256(binary).hexdigest()
        label = "dev.legorl.pause.sha256"
        held = self.docker(
            "image", "inspect", "-f", f'{{{{index .Config.Labels "{label}"}}}}', PAUSE_IMAGE, check=False
        )
        if held.returncode == 0 and held.stdout.strip() == digest:
            return
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo("pause")
            info.size, info.mode = len(binary), 0o755
            tar.addfile(info, io.BytesIO(binary))
        argv = [docker_cli(), "import", "-c", 'ENTRYPOINT ["/pause"]', "-c", f"LABEL {label}={digest}"]
        subprocess.run(
            [*argv, "-", PAUSE_IMAGE],
            input=buf.getvalue(),
            env=self.docker_env,
            capture_output=True,
            check=True,
            timeout=120,
        )

    def _dns(self) -> None:
        hosts = self.run / "cluster-hosts"
        hosts.write_text("")
        token = self.root / "pki/dns-sync.token"  # the admin's: this is test infrastructure
        token.write_text(self.admin_token + "\n")
        token.chmod(0o600)
        dnsmasq = self._spawn(
            "dnsmasq",
            [
                "dnsmasq", "--keep-in-foreground", "--log-facility=-", "--conf-file=/dev/null",
                "--pid-file=", "--user=root", "--group=root", f"--listen-address={DNS_IP}",
                "--bind-interfaces", "--no-resolv", "--no-hosts", f"--addn-hosts={hosts}",
                f"--local=/{CLUSTER_DOMAIN}/", "--domain-needed", "--bogus-priv", "--log-queries",
            ],
        )  # fmt: skip
        self._spawn(
            "dns-sync",
            [
                sys.executable, "-m", "tests.support.kubenode", "dns-sync", f"--server={self.server}",
                f"--ca={self.ca}", f"--token-file={self.root / 'pki/dns-sync.token'}",
                f"--hosts={hosts}", f"--dnsmasq-pid={dnsmasq.proc.pid}",
            ],
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip

    def _kube_proxy(self) -> None:
        self._spawn(
            "kube-proxy",
            [
                str(self.bin / "kube-proxy"), f"--kubeconfig={self.kubeconfig('kube-proxy')}",
                "--proxy-mode=iptables", "--masquerade-all", f"--cluster-cidr={POD_CIDR}",
                f"--hostname-override={NODE_NAME}", f"--bind-address={NODE_IP}",
                "--healthz-bind-address=127.0.0.1:10256", "--metrics-bind-address=127.0.0.1:10249",
                # 0: leave the conntrack sysctls alone (nf_conntrack_max is the machine's).
                "--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0",
                "--conntrack-tcp-timeout-close-wait=0", "-v=1",
            ],
        )  # fmt: skip

    def _kubelet(self) -> None:
        cni = self.root / "cni"
        (cni / "net.d").mkdir(parents=True, exist_ok=True)
        conflist = {
            "cniVersion": "0.4.0",
            "name": "legorl",
            "plugins": [
                {
                    "type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_CIDR, "gateway": POD_GATEWAY}]],
                        # No default route in pods: the node, its DNS and the Services are in 10/8.
                        "routes": [{"dst": "10.0.0.0/8"}],
                        "dataDir": str(self.run / "cni-ipam"),
                    },
                }
            ],
        }  # fmt: skip
        (cni / "net.d/10-legorl.conflist").write_text(json.dumps(conflist, indent=1) + "\n")
        (self.root / "resolv.conf").write_text("")  # nothing of the machine's resolver reaches pods
        kubelet_root = self.root / "kubelet"
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": NODE_IP,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{self.netns}",
            "failSwapOn": False,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "clusterDNS": [DNS_IP],
            "clusterDomain": CLUSTER_DOMAIN,
            "resolvConf": str(self.root / "resolv.conf"),
            # The images are the build's: never collect them, never evict for disk.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "volumePluginDir": str(self.root / "volume-plugins"),
            "serializeImagePulls": False,
            # Check the node's status every 2 s, not 10: Ready is seen at the first check after the
            # runtime and CNI are up (a status is still only sent when it changed, or every 5 min).
            "nodeStatusUpdateFrequency": "2s",
        }
        (self.root / "kubelet.yaml").write_text(json.dumps(config, indent=1) + "\n")
        argv = [
            str(self.bin / "kubelet"), f"--config={self.root / 'kubelet.yaml'}",
            f"--kubeconfig={self.kubeconfig('kubelet')}", f"--hostname-override={NODE_NAME}",
            f"--node-ip={NODE_IP}", f"--root-dir={kubelet_root}", f"--cert-dir={self.root / 'kubelet-pki'}",
            "--container-runtime=docker", f"--docker-endpoint=unix://{self.run}/docker.sock",
            f"--container-runtime-endpoint=unix://{self.run}/dockershim.sock",
            f"--experimental-dockershim-root-directory={self.root / 'dockershim'}",
            f"--pod-infra-container-image={PAUSE_IMAGE}",
            "--network-plugin=cni", f"--cni-bin-dir={CNI_BIN}", f"--cni-conf-dir={cni / 'net.d'}",
            f"--cni-cache-dir={self.run / 'cni-cache'}", "-v=1",
        ]  # fmt: skip
        # The program that may probe a cloud metadata address (1.20's in-tree AWS credential provider
        # does at start): once more, no way out of the namespace before it starts.
        self._assert_no_way_out()
        self._spawn("kubelet", argv)

    def restart_kubelet(self, timeout: float = 120) -> float:
        """Stop the kubelet as a service manager restarts it (SIGTERM) and start it again with the same
        flags; its pods go on running in Docker meanwhile. Returns the seconds until it renewed the
        node's Lease again (its heartbeat, every 10 s)."""
        (old,) = [p for p in self.procs if p.name == "kubelet" and p.proc.poll() is None]
        old.stop()
        self.procs.remove(old)
        stopped = time.time()
        self._assert_no_way_out()
        self._spawn("kubelet", old.argv)

        def renewed() -> bool:
            got = self.kubectl(
                "get", "lease", NODE_NAME, "-n", "kube-node-lease", "-o", "json", check=False, timeout=10
            )
            if got.returncode != 0:
                return False
            renew = json.loads(got.stdout)["spec"].get("renewTime") or ""
            return bool(renew) and datetime.fromisoformat(renew.replace("Z", "+00:00")).timestamp() > stopped

        self._wait("the restarted kubelet did not renew its Lease", renewed, timeout, every=1.0)
        return time.time() - stopped

    def _wait_node_ready(self, timeout: float) -> None:
        def ready() -> bool:
            got = self.kubectl("get", "node", NODE_NAME, "-o", "json", check=False, timeout=10)
            if got.returncode != 0:
                return False
            conditions = json.loads(got.stdout)["status"].get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        self._wait("the node was not Ready", ready, timeout, every=1.0)

    # --- observe and stop ----------------------------------------------------------------------

    def observe(self) -> dict[int, tuple[int, str]]:
        """Record every process of the node now (the programs started, what runs in the namespace and
        in the pods' cgroups); stop ends them all, and `leftovers()` checks it did."""
        pids = [p.proc.pid for p in self.procs if p.proc.poll() is None]
        if self._state.get("netns_inode"):
            dev, ino = self._state["netns_inode"]
            pids += pids_in_netns((dev, ino))
        pids += pids_in_cgroup(self.netns)
        for pid in pids:
            start = _start_time(pid)
            if start is not None and pid != os.getpid():
                self.seen[pid] = (start, _comm(pid))
        return self.seen

    def pod_pids(self) -> list[int]:
        """The processes in the pods' cgroups (under the node's cgroup root) now."""
        return pids_in_cgroup(self.netns)

    @property
    def saved_sysctls(self) -> dict[str, str]:
        """The kernel sysctls the kubelet changes, as they were before the node started."""
        return dict(self._state.get("sysctls", {}))

    def leftovers(self) -> list[str]:
        """The processes `observe` saw that still run (same PID, same start time)."""
        return [f"{pid} {name}" for pid, (start, name) in self.seen.items() if _start_time(pid) == start]

    def create_namespace(self, name: str, timeout: float = 60) -> None:
        """A namespace whose `default` ServiceAccount has its token (pods are refused until then)."""
        self.kubectl("create", "namespace", name)

        def has_token() -> bool:
            got = self.kubectl("get", "serviceaccount", "default", "-n", name, "-o", "json", check=False)
            return got.returncode == 0 and bool(json.loads(got.stdout).get("secrets"))

        self._wait(f"no token for {name}/default", has_token, timeout)

    def stop(self) -> None:
        """Stop everything by PID (the kubelet first, the pods' containers removed, etcd last), then undo
        what the node left on the machine and release the locks. Idempotent; a failing step does not skip
        the others."""
        try:
            if self._state:
                self._stop_node()
        finally:
            for lock in self._locks:
                lock.close()  # releases its flock
            self._locks.clear()

    def _stop_node(self) -> None:
        started = time.monotonic()
        with contextlib.suppress(Exception):
            self.observe()
        by_name = {p.name: p for p in self.procs}
        if "kubelet" in by_name:
            by_name["kubelet"].stop()
        if "dockerd" in by_name and by_name["dockerd"].proc.poll() is None:
            with contextlib.suppress(Exception):
                self._remove_k8s_containers()
        for p in reversed(self.procs):
            with contextlib.suppress(Exception):
                p.stop()
        self.procs.clear()
        _teardown(self._state)
        STATE.unlink(missing_ok=True)
        self._state = {}
        self.timings["stop"] = time.monotonic() - started

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def node(root: Path, **kwargs: Any) -> Iterator[Node]:
    """Start a node in ROOT; stop it (by PID) and remove its namespace on exit, also on failure."""
    binary = node_bin()
    if binary is None:
        raise RuntimeError("no kubelet: run `bash scripts/get-kube.sh`")
    n = Node(root=root, bin=binary, **kwargs)
    try:
        n.start()
        yield n
    finally:
        n.stop()


# --- the DNS stand-in's sync loop (test infrastructure, run inside the namespace) -----------------


def cluster_hosts(services: dict[str, Any], endpoints: dict[str, Any] | None = None) -> str:
    """An addn-hosts file for dnsmasq from a ServiceList and an EndpointsList, as CoreDNS answers them:
    `<clusterIP> <name>.<ns>.svc.<domain>` for a Service with a cluster IP; for a headless one, a line per
    ready address of its Endpoints, and `<ip> <hostname>.<name>.<ns>.svc.<domain>` for an address with a
    hostname (a pod whose `hostname` and `subdomain` name it, e.g. an Indexed Job's)."""
    rows = []
    headless = set()
    for svc in services.get("items", []):
        meta, ip = svc["metadata"], svc.get("spec", {}).get("clusterIP")
        fqdn = f"{meta['name']}.{meta['namespace']}.svc.{CLUSTER_DOMAIN}"
        if ip == "None":
            headless.add((meta["namespace"], meta["name"]))
        elif ip:
            rows.append(f"{ip} {fqdn}")
    for ep in (endpoints or {}).get("items", []):
        meta = ep["metadata"]
        if (meta["namespace"], meta["name"]) not in headless:
            continue
        fqdn = f"{meta['name']}.{meta['namespace']}.svc.{CLUSTER_DOMAIN}"
        for subset in ep.get("subsets") or []:
            for address in subset.get("addresses") or []:
                rows.append(f"{address['ip']} {fqdn}")
                if address.get("hostname"):
                    rows.append(f"{address['ip']} {address['hostname']}.{fqdn}")
    return "".join(f"{r}\n" for r in sorted(set(rows)))


def dns_sync(server: str, ca: Path, token: str, hosts: Path, dnsmasq_pid: int, *, every: float = 1.0) -> None:
    """List the Services and Endpoints every EVERY seconds; on a change rewrite HOSTS and SIGHUP dnsmasq."""
    context = ssl.create_default_context(cafile=str(ca))

    def get(path: str) -> Any:
        request = urllib.request.Request(f"{server}{path}", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, context=context, timeout=10) as reply:
            return json.loads(reply.read())

    last = None
    while True:
        try:
            text = cluster_hosts(get("/api/v1/services"), get("/api/v1/endpoints"))
        except (OSError, ValueError) as exc:
            print(f"dns-sync: {exc}", file=sys.stderr, flush=True)
            text = None
        if text is not None and text != last:
            tmp = hosts.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(hosts)
            os.kill(dnsmasq_pid, signal.SIGHUP)
            last = text
        time.sleep(every)


# --- the Downgrade's TLS front (test infrastructure, run inside the namespace) ---------------------


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy READER to WRITER until EOF (or either side fails), then close WRITER."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError as exc:  # a peer went away (reset, TLS cut): the other direction ends too
        print(f"downgrade front: {exc!r}", file=sys.stderr, flush=True)
    finally:
        writer.close()


async def _tls_front(host: str, port: int, tls: ssl.SSLContext, back: tuple[str, int]) -> None:
    """Accept TLS on HOST:PORT and relay each connection's plain bytes to BACK (the Downgrade)."""

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*back)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))

    server = await asyncio.start_server(relay, host, port, ssl=tls)
    async with server:
        await server.serve_forever()


def serve_downgrade(listen: str, upstream: str, ca: Path, cert: Path, key: Path) -> None:
    """tests/kube120's Downgrade (plain HTTP on this namespace's 127.0.0.1) in front of UPSTREAM, and
    a TLS front on LISTEN with the API server's certificate, which pods' service-account CA verifies for
    `kubernetes.default.svc` and the Service's IP. Bytes pass unchanged; the Downgrade rewrites."""
    from tests.support.kube120 import Downgrade  # noqa: PLC0415 - only this subcommand needs it

    host, port = listen.rsplit(":", 1)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(str(cert), str(key))
    tls.set_alpn_protocols(["http/1.1"])  # the Downgrade speaks HTTP/1.1 only
    with Downgrade(upstream, ca) as proxy:
        back = urllib.parse.urlsplit(proxy.url)
        assert back.hostname is not None and back.port is not None
        print(f"downgrade: {listen} (TLS) -> {proxy.url} -> {upstream}", flush=True)
        asyncio.run(_tls_front(host, int(port), tls, (back.hostname, back.port)))


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.kubenode")
    sub = parser.add_subparsers(dest="command", required=True)
    sync = sub.add_parser("dns-sync", help="keep dnsmasq's hosts file in step with the cluster's Services")
    sync.add_argument("--server", required=True)
    sync.add_argument("--ca", type=Path, required=True)
    sync.add_argument("--token-file", type=Path, required=True)
    sync.add_argument("--hosts", type=Path, required=True)
    sync.add_argument("--dnsmasq-pid", type=int, required=True)
    down = sub.add_parser("downgrade", help="tests/kube120's Downgrade behind a TLS front (api_downgrade)")
    down.add_argument("--listen", required=True, help="HOST:PORT of the TLS front")
    down.add_argument("--upstream", required=True)
    down.add_argument("--ca", type=Path, required=True)
    down.add_argument("--cert", type=Path, required=True)
    down.add_argument("--key", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "downgrade":
        serve_downgrade(args.listen, args.upstream, args.ca, args.cert, args.key)
        return 0
    dns_sync(args.server, args.ca, args.token_file.read_text().strip(), args.hosts, args.dnsmasq_pid)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
