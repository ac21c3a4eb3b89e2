"""The trainer process: wait for a committed batch, update, publish weights, sync the fleet, repeat.

Every rank of the trainer runs this loop in lock step. The writer (global rank 0) alone reads the store's
listings and decides what comes next — a step, scoring requests, waiting, stopping — and tells the others
(`parallel.broadcast`); every rank trains, exports (a collective) and writes its part of each checkpoint; the
writer alone publishes weights, writes metrics and state, and syncs the fleet.

State that a restart needs lives in the run store: the committed batches, the published weights, the
per-step metrics, `trainer/state.json` (last completed step and policy version) and the checkpoints. On
start the service loads the newest checkpoint and re-trains any later steps whose batches are committed
and whose weights were already published (deterministic on CPU, so the policy it ends with is the one it
had published); it never publishes a version twice.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.api.figures import ScoringAnswer, StepFigures, TrainerState
from legorl.api.store import RunStore, StoreError, parse_policy_version, policy_version
from legorl.api.weights import PublishedWeights
from legorl.trainer import parallel
from legorl.trainer.checkpoint import CheckpointStore, load_checkpoint, save_checkpoint
from legorl.trainer.models.convert import HfExport
from legorl.trainer.settings import SettingsError, TrainerSettings
from legorl.trainer.sync.fleet_sync import FleetWeightSync
from legorl.trainer.sync.nccl_sync import NcclWeightSync
from legorl.trainer.sync.publish import WeightSyncError, publish_weights, read_published
from legorl.trainer.telemetry import TrainerTelemetry
from legorl.trainer.train import PolicyTrainer

log = logging.getLogger(__name__)


@dataclass
class StepOutcome:
    """What one step produced."""

    step: int
    version: str
    figures: StepFigures
    published: PublishedWeights | None = None
    sync_seconds: float | None = None
    checkpoint: str | None = None
    replayed: bool = False
    """The step was re-trained on resume (its weights had been published before the restart)."""


@dataclass
class TrainingService:
    """Drives a `PolicyTrainer` from the run store."""

    settings: TrainerSettings
    store: RunStore
    telemetry: TrainerTelemetry | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    nccl_engine_factory: Any = None
    """For `weightSync.method: NCCL`: vLLM's trainer-side transfer engine factory (None: vLLM's own; the
    tests pass a recorder, NCCL needing GPUs)."""

    def __post_init__(self) -> None:
        self.settings.check_supported()
        nccl = self.settings.weight_sync_method == "NCCL" and bool(self.settings.fleet_urls)
        if nccl and self.settings.weight_sync_address is None:
            raise SettingsError(
                "weightSync.method NCCL needs the writer's rendezvous address that the engines connect to "
                "($LEGORL_WEIGHT_SYNC_ADDRESS and $LEGORL_WEIGHT_SYNC_PORT, which the operator sets)"
            )
        if self.settings.fleet_urls and not nccl and self.store.local_path("weights") is None:
            raise SettingsError(
                f"run store {self.settings.store_uri} is not a local path: engines load published "
                "weights from a path, so put the store on a volume both can mount (pvc:// or file://)"
            )
        self.trainer = PolicyTrainer(self.settings)
        self.writer = self.trainer.ranks.writer
        self.checkpoints = CheckpointStore(self.settings.checkpoint_uri or f"{self.store.uri}/checkpoints")
        self.sync = (
            FleetWeightSync(
                list(self.settings.fleet_urls),
                pause_mode=self.settings.pause_mode,
                timeout=self.settings.sync_timeout_seconds,
            )
            if self.settings.fleet_urls and self.writer and not nccl
            else None
        )
        self.nccl: NcclWeightSync | None = None
        if nccl:
            assert self.settings.weight_sync_address is not None
            self.nccl = NcclWeightSync(
                list(self.settings.fleet_urls),
                rank=self.trainer.ranks.rank,
                master_address=self.settings.weight_sync_address,
                master_port=self.settings.weight_sync_port,
                pause_mode=self.settings.pause_mode,
                timeout=self.settings.sync_timeout_seconds,
                engine_factory=self.nccl_engine_factory,
            )
            self.nccl.connect(lambda: HfExport(self.trainer.model, self.trainer.arch))
        self.resumed_from: int | None = None
        self._resume()

    # -- resume ----------------------------------------------------------------------------------------

    def _resume(self) -> None:
        latest = parallel.broadcast(self.checkpoints.latest() if self.writer else None)
        if latest is not None:
            load_checkpoint(self.checkpoints, latest.step, self.trainer)
            self.resumed_from = latest.step
            if self.writer:
                log.info("resumed from the checkpoint of step %d (%s)", latest.step, latest.uri)
        published, committed, recorded = parallel.broadcast(
            (
                set(self.store.published_versions()),
                set(self.store.committed_steps()),
                {m.step for m in self.store.step_figures()},
            )
            if self.writer
            else None
        )
        # Steps after the checkpoint whose weights the fleet may already serve: re-train them from their
        # batches so the optimizer state matches, but publish nothing again.
        while policy_version(self.trainer.step + 1) in published:
            step = self.trainer.step + 1
            if step not in committed:
                break
            if self.writer:
                log.info("re-training step %d from its committed batch (published before the restart)", step)
            figures = self.trainer.train_step(self.store.read_batch(step).trials, step=step)
            figures.retrained_on_resume = 1
            # A crash between publishing and recording the step left no figures and a stale pointer; figures
            # that were recorded stay (they describe the step as it was published and synced).
            if self.writer:
                if step not in recorded:
                    self.store.write_step_figures(figures)
                self._write_state(step, None)
        self._catch_up_fleet()

    def _catch_up_fleet(self) -> None:
        """Load the newest published version into replicas that serve an older one (every rank calls it).

        A crash (or a failed sync) after a version was published leaves the fleet behind; in Sync mode
        every later trial would then be stale.
        """
        if self.nccl is not None:
            version = policy_version(self.trainer.step)
            behind = self.writer and any(
                _step_of(v) != self.trainer.step for v in self.nccl.served_versions()
            )
            if parallel.broadcast(behind):
                # The trainer's weights are that version: resume re-trained every published step.
                log.warning("fleet is behind the trainer's %s: sending it over NCCL", version)
                self.nccl.sync(version)
            return
        if not self.writer:
            return
        versions = self.store.published_versions()
        if self.sync is None or not versions:
            return
        latest = versions[-1]
        served = self.sync.served_versions()
        if all(v == latest for v in served):
            return
        log.warning("fleet serves %s, the newest published version is %s: syncing it", served, latest)
        target = self.store.local_path(self.store.weights_path(latest))
        assert target is not None  # checked in __post_init__
        self._sync_with_retries(read_published(Path(target)))

    def _sync_with_retries(self, published: PublishedWeights, attempts: int = 3) -> float:
        """Sync `published` into the fleet; transient failures are retried with a growing pause."""
        assert self.sync is not None
        for attempt in range(1, attempts + 1):
            started = time.perf_counter()
            try:
                self.sync.sync(published)
            except WeightSyncError as exc:
                if attempt == attempts:
                    raise
                log.warning(
                    "sync of %s failed (attempt %d/%d): %s", published.version, attempt, attempts, exc
                )
                self.stop.wait(2.0 * attempt)
                continue
            return time.perf_counter() - started
        raise AssertionError("unreachable")

    # -- the loop --------------------------------------------------------------------------------------

    def next_step(self) -> int:
        return self.trainer.step + 1

    def run_step(self, step: int) -> StepOutcome:
        """Train on the committed batch of `step`, publish policy version `step`, sync, record (every rank
        calls it; the writer publishes, records and syncs)."""
        if step != self.trainer.step + 1:
            raise ValueError(f"step {step} out of order: the trainer is at step {self.trainer.step}")
        batch = self.store.read_batch(step)
        figures = self.trainer.train_step(batch.trials, step=step)
        if self.writer and self.trainer.token_logprobs:
            # Per-token training log-probs for the UI's trajectory viewer (rollout vs. training).
            self.store.write_token_logprobs(step, self.trainer.token_logprobs)
        version = policy_version(step)
        outcome = StepOutcome(step=step, version=version, figures=figures)
        published = self._publish(version)
        if self.writer:
            assert published is not None
            # The run store writes the version's PUBLISHED.json: from then on it is published.
            recorded = self.store.record_weights(
                version,
                step=step,
                sha256=published.sha256,
                files=published.files,
                num_tensors=published.num_tensors,
            )
            outcome.published = dataclasses.replace(recorded, path=published.path)
            if self.sync is not None:
                outcome.sync_seconds = self._sync_with_retries(outcome.published)
                figures.sync_seconds = outcome.sync_seconds
        if self.nccl is not None:
            report = self.nccl.sync(version)
            if report is not None:
                outcome.sync_seconds = report.seconds
                figures.sync_seconds = report.seconds
                figures.sync_transfer_seconds = report.transfer_seconds
                figures.sync_bytes = report.bytes
                figures.sync_bytes_per_second = report.bytes_per_second
        if step % self.settings.checkpoint_interval == 0 or step == self.settings.max_steps:
            info = save_checkpoint(self.checkpoints, step, self.trainer, keep=self.settings.checkpoint_keep)
            outcome.checkpoint = info.uri
            figures.checkpoint = info.uri
        if self.writer:
            self.store.write_step_figures(figures)
            self._write_state(step, outcome.checkpoint)
            if self.telemetry is not None:
                self.telemetry.record(step, figures)
            log.info(
                "step %d: reward %.3f, loss %.4g, fidelity %.5f, %s",
                step,
                _or_nan(figures.reward_mean),
                _or_nan(figures.loss),
                _or_nan(figures.fidelity_pearson),
                figures.skipped or "updated",
            )
        # The fleet serves the new version (or the step failed on the writer) before anyone goes on.
        parallel.broadcast(None)
        return outcome

    def _write_state(self, step: int, checkpoint: str | None) -> None:
        latest = self.checkpoints.latest()
        self.store.write_trainer_state(
            TrainerState(
                step=step,
                policy_version=policy_version(step),
                checkpoint=checkpoint or (latest.uri if latest else None),
                updated=time.time(),
            )
        )

    def _publish(self, version: str) -> PublishedWeights | None:
        """Export the weights (every rank takes part) and publish them (the writer; None elsewhere)."""
        weights = self.trainer.hf_state_dict()
        if not self.writer:
            return None
        assert weights is not None
        target = self.store.local_path(self.store.weights_path(version))
        if target is None:
            raise SettingsError(f"run store {self.settings.store_uri} has no local path for weights")
        if target.exists() and self.store.read_published(version) is None:
            # Written but never recorded (a crash in between): nobody was told about it, so it is
            # replaced rather than trusted.
            log.warning("replacing unrecorded weights of %s left by an earlier crash", version)
            shutil.rmtree(target)
        return publish_weights(
            weights, Path(target), version=version, source_dir=self.trainer.source_dir, marker=False
        )

    def _next(self, limit: int | None) -> tuple[str, Any]:
        """The writer's decision of what every rank does next: ("stop", None), ("step", n),
        ("score", [request ids]) or ("wait", None)."""
        if not self.writer:
            decision: tuple[str, Any] = parallel.broadcast(None)
            return decision
        step = self.next_step()
        if self.stop.is_set() or (limit is not None and self.trainer.step >= limit):
            decision = ("stop", None)
        elif step in self.store.committed_steps():
            decision = ("step", step)
        else:
            try:
                pending = self.store.scoring_requests()
            except (StoreError, OSError) as exc:
                log.warning("could not list scoring requests: %s", exc)
                pending = []
            decision = ("score", pending) if pending else ("wait", None)
        shared: tuple[str, Any] = parallel.broadcast(decision)
        return shared

    def run(self, *, max_steps: int | None = None, wait: bool = True, poll_seconds: float = 1.0) -> list[int]:
        """Train every committed step in order until `max_steps` (default: the run's), or `stop` is set.

        With `wait=False` it returns once no further batch is committed. Every rank calls it; the writer's
        view of the store (and its stop signal) decides for all.
        """
        limit = max_steps if max_steps is not None else self.settings.max_steps
        done: list[int] = []
        checked = time.monotonic()
        while True:
            action, arg = self._next(limit)
            if action == "stop":
                break
            if action == "step":
                self.run_step(int(arg))
                done.append(int(arg))
                continue
            if action == "score":
                self._score(list(arg))
            if not wait:
                break
            if action == "wait":
                if time.monotonic() - checked >= self.settings.fleet_check_seconds:
                    self._watch_fleet()
                    checked = time.monotonic()
                self.stop.wait(poll_seconds)
        return done

    def _watch_fleet(self) -> None:
        """While the trials of the next step run: a replica that serves an older version than the newest
        published one gets it. A restarted engine pod starts from the run's checkpoint (vLLM names it
        `default`, recorded as v0) and nothing else would bring it up to date before the next step, so
        in Sync mode every trial it served would be stale. Filesystem sync only: a replica that joins
        after an NCCL group was formed is not in it (it is caught up when the trainer restarts)."""
        if self.nccl is not None or not self.writer:
            return
        try:
            self._catch_up_fleet()
        except (WeightSyncError, OSError) as exc:  # a replica still starting; the next check retries
            log.warning("could not bring the fleet up to date: %s", exc)

    def serve_scoring(self) -> list[str]:
        """Answer the canary's scoring requests (`RunStore.request_scoring`) with the weights held now:
        `ScoredBatch.fidelity()` of the request's trials and the policy version those weights are. Served
        between steps, so the answer is always about one version. A request that cannot be scored gets an
        `error` answer; training goes on either way. Every rank calls it."""
        pending: list[str] = []
        if self.writer:
            try:
                pending = self.store.scoring_requests()
            except (StoreError, OSError) as exc:
                log.warning("could not list scoring requests: %s", exc)
        return self._score(parallel.broadcast(pending))

    def _score(self, pending: list[str]) -> list[str]:
        answered = []
        for request in pending:
            version = policy_version(self.trainer.step)
            answer = ScoringAnswer(policy_version=version)
            started = time.perf_counter()
            try:
                records = self.store.read_scoring_request(request)
                figures = self.trainer.score_trials(records).fidelity()
                answer = ScoringAnswer.from_json(
                    {
                        "policy_version": version,
                        **{k: (v if math.isfinite(v) else None) for k, v in figures.items()},
                    }
                )
            except Exception as exc:
                if self.writer:
                    log.exception("scoring request %s failed", request)
                answer.error = f"{type(exc).__name__}: {exc}"[:2000]
            answer.seconds = round(time.perf_counter() - started, 3)
            if self.writer:
                self.store.answer_scoring(request, answer)
                log.info("answered scoring request %s with %s: %s", request, version, answer.to_json())
            answered.append(request)
        return answered


def _step_of(version: str) -> int | None:
    """The step a served version names (vLLM's startup `default` is 0); None for anything else."""
    try:
        return parse_policy_version(version)
    except ValueError:
        return None


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value
