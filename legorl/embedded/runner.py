"""`legorl run FILE`: one RLRun manifest, the whole loop, on this machine (no cluster, no GPU needed).

What runs, all from the same manifest a cluster would get:

- **Engine**: vLLM (the CPU build here) serving the policy with the flags the operator gives a fleet's
  pods (`vllm_args`), plus the filesystem weight-transfer extension the trainer syncs through.
- **Trials**: `RunController` over `LocalTrialBackend`: per-trial proxies and bubblewrap sandboxes running
  the real harness (mini-swe-agent), verified in fresh sandboxes.
- **Trainer**: `TrainingService` (megatron-core) in a thread of this process, training each committed
  batch, publishing `weights/vN` and syncing it into vLLM.

Everything is recorded in the run store (default `.legorl/runs/<name>/store`); running the same command
again resumes: the trainer from its checkpoints and published weights (the fresh engine is caught up),
the controller from the saved trials. Ctrl-C stops cleanly (a second one exits at once).
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from legorl.api.figures import BatchSummary
from legorl.api.fleet import RolloutFleetSpec
from legorl.api.kinds import RLRun, RolloutFleet
from legorl.api.labels import owned_fleet_name
from legorl.api.progress import Progress
from legorl.api.store import RunStore, policy_version
from legorl.api.trajectory import TrialRecord
from legorl.controller.backend import BackendError
from legorl.controller.loop import RunController, RunOutcome, StoreTrainer
from legorl.controller.plan import PlanError
from legorl.embedded.engine import VllmServer
from legorl.embedded.local import LocalTrialBackend
from legorl.operator.render.fleet import vllm_args
from legorl.sandbox import reading
from legorl.sandbox.bundled import BUILTIN_URI, builtin_task_set, default_cache_dir
from legorl.sandbox.local import LocalBackend, SandboxError
from legorl.sandbox.task import TaskSet, load_task_set
from legorl.telemetry.traces import emit_trial_spans

log = logging.getLogger(__name__)

DEFAULT_UI_PORT = 8090
"""Where `legorl run` serves the live UI (the chart's UI port too)."""

_SERVER_FLAGS = {"--served-model-name", "--host", "--port"}


class RunError(RuntimeError):
    """The run cannot start as asked (a message a person can act on)."""


def engine_args(run: RLRun) -> list[str]:
    """vLLM flags for the run's fleet, as the operator renders them (model, name, host and port are the
    local server's own); on a machine without GPUs, eager mode (CPU graph capture only costs start time)."""
    if run.spec.fleet is None:
        raise RunError("spec.fleet is needed locally (fleetRef names a RolloutFleet on a cluster)")
    spec = RolloutFleetSpec.model_validate(
        {**run.spec.fleet.to_wire(), "model": run.spec.policy.checkpoint.to_wire()}
    )
    fleet = RolloutFleet.model_validate(
        {
            "apiVersion": "legorl.dev/v1alpha1",
            "kind": "RolloutFleet",
            "metadata": {"name": owned_fleet_name(run.metadata.name)},
            "spec": spec.to_wire(),
        }
    )
    args = vllm_args(fleet, "MODEL", [])[1:]
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in _SERVER_FLAGS:
            skip = True
            continue
        out.append(arg)
    return out


def resolve_task_set(uri: str) -> TaskSet:
    if uri == BUILTIN_URI:
        return load_task_set(builtin_task_set())
    if uri == reading.BUILTIN_URI:
        return load_task_set(reading.builtin_task_set())
    if uri.startswith("file://"):
        return load_task_set(Path(uri.removeprefix("file://")))
    raise RunError(
        f"tasks.source.uri {uri!r}: locally, use {BUILTIN_URI}, {reading.BUILTIN_URI} or file:///path/to/tasks.jsonl"
    )


@dataclass
class RunPaths:
    root: Path

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def work(self) -> Path:
        return self.root / "work"


@dataclass
class TrainerThread:
    """The trainer in a thread of this process; its failure is reported to the controller."""

    service: Any
    max_steps: int
    thread: threading.Thread | None = None
    failure: str | None = None
    steps_done: list[int] = field(default_factory=list)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._main, name="trainer", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            self.steps_done = self.service.run(max_steps=self.max_steps, wait=True, poll_seconds=0.5)
        except Exception as exc:  # noqa: BLE001 - reported to the controller, which stops the run
            log.error("the trainer failed:\n%s", traceback.format_exc())
            self.failure = f"{type(exc).__name__}: {exc}"

    def error(self) -> str | None:
        return self.failure

    def stop(self) -> None:
        self.service.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=120)


class ProgressPrinter:
    """One line per change (or every `every` seconds): step, trials, reward, held-out, fidelity, ETA."""

    def __init__(self, out: TextIO, every: float = 15.0) -> None:
        self.out = out
        self.every = every
        self.last_key: tuple[Any, ...] | None = None
        self.last_time = 0.0

    def __call__(self, p: Progress) -> None:
        key = (
            p.step,
            p.policy_version,
            p.trials_total,
            p.eval_trials,
            p.trials_running,
            p.held_out_solve_rate,
            p.message,
        )
        now = time.monotonic()
        if key == self.last_key and now - self.last_time < self.every:
            return
        self.last_key, self.last_time = key, now
        self.out.write(format_progress(p) + "\n")
        self.out.flush()


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(seconds)
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _rate(value: float | None, interval: tuple[float, float] | None = None) -> str:
    if value is None:
        return "-"
    text = f"{value:.2f}"
    return f"{text} [{interval[0]:.2f}-{interval[1]:.2f}]" if interval else text


def format_progress(p: Progress) -> str:
    reasons = " ".join(f"{k}={v}" for k, v in sorted(p.by_reason.items())) or "-"
    parts = [
        f"[{_clock(p.elapsed_seconds)}] step {p.step}/{p.max_steps} serving {p.policy_version}",
        f"trials {p.trials_total} done (+{p.eval_trials} held-out), {p.trials_running} running ({reasons})",
        f"reward {_rate(p.reward_mean)}",
        f"held-out {_rate(p.held_out_solve_rate, p.held_out_interval)}"
        f" (start {_rate(p.baseline_solve_rate)})",
        f"fidelity {p.fidelity_correlation:.4f}" if p.fidelity_correlation is not None else "fidelity -",
        f"{p.trials_per_minute:.1f} trials/min" if p.trials_per_minute else "- trials/min",
        f"ETA {_clock(p.eta_seconds)}",
    ]
    if p.degraded_reason:
        parts.append(f"DEGRADED: {p.degraded_reason} ({p.fidelity_below_steps} step(s))")
    text = " | ".join(parts)
    return f"{text} | {p.message}" if p.message else text


def summary(store: RunStore, outcome: RunOutcome, wall_seconds: float) -> str:
    """What happened, readably: per-step reward, held-out evaluations, fidelity, where to look."""
    p = outcome.progress
    lines = [
        f"run {p.run}: {outcome.state} ({outcome.reason}) — {outcome.message}",
        f"wall time {_clock(wall_seconds)}; {p.step} step(s) committed; policy {p.policy_version}",
        "trials by termination reason: "
        + (", ".join(f"{k} {v}" for k, v in sorted(p.by_reason.items())) or "none"),
    ]
    fidelity = {m.step: m.fidelity_pearson for m in store.step_figures()}
    rows = []
    for step in store.committed_steps():
        batch = BatchSummary.from_json(store.batch_ref(step).meta)
        reward = batch.reward_mean
        fid = fidelity.get(step)
        rows.append(
            f"  step {step:>3}: reward {reward if reward is None else f'{reward:.3f}'}, "
            f"{_known(batch.kept)}/{_known(batch.trials)} trials kept, "
            f"{_known(batch.zero_variance_groups)} zero-variance groups, "
            f"fidelity {fid if fid is None else f'{fid:.5f}'}"
        )
    if rows:
        lines += ["training steps:", *rows]
    evals = store.eval_summaries()
    if evals:
        lines.append("held-out evaluations (solve rate, 95% Wilson interval):")
        for e in evals:
            rate = e.solve_rate
            low, high = e.interval95 or (0.0, 1.0)
            lines.append(
                f"  {policy_version(e.step):>4}: "
                f"{'-' if rate is None else f'{rate:.3f}'} [{low:.3f}, {high:.3f}] "
                f"({e.solved}/{e.scored} scored trials)"
            )
    lines.append(f"run store: {store.uri}  (batches/, trials/, evals/, metrics/trainer/, weights/)")
    return "\n".join(lines)


class EmbeddedRun:
    """Starts the engine, the trainer and the controller for one RLRun; `run()` returns an exit code."""

    def __init__(
        self,
        run: RLRun,
        *,
        root: Path,
        out: TextIO = sys.stdout,
        steps: int | None = None,
        eval_trials: int | None = None,
        ui_port: int | None = DEFAULT_UI_PORT,
        metrics_port: int | None = None,
        engine_startup_seconds: float = 600.0,
    ) -> None:
        self.ui_port = ui_port
        self.metrics_port = metrics_port
        self._metrics: Any = None
        self._tracer: Any = None
        self.run_obj = run
        if steps is not None or eval_trials is not None:
            body = run.to_wire()
            if steps is not None:
                body["spec"].setdefault("stop", {})["maxSteps"] = steps
            if eval_trials is not None:
                body["spec"].setdefault("evaluation", {})["trialsPerTask"] = eval_trials
            try:
                self.run_obj = RLRun.model_validate(body)
            except ValueError as exc:
                raise RunError(f"the overrides make the manifest invalid: {exc}") from None
        self.paths = RunPaths(root)
        self.out = out
        self.engine_startup_seconds = engine_startup_seconds
        self.controller: RunController | None = None
        self.trainer: TrainerThread | None = None
        self._interrupts = 0

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def _check_store(self, store: RunStore) -> None:
        recorded = store.read_run_spec()
        if recorded is None:
            store.write_run_spec(self.run_obj.to_wire())
            return

        def core(spec: dict[str, Any]) -> dict[str, Any]:
            # Stop conditions may change between runs of the same store (extend a run with --steps).
            return {k: v for k, v in spec.items() if k != "stop"}

        if core(recorded.get("spec") or {}) != core(self.run_obj.to_wire()["spec"]):
            raise RunError(
                f"{store.uri} holds run {recorded.get('metadata', {}).get('name')!r} with another spec; "
                "resume it with the same manifest (only stop conditions may change), or start a new run "
                "with --dir pointing elsewhere"
            )
        store.write_run_spec(self.run_obj.to_wire())

    def _lock(self) -> None:
        """One `legorl run` per run folder: a second one would run the same trials twice."""
        self.paths.root.mkdir(parents=True, exist_ok=True)
        self._lock_file = (self.paths.root / ".lock").open("w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunError(f"another `legorl run` is using {self.paths.root}") from None

    def prepare(self) -> tuple[RunStore, TaskSet, Path, LocalBackend]:
        """Lock the run folder, open (or check) the store, resolve the task set and the policy, sandboxes."""
        run = self.run_obj
        spec = run.spec
        self._lock()
        self.paths.store.mkdir(parents=True, exist_ok=True)
        store = RunStore(str(self.paths.store))
        self._check_store(store)
        task_set = resolve_task_set(spec.tasks.source.uri)
        self.say(
            f"run {run.metadata.name}: {len(task_set)} tasks from {spec.tasks.source.uri}; store {store.uri}"
        )
        from legorl.trainer.main import resolve_checkpoint  # noqa: PLC0415 - torch only when running

        t0 = time.monotonic()
        model = resolve_checkpoint(spec.policy.checkpoint.uri, default_cache_dir() / "models")
        self.say(f"policy {spec.policy.checkpoint.uri}: {model} ({time.monotonic() - t0:.0f} s)")
        try:
            sandbox = LocalBackend(self.paths.work / "sandbox")
        except SandboxError as exc:
            raise RunError(f"local sandboxes: {exc}") from exc
        return store, task_set, model, sandbox

    def start_engine(self, model: Path) -> VllmServer:
        """vLLM serving `model` with the flags the operator's fleet gets for this manifest, version v0."""
        spec = self.run_obj.spec
        engine = VllmServer(
            model,
            engine_args=engine_args(self.run_obj),
            startup_timeout=self.engine_startup_seconds,
            log_path=self.paths.work / "logs" / "engine.log",
            max_model_len=spec.fleet.settings.max_model_len or 4096 if spec.fleet else 4096,
        )
        self.say(f"starting vLLM: {' '.join(engine.command()[2:])}")
        t0 = time.monotonic()
        engine.start()
        engine.set_weight_version("v0")  # the trainer's catch-up renames it when it loads newer weights
        self.say(f"vLLM ready at {engine.url} in {time.monotonic() - t0:.0f} s (log {engine.log_path})")
        return engine

    def run(self) -> int:
        started = time.monotonic()
        run = self.run_obj
        spec = run.spec
        store, task_set, model, sandbox = self.prepare()
        from legorl.trainer.service import TrainingService  # noqa: PLC0415 - torch only when running
        from legorl.trainer.settings import TrainerSettings  # noqa: PLC0415

        engine = self.start_engine(model)
        backend: LocalTrialBackend | None = None
        previous = signal.getsignal(signal.SIGINT)
        stop_ui: Callable[[], None] | None = None
        stop_telemetry: Callable[[], None] | None = None
        try:
            stop_ui = self._start_ui(engine.url)
            stop_telemetry = self._start_telemetry()
            settings = TrainerSettings.from_run(
                run,
                store_uri=str(self.paths.store),
                checkpoint_dir=model,
                fleet_urls=(engine.url,),
                device="cpu",
            )
            service = TrainingService(settings, store=store)
            if service.resumed_from is not None or service.trainer.step:
                self.say(f"trainer resumed at step {service.trainer.step}")
            limit = spec.stop.max_steps
            self.trainer = TrainerThread(service, max_steps=limit if limit is not None else 10**9)
            self.trainer.start()
            workers = spec.schedule.max_concurrent_trials
            backend = LocalTrialBackend(
                run,
                sandbox=sandbox,
                task_set=task_set,
                engine_url=engine.url,
                workers=workers,
                folder=self.paths.work,
            )
            self.controller = RunController(
                run,
                store=store,
                backend=backend,
                task_set=task_set,
                trainer=StoreTrainer(store, error=self.trainer.error),
                on_progress=self._progress_sinks(ProgressPrinter(self.out)),
                on_trial=self._trial_spans,
            )
            signal.signal(signal.SIGINT, self._interrupt)
            outcome = self.controller.run()
        except (PlanError, BackendError) as exc:
            raise RunError(str(exc)) from exc
        finally:
            signal.signal(signal.SIGINT, previous)
            if backend is not None:
                backend.close()
            if self.trainer is not None:
                self.trainer.stop()
            engine.close()
            for stop in (stop_ui, stop_telemetry):
                if stop is not None:
                    stop()
        self.say(summary(store, outcome, time.monotonic() - started))
        if outcome.state == "Stopped":
            self.say(f"stopped: run the same command again to resume ({self.paths.store})")
        return 0 if outcome.state != "Failed" else 1

    def _progress_sinks(self, printer: ProgressPrinter) -> Callable[[Progress], None]:
        """The display, and the run's Prometheus gauges when `--metrics-port` asked for them."""
        metrics = self._metrics

        def sink(progress: Progress) -> None:
            printer(progress)
            if metrics is not None:
                metrics.update(progress)

        return sink

    def _trial_spans(self, record: TrialRecord) -> None:
        if self._tracer is not None:
            emit_trial_spans(self._tracer, record)

    def _start_telemetry(self) -> Callable[[], None]:
        """OTLP trial spans when the OTEL_* variables say where (no cost otherwise), and `/metrics` on
        `metrics_port` when given; returns what stops both."""
        from legorl.telemetry.metrics import ProgressMetrics, new_registry, serve_metrics  # noqa: PLC0415
        from legorl.telemetry.traces import tracer_provider_from_env  # noqa: PLC0415

        self._tracer = tracer_provider_from_env("legorl-run")
        server = None
        if self.metrics_port is not None:
            registry = new_registry()
            self._metrics = ProgressMetrics(registry)
            try:
                server = serve_metrics(registry, self.metrics_port)
            except OSError as exc:
                raise RunError(f"--metrics-port {self.metrics_port}: {exc}") from exc
            self.say(f"metrics: http://127.0.0.1:{server.port}/metrics")

        def stop() -> None:
            if server is not None:
                server.close()
            if self._tracer is not None:
                self._tracer.shutdown()

        return stop

    def _start_ui(self, engine_url: str) -> Callable[[], None] | None:
        """The live UI on this run's store (and engine), on `ui_port` or, when that is taken, a free one.
        A run without the UI is still a run: a UI that cannot start is reported, not fatal."""
        if self.ui_port is None:
            return None
        try:
            from legorl.ui.server import start_in_thread  # noqa: PLC0415 - the `ui` extra
        except ImportError as exc:
            self.say(f"UI: not started ({exc}; install legorl[ui])")
            return None
        engines = {self.run_obj.metadata.name: engine_url}
        problem: Exception | None = None
        for port in dict.fromkeys((self.ui_port, 0)):
            try:
                url, stop = start_in_thread([str(self.paths.store)], port=port, engines=engines)
            except (OSError, RuntimeError) as exc:
                problem = exc
                continue
            self.say(
                f"UI: {url} (live while this run runs; afterwards: legorl ui --store {self.paths.store})"
            )
            return stop
        self.say(f"UI: not started ({problem})")
        return None

    def _interrupt(self, signum: int, frame: FrameType | None) -> None:
        self._interrupts += 1
        if self._interrupts > 1:
            self.say("second interrupt: exiting now")
            os._exit(130)
        self.say("interrupt: stopping (cancelling running trials; Ctrl-C again to exit at once)")
        if self.controller is not None:
            self.controller.stop()


def load_run(path: str) -> RLRun:
    """The one RLRun in a manifest file, validated as `legorl validate` does."""
    from legorl.manifests.validate import validate_paths  # noqa: PLC0415

    reports, errors = validate_paths([path])
    if errors:
        raise RunError("; ".join(errors))
    runs = [r for r in reports if r.resource is not None and r.resource.kind == "RLRun"]
    problems = [
        f"{p.path or '(document)'}: {p.message}" for r in reports for p in r.problems if p.severity == "error"
    ]
    if problems:
        raise RunError("the manifest is invalid (see `legorl validate`):\n  " + "\n  ".join(problems))
    if len(runs) != 1:
        raise RunError(f"{path}: expected exactly one RLRun, found {len(runs)}")
    resource = runs[0].resource
    assert isinstance(resource, RLRun)
    return resource


def main(argv: list[str], out: TextIO = sys.stdout, configure: Callable[[], None] | None = None) -> int:
    import argparse  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="legorl run", description=__doc__.split("\n\n")[0])
    parser.add_argument("manifest", help="an RLRun manifest (e.g. examples/tiny-local.yaml)")
    parser.add_argument("--dir", help="folder for the run store and work files (default .legorl/runs/NAME)")
    parser.add_argument("--steps", type=int, help="override stop.maxSteps")
    parser.add_argument(
        "--eval-trials", type=int, help="override evaluation.trialsPerTask (trials per held-out task)"
    )
    parser.add_argument(
        "--ui-port",
        type=int,
        default=DEFAULT_UI_PORT,
        help=f"port of the live UI on 127.0.0.1 (default {DEFAULT_UI_PORT}; a free one when taken)",
    )
    parser.add_argument("--no-ui", action="store_true", help="do not serve the live UI")
    parser.add_argument(
        "--metrics-port", type=int, help="serve the run's Prometheus metrics on 127.0.0.1:PORT/metrics"
    )
    parser.add_argument(
        "--canary",
        action="store_true",
        help="check before a long run: preflight, one trial end to end, token and routing parity "
        "(exit 1 when a check fails; the result goes to the run store's validation/latest.json)",
    )
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run = load_run(args.manifest)
        root = Path(args.dir) if args.dir else Path(".legorl") / "runs" / run.metadata.name
        embedded = EmbeddedRun(
            run,
            root=root.resolve(),
            out=out,
            steps=args.steps,
            eval_trials=args.eval_trials,
            ui_port=None if args.no_ui or args.canary else args.ui_port,
            metrics_port=args.metrics_port,
        )
        if args.canary:
            from legorl.embedded.canary import run_canary  # noqa: PLC0415

            report = run_canary(embedded)
            embedded.say(report.text())
            return 1 if report.result == "Failed" else 0
        return embedded.run()
    except RunError as exc:
        sys.stderr.write(f"legorl run: {exc}\n")
        return 2


def _known(count: int | None) -> str:
    return "?" if count is None else str(count)
