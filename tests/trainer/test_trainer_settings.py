"""Trainer settings from RLRun manifests, checkpoint resolution, and the per-step OpenTelemetry gauges.

No torch here: the settings module must stay light so launchers can validate a run before importing it.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint

from legorl.api.kinds import RLRun
from legorl.api.termination import INFRA_REASONS
from legorl.trainer.main import MODELS_DIR, resolve_checkpoint
from legorl.trainer.settings import TrainerSettings
from legorl.trainer.telemetry import STEP_FIGURES, TrainerTelemetry

EXAMPLES = Path(__file__).parents[2] / "examples"


def run_from(name: str, **spec_overrides: Any) -> RLRun:
    body = yaml.safe_load((EXAMPLES / name).read_text())
    if isinstance(body, list) or "kind" not in body:
        raise AssertionError(name)
    body["spec"].update(spec_overrides)
    return RLRun.model_validate(body)


def first_run(name: str) -> dict[str, Any]:
    for doc in yaml.safe_load_all((EXAMPLES / name).read_text()):
        if doc and doc.get("kind") == "RLRun":
            return dict(doc)
    raise AssertionError(f"no RLRun in {name}")


def test_tiny_local_resolves_to_cpu_settings(tmp_path: Path) -> None:
    run = RLRun.model_validate(first_run("tiny-local.yaml"))
    s = TrainerSettings.from_run(run, store_uri=str(tmp_path), checkpoint_dir=tmp_path)
    assert s.algorithm == "GRPO"
    assert s.learning_rate == pytest.approx(5e-4) and s.mini_batches == 2
    assert (s.clip_low, s.clip_high) == (0.2, 0.28)  # the GRPO defaults, since the manifest sets none
    assert s.device == "cpu" and s.moe_token_dispatcher == "allgather"
    assert s.dtype == "float32" and s.routing_replay == "Auto"
    assert s.max_staleness == 1  # Async mode trains on trials at most one version behind
    assert s.drop_reasons == INFRA_REASONS
    assert s.importance_mode == "Truncated" and s.importance_cap == 2.0
    assert s.max_steps == 6
    s.check_supported()


def test_gpu_manifest_resolves_to_the_gpu_layout(tmp_path: Path) -> None:
    body = first_run("gpu-swe-verified.yaml")
    body["spec"]["algorithm"] = {**body["spec"].get("algorithm", {}), "name": "GSPO"}
    body["spec"].pop("schedule", None)
    body["spec"]["schedule"] = {"mode": "Async", "maxStalenessSteps": 2}
    run = RLRun.model_validate(body)
    s = TrainerSettings.from_run(run, store_uri=str(tmp_path), checkpoint_dir=tmp_path)
    assert (s.clip_low, s.clip_high) == (0.2, 0.28)  # as the manifest sets them
    assert s.mini_batches == 2 and s.advantage == "GroupMean"
    del body["spec"]["algorithm"]["clipLow"], body["spec"]["algorithm"]["clipHigh"]
    s = TrainerSettings.from_run(RLRun.model_validate(body), store_uri=str(tmp_path), checkpoint_dir=tmp_path)
    assert (s.clip_low, s.clip_high) == (3e-4, 4e-4)  # GSPO's own defaults when unset
    assert s.moe_token_dispatcher == "alltoall"
    assert s.max_staleness == 2
    assert s.recompute in ("none", "selective", "full")


def test_settings_module_does_not_import_torch() -> None:
    code = "import sys, legorl.trainer.settings; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_resolve_checkpoint_schemes(tmp_path: Path) -> None:
    assert resolve_checkpoint("file:///data/models/x", tmp_path) == Path("/data/models/x")
    assert resolve_checkpoint("pvc://models/qwen3/base", tmp_path) == MODELS_DIR / "models" / "qwen3/base"
    with pytest.raises(ValueError, match=r"s3:// checkpoints only through a local copy"):
        resolve_checkpoint("s3://bucket/model", tmp_path)


def test_telemetry_exports_each_step_figure() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    telemetry = TrainerTelemetry(provider, run="r1")
    figures = {name: float(i) + 0.5 for i, name in enumerate(STEP_FIGURES)}
    figures["entropy"] = math.nan  # not finite: left out, never exported as NaN
    telemetry.record(3, figures)
    data = reader.get_metrics_data()
    assert data is not None
    points: dict[str, Any] = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    assert isinstance(point, NumberDataPoint)  # gauges, not histograms
                    points[metric.name] = (point.value, dict(point.attributes or {}))
    assert points["legorl.trainer.step"] == (3, {"legorl.run": "r1"})
    assert points["legorl.trainer.fidelity_pearson"][0] == figures["fidelity_pearson"]
    assert points["legorl.trainer.is_ess"][0] == figures["is_ess"]
    assert "legorl.trainer.entropy" not in points
    assert len(points) == len(STEP_FIGURES)  # every finite figure, plus the step, minus entropy
