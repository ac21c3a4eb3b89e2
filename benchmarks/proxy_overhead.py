"""Benchmark: what the proxy adds to a model call, direct to the engine vs through a proxy, in one run.

The same workload runs against the engine directly and through each target (`--targets`: legorl's proxy as
shipped, the same proxy in front of an engine that does not name its weight versions so that it reads
`/weight_info` around every call, with a fixed version, without fsync, and LiteLLM's proxy as a peer), in
interleaved rounds so that machine noise falls on every target alike:

- S concurrent sessions (default 64), each a conversation of K turns (default 8) that sends its whole
  history every turn, behind one shared system prompt, as a coding harness does;
- unstreamed and streamed calls, reported separately; a streamed call's latency runs to its last byte;
- one client process (httpx, keep-alive, one pool per target).

The upstream is the fake engine of `legorl.proxy.testing` (`FakeEngine`), not vLLM: it answers in
well under a millisecond, so the engine's speed does not hide the proxy's cost. Its tokens are UTF-8
bytes, so a prompt of N bytes is N tokens (a real tokenizer would give about N/4): the proxy handles
token lists about four times as long as for the same text on a real model. The targets that expect the
fleet's engine talk to the fake behind legorl's real weight-versions middleware, as vLLM runs it.

Engine, proxies and client each run in a process of their own, so no two share an event loop or an
interpreter lock, but they do share the machine's CPUs: on the 2-CPU machines of this project, the
proxy's CPU time is taken from the engine and the client too, and at 64 sessions every process is
CPU-bound. The latencies are therefore the proxy's cost under saturation, queueing included (run
`--sessions 1` for the cost of one call on an idle path). Each round also reads the CPU time every
process spent (/proc): CPU per call is the figure that other load on a shared machine disturbs least.

Goals (the proxy's cost issue): added p50 at most 1 ms and proxy CPU at most 2 ms per call at one session,
throughput at least 90% of direct at 16 sessions.

Usage: python benchmarks/proxy_overhead.py [--sessions 64] [--turns 8] [--repeats 3] [--chunk-delay 0]
       [--targets legorl legorl-reads legorl-fixed litellm] [--baseline COMMIT] [--json] [--out FILE]
       [--profile DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from provenance import git_commit  # noqa: E402

from tests.support.asgi_server import free_port  # noqa: E402

PATH = "/v1/chat/completions"
MODES = ("unary", "stream")
GOAL_ADDED_P50_MS = 1.0
GOAL_PROXY_CPU_MS = 2.0
GOAL_THROUGHPUT_RATIO = 0.90
UPSTREAM_NOTE = (
    "upstream: legorl.proxy.testing.FakeEngine, a fast local fake (sub-millisecond answers), so the "
    "engine's speed does not hide the proxy's cost"
)

# The fake engine under uvicorn, in a process of its own (argv: port, tokens per chunk, chunk delay, and
# "versions" to put legorl's weight-versions middleware in front of it, as the fleet's vLLM runs it).
ENGINE_CODE = """
import sys
import uvicorn
from legorl.proxy.testing import FakeEngine
from legorl.trainer.engine.versions import WeightVersions
engine = FakeEngine(chunk_tokens=int(sys.argv[2]), delay_per_chunk=float(sys.argv[3]))
engine.record_requests = False
async def version(scope):
    return engine.version
app = WeightVersions(engine, read_version=version) if sys.argv[4] == "versions" else engine
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False,
            timeout_keep_alive=600)
"""

LITELLM_VERSION = "1.108.0"
LITELLM_HOME = Path.home() / ".cache" / "legorl" / "litellm"
LITELLM_KEY = "sk-legorl-benchmark-loopback-only"
"""LiteLLM refuses to start without a master key; one key, no database, loopback only."""


@dataclass(frozen=True)
class Target:
    """One way to reach the engine."""

    name: str
    engine: str
    """Which engine it talks to: `plain` (the fake alone) or `versions` (behind the middleware)."""
    proxy_args: tuple[str, ...] | None = None
    """`legorl proxy` arguments beyond upstream, journal and port; None: no legorl proxy."""
    litellm: bool = False
    tree: Path | None = None
    """Run the proxy of this checkout (a git worktree of `--baseline`) instead of this tree's."""


PARTS = ("", "proxy", "operator", "trainer", "sandbox-images")
"""The folders whose `legorl` trees make up the namespace (pyproject's dev-mode dirs)."""


TARGETS = {
    "legorl": Target("legorl", "versions", ()),
    "legorl-reads": Target("legorl, /weight_info reads", "plain", ()),
    "legorl-fixed": Target("legorl, fixed version", "plain", ("--policy-version-source", "fixed")),
    "legorl-no-fsync": Target("legorl, no fsync", "versions", ("--no-fsync",)),
    "litellm": Target(f"LiteLLM {LITELLM_VERSION}", "plain", litellm=True),
}
"""`legorl`: as shipped (journal fsync'd, versions named by the engine's middleware); `legorl-reads`: an
engine without the middleware, so the proxy reads /weight_info before and after every call (what every
call cost before the middleware); `legorl-fixed`: no version at all (the floor of version tracking);
`legorl-no-fsync`: the journal unsynced; `litellm`: LiteLLM's proxy, one worker, no database, in its own
virtualenv (made under ~/.cache/legorl/litellm on first use, from PyPI)."""
DEFAULT_TARGETS = ["legorl", "legorl-reads", "legorl-fixed", "litellm"]


def litellm_executable() -> Path:
    """LiteLLM's CLI in a virtualenv of its own (its pins would fight legorl's), installed if missing."""
    venv = LITELLM_HOME / f"venv-{LITELLM_VERSION}"
    executable = venv / "bin" / "litellm"
    if not executable.exists():
        print(f"installing litellm[proxy]=={LITELLM_VERSION} into {venv} ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)  # noqa: S603
        subprocess.run(  # noqa: S603 - the venv's pip, a pinned requirement
            [str(venv / "bin" / "pip"), "install", "--quiet", f"litellm[proxy]=={LITELLM_VERSION}"],
            check=True,
        )
    return executable


def litellm_config(upstream: str, path: Path) -> Path:
    # JSON is YAML: one model, the fake engine as an OpenAI-compatible server.
    config = {
        "model_list": [
            {
                "model_name": "policy",
                "litellm_params": {"model": "openai/policy", "api_base": f"{upstream}/v1", "api_key": "none"},
            }
        ],
        "litellm_settings": {"drop_params": True, "telemetry": False},
        "general_settings": {"master_key": LITELLM_KEY},
    }
    path.write_text(json.dumps(config))
    return path


FILLER = "the quick brown fox reads the repository, runs the tests, edits a file and reads the diff again; "


# --- the servers -----------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    profile: Path | None = None
    headers: dict[str, str] = field(default_factory=dict)
    """What the client sends it on every call (LiteLLM's master key)."""


def _wait_ready(server: Server, path: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=server.url, timeout=2) as client:
        while True:
            if server.process.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {server.process.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if client.get(path).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.name} not ready after {timeout:.0f}s")
            time.sleep(0.05)


def _start_engine(args: argparse.Namespace, kind: str) -> Server:
    port = free_port()
    command = [
        sys.executable,
        "-c",
        ENGINE_CODE,
        str(port),
        str(args.chunk_tokens),
        str(args.chunk_delay),
        kind,
    ]
    engine = Server(f"engine ({kind})", f"http://127.0.0.1:{port}", subprocess.Popen(command))  # noqa: S603
    _wait_ready(engine, "/weight_info")
    return engine


@contextlib.contextmanager
def servers(args: argparse.Namespace, workdir: Path) -> Iterator[tuple[dict[str, Server], dict[str, Server]]]:
    """(target name → server, target name → the engine behind it); "direct" is the plain engine."""
    started: list[Server] = []
    try:
        engines = {"plain": _start_engine(args, "plain")}
        started.append(engines["plain"])
        up, behind = {"direct": engines["plain"]}, {"direct": engines["plain"]}
        for key in args.targets:
            target = TARGETS[key]
            if target.engine not in engines:
                engines[target.engine] = _start_engine(args, target.engine)
                started.append(engines[target.engine])
            upstream = engines[target.engine]
            port = free_port()
            profile = None
            if target.litellm:
                config = litellm_config(upstream.url, workdir / "litellm.yaml")
                command = [
                    str(litellm_executable()), "--config", str(config),
                    "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1",
                ]  # fmt: skip
                env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
                process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)  # noqa: S603
                ready = "/health/liveliness"
            else:
                assert target.proxy_args is not None
                prefix = [sys.executable]
                if args.profile:
                    profile = Path(args.profile) / f"proxy-{key}.prof"
                    prefix += ["-m", "cProfile", "-o", str(profile)]
                command = [
                    *prefix, "-m", "legorl.cli", "proxy",
                    "--upstream", upstream.url,
                    "--journal", str(workdir / f"journal-{key}"),
                    "--port", str(port),
                    "--log-level", "WARNING",
                    *target.proxy_args,
                ]  # fmt: skip
                env = dict(os.environ)
                if target.tree is not None:
                    env["PYTHONPATH"] = os.pathsep.join(str(target.tree / part) for part in PARTS)
                process = subprocess.Popen(command, env=env)  # noqa: S603 - this interpreter, our arguments
                ready = "/ready"
            headers = {"authorization": f"Bearer {LITELLM_KEY}"} if target.litellm else {}
            started.append(Server(target.name, f"http://127.0.0.1:{port}", process, profile, headers))
            _wait_ready(started[-1], ready, timeout=180)
            up[target.name], behind[target.name] = started[-1], upstream
        yield up, behind
    finally:
        for server in reversed(started):
            # SIGINT for a profiled proxy: uvicorn re-raises the signal once it has shut down, and
            # only SIGINT's KeyboardInterrupt lets cProfile write its file before the process ends.
            server.process.send_signal(signal.SIGINT if server.profile else signal.SIGTERM)
            try:
                server.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait()


@contextlib.contextmanager
def _worktree(commit: str) -> Iterator[Path]:
    """A detached git worktree of `commit`, removed afterwards."""
    tree = Path(tempfile.mkdtemp(prefix="proxy-overhead-baseline-")) / "tree"
    git = ["git", "-C", str(REPO), "worktree"]
    subprocess.run([*git, "add", "--detach", str(tree), commit], check=True, capture_output=True)  # noqa: S603
    try:
        yield tree
    finally:
        subprocess.run([*git, "remove", "--force", str(tree)], check=False)  # noqa: S603


# --- the workload ----------------------------------------------------------------------------------


@dataclass
class Round:
    """One target, one mode, every session once."""

    latencies: list[float]
    seconds: float
    cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds each process spent in the round: client, engine, proxy (when one was in the path)."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds spent since it was made: by this (client) process and by the named servers."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.start = self._now()

    def _now(self) -> dict[str, float]:
        return {"client": time.process_time()} | {k: cpu_seconds(p) for k, p in self.pids.items()}

    def spent(self) -> dict[str, float]:
        now = self._now()
        return {k: now[k] - self.start[k] for k in now}


def _reply(tag: str, session: int, turn: int, size: int) -> str:
    head = f"{tag}-s{session}-t{turn}: "
    return (head + FILLER * (size // len(FILLER) + 1))[:size].strip()


async def _session(
    client: httpx.AsyncClient,
    *,
    system: str,
    tag: str,
    session: int,
    reply_bytes: int,
    stream: bool,
    turns: int,
    latencies: list[float],
) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for turn in range(turns):
        reply = _reply(tag, session, turn, reply_bytes)
        messages.append({"role": "user", "content": f"SAY:{reply}"})
        body = {"model": "policy", "messages": messages, "stream": stream}
        started = time.perf_counter()
        if stream:
            async with client.stream("POST", PATH, json=body) as response:
                head = tail = b""
                async for chunk in response.aiter_raw():
                    head = head or chunk
                    tail = (tail + chunk)[-64:]
            ok = response.status_code == 200 and tail.rstrip().endswith(b"[DONE]")
        else:
            response = await client.post(PATH, json=body)
            ok = response.status_code == 200
            head = tail = response.content
        latencies.append(time.perf_counter() - started)
        if not ok:
            raise RuntimeError(
                f"{client.base_url}: HTTP {response.status_code}: {head[:500]!r} ... {tail[-100:]!r}"
            )
        messages.append({"role": "assistant", "content": reply})


async def run_round(
    client: httpx.AsyncClient, *, system: str, tag: str, args: argparse.Namespace, stream: bool, turns: int
) -> Round:
    """Every session through `turns` turns at once; each turn waits for the previous answer."""
    latencies: list[float] = []
    started = time.perf_counter()
    await asyncio.gather(
        *(
            _session(
                client,
                system=system,
                tag=tag,
                session=s,
                reply_bytes=args.reply_bytes,
                stream=stream,
                turns=turns,
                latencies=latencies,
            )
            for s in range(args.sessions)
        )
    )
    return Round(latencies, time.perf_counter() - started)


# --- the figures -----------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


@dataclass
class Figures:
    mode: str
    target: str
    requests: int
    seconds: float
    throughput_rps: float
    p50_ms: float
    p99_ms: float
    cpu_ms_per_call: dict[str, float]
    """CPU time per call of each process (client, engine, proxy): contention inflates it far less
    than it inflates latency, so it is the steadiest measure of what the proxy costs."""
    added_p50_ms: float | None = None
    added_p99_ms: float | None = None
    throughput_ratio: float | None = None
    goals_missed: list[str] | None = None
    """Which goals this cell misses: `+p50`, `cpu`, `throughput` (empty: all met; None: direct)."""


def figures(rounds: dict[tuple[str, str], list[Round]], targets: list[str]) -> list[Figures]:
    out = []
    for mode in MODES:
        direct: Figures | None = None
        for target in targets:
            done = rounds[(mode, target)]
            latencies = [x for r in done for x in r.latencies]
            seconds = sum(r.seconds for r in done)
            cpu = {k: sum(r.cpu[k] for r in done) / len(latencies) * 1e3 for k in done[0].cpu}
            fig = Figures(
                mode=mode,
                target=target,
                requests=len(latencies),
                seconds=seconds,
                throughput_rps=len(latencies) / seconds,
                p50_ms=percentile(latencies, 50) * 1e3,
                p99_ms=percentile(latencies, 99) * 1e3,
                cpu_ms_per_call=cpu,
            )
            if direct is None:
                direct = fig
            else:
                fig.added_p50_ms = fig.p50_ms - direct.p50_ms
                fig.added_p99_ms = fig.p99_ms - direct.p99_ms
                fig.throughput_ratio = fig.throughput_rps / direct.throughput_rps
                missed = {
                    "+p50": fig.added_p50_ms > GOAL_ADDED_P50_MS,
                    "cpu": cpu.get("proxy", 0.0) > GOAL_PROXY_CPU_MS,
                    "throughput": fig.throughput_ratio < GOAL_THROUGHPUT_RATIO,
                }
                fig.goals_missed = [name for name, miss in missed.items() if miss]
            out.append(fig)
    return out


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def machine_note() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"machine: {_cpus()} CPU(s) shared by the client, the proxy and the engine (one process each); "
        f"python {platform.python_version()}; load average now {load}"
    )


def workload_note(args: argparse.Namespace) -> str:
    last_prompt = args.system_bytes + args.turns * (args.reply_bytes + 4) * 2
    return (
        f"workload: {args.sessions} sessions x {args.turns} turns, {args.repeats} interleaved repeat(s); "
        f"system prompt {args.system_bytes} B, replies {args.reply_bytes} B (last prompt ~{last_prompt} "
        f"fake tokens), {args.chunk_tokens} tokens per streamed chunk, chunk delay "
        f"{args.chunk_delay * 1e3:g} ms"
    )


def report(figs: list[Figures], args: argparse.Namespace, out: TextIO) -> None:
    def cell(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    print(file=out)
    print(UPSTREAM_NOTE, file=out)
    print(machine_note(), file=out)
    print(workload_note(args), file=out)
    print(file=out)
    print(
        f"{'':35} {'':>8} {'latency, ms':^35} {'':>8} {'':>20} {'CPU ms per call':^23}",
        file=out,
    )
    print(
        f"{'mode':6} {'target':28} {'req/s':>8} {'p50':>8} {'p99':>8} {'+p50':>8} {'+p99':>8} "
        f"{'vs direct':>9} {'missed':>20} {'client':>7} {'engine':>7} {'proxy':>7}",
        file=out,
    )
    for f in figs:
        goal = "-" if f.goals_missed is None else (",".join(f.goals_missed) or "none")
        ratio = "-" if f.throughput_ratio is None else f"{f.throughput_ratio:.1%}"
        cpu = f.cpu_ms_per_call
        print(
            f"{f.mode:6} {f.target:28} {f.throughput_rps:8.1f} {f.p50_ms:8.2f} {f.p99_ms:8.2f} "
            f"{cell(f.added_p50_ms, '8.2f'):>8} {cell(f.added_p99_ms, '8.2f'):>8} {ratio:>9} {goal:>20} "
            f"{cpu['client']:7.2f} {cpu['engine']:7.2f} {cell(cpu.get('proxy'), '7.2f'):>7}",
            file=out,
        )
    print(file=out)
    print(
        f"goals: added p50 <= {GOAL_ADDED_P50_MS:g} ms (+p50), proxy CPU <= {GOAL_PROXY_CPU_MS:g} ms per "
        f"call (cpu), throughput >= {GOAL_THROUGHPUT_RATIO:.0%} of direct (throughput); 'missed' lists the "
        "goals a row misses. +p50/+p99: the proxy's percentile minus "
        "direct's; 'vs direct': req/s through the proxy over req/s direct. Compare within one run, not "
        "across runs.",
        file=out,
    )


def print_profiles(servers_: dict[str, Server], out: TextIO, top: int) -> None:
    for server in servers_.values():
        if server.profile is None or not server.profile.exists():
            continue
        print(f"\n{server.name}: cProfile of the proxy's main thread, top {top} by own time", file=out)
        stats = pstats.Stats(str(server.profile), stream=out)
        stats.sort_stats("tottime").print_stats(top)


# --- the run ---------------------------------------------------------------------------------------


async def amain(args: argparse.Namespace, out: TextIO) -> list[Figures]:
    system = (FILLER * (args.system_bytes // len(FILLER) + 1))[: args.system_bytes]
    with (
        tempfile.TemporaryDirectory(prefix="proxy-overhead-") as workdir,
        servers(args, Path(workdir)) as (
            up,
            behind,
        ),
    ):
        targets = list(up)
        limits = httpx.Limits(max_connections=args.sessions, max_keepalive_connections=args.sessions)
        clients = {
            name: httpx.AsyncClient(base_url=s.url, limits=limits, timeout=120, headers=s.headers)
            for name, s in up.items()
        }
        try:
            # Warm-up, not counted: open every connection, fill every cache.
            for name in targets:
                for mode in MODES:
                    await run_round(
                        clients[name],
                        system=system,
                        tag=f"w{mode}",
                        args=args,
                        stream=mode == "stream",
                        turns=2,
                    )
            rounds: dict[tuple[str, str], list[Round]] = {(m, t): [] for m in MODES for t in targets}
            for repeat in range(args.repeats):
                # Rotate the order every repeat, so no target always runs first or last.
                order = targets[repeat % len(targets) :] + targets[: repeat % len(targets)]
                for mode in MODES:
                    for name in order:
                        pids = {"engine": behind[name].process.pid}
                        if name != "direct":
                            pids["proxy"] = up[name].process.pid
                        cpu = CpuMeter(pids)
                        r = await run_round(
                            clients[name],
                            system=system,
                            tag=f"r{repeat}{mode[0]}",
                            args=args,
                            stream=mode == "stream",
                            turns=args.turns,
                        )
                        r.cpu = cpu.spent()
                        rounds[(mode, name)].append(r)
                        per_call = ", ".join(
                            f"{k} {v / len(r.latencies) * 1e3:.2f}" for k, v in r.cpu.items()
                        )
                        print(
                            f"[repeat {repeat + 1}/{args.repeats}] {mode:6} {name:28} "
                            f"{len(r.latencies) / r.seconds:7.1f} req/s, "
                            f"p50 {percentile(r.latencies, 50) * 1e3:.2f} ms, CPU ms/call {per_call}",
                            file=out,
                            flush=True,
                        )
        finally:
            for client in clients.values():
                await client.aclose()
    figs = figures(rounds, targets)
    report(figs, args, out)
    if args.profile:
        print_profiles(up, out, args.top)
    return figs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sessions", type=int, default=64, help="concurrent sessions")
    parser.add_argument("--turns", type=int, default=8, help="turns per session and round")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds per target and mode")
    parser.add_argument("--system-bytes", type=int, default=2048, help="shared system prompt size")
    parser.add_argument("--reply-bytes", type=int, default=256, help="size of each answer")
    parser.add_argument("--chunk-tokens", type=int, default=4, help="tokens per streamed engine chunk")
    parser.add_argument(
        "--chunk-delay", type=float, default=0.0, help="engine's delay before each streamed chunk, seconds"
    )
    parser.add_argument(
        "--targets",
        nargs="+",
        choices=list(TARGETS),
        default=DEFAULT_TARGETS,
        help="what to measure besides direct: " + "; ".join(f"{k}: {t.name}" for k, t in TARGETS.items()),
    )
    parser.add_argument("--json", action="store_true", help="figures as JSON on stdout (the table to stderr)")
    parser.add_argument(
        "--out",
        type=Path,
        help="also write the figures as JSON to this file (under benchmarks/results/)",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="run the proxies under cProfile, write DIR/proxy-*.prof and print their hotspots "
        "(profiling slows the proxy: its figures are then not the proxy's)",
    )
    parser.add_argument(
        "--baseline",
        metavar="COMMIT",
        help="also measure the legorl proxy of COMMIT (a git worktree of it, in front of the plain engine, "
        "with its defaults) in the same interleaved rounds: a before/after in one run",
    )
    parser.add_argument("--top", type=int, default=25, help="functions shown per profile")
    args = parser.parse_args(argv)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    out = sys.stderr if args.json else sys.stdout
    with contextlib.ExitStack() as stack:
        if args.baseline:
            commit = subprocess.run(  # noqa: S603
                ["git", "-C", str(REPO), "rev-parse", "--verify", f"{args.baseline}^{{commit}}"],  # noqa: S607
                capture_output=True, text=True, check=True,
            ).stdout.strip()  # fmt: skip
            args.baseline = commit
            tree = stack.enter_context(_worktree(commit))
            TARGETS["baseline"] = Target(f"legorl @ {commit[:7]}", "plain", (), tree=tree)
            args.targets = ["baseline", *args.targets]
        figs = asyncio.run(amain(args, out))
    if args.json or args.out:
        document = {
            "git_commit": git_commit(),
            "upstream": UPSTREAM_NOTE,
            "machine": {"cpus": _cpus(), "python": platform.python_version(), "note": machine_note()},
            "workload": {
                "sessions": args.sessions,
                "turns": args.turns,
                "repeats": args.repeats,
                "system_bytes": args.system_bytes,
                "reply_bytes": args.reply_bytes,
                "chunk_tokens": args.chunk_tokens,
                "chunk_delay_seconds": args.chunk_delay,
            },
            "targets": {TARGETS[k].name: k for k in args.targets},
            "baseline_commit": args.baseline,
            "goal": {
                "added_p50_ms_at_most": GOAL_ADDED_P50_MS,
                "proxy_cpu_ms_per_call_at_most": GOAL_PROXY_CPU_MS,
                "throughput_ratio_at_least": GOAL_THROUGHPUT_RATIO,
            },
            "results": [asdict(f) for f in figs],
        }
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(document, indent=2) + "\n")
        if args.json:
            json.dump(document, sys.stdout, indent=2)
            print()


if __name__ == "__main__":
    main()
