"""A "downgrade" reverse proxy that makes the test suite's kube-apiserver v1.20.2 look newer.

Test-only. The operator renders its objects for Kubernetes >= 1.30 and keeps doing so; the real
API server the tests run (`tests/support/kubecluster.py`) is 1.20, which lacks two things the operator
uses:

- `policy/v1` PodDisruptionBudgets: 1.20 serves only `policy/v1beta1` (the same spec, less
  `unhealthyPodEvictionPolicy`), so a `policy/v1` path is a 404 there;
- newer `batch/v1` Job spec fields (`completionMode`, `podFailurePolicy`, `suspend`, ...), which
  1.20's server-side apply refuses ("field not declared in schema");
- native sidecars (an init container's `restartPolicy: Always`, 1.28), refused the same way.

`Downgrade` sits between the operator and that server, on plain HTTP on 127.0.0.1, and forwards
every request over TLS to the server (the caller's own `Authorization` untouched, so RBAC sees
the caller). On the way up it rewrites `/apis/policy/v1...` to `/apis/policy/v1beta1...`, a PDB
body's `policy/v1` to `policy/v1beta1` (without `unhealthyPodEvictionPolicy`), drops the Job
spec fields 1.20 does not know (giving a one-completion Indexed Job's pod the index annotation and
hostname 1.21+ gives it) and turns native sidecars into the first regular containers, started before
the others by a `postStart` hook that waits for their probe's port; on the way down it turns
`policy/v1beta1` back into `policy/v1` in what those policy paths answer (watch events too, line
by line) and makes discovery (`/apis`, `/apis/policy`) advertise `policy/v1` as the preferred
version. Nothing leaves loopback.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import io
import json
import re
import socket
import ssl
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

Edit = Callable[[Any], bool]
"""An in-place change of a decoded JSON value; whether it changed anything."""

POLICY_V1 = "/apis/policy/v1"
POLICY_V1BETA1 = "/apis/policy/v1beta1"
JOBS = re.compile(r"/apis/batch/v1/(namespaces/[^/]+/)?jobs(/|$)")
PODS = re.compile(r"^/api/v1/namespaces/[^/]+/pods(/[^/]+)?$")
# Job spec fields newer than 1.20 (its schema refuses them under server-side apply).
NEW_JOB_FIELDS = (
    "completionMode",
    "podFailurePolicy",
    "suspend",
    "backoffLimitPerIndex",
    "maxFailedIndexes",
    "podReplacementPolicy",
    "managedBy",
    "successPolicy",
)
# Hop-by-hop headers (RFC 9110 §7.6.1) and those the proxy recomputes or must not pass on: the
# body is read whole and re-sent with its own length, and the upstream is asked for identity
# encoding so that the rewritten responses can be read.
NOT_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
        "expect",
        "accept-encoding",
    }
)


# --- rewrites (pure) -------------------------------------------------------------------------------


def is_policy_v1(path: str) -> bool:
    return path == POLICY_V1 or path.startswith(POLICY_V1 + "/")


def is_discovery(path: str) -> bool:
    return path.rstrip("/") in ("/apis", "/apis/policy")


def is_watch(path: str, query: str) -> bool:
    """A watch: `?watch=` a true value (as Go's strconv.ParseBool reads it, the way the API server
    does), or the legacy `/api/v1/watch/...` and `/apis/<group>/<version>/watch/...` paths."""
    flags = urllib.parse.parse_qs(query).get("watch", [])
    parts = path.split("/")
    legacy = parts[3:4] == ["watch"] if parts[1:2] == ["api"] else parts[4:5] == ["watch"]
    return legacy or any(f in ("1", "t", "T", "true", "TRUE", "True") for f in flags)


def _swap_versions(value: Any, old: str, new: str) -> bool:
    """Replace every `apiVersion`/`groupVersion` OLD by NEW in a JSON value, in place; whether any was."""
    changed = False
    if isinstance(value, dict):
        for key in ("apiVersion", "groupVersion"):
            if value.get(key) == old:
                value[key] = new
                changed = True
        children: Iterable[Any] = value.values()
    elif isinstance(value, list):
        children = value
    else:
        return False
    for child in children:
        changed = _swap_versions(child, old, new) or changed
    return changed


def _drop_spec_fields(body: Any, fields: Iterable[str]) -> bool:
    """Remove FIELDS from `body.spec` in place; whether any was there."""
    spec = body.get("spec") if isinstance(body, dict) else None
    if not isinstance(spec, dict):
        return False
    present = [f for f in fields if f in spec]
    for name in present:
        del spec[name]
    return bool(present)


def _advertise_policy_v1(group: Any) -> bool:
    """Make an APIGroup named `policy` list (and prefer) `v1` in place of `v1beta1`."""
    if not isinstance(group, dict) or group.get("name") != "policy":
        return False
    v1 = {"groupVersion": "policy/v1", "version": "v1"}
    others = [v for v in group.get("versions", []) if v.get("version") not in ("v1", "v1beta1")]
    group["versions"] = [v1, *others]
    group["preferredVersion"] = dict(v1)
    return True


def _rewrite_json(raw: bytes, edit: Edit) -> tuple[bytes, bool]:
    """RAW with EDIT (a function changing a JSON value in place) applied; RAW itself if not JSON."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw, False
    if not edit(value):
        return raw, False
    return json.dumps(value, separators=(",", ":")).encode(), True


def _request_edit(path: str) -> tuple[str, Edit] | None:
    """The rewrite kind and in-place edit of a request body to PATH (None: the body goes as it is)."""
    if is_policy_v1(path):

        def pdb(body: Any) -> bool:
            swapped = _swap_versions(body, "policy/v1", "policy/v1beta1")
            return _drop_spec_fields(body, ["unhealthyPodEvictionPolicy"]) or swapped

        return "pdb-body", pdb
    if JOBS.match(path):
        return "job-fields", _downgrade_job
    if PODS.match(path):
        return "sidecar", _emulate_sidecars
    return None


SIDECAR_WAIT = (
    "for i in $(seq 600); do (: </dev/tcp/127.0.0.1/{port}) 2>/dev/null && exit 0; sleep 0.1; done; "
    "echo 'port {port} did not open within 60 s' >&2; exit 1"
)
"""An emulated sidecar's postStart hook: wait until its startup probe's port accepts (bash's /dev/tcp)."""


def _emulate_sidecars(pod: Any) -> bool:
    """Make a pod's native sidecars (init containers with `restartPolicy: Always`, Kubernetes 1.28) what
    1.20 can run, in place: the first regular containers, in their order, without the restart policy.

    1.20 refuses the restart policy on an init container, and a plain init container that never exits would
    hold the pod in Init forever. A regular container runs beside the others as a sidecar does; the order a
    native sidecar guarantees (its startup probe passed before the containers after it start) comes from a
    `postStart` hook that waits for the probe's TCP port: the kubelet starts a pod's containers one after
    the other and starts the next only when the hook has returned (Istio's `holdApplicationUntilProxyStarts`
    pattern). The hook runs bash in the sidecar's image. Only the test's node runs them."""
    spec = pod.get("spec") if isinstance(pod, dict) else None
    if not isinstance(spec, dict) or not isinstance(inits := spec.get("initContainers"), list):
        return False
    sidecars = [c for c in inits if isinstance(c, dict) and c.get("restartPolicy") == "Always"]
    if not sidecars:
        return False
    spec["initContainers"] = [c for c in inits if c not in sidecars]
    for container in sidecars:
        del container["restartPolicy"]
        probe = container.get("startupProbe") or {}
        port = (probe.get("tcpSocket") or probe.get("httpGet") or {}).get("port")
        if isinstance(port, int):
            hook = {"exec": {"command": ["bash", "-c", SIDECAR_WAIT.format(port=port)]}}
            container.setdefault("lifecycle", {})["postStart"] = hook
    spec["containers"] = [*sidecars, *(spec.get("containers") or [])]
    return True


JOB_INDEX = "batch.kubernetes.io/job-completion-index"


def _downgrade_job(job: Any) -> bool:
    """Drop the Job spec fields 1.20 does not know, in place. An Indexed Job of one completion keeps what
    1.21+ gives its pod: the completion index annotation (0) and the hostname `<job>-0` (a pod of a Job
    with more completions cannot be told its index on 1.20)."""
    spec = job.get("spec") if isinstance(job, dict) else None
    if not isinstance(spec, dict):
        return False
    indexed = spec.get("completionMode") == "Indexed" and spec.get("completions", 1) == 1
    changed = _drop_spec_fields(job, NEW_JOB_FIELDS)
    template = spec.get("template")
    name = (job.get("metadata") or {}).get("name")
    if indexed and isinstance(template, dict) and name:
        meta = template.setdefault("metadata", {})
        meta.setdefault("annotations", {})[JOB_INDEX] = "0"
        template.setdefault("spec", {}).setdefault("hostname", f"{name}-0")
        changed = True
    return changed


def _response_edit(path: str) -> tuple[str, Edit] | None:
    """The rewrite kind and in-place edit of a response from PATH (None: it goes back as it is)."""
    if is_policy_v1(path):
        return "pdb-response", lambda value: _swap_versions(value, "policy/v1beta1", "policy/v1")
    if is_discovery(path):

        def discovery(value: Any) -> bool:
            groups = value.get("groups", []) if isinstance(value, dict) else []
            return any([_advertise_policy_v1(g) for g in [value, *groups]])  # every one, no short cut

        return "discovery", discovery
    return None


def _read_chunked(stream: io.BufferedIOBase) -> bytes:
    """A chunked request body (RFC 9112 §7.1), trailers skipped."""
    parts = []
    while size := int(stream.readline().split(b";")[0].strip() or b"0", 16):
        parts.append(stream.read(size))
        stream.readline()
    while stream.readline() not in (b"\r\n", b"\n", b""):
        pass
    return b"".join(parts)


def _status_body(code: int, message: str) -> bytes:
    """A Kubernetes Status object, as the API server itself would answer a failure."""
    status = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": "ServiceUnavailable",
        "code": code,
    }
    return json.dumps(status).encode()


# --- the server ------------------------------------------------------------------------------------


class _Sockets:
    """The open sockets on either side, so that `stop()` can wake every handler blocked on one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False

    def add(self, sock: socket.socket) -> bool:
        """Track SOCK; False once stopping (the caller must not use it then)."""
        with self._lock:
            if not self._closed:
                self._open.add(sock)
            return not self._closed

    def discard(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.discard(sock)

    def shut_all(self) -> None:
        """Shut every socket down (reads return EOF, writes fail) and refuse new ones; the handlers
        close them. The plain `socket.shutdown` also serves TLS sockets, without touching their
        TLS state from this thread."""
        with self._lock:
            self._closed = True
            for sock in self._open:
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)


class _Server(ThreadingHTTPServer):
    """Handler threads are daemons, and `server_close()` joins them (after `_Sockets.shut_all`)."""

    daemon_threads = True
    block_on_close = True

    def __init__(self, proxy: Downgrade) -> None:
        self.proxy = proxy
        super().__init__(("127.0.0.1", 0), _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Tracked here, in the accepting thread, so that no connection escapes `shut_all`.
        if not self.proxy.sockets.add(request):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.proxy.sockets.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Quiet about peers going away (a client hanging up, `stop()`), loud about the rest."""
        if not isinstance(sys.exc_info()[1], OSError | http.client.HTTPException):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        """No access log on stderr."""

    def do_GET(self) -> None:
        self._forward()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    def _forward(self) -> None:
        proxy = self.server.proxy
        split = urllib.parse.urlsplit(self.path)
        path, query = split.path, split.query
        body = self._request_body(path)
        if not proxy.gate(self.command, path):
            self.close_connection = True  # held, then cut off unanswered: the client sees a disconnect
            return
        target = path
        if is_policy_v1(path):
            target = POLICY_V1BETA1 + path[len(POLICY_V1) :]
            proxy.count("pdb-path")
        with proxy.upstream() as conn:
            response = self._send_upstream(conn, target + (f"?{query}" if query else ""), body, path)
            if response is None:
                message = f"the 1.20 API server at {proxy.upstream_url} is unreachable"
                self._reply(
                    502, "Bad Gateway", [("Content-Type", "application/json")], _status_body(502, message)
                )
                return
            with response:
                if is_watch(path, query) and response.status == 200 and conn is not None:
                    with proxy.watching(path, conn):
                        self._stream(path, response)
                else:
                    self._relay(path, response)

    def _send_upstream(
        self, conn: http.client.HTTPSConnection | None, url: str, body: bytes | None, path: str
    ) -> http.client.HTTPResponse | None:
        """The upstream's answer to this request (sent to URL with BODY); None if it gave none."""
        if conn is None:
            return None
        try:
            # No Accept-Encoding at all: the server answers uncompressed, so that answers can be rewritten.
            conn.putrequest(self.command, url, skip_accept_encoding=True)
            for name, value in self._headers(path):
                conn.putheader(name, value)
            if body is not None or self.command in ("POST", "PUT", "PATCH"):
                conn.putheader("Content-Length", str(len(body or b"")))
            conn.endheaders(body)
            return conn.getresponse()
        except (OSError, http.client.HTTPException):
            return None

    def _request_body(self, path: str) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raw = _read_chunked(self.rfile)
        else:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        rewrite = _request_edit(path)
        if not raw or rewrite is None:
            return raw or None
        raw, changed = _rewrite_json(raw, rewrite[1])
        if changed:
            self.server.proxy.count(rewrite[0])
        return raw

    def _headers(self, path: str) -> list[tuple[str, str]]:
        """The request's end-to-end headers, repeated ones kept; JSON asked for (not protobuf) where
        the answer is rewritten."""
        headers = _end_to_end(self.headers.items(), self.headers.get("Connection"))
        if _response_edit(path) is not None:
            headers = [
                (k, "application/json" if k.lower() == "accept" and "protobuf" in v else v)
                for k, v in headers
            ]
        return headers

    def _relay(self, path: str, response: http.client.HTTPResponse) -> None:
        """A whole response, rewritten where PATH's answers are."""
        body = response.read()
        rewrite = _response_edit(path)
        if rewrite is not None:
            body, changed = _rewrite_json(body, rewrite[1])
            if changed:
                self.server.proxy.count(rewrite[0])
        self._reply(response.status, response.reason, _upstream_headers(response), body)

    def _stream(self, path: str, response: http.client.HTTPResponse) -> None:
        """A watch: its newline-delimited events sent on as they come, one chunk each, until the
        upstream ends the watch (or `stop()` shuts its socket)."""
        self.send_response_only(response.status, response.reason)
        for name, value in _upstream_headers(response):
            self.send_header(name, value)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        rewrite = _response_edit(path)
        with contextlib.suppress(http.client.HTTPException):  # the upstream cut off mid-chunk
            while line := response.readline():
                if line.startswith(b'{"type":"ERROR"') and b'"code":410' in line:
                    self.server.proxy.count("watch-gone")  # resourceVersion too old: history gone
                if rewrite is not None:
                    line = self._rewrite_event(line, *rewrite)
                self._chunk(line)
        self._chunk(b"")

    def _rewrite_event(self, line: bytes, kind: str, edit: Edit) -> bytes:
        event, changed = _rewrite_json(line, edit)
        if not changed:
            return line
        self.server.proxy.count(kind)
        return event + b"\n"

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _reply(self, status: int, reason: str, headers: list[tuple[str, str]], body: bytes) -> None:
        self.send_response_only(status, reason)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _end_to_end(headers: Iterable[tuple[str, str]], connection: str | None) -> list[tuple[str, str]]:
    """HEADERS less the hop-by-hop ones, those the `Connection` header names included."""
    named = {t.strip().lower() for t in (connection or "").split(",")}
    return [(k, v) for k, v in headers if k.lower() not in NOT_FORWARDED | named]


def _upstream_headers(response: http.client.HTTPResponse) -> list[tuple[str, str]]:
    return _end_to_end(response.getheaders(), response.getheader("Connection"))


class Downgrade:
    """A plain-HTTP reverse proxy on 127.0.0.1 in front of a 1.20 API server (TLS upstream).

    Listens from construction (so `url` is known at once); `start()` serves, `stop()` ends every
    open request, watches included, and closes every socket. One use: not restartable.

    For HTTP clients that send a bearer token over plain HTTP (httpx, aiohttp: the operator, kopf).
    client-go (kubectl) sends none over `http://`, so kubectl goes to the server itself. GET, POST,
    PUT, PATCH and DELETE only: no HEAD, no protocol upgrades (exec, port-forward).
    """

    def __init__(self, upstream: str, ca: Path) -> None:
        split = urllib.parse.urlsplit(upstream)
        if split.scheme != "https" or split.hostname is None:
            raise ValueError(f"the upstream must be an https:// URL, not {upstream!r}")
        self.upstream_url = upstream
        self._host, self._port = split.hostname, split.port or 443
        self._tls = ssl.create_default_context(cafile=str(ca))
        self.rewritten: collections.Counter[str] = collections.Counter()
        self._count_lock = threading.Lock()
        self._holds: list[tuple[str, re.Pattern[str], threading.Event]] = []
        self._watches: list[tuple[str, socket.socket | None]] = []
        self.sockets = _Sockets()
        self._server = _Server(self)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self, path: str, conn: http.client.HTTPSConnection) -> Iterator[None]:
        """Register an open watch of PATH (its upstream socket), so that `hold` can cut it."""
        entry = (path, conn.sock)
        with self._count_lock:
            self._watches.append(entry)
        try:
            yield
        finally:
            with self._count_lock:
                self._watches.remove(entry)

    @contextlib.contextmanager
    def hold(self, method: str, pattern: str) -> Iterator[threading.Event]:
        """Hold every METHOD request whose path matches PATTERN (a regex) while the block runs; the
        event is set once one is held. Open watches of such paths are ended at the start, so their
        clients must reconnect, and are held. When the block ends, held requests are cut off
        unanswered (the connection closed): a request in flight when its sender died, or a watch
        that could not reconnect for a while."""
        held = threading.Event()
        regex = re.compile(pattern)
        with self._count_lock:
            self._holds.append((method, regex, held))
            for path, sock in self._watches:
                if method == "GET" and regex.search(path) and sock is not None:
                    with contextlib.suppress(OSError):
                        socket.socket.shutdown(sock, socket.SHUT_RDWR)
        try:
            yield held
        finally:
            with self._count_lock:
                self._holds = [h for h in self._holds if h[2] is not held]

    def gate(self, method: str, path: str) -> bool:
        """Whether to forward this request: False after holding it until its hold ended."""
        with self._count_lock:
            hold = next((h for h in self._holds if h[0] == method and h[1].search(path)), None)
        if hold is None:
            return True
        hold[2].set()
        while hold in self._holds and self._thread is not None:
            time.sleep(0.05)
        return False

    def count(self, kind: str) -> None:
        with self._count_lock:
            self.rewritten[kind] += 1

    @contextlib.contextmanager
    def upstream(self) -> Iterator[http.client.HTTPSConnection | None]:
        """A fresh upstream connection, connected and tracked until the block ends; None if the
        server is unreachable or the proxy stopping."""
        conn = http.client.HTTPSConnection(self._host, self._port, context=self._tls)
        with contextlib.closing(conn):
            try:
                conn.connect()
            except OSError:
                yield None
                return
            sock = conn.sock  # the response may detach it from `conn`; it stays tracked until closed
            assert sock is not None
            if not self.sockets.add(sock):
                yield None
                return
            try:
                yield conn
            finally:
                self.sockets.discard(sock)

    def start(self) -> Downgrade:
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.1,), name="kube120", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, end every open request (watches too) and close every socket."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self.sockets.shut_all()
        self._server.server_close()

    def __enter__(self) -> Downgrade:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
