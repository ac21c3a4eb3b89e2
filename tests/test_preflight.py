"""Preflight checks: each fires on the manifest that deserves it and stays quiet otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from legorl.manifests import Problem, parse_documents, validate_documents

BASE = (Path(__file__).parents[1] / "examples" / "tiny-local.yaml").read_text()


def problems(text: str) -> list[Problem]:
    (report,) = validate_documents(parse_documents(text, "t.yaml"))
    return report.problems


def test_base_is_clean() -> None:
    assert problems(BASE) == []


@pytest.mark.parametrize(
    ("old", "new", "severity", "path", "words"),
    [
        (
            "    dtype: float32\n    routingReplay",
            "    dtype: float32\n"
            "    resources: {requests: {memory: 8Gi}, limits: {memory: 4Gi}}\n"
            "    routingReplay",
            "error",
            "spec.trainer.resources.requests.memory",
            "above the limit 4Gi",
        ),
        (
            "    maxTurns: 4",
            "    maxTurns: 4\n    env: [{name: OPENAI_API_KEY, value: sk-123}]",
            "warning",
            "spec.harness.env[0].value",
            "put it in a Secret",
        ),
        (
            "    replicas: 1\n",
            "    replicas: 1\n    engine: {image: vllm/vllm-openai:latest}\n",
            "warning",
            "spec.fleet.engine.image",
            "not pinned",
        ),
        (
            "    miniBatches: 2 ",
            "    miniBatches: 17 ",
            "error",
            "spec.algorithm.miniBatches",
            "cannot be cut from a batch of 16",
        ),
        (
            "    maxSteps: 6",
            '    maxSteps: 6\n    targetReward: "0.5"',
            "error",
            "spec.stop.targetReward",
            "heldOutPercent is 0",
        ),
        (
            "    maxConcurrentTrials: 4",
            "    maxConcurrentTrials: 2",
            "warning",
            "spec.schedule.maxConcurrentTrials",
            "below groupSize 4",
        ),
        (
            "      dtype: float32                   # same dtype",
            "      dtype: bfloat16                  # same dtype",
            "warning",
            "spec.fleet.settings.dtype",
            "samples in bfloat16 but the trainer computes in float32",
        ),
        (
            "    deadlines:",
            "    defenses: {gitHistory: Preserve}\n    deadlines:",
            "warning",
            "spec.pool.defenses.gitHistory",
            "rewards from this pool can be gamed",
        ),
        (
            "    kind: MiniSweAgent",
            "    kind: Custom\n"
            "    apiFormat: OpenAIChatCompletions\n"
            "    command: [my-agent, --task-file, /task.md]",
            "warning",
            "spec.harness.command",
            "{prompt}",
        ),
        (
            "    kind: MiniSweAgent",
            "    kind: Custom\n    apiFormat: OpenAIChatCompletions\n    command: [my-agent, '{prompt}']",
            "error",
            "spec.harness.image",
            "kind Custom needs harness.image",
        ),
    ],
)
def test_check_fires(old: str, new: str, severity: str, path: str, words: str) -> None:
    assert old in BASE
    text = BASE.replace(old, new)
    if "targetReward" in new:
        text = text.replace("heldOutPercent: 25", "heldOutPercent: 0")
    found = [p for p in problems(text) if p.path == path]
    assert found, problems(text)
    assert found[0].severity == severity
    assert found[0].check == "preflight"
    assert words in found[0].message


def test_preflight_waits_for_schema_errors() -> None:
    # An invalid document gets schema/CEL problems only; preflight needs a parsed resource.
    text = BASE.replace("groupSize: 4", "groupSize: 0")
    checks = {p.check for p in problems(text)}
    assert "schema" in checks
    assert "preflight" not in checks


def test_two_training_runs_on_one_fleet_are_flagged() -> None:
    shared = (Path(__file__).parents[1] / "examples" / "shared-fleet-and-pool.yaml").read_text()
    both_train = shared.replace("mode: Evaluate", "mode: Train")
    reports = validate_documents(parse_documents(both_train, "s.yaml"))
    flagged = [
        r.document.body["metadata"]["name"] for r in reports for p in r.problems if p.path == "spec.fleetRef"
    ]
    assert sorted(flagged) == ["coder-benchmark", "coder-grpo"]
