"""A real Kubernetes control plane on loopback: etcd, kube-apiserver and kube-controller-manager.

The binaries come from `scripts/get-kube.sh` (kube-apiserver and kube-controller-manager v1.20.2,
built from Debian's source package; etcd from Debian). Everything listens on 127.0.0.1 on free
ports: the API server serves TLS with a self-signed certificate, authenticates with static tokens
(an admin in `system:masters`, and any extra users a test asks for) and authorizes with RBAC. The
controller-manager gives real owner-reference garbage collection and service-account tokens. No
kubelet runs (1.20's may probe a cloud metadata address): tests play the kubelet, as they do
against the mock. Processes are stopped by PID, their process group included.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
KUBE_VERSION = "v1.20.2"


def kube_bin() -> Path | None:
    """The directory `scripts/get-kube.sh` filled: $LEGORL_KUBE_BIN, else the newest cached build."""
    given = os.environ.get("LEGORL_KUBE_BIN")
    if given:
        return Path(given)
    cache = Path(os.environ.get("LEGORL_CACHE", Path.home() / ".cache/legorl")) / "kube"
    built = sorted(
        (p for p in cache.glob("*/bin") if (p / "kube-apiserver").is_file() and (p / "etcd").exists()),
        key=lambda p: p.stat().st_mtime,
    )
    return built[-1] if built else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@dataclass
class Process:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    argv: list[str]

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class ControlPlane:
    """etcd + kube-apiserver (+ kube-controller-manager) in ROOT, on free loopback ports."""

    root: Path
    bin: Path
    users: Sequence[str] = ()
    """Extra token users (`name` → token in `tokens[name]`, in no group) for RBAC tests."""
    controller_manager: bool = True
    audit: bool = False
    """Write every request's metadata (who, verb, resource, response code) to `audit_log`."""
    admission: Sequence[str] = ()
    """Admission plugins to enable beside 1.20's defaults (e.g. OwnerReferencesPermissionEnforcement)."""
    port: int = 0
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    tokens: dict[str, str] = field(default_factory=dict)
    procs: list[Process] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca(self) -> Path:
        return self.root / "pki/server.crt"

    @property
    def audit_log(self) -> Path:
        return self.root / "audit.log"

    def audit_events(self) -> list[dict[str, Any]]:
        """One audit record per request, oldest first: its last stage. Every request is recorded when
        it arrives (RequestReceived): a watch reaches ResponseStarted only with its first event or
        when it closes, so a quiet watch would otherwise not be in the log yet."""
        if not self.audit_log.exists():
            return []
        last: dict[str, dict[str, Any]] = {}
        for line in self.audit_log.read_text().splitlines():
            if line.strip():
                event = json.loads(line)
                last[event["auditID"]] = event
        return list(last.values())

    def kubeconfig(self, user: str = "admin") -> Path:
        """A kubeconfig for USER (the admin by default), written once."""
        path = self.root / f"{user}.kubeconfig"
        if not path.exists():
            token = self.admin_token if user == "admin" else self.tokens[user]
            path.write_text(
                "apiVersion: v1\nkind: Config\n"
                f"clusters:\n- name: real\n  cluster:\n    server: {self.url}\n"
                f"    certificate-authority: {self.ca}\n"
                f"users:\n- name: {user}\n  user:\n    token: {token}\n"
                f"contexts:\n- name: real\n  context:\n    cluster: real\n    user: {user}\n"
                "current-context: real\n"
            )
            path.chmod(0o600)
        return path

    # --- start and stop ------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> Process:
        log = self.root / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, cwd=self.root, start_new_session=True
            )
        p = Process(name, proc, log, argv)
        self.procs.append(p)
        return p

    def restart_apiserver(self, down_seconds: float = 1.0, timeout: float = 90.0) -> None:
        """Stop kube-apiserver (etcd keeps the state), wait DOWN_SECONDS, start it again on its port."""
        (old,) = (p for p in self.procs if p.name == "kube-apiserver")
        old.stop()
        time.sleep(down_seconds)
        slot = self.procs.index(old)
        self._spawn("kube-apiserver", old.argv)
        self.procs[slot] = self.procs.pop()  # the old one's place: processes stop in reverse order
        self._wait_ready(timeout)

    def _pki(self) -> None:
        pki = self.root / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-keyout", str(pki / "server.key"), "-out", str(pki / "server.crt"),
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        )  # fmt: skip
        _openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
        _openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))
        rows = [f"{self.admin_token},admin,admin,system:masters"]
        for i, user in enumerate(self.users):
            self.tokens[user] = secrets.token_hex(16)
            rows.append(f"{self.tokens[user]},{user},uid-{i}")
        (pki / "tokens.csv").write_text("\n".join(rows) + "\n")
        (pki / "tokens.csv").chmod(0o600)

    def start(self, timeout: float = 90.0) -> ControlPlane:
        self.root.mkdir(parents=True, exist_ok=True)
        self._pki()
        pki = self.root / "pki"
        client, peer = free_port(), free_port()
        self._spawn(
            "etcd",
            [
                str(self.bin / "etcd"), "--name", "real", "--data-dir", str(self.root / "etcd"),
                "--listen-client-urls", f"http://127.0.0.1:{client}",
                "--advertise-client-urls", f"http://127.0.0.1:{client}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", f"real=http://127.0.0.1:{peer}",
                "--listen-metrics-urls", "", "--log-level", "warn",
            ],
        )  # fmt: skip
        self.port = free_port()
        self._spawn(
            "kube-apiserver",
            [
                str(self.bin / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{client}",
                "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}", "--insecure-port=0",
                f"--tls-cert-file={pki / 'server.crt'}", f"--tls-private-key-file={pki / 'server.key'}",
                f"--token-auth-file={pki / 'tokens.csv'}", "--authorization-mode=RBAC",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--service-cluster-ip-range=10.96.0.0/24", "--endpoint-reconciler-type=none",
                "--enable-priority-and-fairness=false", "--profiling=false", "-v=1",
                *self._optional_flags(),
            ],
        )  # fmt: skip
        self._wait_ready(timeout)
        if self.controller_manager:
            self._spawn(
                "kube-controller-manager",
                [
                    str(self.bin / "kube-controller-manager"),
                    f"--kubeconfig={self.kubeconfig()}", "--leader-elect=false",
                    "--bind-address=127.0.0.1", "--secure-port=0", "--port=0",
                    f"--service-account-private-key-file={pki / 'sa.key'}",
                    f"--root-ca-file={pki / 'server.crt'}", "--use-service-account-credentials=false",
                    "--controllers=*,-nodeipam,-nodelifecycle,-cloud-node-lifecycle,-route,-service",
                    "-v=1",
                ],
            )  # fmt: skip
        return self

    def _optional_flags(self) -> list[str]:
        flags = [f"--enable-admission-plugins={','.join(self.admission)}"] if self.admission else []
        if self.audit:
            policy = self.root / "audit-policy.yaml"
            policy.write_text("apiVersion: audit.k8s.io/v1\nkind: Policy\nrules:\n- level: Metadata\n")
            flags += [f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}"]
            flags += ["--audit-log-format=json", "--audit-log-mode=blocking"]
        return flags

    def _wait_ready(self, timeout: float) -> None:
        context = ssl.create_default_context(cafile=str(self.ca))
        request = urllib.request.Request(
            f"{self.url}/readyz", headers={"Authorization": f"Bearer {self.admin_token}"}
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.tail()}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(request, context=context, timeout=5) as reply,
            ):
                if reply.status == 200:
                    return
            time.sleep(0.25)
        tails = "\n".join(f"--- {p.name}\n{p.tail()}" for p in self.procs)
        self.stop()
        raise RuntimeError(f"the API server was not ready in {timeout:.0f} s:\n{tails}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- kubectl -------------------------------------------------------------------------------

    def kubectl(
        self,
        *args: str,
        user: str = "admin",
        stdin: str | None = None,
        check: bool = True,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        binary = shutil.which("kubectl", path=str(REPO / ".cache/tools/bin")) or shutil.which("kubectl")
        if binary is None:
            raise RuntimeError("kubectl not found: run `bash scripts/get-helm.sh .cache/tools`")
        result = subprocess.run(
            [binary, f"--kubeconfig={self.kubeconfig(user)}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
        return result


@contextlib.contextmanager
def control_plane(root: Path, **kwargs: object) -> Iterator[ControlPlane]:
    """Start a control plane in ROOT; stop it (by PID) on exit."""
    binary = kube_bin()
    if binary is None:
        raise RuntimeError("no kube-apiserver: run `bash scripts/get-kube.sh` (scripts/test.sh does)")
    plane = ControlPlane(root=root, bin=binary, **kwargs)  # type: ignore[arg-type]
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()
