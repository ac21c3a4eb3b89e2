"""Benchmark: the operator reconciling N RLRuns, each with its fleet and pool, against a naive baseline.

Three variants, measured one after the other in the same run under the same conditions, each against a
fresh API mock (`tests/support/kubeapi.py`, served from a process of its own, as a real API server would be):

- optimized: `Reconciler` as shipped: apply only children whose desired-state hash changed, patch the
  status only when it changed, read observed state from the watch-fed `Store`;
- simple: the strongest simple baseline: server-side apply of every child on every pass and a status
  patch every time, with no reads (server-side apply needs none) and no change detection;
- naive: the same class with three methods overridden: every reconcile GETs the object and every
  desired child from the API, re-applies every child, and always patches the status (the GETs are what
  a read-modify-write controller does; server-side apply does not need them).

Two drivers run the variant's reconciler with the real `KubeClient` over HTTP:

- direct (default): the operator minus kopf: watch streams feed the `Store` exactly as the kopf event
  handlers in handlers.py do, and the production resync loop (`handlers._resync_loop`) reconciles what
  is dirty, `settings.concurrency` at a time;
- kopf: the real operator: kopf with our registry (`build_registry`) and the reconciler in its memo,
  so kopf's own requests (finalizers, bookkeeping annotations) and its create handlers count too.

Phases, per variant:
1. initial convergence: create 3N custom resources; wait until every one has a status for its current
   generation, every owner has exactly the children the renderers produce, and no request has come
   for a while (the quiet window);
2. no-op passes: mark every object dirty, as a burst of unrelated watch events would, and reconcile;
   nothing changed, so ideally no request;
3. resync passes: the same after the resync period has run out (`full_apply` forgotten): every child
   is re-applied on purpose, to repair drift that the hash annotation cannot see.

Usage: python benchmarks/bench_operator.py [--runs 500] [--passes 1] [--resync-passes 1] [--driver direct]
Results: `benchmarks/results/bench_operator.json` (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import multiprocessing
import os
import platform
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, ClassVar

import httpx
import kopf
import yaml

REPO = Path(__file__).resolve().parents[1]
# The API mock is the test harness's (tests/support/kubeapi.py): a plain `python benchmarks/bench_operator.py`
# needs the repository root on sys.path to import it.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from legorl.api.kinds import RLRun, RolloutFleet, SandboxPool  # noqa: E402
from legorl.api.labels import OWNER_LABEL  # noqa: E402
from legorl.operator.handlers import CHILD_KINDS, MANAGED, _resync_loop, build_registry  # noqa: E402
from legorl.operator.kube import RESOURCES, Credentials, KubeClient  # noqa: E402
from legorl.operator.main import kopf_settings, make_reconciler  # noqa: E402
from legorl.operator.observe import Observed  # noqa: E402
from legorl.operator.reconcile import Reconciler  # noqa: E402
from legorl.operator.render.common import RenderContext, owner_key  # noqa: E402
from legorl.operator.render.fleet import render_fleet  # noqa: E402
from legorl.operator.render.pool import render_pool  # noqa: E402
from legorl.operator.render.run import render_run  # noqa: E402
from legorl.operator.settings import OperatorSettings  # noqa: E402
from legorl.operator.store import CUSTOM_KINDS, ObjectKey, Store  # noqa: E402
from tests.support.kubeapi import MockApi, mock_timeouts  # noqa: E402

NS = "default"
GV = "legorl.dev/v1alpha1"
EXAMPLE = REPO / "examples" / "shared-fleet-and-pool.yaml"
POLL_SECONDS = 0.1
"""How often the request counter is read."""
CHECK_SECONDS = 0.5
"""How often the stored objects are checked for convergence (a walk over all of them)."""
Expected = dict[str, set[tuple[str, str]]]
"""Owner label value → the (kind, name) of every child the renderers produce for it."""


# --- the baselines -------------------------------------------------------------------------------------


@dataclass
class SimpleReconciler(Reconciler):
    """The strongest simple baseline: apply every desired child and patch the status on every reconcile,
    reading nothing from the API (server-side apply needs no prior GET) and comparing nothing.

    It still reads children's *state* from the watch-fed store for the status computation, so every
    variant computes the same statuses and creates the same children.
    """

    read_back: ClassVar[bool] = False
    """GET each child before applying it (the naive baseline)."""

    async def _sync_children(
        self, key: ObjectKey, desired: list[dict[str, Any]], observed: Observed
    ) -> list[str]:
        namespace = key[1]
        wanted = set()
        for obj in desired:
            kind, name = obj["kind"], obj["metadata"]["name"]
            wanted.add((kind, name))
            if self.read_back:
                await self.client.get(kind, namespace, name)  # read it back, whatever the watch says
            await self.client.apply(obj)
        for kind, name in list(observed.children):
            if (kind, name) not in wanted:
                await self.client.delete(kind, namespace, name)
        return []

    async def _write_status(self, body: dict[str, Any], status: dict[str, Any]) -> None:
        old = body.get("status") or {}
        meta = body["metadata"]
        await self.client.patch_status(body["kind"], meta.get("namespace", NS), meta["name"], status)
        body["status"] = status
        await self._post_transitions(body, old.get("conditions") or [], status.get("conditions") or [])


@dataclass
class NaiveReconciler(SimpleReconciler):
    """A controller with no trust in its watch cache and no change detection: the simple baseline that
    also GETs the object and every desired child before each reconcile and apply."""

    read_back: ClassVar[bool] = True

    async def reconcile(self, key: ObjectKey) -> None:
        kind, namespace, name = key
        if self.store.objects.get(key) is not None:
            fresh = await self.client.get(kind, namespace, name)
            if fresh is None:
                return
            self.store.objects[key] = fresh
        await super().reconcile(key)


VARIANTS: dict[str, type[Reconciler]] = {
    "optimized": Reconciler,
    "simple": SimpleReconciler,
    "naive": NaiveReconciler,
}
BASELINES = ("simple", "naive")
RESULTS = REPO / "benchmarks" / "results" / "bench_operator.json"


# --- the workload --------------------------------------------------------------------------------------


def workload(runs: int) -> list[dict[str, Any]]:
    """3 × runs manifests: per index a RolloutFleet, a SandboxPool and a Train RLRun that uses them."""
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    fleet = next(d for d in docs if d["kind"] == "RolloutFleet")
    pool = next(d for d in docs if d["kind"] == "SandboxPool")
    train = next(d for d in docs if d["kind"] == "RLRun" and d["spec"].get("mode") == "Train")
    out = []
    for i in range(runs):
        ids = {"fleet": f"fleet-{i:04d}", "pool": f"pool-{i:04d}", "run": f"run-{i:04d}"}
        for template, name in ((fleet, ids["fleet"]), (pool, ids["pool"]), (train, ids["run"])):
            doc = copy.deepcopy(template)
            doc["metadata"] = {"name": name, "namespace": NS}
            out.append(doc)
        run = out[-1]["spec"]
        run["fleetRef"], run["poolRef"] = {"name": ids["fleet"]}, {"name": ids["pool"]}
        run["store"] = {"uri": f"pvc://rl-store/{ids['run']}"}
    return out


def expected_children(docs: list[dict[str, Any]], ctx: RenderContext) -> Expected:
    """Owner label value → the (kind, name) of every child the renderers produce for it."""
    fleets = {
        d["metadata"]["name"]: RolloutFleet.model_validate(d) for d in docs if d["kind"] == "RolloutFleet"
    }
    out: Expected = {}
    for original in docs:
        # Renderers want a stored object (owner references need its uid); names do not depend on it.
        doc = copy.deepcopy(original)
        doc["metadata"]["uid"] = "00000000-0000-0000-0000-000000000000"
        if doc["kind"] == "RolloutFleet":
            rendered = render_fleet(RolloutFleet.model_validate(doc), ctx)
        elif doc["kind"] == "SandboxPool":
            rendered = render_pool(SandboxPool.model_validate(doc), ctx, [])
        else:
            run = RLRun.model_validate(doc)
            assert run.spec.fleet_ref is not None
            fleet = fleets[run.spec.fleet_ref.name].spec
            rendered = render_run(run, ctx, fleet.port, fleet_sync=fleet.weight_sync.method)
        owner = owner_key(doc["kind"], doc["metadata"]["name"])
        out[owner] = {(o["kind"], o["metadata"]["name"]) for o in rendered}
    return out


# --- the API mock, in a process of its own -------------------------------------------------------------


def _progress(mock: MockApi, expected: Expected) -> tuple[int, int]:
    """(custom resources whose status is for their generation, owners with exactly their children).

    One walk over the mock's objects on its thread under its lock; only the two numbers come back.
    """
    custom = {mock.kind(GV, RESOURCES[kind].plural).resource for kind in CUSTOM_KINDS}
    children = {
        mock.kind(RESOURCES[kind].group_version, RESOURCES[kind].plural).resource
        for kind in CHILD_KINDS
        if kind != "LeaderWorkerSet"
    }

    def count(em: Any) -> tuple[int, int]:
        current = 0
        found: dict[str, set[tuple[str, str]]] = defaultdict(set)
        for (res, namespace, name), stored in em._objects.items():
            if stored.deleted or namespace != NS or (res not in custom and res not in children):
                continue
            body = stored.last.raw
            if res in custom:
                status = body.get("status") or {}
                current += status.get("observedGeneration") == body["metadata"].get("generation")
            else:
                owner = (body["metadata"].get("labels") or {}).get(OWNER_LABEL, "")
                found[owner].add((body["kind"], name))
        return current, sum(1 for owner, want in expected.items() if found.get(owner) == want)

    result: tuple[int, int] = mock._call(count)
    return result


def _serve_api(conn: Connection) -> None:
    """The child process: a mock, driven by (command, argument) messages; replies are sent back."""
    with MockApi(record_requests=False) as mock:  # counters only: no per-request records
        conn.send(mock.url)
        expected: Expected = {}
        while True:
            command, arg = conn.recv()
            reply: Any = None
            try:
                if command == "stop":
                    conn.send(None)
                    return
                if command == "create":
                    for doc in arg:
                        mock.create(doc)
                elif command == "expect":
                    expected = arg
                elif command == "progress":
                    reply = _progress(mock, expected)
                elif command == "request_count":
                    reply = mock.request_count
                elif command == "counts":
                    reply = (mock.request_counts(), mock.request_counts(by_resource=True))
                elif command == "reset":
                    mock.reset_requests()
                elif command == "watch_count":
                    reply = mock.watch_count()
                else:
                    reply = ValueError(f"unknown command {command!r}")
            except Exception as exc:  # noqa: BLE001 -- raised again in the parent by RemoteApi._call
                reply = exc
            conn.send(reply)


class RemoteApi:
    """The API mock served from a child process, so it competes with the operator for CPUs, not for
    one interpreter lock; its helpers are reached over a pipe (and, like its helpers in-process, are
    not counted as API requests)."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that runs threads
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve_api, args=(child,), name="kubeapi-mock", daemon=True)
        self._lock = threading.Lock()
        self.url = ""

    def __enter__(self) -> RemoteApi:
        self._process.start()
        if not self._conn.poll(60):
            raise TimeoutError("the API mock process did not start in 60s")
        self.url = self._conn.recv()
        return self

    def __exit__(self, *exc: object) -> None:
        self._call("stop")
        self._process.join(30)

    def _call(self, command: str, arg: Any = None) -> Any:
        with self._lock:
            self._conn.send((command, arg))
            reply = self._conn.recv()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def call(self, command: str, arg: Any = None) -> Any:
        """`command` without blocking the event loop the operator shares with the benchmark."""
        return await asyncio.to_thread(self._call, command, arg)


# --- the operator, two ways ----------------------------------------------------------------------------


async def _watch(
    http: httpx.AsyncClient,
    kind: str,
    labels: str,
    feed: Callable[[dict[str, Any], bool], None],
    listed: asyncio.Event,
) -> None:
    """List then watch one resource cluster-wide, feeding every object to `feed(body, deleted)`."""
    path = RESOURCES[kind].path(None)
    params = {"labelSelector": labels} if labels else {}
    response = await http.get(path, params=params)
    if response.status_code == 404:  # not served (LeaderWorkerSet): nothing to watch
        listed.set()
        return
    response.raise_for_status()
    listing = response.json()
    for item in listing.get("items") or []:
        feed({"kind": kind, **item}, False)
    version = listing["metadata"]["resourceVersion"]
    listed.set()
    while True:
        watch = {**params, "watch": "true", "resourceVersion": version, "timeoutSeconds": "300"}
        async with http.stream("GET", path, params=watch) as stream:
            async for line in stream.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                body = event["object"]
                version = body.get("metadata", {}).get("resourceVersion", version)
                if event["type"] in {"ADDED", "MODIFIED", "DELETED"}:
                    feed(body, event["type"] == "DELETED")
                elif event["type"] == "ERROR":
                    raise RuntimeError(f"watch of {kind} failed: {body}")


def _feed(store: Store, kind: str) -> Callable[[dict[str, Any], bool], None]:
    """What handlers.py's kopf event handler for `kind` does with an event."""

    def feed(body: dict[str, Any], deleted: bool) -> None:
        namespace = body.get("metadata", {}).get("namespace") or ""
        if kind in CUSTOM_KINDS:
            store.object_event(kind, namespace, body, deleted)
        elif kind == "Pod":
            store.pod_event(namespace, body, deleted)
        else:
            store.child_event(namespace, body, deleted)

    return feed


@asynccontextmanager
async def direct_operator(reconciler: Reconciler, api: RemoteApi) -> AsyncIterator[None]:
    """The operator minus kopf: watches feed the store; the production resync loop reconciles."""
    reconciler.client_ = KubeClient(Credentials(server=api.url))
    http = httpx.AsyncClient(base_url=api.url, timeout=httpx.Timeout(30.0, read=None))
    managed = ",".join(f"{k}={v}" for k, v in MANAGED.items())
    tasks: list[asyncio.Task[None]] = []
    listed: list[asyncio.Event] = []
    for kind in (*CHILD_KINDS, "Pod", *CUSTOM_KINDS):
        listed.append(asyncio.Event())
        labels = "" if kind in CUSTOM_KINDS else managed
        feed = _feed(reconciler.store, kind)
        tasks.append(asyncio.create_task(_watch(http, kind, labels, feed, listed[-1])))
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in listed)), timeout=30)
        tasks.append(asyncio.create_task(_resync_loop(reconciler)))
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await http.aclose()
        await reconciler.client.close()


def kopf_bench_settings(settings: OperatorSettings) -> kopf.OperatorSettings:
    """The production kopf settings with the short network timeouts the integration tests use."""
    return mock_timeouts(kopf_settings(settings), request_timeout=60)


@asynccontextmanager
async def kopf_operator(
    reconciler: Reconciler, api: RemoteApi, settings: OperatorSettings
) -> AsyncIterator[None]:
    """The real operator: kopf with our registry, the reconciler in its memo, on this event loop."""
    url = api.url
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            registry=build_registry(login=lambda **_: kopf.ConnectionInfo(server=url)),
            settings=kopf_bench_settings(settings),
            memo=kopf.Memo(reconciler=reconciler),
            standalone=True,
            clusterwide=True,
            stop_flag=stop,
            ready_flag=ready,
        )
    )
    try:
        await asyncio.wait_for(ready.wait(), timeout=30)
        # Count from when every stream is open: kopf's initial lists are not the workload's requests.
        # (The mock serves no LeaderWorkerSet: kopf watches the other child kinds, pods and ours.)
        streams = len(CHILD_KINDS) - 1 + 1 + len(CUSTOM_KINDS)  # no LeaderWorkerSet; pods
        await until(lambda: api.call("watch_count"), lambda n: n >= streams, timeout=30)
        await asyncio.sleep(0.5)
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=60)


async def until(probe: Callable[[], Awaitable[Any]], ok: Callable[[Any], bool], *, timeout: float) -> Any:
    """Await `probe()` until `ok` of its value; return that value."""
    deadline = time.monotonic() + timeout
    while not ok(value := await probe()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"still {value!r} after {timeout:.0f}s")
        await asyncio.sleep(POLL_SECONDS)
    return value


# --- measuring -----------------------------------------------------------------------------------------


@dataclass
class Phase:
    """One measured phase: wall time, when its requests stopped, and what they were."""

    seconds: float
    """Until convergence first held; for a pass, until its reconcile returned."""
    busy_seconds: float
    """Until the last request of the phase (the quiet window after it is not counted)."""
    verbs: Counter[str]
    resources: Counter[str] = field(default_factory=Counter)

    @property
    def requests(self) -> int:
        return sum(n for verb, n in self.verbs.items() if verb != "WATCH")


@dataclass
class Result:
    """Every phase of one variant."""

    name: str
    objects: int
    converge: Phase
    noop_passes: list[Phase]
    resync_passes: list[Phase]
    errors: list[str]


async def settle(
    api: RemoteApi,
    *,
    start: float,
    quiet: float,
    timeout: float,
    done: Callable[[], Awaitable[bool]] | None = None,
) -> tuple[float, float]:
    """Wait until `done()` holds and no request has come for `quiet` seconds.

    Returns (seconds until done() first held, seconds until the last request), both from `start`.
    """
    done_at: float | None = None if done is not None else start
    last_count, last_change = await api.call("request_count"), start
    next_check = 0.0
    while True:
        now = time.monotonic()
        count = await api.call("request_count")
        if count != last_count:
            last_count, last_change = count, now
        if done is not None and done_at is None and now >= next_check:
            next_check = now + CHECK_SECONDS
            if await done():
                done_at = now
        if done_at is not None and now - last_change >= quiet:
            return done_at - start, last_change - start
        if now - start > timeout:
            raise TimeoutError(f"not settled in {timeout:.0f}s (requests so far: {count})")
        await asyncio.sleep(POLL_SECONDS)


async def counted(api: RemoteApi) -> tuple[Counter[str], Counter[str]]:
    by_verb, by_resource = await api.call("counts")
    return Counter(by_verb), Counter(by_resource)


class _ErrorLog(logging.Handler):
    """Keeps the operator's and kopf's ERROR records, reported with the figures (they would void them)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")


async def measure(
    name: str,
    docs: list[dict[str, Any]],
    expected: Expected,
    settings: OperatorSettings,
    args: argparse.Namespace,
) -> Result:
    total = len(docs)
    base = make_reconciler(settings)
    reconciler = VARIANTS[name](settings=settings, ctx=base.ctx)
    errors = _ErrorLog()
    loggers = [logging.getLogger("legorl"), logging.getLogger("kopf")]
    for logger in loggers:
        logger.addHandler(errors)
    try:
        with RemoteApi() as api:
            await api.call("expect", expected)
            running = (
                direct_operator(reconciler, api)
                if args.driver == "direct"
                else kopf_operator(reconciler, api, settings)
            )
            async with running:
                result = await _phases(name, total, reconciler, api, args)
    finally:
        for logger in loggers:
            logger.removeHandler(errors)
    result.errors = errors.messages
    return result


async def _phases(
    name: str, total: int, reconciler: Reconciler, api: RemoteApi, args: argparse.Namespace
) -> Result:
    async def converged() -> bool:
        current, complete = await api.call("progress")
        return bool(current == total and complete == total)

    await api.call("reset")
    start = time.monotonic()
    await api.call("create", [])  # warm the pipe
    await api.call("create", args.docs)
    seconds, busy = await settle(api, start=start, quiet=args.quiet, timeout=args.timeout, done=converged)
    converge = Phase(seconds, busy, *await counted(api))
    print(f"[{name}] converged in {seconds:.1f}s with {converge.requests} requests", flush=True)

    async def one_pass(full: bool) -> Phase:
        await api.call("reset")
        start = time.monotonic()
        if full:  # as when the resync period has run out since the last full apply
            reconciler.full_apply.clear()
        reconciler.store.mark_all()  # the resync loop wakes too, and finds the dirty set taken
        await reconciler.reconcile_dirty()
        seconds = time.monotonic() - start
        _, busy = await settle(api, start=start, quiet=args.quiet, timeout=args.timeout)
        phase = Phase(seconds, busy, *await counted(api))
        kind = "resync" if full else "no-op"
        print(f"[{name}] {kind} pass: {seconds:.1f}s, {phase.requests} requests", flush=True)
        return phase

    noop = [await one_pass(full=False) for _ in range(args.passes)]
    # The naive reconciler ignores the resync period (it re-applies everything every time): its resync
    # pass is its no-op pass again, and at N=500 it would add a minute and a half for no new figure.
    resync = [await one_pass(full=True) for _ in range(args.resync_passes if name not in BASELINES else 0)]
    if not await converged():
        raise RuntimeError(f"[{name}] the steady-state passes undid convergence")
    return Result(name, total, converge, noop, resync, [])


# --- reporting -----------------------------------------------------------------------------------------


def _mean_requests(phases: list[Phase], objects: int) -> float:
    return statistics.mean(p.requests for p in phases) / objects if phases else float("nan")


def _mean_seconds(phases: list[Phase]) -> float:
    return statistics.mean(p.seconds for p in phases) if phases else float("nan")


def _ratio(naive: float, optimized: float) -> str:
    if optimized == 0:
        return "inf" if naive else "-"
    return f"{naive / optimized:.1f}x"


def _figures(result: Result) -> dict[str, float]:
    n = result.objects
    out = {
        "converge_seconds": result.converge.seconds,
        "converge_busy_seconds": result.converge.busy_seconds,
        "converge_requests": float(result.converge.requests),
        "converge_requests_per_object": result.converge.requests / n,
    }
    # A baseline that ignores the resync period re-applies every time: its resync pass is its no-op pass.
    for label, phases in (
        ("noop", result.noop_passes),
        ("resync", result.resync_passes or result.noop_passes),
    ):
        if phases:
            out[f"{label}_requests_per_object"] = _mean_requests(phases, n)
            out[f"{label}_seconds"] = _mean_seconds(phases)
    return out


ROWS = (
    ("converge: seconds", "converge_seconds", "{:.1f}"),
    ("converge: to the last request", "converge_busy_seconds", "{:.1f}"),
    ("converge: requests", "converge_requests", "{:.0f}"),
    ("converge: requests / object", "converge_requests_per_object", "{:.2f}"),
    ("no-op pass: requests / object", "noop_requests_per_object", "{:.2f}"),
    ("no-op pass: seconds", "noop_seconds", "{:.2f}"),
    ("resync pass: requests / object", "resync_requests_per_object", "{:.2f}"),
    ("resync pass: seconds", "resync_seconds", "{:.2f}"),
)


def report(results: list[Result], args: argparse.Namespace, per_kind: dict[str, int]) -> dict[str, Any]:
    """Print the table and return what goes into the results file."""
    by_name = {r.name: r for r in results}
    figures = {r.name: _figures(r) for r in results}
    n = results[0].objects
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print()
    print(
        f"driver={args.driver}: {args.runs} RLRuns + {args.runs} RolloutFleets + {args.runs} SandboxPools "
        f"= {n} objects; children each: " + ", ".join(f"{k} {v}" for k, v in per_kind.items())
    )
    print(f"python {platform.python_version()}, {cpus} CPU(s); mock in its own process")
    print()
    names = list(figures)
    header = "".join(f"{name:>11}" for name in names) + "".join(f"{b + '/opt':>12}" for b in BASELINES)
    print(f"{'':32}{header}")
    for label, key, fmt in ROWS:
        if key not in figures["optimized"]:
            continue
        cells = "".join(f"{fmt.format(figures[name].get(key, float('nan'))):>11}" for name in names)
        ratios = "".join(
            f"{_ratio(figures[b].get(key, 0.0), figures['optimized'][key]):>12}" for b in BASELINES
        )
        print(f"{label:32}{cells}{ratios}")
    for result in results:
        print()
        verbs = sorted((v, c) for v, c in result.converge.verbs.items() if v != "WATCH")
        shown = ", ".join(f"{v} {c / n:.2f}" for v, c in verbs)
        print(f"{result.name}, converge, requests / object: {shown}")
        top = [(k, c) for k, c in result.converge.resources.most_common() if not k.startswith("WATCH")]
        for key, count in top[: args.top]:
            print(f"  {count:>7}  {count / n:5.2f}/object  {key}")
        if result.errors:
            print(f"{result.name}: {len(result.errors)} error(s) logged, the first: {result.errors[0]}")
    print()
    print("Compare the ratios, all measured in this run, not absolute seconds across runs.")
    return {
        "benchmark": "bench_operator",
        "command": "python benchmarks/bench_operator.py " + " ".join(args.argv),
        "driver": args.driver,
        "runs": args.runs,
        "objects": n,
        "cpus": cpus,
        "python": platform.python_version(),
        "variants": figures,
        "converge_verbs_per_object": {
            name: {v: c / n for v, c in sorted(r.converge.verbs.items()) if v != "WATCH"}
            for name, r in by_name.items()
        },
        "errors": {name: len(r.errors) for name, r in by_name.items()},
    }


async def amain(args: argparse.Namespace) -> None:
    # Production settings, except that no periodic resync fires during the run (passes are triggered
    # explicitly) and watches are short enough for a stopped operator to close them promptly.
    settings = replace(
        OperatorSettings(), resync_seconds=3600.0, watch_timeout_seconds=60, settle_seconds=0.5
    )
    args.docs = workload(args.runs)
    expected = expected_children(args.docs, make_reconciler(settings).ctx)
    per_kind = {d["kind"]: len(expected[owner_key(d["kind"], d["metadata"]["name"])]) for d in args.docs[:3]}
    results = [await measure(name, args.docs, expected, settings, args) for name in VARIANTS]
    out = report(results, args, per_kind)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=500, help="RLRuns, each with its own fleet and pool")
    parser.add_argument("--passes", type=int, default=1, help="no-op passes (nothing changed)")
    parser.add_argument("--resync-passes", type=int, default=1, help="passes after the resync period")
    parser.add_argument(
        "--driver", choices=("direct", "kopf"), default="direct", help="without kopf, or the real operator"
    )
    parser.add_argument("--quiet", type=float, default=1.5, help="seconds without a request ending a phase")
    parser.add_argument("--timeout", type=float, default=900.0, help="give up on a phase after this long")
    parser.add_argument("--top", type=int, default=6, help="resources shown per variant")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results file (JSON)")
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
