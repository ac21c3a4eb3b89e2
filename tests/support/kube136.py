"""A current Kubernetes API server for the CRDs: etcd + apiextensions-apiserver 1.36 on loopback.

The binary comes from `scripts/get-apiext.sh` (k8s.io/apiextensions-apiserver 0.36, built from
Debian sid's Go source packages). It serves CustomResourceDefinitions and custom resources only,
with a current server's CEL rules, defaulting, pruning, strict field validation, server-side apply
and validation ratcheting; Pods, Jobs and RBAC stay with the 1.20 cluster of `tests/support/kubecluster.py`.

Authentication is a client certificate in `system:masters` signed by a CA made here; the server
uses the same certificate to reach itself (`--kubeconfig`), since it has no in-cluster config, and
its authorizer allows every path (it serves no RBAC API to ask). The admission plugins that need a
core API server (namespaces, webhooks, admission policies) are off, so namespaces need not exist.
Everything listens on 127.0.0.1; processes are stopped by PID, their process group included.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.kubecluster import Process, _openssl, free_port

DISABLED_ADMISSION = (
    "NamespaceLifecycle,MutatingAdmissionWebhook,ValidatingAdmissionWebhook,"
    "ValidatingAdmissionPolicy,MutatingAdmissionPolicy"
)


def apiext_bin() -> Path | None:
    """The directory `scripts/get-apiext.sh` filled: $LEGORL_APIEXT_BIN, else the newest cached build."""
    given = os.environ.get("LEGORL_APIEXT_BIN")
    if given:
        return Path(given)
    cache = Path(os.environ.get("LEGORL_CACHE", Path.home() / ".cache/legorl")) / "apiext"
    built = sorted(
        (p for p in cache.glob("*/bin") if (p / "apiextensions-apiserver").is_file()),
        key=lambda p: p.stat().st_mtime,
    )
    return built[-1] if built else None


@dataclass
class Reply:
    """One answer of the server: its status code, decoded JSON body and warning headers."""

    status: int
    body: Any
    warnings: list[str]

    @property
    def message(self) -> str:
        return str(self.body.get("message", "")) if isinstance(self.body, dict) else str(self.body)


@dataclass
class CrdServer:
    """etcd + apiextensions-apiserver in ROOT, on free loopback ports."""

    root: Path
    bin: Path
    port: int = 0
    procs: list[Process] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    def version(self) -> str:
        """The server's own `gitVersion` (e.g. v1.36.4)."""
        return str(self.request("GET", "/version").body["gitVersion"])

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

    def _make_pki(self) -> None:
        pki = self.pki
        pki.mkdir(parents=True, exist_ok=True)
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"), "-subj", "/CN=legorl-test-ca",
        )  # fmt: skip
        _openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(pki / "admin.key"),
            "-out", str(pki / "admin.csr"), "-subj", "/O=system:masters/CN=admin",
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", str(pki / "admin.csr"), "-CA", str(pki / "ca.crt"),
            "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "2", "-out", str(pki / "admin.crt"),
        )  # fmt: skip

    def kubeconfig(self) -> Path:
        """A kubeconfig for the admin (the server's own identity too)."""
        path = self.root / "admin.kubeconfig"
        if not path.exists():
            path.write_text(
                "apiVersion: v1\nkind: Config\n"
                f"clusters:\n- name: crds\n  cluster:\n    server: {self.url}\n"
                f"    certificate-authority: {self.pki / 'apiserver.crt'}\n"
                f"users:\n- name: admin\n  user:\n    client-certificate: {self.pki / 'admin.crt'}\n"
                f"    client-key: {self.pki / 'admin.key'}\n"
                "contexts:\n- name: crds\n  context:\n    cluster: crds\n    user: admin\n"
                "current-context: crds\n"
            )
            path.chmod(0o600)
        return path

    def start(self, timeout: float = 90.0) -> CrdServer:
        self.root.mkdir(parents=True, exist_ok=True)
        self._make_pki()
        client, peer = free_port(), free_port()
        etcd = shutil.which("etcd")
        if etcd is None:
            raise RuntimeError("no etcd: apt-get install etcd-server (scripts/get-kube.sh does)")
        self._spawn(
            "etcd",
            [
                etcd, "--name", "crds", "--data-dir", str(self.root / "etcd"),
                "--listen-client-urls", f"http://127.0.0.1:{client}",
                "--advertise-client-urls", f"http://127.0.0.1:{client}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", f"crds=http://127.0.0.1:{peer}",
                "--listen-metrics-urls", "", "--log-level", "warn",
            ],
        )  # fmt: skip
        self.port = free_port()
        # The serving certificate is written by the server into --cert-dir (self-signed for
        # 127.0.0.1 and localhost); clients trust that file once it exists.
        kubeconfig = self.kubeconfig()
        self._spawn(
            "apiextensions-apiserver",
            [
                str(self.bin / "apiextensions-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{client}",
                f"--secure-port={self.port}", "--bind-address=127.0.0.1",
                f"--cert-dir={self.pki}", f"--client-ca-file={self.pki / 'ca.crt'}",
                f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}", "--authentication-skip-lookup",
                "--authorization-always-allow-paths=/*",
                f"--disable-admission-plugins={DISABLED_ADMISSION}",
                "--enable-priority-and-fairness=false", "--profiling=false", "-v=1",
            ],
        )  # fmt: skip
        self._wait_ready(timeout)
        return self

    def _context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki / "apiserver.crt"))
        context.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return context

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.tail()}")
            if (self.pki / "apiserver.crt").exists():
                with contextlib.suppress(OSError, urllib.error.URLError, ssl.SSLError):
                    # informer-sync never passes: the server watches Services (for conversion
                    # webhooks) and serves none.
                    if self.request("GET", "/readyz", params={"exclude": "informer-sync"}).status == 200:
                        return
            time.sleep(0.25)
        tails = "\n".join(f"--- {p.name}\n{p.tail()}" for p in self.procs)
        self.stop()
        raise RuntimeError(f"the CRD API server was not ready in {timeout:.0f} s:\n{tails}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()

    # --- requests ------------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        accept: str = "application/json",
        timeout: float = 60,
    ) -> Reply:
        """One request as the admin; the reply whatever its status (never raises on 4xx/5xx)."""
        url = self.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Accept", accept)
        if data is not None:
            request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(request, context=self._context(), timeout=timeout) as reply:
                status, raw, headers = reply.status, reply.read(), reply.headers
        except urllib.error.HTTPError as error:
            status, raw, headers = error.code, error.read(), error.headers
        text = raw.decode(errors="replace")
        try:
            decoded: Any = json.loads(text) if text else None
        except json.JSONDecodeError:
            decoded = text
        return Reply(status, decoded, headers.get_all("Warning") or [])

    def apply(
        self,
        obj: Mapping[str, Any],
        *,
        manager: str,
        force: bool = False,
        subresource: str = "",
        **params: str,
    ) -> Reply:
        """Server-side apply of OBJ (strict field validation, as kubectl sends)."""
        path = resource_path(obj) + (f"/{subresource}" if subresource else "")
        query = {"fieldManager": manager, "fieldValidation": "Strict", **params}
        if force:
            query["force"] = "true"
        return self.request(
            "PATCH", path, json.dumps(obj).encode(), params=query, content_type="application/apply-patch+yaml"
        )

    def create(self, obj: Mapping[str, Any], **params: str) -> Reply:
        """POST OBJ to its collection (strict field validation unless PARAMS say otherwise)."""
        return self.request(
            "POST", resource_path(obj, collection=True), obj, params={"fieldValidation": "Strict", **params}
        )

    def wait_established(self, name: str, timeout: float = 60) -> None:
        """Until CRD NAME is Established and its resources are served."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            crd = self.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}").body
            conditions = {c["type"]: c["status"] for c in (crd.get("status") or {}).get("conditions") or []}
            if conditions.get("Established") == "True":
                group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
                version = crd["spec"]["versions"][0]["name"]
                if self.request("GET", f"/apis/{group}/{version}/{plural}").status == 200:
                    return
            time.sleep(0.2)
        raise AssertionError(f"CRD {name} not established in {timeout:.0f} s")


PLURALS = {"RLRun": "rlruns", "SandboxPool": "sandboxpools", "RolloutFleet": "rolloutfleets"}


def resource_path(obj: Mapping[str, Any], *, collection: bool = False) -> str:
    """The REST path of a namespaced legorl resource or a CRD (apiextensions.k8s.io/v1)."""
    meta = obj["metadata"]
    if obj["kind"] == "CustomResourceDefinition":
        base = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        return base if collection else f"{base}/{meta['name']}"
    base = f"/apis/{obj['apiVersion']}/namespaces/{meta.get('namespace', 'default')}/{PLURALS[obj['kind']]}"
    return base if collection else f"{base}/{meta['name']}"


@contextlib.contextmanager
def crd_server(root: Path) -> Iterator[CrdServer]:
    """Start a CRD API server in ROOT; stop it (by PID) on exit."""
    binary = apiext_bin()
    if binary is None:
        raise RuntimeError(
            "no apiextensions-apiserver: run `bash scripts/get-apiext.sh` (scripts/test.sh does)"
        )
    server = CrdServer(root=root, bin=binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()
