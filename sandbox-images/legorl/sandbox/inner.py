"""First process inside a local sandbox: egress self-test, the relay to the proxy, then the harness.

Runs as the trial's uid inside the sandbox's namespaces, before any agent code. It

1. checks the egress defense from the inside — the only network interface is loopback, and
   connections to outside addresses (the host's own addresses and the engine's port included) are
   refused — and that the proxy answers through its Unix socket;
2. reports the checks as JSON on an inherited pipe and closes it, so nothing the agent runs later
   can write a result the host would believe;
3. relays TCP `127.0.0.1:PORT` (what the harness is configured with) to the proxy's Unix socket
   bound into the sandbox: the one way out;
4. runs the harness as its child and exits with its status.

Usage: python -m legorl.sandbox.inner --report-fd N [--proxy-socket PATH --port 4000]
[--probe HOST:PORT ...] -- HARNESS ARGV...
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from legorl.sandbox.checks import Check

DEFAULT_PROBES = (("1.1.1.1", 443), ("169.254.169.254", 80), ("8.8.8.8", 53))
EXIT_DEFENSE_FAILED = 97


def interfaces() -> list[str]:
    """Network interfaces visible in this namespace."""
    lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    return sorted(line.split(":", 1)[0].strip() for line in lines)


def probe(host: str, port: int, timeout: float = 1.0) -> tuple[bool, str]:
    """Try a TCP connect; (blocked, how)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect((host, port))
        except TimeoutError:
            return True, "timed out"
        except OSError as exc:
            return True, errno.errorcode.get(exc.errno or 0, str(exc))
    return False, "connected"


def proxy_health(path: str) -> tuple[bool, str]:
    """GET /health over the proxy's Unix socket."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5.0)
            sock.connect(path)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n")
            head = sock.recv(64)
    except OSError as exc:
        return False, f"proxy socket {path}: {exc}"
    status = head.split(b" ", 2)[1:2]
    ok = status == [b"200"]
    return ok, f"GET /health → {status[0].decode() if status else 'no answer'}"


def self_test(probes: Sequence[tuple[str, int]], proxy_socket: str | None) -> list[Check]:
    """Egress checks from inside the sandbox, before any agent code runs."""
    names = interfaces()
    checks = [Check("egress.loopback_only", names == ["lo"], f"interfaces: {', '.join(names)}")]
    for host, port in probes:
        blocked, how = probe(host, port)
        checks.append(Check(f"egress.refused {host}:{port}", blocked, how))
    if proxy_socket:
        ok, how = proxy_health(proxy_socket)
        checks.append(Check("egress.proxy_reachable", ok, how))
    return checks


def _pump(selector: selectors.BaseSelector, a: socket.socket, b: socket.socket) -> None:
    peers = {a: b, b: a}
    for s in peers:
        selector.register(s, selectors.EVENT_READ)
    try:
        while peers:
            for key, _ in selector.select():
                src = key.fileobj
                assert isinstance(src, socket.socket)
                try:
                    data = src.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    return
                peers[src].sendall(data)
    except OSError:
        return
    finally:
        for s in (a, b):
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(s)
            s.close()


def relay(port: int, proxy_socket: str) -> socket.socket:
    """Accept on 127.0.0.1:port and splice each connection to the proxy's Unix socket."""
    server = socket.create_server(("127.0.0.1", port), backlog=128)

    def handle(client: socket.socket) -> None:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(proxy_socket)
        except OSError:
            client.close()
            upstream.close()
            return
        _pump(selectors.DefaultSelector(), client, upstream)

    def accept_loop() -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(client,), daemon=True).start()

    threading.Thread(target=accept_loop, daemon=True).start()
    return server


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="legorl.sandbox.inner")
    parser.add_argument("--report-fd", type=int, required=True)
    parser.add_argument("--proxy-socket")
    parser.add_argument("--port", type=int, default=4000)
    parser.add_argument("--probe", action="append", default=[], metavar="HOST:PORT")
    parser.add_argument("--no-egress-check", action="store_true", help="egress: Unrestricted")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no harness command after --")
    probes = [*DEFAULT_PROBES]
    for item in args.probe:
        host, _, port = item.rpartition(":")
        probes.append((host.strip("[]"), int(port)))
    checks = [] if args.no_egress_check else self_test(probes, args.proxy_socket)
    with os.fdopen(args.report_fd, "w") as report:
        report.write(json.dumps([c.to_dict() for c in checks]) + "\n")
    if not all(c.passed for c in checks):
        return EXIT_DEFENSE_FAILED
    if args.proxy_socket:
        relay(args.port, args.proxy_socket)
    child = subprocess.Popen(command)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())
