"""Egress lock: in a trial pod only the proxy's uid may send non-loopback traffic; applied, then proved.

A trial pod's containers share one network namespace. The `egress-lock` init container (root with
NET_ADMIN and NET_RAW, before any other container starts) installs iptables and ip6tables rules in
that namespace's filter table, the way a service mesh's init container does:

    OUTPUT -> LEGORL-EGRESS:  -o lo ACCEPT                 (harness <-> proxy on 127.0.0.1)
                              [IPv6: neighbour discovery ACCEPT]
                              -m owner --uid-owner U ACCEPT  (each allowed uid: the proxy, 65533)
                              -p tcp REJECT tcp-reset        (a blocked connect fails at once)
                              REJECT icmp(6)-port-unreachable (UDP, ICMP echo, anything else)

The agent (uid 65532, no capabilities) cannot change the rules, so it reaches the model only
through the proxy on loopback, and never the Kubernetes API, the cloud metadata service or DNS.

`--self-test` then proves the lock from the kernel's point of view, not from the rules' text: the
rules read back as rendered; as the denied uid, TCP and UDP to each probe address fail; the lock's
REJECT counters (or a datagram dropped locally) show the kernel applies the rules; loopback still
works; each allowed uid's datagrams still leave. Any failed check exits 3 (fail closed: the trial
ends `defense_failed`). The self-test forks a child that drops to each uid, so the init container
needs CAP_SETUID and CAP_SETGID besides NET_ADMIN and NET_RAW.

Usage: egress-lock --allow-uid=N [--allow-uid=M ...] [--deny-uid=65532] [--probe HOST:PORT ...]
[--self-test | --verify-only | --dry-run] [--backend auto|nft|legacy] [--probe-timeout S]

Standard library only (plus the iptables tools): this runs in the small sandbox-init image.

Where it runs (each of these fails the self-test, closed, rather than leaving a pod open):
- iptables-nft (the default of current distributions) needs nf_tables in the node's kernel;
  `--backend=legacy` uses the x_tables interface instead. Both are enforced by the kernel at once,
  so rules of the other backend cannot weaken the lock; the self-test reads back with the same one.
- iptables-legacy takes /run/xtables.lock: with readOnlyRootFilesystem, set
  XTABLES_LOCKFILE to a writable path (an emptyDir); iptables-nft needs no lock file.
- gVisor implements neither nf_tables nor conntrack; its own iptables (legacy interface, with
  runsc --net-raw) may lack REJECT or the owner match, depending on the release. Kata runs the
  pod's namespace in a guest kernel, which needs the owner match and REJECT built in.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import functools
import ipaddress
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, NamedTuple, NoReturn, get_args

from legorl.sandbox.checks import Check, DefenseFailed, require

CHAIN = "LEGORL-EGRESS"
AGENT_UID = 65532
PROXY_UID = 65533
MAX_UID = 2**32 - 2
"""(uid_t)-1 is "no uid" to the kernel, so the largest usable uid is one less."""

IF_INET6 = Path("/proc/net/if_inet6")
"""Exists exactly when this network namespace has an IPv6 stack (even with no address yet)."""

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_DEFENSE_FAILED = 3

Family = Literal[4, 6]
Backend = Literal["auto", "nft", "legacy"]
Proto = Literal["tcp", "udp"]
PROTOS: tuple[Proto, ...] = ("tcp", "udp")
Runner = Callable[..., "subprocess.CompletedProcess[str]"]
"""`subprocess.run`, or a wrapper with its signature (the tests run tools in a throwaway netns)."""

NEIGHBOUR_DISCOVERY = (133, 135, 136)
"""ICMPv6 router solicitation, neighbour solicitation and advertisement. The kernel sends them itself
(no socket, so no owner), and without them IPv6 stops working for the proxy too. Only the kernel or
CAP_NET_RAW can emit these types (unprivileged ICMP sockets may send echo requests only), so
accepting them opens nothing for the agent."""

TOOL_TIMEOUT_S = 60.0
ALLOWED_TIMEOUT_S = 0.5
PROBE_PAYLOAD = b"legorl egress-lock self-test\n"


# --- rules ------------------------------------------------------------------------------------------


def _validate_uids(uids: Sequence[int]) -> list[int]:
    out: list[int] = []
    for uid in uids:
        if isinstance(uid, bool) or not isinstance(uid, int) or not 0 <= uid <= MAX_UID:
            raise ValueError(f"uid must be an integer in 0..{MAX_UID}, got {uid!r}")
        if uid not in out:
            out.append(uid)
    return out


def render_rules(allow_uids: Sequence[int], *, family: Literal[4, 6]) -> str:
    """iptables-restore input (filter table) that lets only `allow_uids` send non-loopback traffic.

    Pure. The whole filter table is replaced, not appended to, so applying twice (an init container
    retried in the same pod) gives the same table and the self-test can compare it exactly. The pod's
    network namespace is the pod's own; nothing else in it owns filter rules.

    No `-m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT`: nothing in the trial takes inbound
    non-loopback connections that need one, and it would be a hole — replies on any connection a
    remote opened to a port the agent listens on would pass, giving the agent a two-way channel. The
    proxy's own traffic (including SYN-ACKs of its listener) carries its socket, so the owner match
    already accepts it. Even the narrower `--ctstate ESTABLISHED --ctdir ORIGINAL` is not safe: a UDP
    flow the proxy opened (a DNS query) stays ESTABLISHED for seconds to minutes after its socket
    closes, and the agent, which sees the proxy's ports in /proc/net/udp, could bind the same port
    and send through it. Leaving conntrack out also keeps it (absent in gVisor) out of the lock's
    dependencies.

    The price: packets the kernel sends for a socket no process holds carry no owner: a connection to
    the proxy's listener before it is accept()ed (the ACK of the client's request), the final ACK from
    TIME_WAIT after the proxy closes a connection first. They are dropped (a reset would kill the
    connection being accepted); the peer retransmits, by when the proxy holds the socket, or gives up
    on its FIN after a while.
    """
    if family not in (4, 6):
        raise ValueError(f"family must be 4 or 6, got {family!r}")
    uids = _validate_uids(allow_uids)
    icmp_reject = "icmp-port-unreachable" if family == 4 else "icmp6-port-unreachable"
    lines = [
        f"# legorl egress lock (IPv{family}): only uids {', '.join(map(str, uids)) or 'none'} leave the pod",
        "*filter",
        ":INPUT ACCEPT [0:0]",
        ":FORWARD ACCEPT [0:0]",
        # DROP, not ACCEPT: the chain below ends in REJECT for everything, so the policy is never
        # reached while the jump is in place — and if the jump is ever lost, nothing leaks.
        ":OUTPUT DROP [0:0]",
        f":{CHAIN} - [0:0]",
        f"-A OUTPUT -j {CHAIN}",
        # Loopback first: the harness reaches the proxy on 127.0.0.1, and traffic to the pod's own
        # address is routed over lo too. Nothing on lo leaves the pod.
        f"-A {CHAIN} -o lo -j ACCEPT",
    ]
    if family == 6:
        lines += [
            f"-A {CHAIN} -p ipv6-icmp -m icmp6 --icmpv6-type {t} -j ACCEPT" for t in NEIGHBOUR_DISCOVERY
        ]
    lines += [f"-A {CHAIN} -m owner --uid-owner {uid} -j ACCEPT" for uid in uids]
    lines += [
        # A reset, not a drop, for a socket's own packets: a blocked connect() fails in milliseconds with
        # ECONNREFUSED instead of hanging until the harness's timeout, and the self-test's probes finish
        # at once.
        f"-A {CHAIN} -p tcp -m owner --socket-exists -j REJECT --reject-with tcp-reset",
        # TCP the kernel sends with no socket file behind it is dropped, not reset: a connection to the
        # proxy's listener that it has not accept()ed yet (the ACK of the request: a reset killed the
        # connection, and the operator's reads of the proxy failed with ECONNRESET on a real node), or
        # the last ACK from TIME_WAIT. Dropping is stricter than a reset; the peer retransmits.
        f"-A {CHAIN} -p tcp -j DROP",
        f"-A {CHAIN} -j REJECT --reject-with {icmp_reject}",
        "COMMIT",
    ]
    return "\n".join(lines) + "\n"


def expected_listing(rules: str) -> list[str]:
    """What `iptables -S` prints once `rules` (render_rules output) are applied, canonically ordered."""
    listing: list[str] = []
    for line in rules.splitlines():
        if m := re.fullmatch(r":(\S+) (\S+) \[\d+:\d+\]", line):
            chain, policy = m.groups()
            listing.append(f"-N {chain}" if policy == "-" else f"-P {chain} {policy}")
        elif line.startswith("-A "):
            listing.append(line)
    return _canonical(listing)


def _canonical(listing: Sequence[str]) -> list[str]:
    """Policies, then chains, then each chain's rules in order; chains sorted by name.

    `iptables -S` orders chains its own way (built-ins first); rule order within a chain is what
    matters, so that is kept while chains are put in a fixed order for comparison."""
    lines = [" ".join(line.split()) for line in listing if line.strip()]
    policies = sorted(line for line in lines if line.startswith("-P "))
    chains = sorted(line for line in lines if line.startswith("-N "))
    rules = [line for line in lines if line.startswith("-A ")]
    other = sorted(line for line in lines if not line.startswith(("-P ", "-N ", "-A ")))
    by_chain = sorted(rules, key=lambda line: line.split()[1])  # stable: keeps order within a chain
    return [*policies, *chains, *by_chain, *other]


# --- applying ---------------------------------------------------------------------------------------


def ipv6_present(if_inet6: Path = IF_INET6) -> bool:
    """Whether this network namespace has an IPv6 stack (so IPv6 must be locked too)."""
    return if_inet6.exists()


def tool(family: Family, backend: Backend, suffix: str = "") -> str:
    """`iptables`, `ip6tables-nft-restore`, ... for a family and backend (`auto`: the image default)."""
    base = "iptables" if family == 4 else "ip6tables"
    if backend != "auto":
        base = f"{base}-{backend}"
    return base + suffix


def _run_tool(runner: Runner, argv: list[str], stdin: str | None = None) -> tuple[bool, str]:
    """Run an iptables tool; (ok, output or why it failed). Never raises for a missing tool."""
    try:
        proc = runner(argv, input=stdin, capture_output=True, text=True, check=False, timeout=TOOL_TIMEOUT_S)
    except FileNotFoundError:
        return False, f"{argv[0]} is not installed"
    except subprocess.TimeoutExpired:
        return False, f"{argv[0]} did not finish within {TOOL_TIMEOUT_S:.0f}s"
    except OSError as exc:
        return False, f"{argv[0]}: {exc}"
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout or "").strip().replace("\n", " | ")
        return False, f"{' '.join(argv)} exited {proc.returncode}: {detail or 'no output'}"
    return True, proc.stdout


def apply(
    allow_uids: Sequence[int],
    *,
    backend: Backend = "auto",
    runner: Runner = subprocess.run,
    if_inet6: Path = IF_INET6,
) -> list[Check]:
    """Install the lock for IPv4 and IPv6 with `iptables-restore -w` / `ip6tables-restore -w`.

    IPv6 is skipped only when the namespace has no IPv6 stack at all (no /proc/net/if_inet6); with
    a stack present, a missing or failing ip6tables is a failure — an unlocked IPv6 route out is
    still a route out. Raises DefenseFailed (with every check) unless both families are locked.
    """
    uids = _validate_uids(allow_uids)
    checks: list[Check] = []
    for family in (4, 6):
        name = f"egress.apply ipv{family}"
        if family == 6 and not ipv6_present(if_inet6):
            checks.append(Check(name, True, f"skipped: no IPv6 stack in this network namespace ({if_inet6})"))
            continue
        restore = tool(family, backend, "-restore")
        ok, out = _run_tool(runner, [restore, "-w"], render_rules(uids, family=family))
        if ok:
            checks.append(Check(name, True, f"{restore}: only uids {uids} may leave over IPv{family}"))
        else:
            why = (
                f"{out}; IPv6 is enabled here ({if_inet6} exists), so it must be locked"
                if family == 6
                else out
            )
            checks.append(Check(name, False, why))
    return require(checks)


# --- probing ----------------------------------------------------------------------------------------


class Probe(NamedTuple):
    """An address the denied uid must not reach (an IP literal: DNS is itself blocked by the lock)."""

    host: str
    port: int

    @classmethod
    def of(cls, host: str, port: int) -> Probe:
        """A validated probe from a (host, port) pair."""
        return cls.parse(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")

    @property
    def family(self) -> Family:
        return 6 if ipaddress.ip_address(self.host).version == 6 else 4

    def url(self, proto: Proto) -> str:
        host = f"[{self.host}]" if self.family == 6 else self.host
        return f"{proto}://{host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> Probe:
        """`HOST:PORT` or `[V6]:PORT`, HOST an IP address."""
        host, sep, port = text.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"probe {text!r} is not HOST:PORT (IPv6 as [ADDR]:PORT)")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        elif ":" in host:
            raise ValueError(f"probe {text!r}: write an IPv6 address in brackets, [ADDR]:PORT")
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"probe {text!r}: {host!r} is not an IP address (the lock blocks DNS)") from None
        if not 1 <= int(port) <= 65535:
            raise ValueError(f"probe {text!r}: port must be 1..65535")
        return cls(str(address), int(port))


def default_probes(environ: Mapping[str, str] | None = None) -> list[Probe]:
    """What the agent must never reach: the Kubernetes API, cloud metadata, the internet.

    Probes of a family the pod has no route for are harmless: they are refused before any packet
    is sent and reported as such."""
    env = os.environ if environ is None else environ
    probes: list[Probe] = []
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "443")
    if host:
        with contextlib.suppress(ValueError):
            probes.append(Probe.parse(f"[{host}]:{port}" if ":" in host else f"{host}:{port}"))
    probes += [
        Probe("169.254.169.254", 80),  # metadata service (AWS, GCP, Azure, OpenStack)
        Probe("fd00:ec2::254", 80),  # AWS metadata over IPv6
        Probe("1.1.1.1", 443),
        Probe("2606:4700:4700::1111", 443),
    ]
    return probes


Outcome = Literal["connected", "sent", "refused", "denied", "unreachable", "timeout", "error"]
LEFT_THE_POD: frozenset[str] = frozenset({"connected", "sent"})


@dataclass(frozen=True)
class Attempt:
    """One connection attempt made as one uid, as the kernel answered it."""

    outcome: Outcome
    detail: str
    seconds: float

    def describe(self) -> str:
        return f"{self.detail} after {self.seconds * 1000:.0f} ms"


def _classify(exc: OSError) -> Outcome:
    if isinstance(exc, TimeoutError) or exc.errno == errno.ETIMEDOUT:
        return "timeout"
    if exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET):
        return "refused"
    if exc.errno in (errno.EPERM, errno.EACCES):
        return "denied"  # dropped by a local netfilter rule before it left the host
    if exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
        return "unreachable"
    return "error"


def attempt(host: str, port: int, proto: Proto, timeout: float) -> Attempt:
    """A TCP connect, or a UDP datagram send, to host:port from the current process's uid.

    UDP has no handshake, so a send that succeeds means a datagram left (there is no later answer
    to wait for that would make it less of a leak)."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    start = time.monotonic()
    try:
        with socket.socket(family, socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM) as sock:
            sock.settimeout(timeout)
            sock.connect((host, port))
            if proto == "udp":
                sock.send(PROBE_PAYLOAD)
    except OSError as exc:
        name = "timed out" if isinstance(exc, TimeoutError) else errno.errorcode.get(exc.errno or 0, str(exc))
        return Attempt(_classify(exc), name, time.monotonic() - start)
    return Attempt(
        "connected" if proto == "tcp" else "sent",
        "connected" if proto == "tcp" else "datagram sent",
        time.monotonic() - start,
    )


def as_uid(uid: int, action: Callable[[], Attempt], *, deadline_s: float) -> Attempt:
    """Run `action` in a forked child that has dropped to `uid` (gid `uid`, no groups).

    A fork, not a thread or a new interpreter: the owner match sees the socket's uid, so the
    connect must come from a process with that uid, and the child needs nothing from the image
    beyond this module. Dropping privileges needs CAP_SETUID and CAP_SETGID."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's stack
        try:
            os.close(read_fd)
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            except OSError as exc:
                result = Attempt(
                    "error",
                    f"cannot drop to uid {uid}: {exc.strerror} (the egress-lock container needs "
                    "CAP_SETUID and CAP_SETGID to run its self-test)",
                    0.0,
                )
            else:
                result = action()
            os.write(write_fd, json.dumps(asdict(result)).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    chunks: list[bytes] = []
    end = time.monotonic() + deadline_s
    killed = False
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0 or not select.select([read_fd], [], [], left)[0]:
                # The attempt has its own socket timeout; this only guards against a stuck child.
                os.kill(pid, signal.SIGKILL)
                killed = True
                break
            if not (chunk := os.read(read_fd, 65536)):
                break
            chunks.append(chunk)
    finally:
        os.close(read_fd)
        os.waitpid(pid, 0)
    if killed or not chunks:
        how = f"was killed after {deadline_s:.0f}s" if killed else "reported nothing"
        return Attempt("error", f"the probe process for uid {uid} {how}", 0.0)
    data = json.loads(b"".join(chunks))
    return Attempt(data["outcome"], data["detail"], data["seconds"])


def reject_count(family: Family, backend: Backend, runner: Runner) -> int | None:
    """Packets the lock's REJECT rules have hit so far (None when they cannot be read)."""
    ok, out = _run_tool(runner, [tool(family, backend), "-w", "-S", CHAIN, "-v"])
    if not ok:
        return None
    total = 0
    for line in out.splitlines():
        if "-j REJECT" in line and (m := re.search(r" -c (\d+) \d+", line)):
            total += int(m.group(1))
    return total


# --- the self-test ----------------------------------------------------------------------------------


def _rules_check(allow_uids: Sequence[int], family: Family, backend: Backend, runner: Runner) -> Check:
    name = f"egress.rules ipv{family}"
    listing = tool(family, backend)
    ok, out = _run_tool(runner, [listing, "-w", "-S"])
    if not ok:
        return Check(name, False, f"cannot read the rules back: {out}")
    want = expected_listing(render_rules(allow_uids, family=family))
    have = _canonical(out.splitlines())
    if have == want:
        return Check(name, True, f"{listing} -S matches the lock ({len(want)} lines)")
    diff = [
        line
        for line in difflib.unified_diff(want, have, "expected", f"{listing} -S", lineterm="", n=0)
        if not line.startswith("@@")
    ]
    return Check(name, False, "filter table differs from the lock: " + " | ".join(diff[2:]))


def _refused_check(probe: Probe, proto: Proto, result: Attempt, rejected: int | None) -> Check:
    """Blocked unless the connect succeeded or the datagram left. `rejected` (how far the lock's
    REJECT counters moved meanwhile) only explains the outcome: packets the kernel sends on its own
    also count there, so it is a hint, not a verdict."""
    name = f"egress.refused {probe.url(proto)}"
    if result.outcome in LEFT_THE_POD:
        return Check(name, False, f"NOT blocked: {result.describe()}")
    if result.outcome == "error":
        return Check(name, False, f"could not probe: {result.describe()}")
    if result.outcome == "unreachable":
        how = "no route: refused before any rule was consulted"
    elif rejected:
        how = "rejected by the lock (its REJECT counters rose)"
    elif result.outcome == "denied":
        how = "dropped by this host's netfilter before leaving"
    elif result.outcome == "timeout":
        how = "timed out without an answer (the lock answers at once; something further on dropped it)"
    else:
        how = "refused, but the lock's REJECT counters did not move"
    return Check(name, True, f"{how}: {result.describe()}")


def _loopback_check(deny_uid: int, family: Family, timeout: float) -> Check:
    """The harness must still reach the proxy on loopback: connect as the denied uid to a listener
    this process opens (the listener needs no accept(): the kernel completes the handshake)."""
    host = "127.0.0.1" if family == 4 else "::1"
    name = f"egress.loopback ipv{family}"
    try:
        server = socket.create_server((host, 0), family=socket.AF_INET if family == 4 else socket.AF_INET6)
    except OSError as exc:
        if family == 6 and exc.errno == errno.EADDRNOTAVAIL:
            # The pod's IPv6 stack is there but its loopback has no ::1 (a runtime that turns IPv6 off per
            # interface, as Docker's dockershim pods do): nothing can use it, and the harness reaches the
            # proxy at 127.0.0.1. Nothing about the lock depends on it.
            return Check(name, True, f"not exercised: {host} is not configured in this pod ({exc.strerror})")
        return Check(name, False, f"cannot listen on {host}: {exc}")
    with server:
        port = server.getsockname()[1]
        result = as_uid(deny_uid, lambda: attempt(host, port, "tcp", timeout), deadline_s=timeout + 5)
    url = Probe(host, port).url("tcp")
    return Check(name, result.outcome == "connected", f"uid {deny_uid} -> {url}: {result.describe()}")


def self_test(
    allow_uids: Sequence[int],
    *,
    deny_uid: int = AGENT_UID,
    probes: Sequence[tuple[str, int]],
    timeout: float = 2.0,
    backend: Backend = "auto",
    runner: Runner = subprocess.run,
    if_inet6: Path = IF_INET6,
) -> list[Check]:
    """Prove the lock as the kernel enforces it; every check must pass (see `require`).

    - `egress.rules ipvN`: `iptables -S` reads back exactly the rendered table;
    - `egress.refused PROTO://HOST:PORT`: as `deny_uid`, a TCP connect and a UDP send to each probe
      fail (success fails the check; a timeout passes but says so);
    - `egress.enforced ipvN`: the kernel applies the rules — the lock's REJECT counters rose during
      those attempts, or a datagram was dropped locally (EPERM). Refusals alone could come from an
      absent target; this catches a runtime or backend that accepts rules it does not enforce;
    - `egress.loopback ipvN`: `deny_uid` still connects to a listener on loopback;
    - `egress.allowed uid U`: each allowed uid's datagrams to the probes still leave.
    """
    uids = _validate_uids(allow_uids)
    probe_list = [Probe.of(host, port) for host, port in probes]
    families: list[Family] = [4, 6] if ipv6_present(if_inet6) else [4]
    checks: list[Check] = []
    if 6 not in families:
        checks.append(Check("egress.rules ipv6", True, f"skipped: no IPv6 stack ({if_inet6})"))
    checks += [_rules_check(uids, family, backend, runner) for family in families]

    # Per family: evidence that the kernel applies the rules (REJECT counters rose, or a datagram of
    # the denied uid was dropped locally), and whether any probe got past routing at all.
    enforced: dict[Family, list[str]] = {family: [] for family in families}
    probed: dict[Family, bool] = dict.fromkeys(families, False)
    routed: dict[Family, bool] = dict.fromkeys(families, False)
    for probe in probe_list:
        family = probe.family
        for proto in PROTOS:
            before = reject_count(family, backend, runner) if family in families else None
            action = functools.partial(attempt, probe.host, probe.port, proto, timeout)
            result = as_uid(deny_uid, action, deadline_s=timeout + 5)
            after = reject_count(family, backend, runner) if family in families else None
            rejected = None if before is None or after is None else after - before
            checks.append(_refused_check(probe, proto, result, rejected))
            if family not in families:
                continue
            probed[family] = True
            routed[family] |= result.outcome != "unreachable"
            if result.outcome in LEFT_THE_POD:
                continue  # its counters only saw the kernel closing what got through: no evidence
            if rejected:
                enforced[family].append(f"{probe.url(proto)}: REJECT counters +{rejected}")
            elif result.outcome == "denied":
                enforced[family].append(f"{probe.url(proto)}: dropped locally ({result.detail})")

    for family in families:
        name = f"egress.enforced ipv{family}"
        if enforced[family]:
            checks.append(Check(name, True, "the kernel applies the lock: " + "; ".join(enforced[family])))
        elif not probed[family]:
            checks.append(Check(name, True, f"no IPv{family} probe given; the rules check stands alone"))
        elif not routed[family]:
            checks.append(Check(name, True, f"not exercised: no IPv{family} route to any probe"))
        else:
            checks.append(
                Check(
                    name,
                    False,
                    f"IPv{family} probes were routed but nothing shows the lock's rules acting on them "
                    "(REJECT counters still, no local drop): the kernel does not apply them (rules in "
                    "another iptables backend's tables? a runtime without netfilter?)",
                )
            )
    checks += [_loopback_check(deny_uid, family, timeout) for family in families]
    checks += [_allowed_check(uid, probe_list, families) for uid in uids if uid != deny_uid]
    return checks


def _allowed_check(uid: int, probes: Sequence[Probe], families: Sequence[Family]) -> Check:
    """An allowed uid's datagrams must leave. UDP, not TCP: a send either leaves or fails with EPERM
    at once when a local rule drops it, whether or not anything listens at the probe address — so
    the check needs no reachable target and leaves no half-closed connection behind."""
    outcomes: list[str] = []
    blocked: list[str] = []
    for probe in probes:
        if probe.family not in families:
            continue
        action = functools.partial(attempt, probe.host, probe.port, "udp", ALLOWED_TIMEOUT_S)
        result = as_uid(uid, action, deadline_s=ALLOWED_TIMEOUT_S + 5)
        outcomes.append(f"{probe.url('udp')}: {result.detail}")
        if result.outcome in ("denied", "error"):
            blocked.append(f"{probe.url('udp')}: {result.describe()}")
    name = f"egress.allowed uid {uid}"
    if blocked:
        return Check(name, False, f"an allowed uid is blocked: {'; '.join(blocked)}")
    return Check(name, True, "not blocked (" + ("; ".join(outcomes) or "no probe of a present family") + ")")


# --- the command ------------------------------------------------------------------------------------


class UsageError(Exception):
    """A bad command line: exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _uid(text: str) -> int:
    if not text.isdigit() or int(text) > MAX_UID:
        raise argparse.ArgumentTypeError(f"{text!r} is not a uid (an integer 0..{MAX_UID})")
    return int(text)


def _probe(text: str) -> Probe:
    try:
        return Probe.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 60:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds in (0, 60]")
    return value


def _parser() -> _Parser:
    parser = _Parser(
        prog="egress-lock",
        description="Let only the given uids open non-loopback connections from this network namespace.",
    )
    parser.add_argument(
        "--allow-uid",
        type=_uid,
        action="append",
        default=[],
        metavar="UID",
        help="a uid that may leave the pod (the proxy); repeatable, at least one",
    )
    parser.add_argument(
        "--deny-uid",
        type=_uid,
        default=AGENT_UID,
        metavar="UID",
        help=f"the uid the self-test must find locked in (default {AGENT_UID}, the agent)",
    )
    parser.add_argument(
        "--probe",
        type=_probe,
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="an IP address the denied uid must not reach (default: Kubernetes API, "
        "metadata service, public addresses)",
    )
    parser.add_argument("--probe-timeout", type=_positive, default=2.0, metavar="S")
    parser.add_argument(
        "--backend",
        choices=get_args(Backend),
        default="auto",
        help="iptables flavour: auto (the image's iptables), nft or legacy (gVisor)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--self-test", action="store_true", help="after applying, prove the lock")
    mode.add_argument("--verify-only", action="store_true", help="prove the lock already in place")
    mode.add_argument("--dry-run", action="store_true", help="print the rules; change nothing")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """`egress-lock ...`: apply (and self-test) the lock; checks as JSON lines on stdout.

    Exit 0 when locked (and proved), 3 when a defense failed (why on stderr), 2 on a bad command line."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        if not args.allow_uid:
            raise UsageError("--allow-uid is required (the proxy's uid, e.g. --allow-uid=65533)")
    except UsageError as exc:
        sys.stderr.write(f"{parser.format_usage()}egress-lock: error: {exc}\n")
        return EXIT_USAGE
    allow: list[int] = args.allow_uid
    backend: Backend = args.backend

    if args.dry_run:
        for family in (4, 6):
            sys.stdout.write(render_rules(allow, family=family))
        return EXIT_OK

    done: list[Check] = []
    try:
        if not args.verify_only:
            done += apply(allow, backend=backend)
        if args.self_test or args.verify_only:
            done += require(
                self_test(
                    allow,
                    deny_uid=args.deny_uid,
                    probes=args.probe or default_probes(),
                    timeout=args.probe_timeout,
                    backend=backend,
                )
            )
    except DefenseFailed as exc:
        _emit([*done, *exc.checks])
        sys.stderr.write(f"egress-lock: {exc}\n")
        return EXIT_DEFENSE_FAILED
    _emit(done)
    return EXIT_OK


def _emit(checks: Sequence[Check]) -> None:
    sys.stdout.write("".join(json.dumps(check.to_dict()) + "\n" for check in checks))
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
