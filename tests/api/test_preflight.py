"""Preflight checks: each fires on the manifest that deserves it and stays quiet otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from legorl.api.kinds import RLRun, RolloutFleet
from legorl.manifests import Problem, parse_documents, validate_documents
from legorl.manifests.preflight import check_resource, check_run_against_fleet

EXAMPLES = Path(__file__).parents[2] / "examples"
BASE = (EXAMPLES / "tiny-local.yaml").read_text()
CPU_TRAINER = "      gpusPerNode: 0                   # megatron-core on CPU (gloo)\n"


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
            # Accepted by the API and CEL, refused by the trainer at start: preflight says so first.
            "      maxTokensPerTurn: 128",
            '      maxTokensPerTurn: 128\n      topP: "0.9"',
            "error",
            "spec.algorithm.sampling.topP",
            "nucleus truncation would bias every importance weight",
        ),
        (
            # vLLM answers every call asking for more tokens than its context with 400.
            "      maxTokensPerTurn: 128",
            "      maxTokensPerTurn: 2048",
            "error",
            "spec.algorithm.sampling.maxTokensPerTurn",
            "leaves no room for a prompt in the fleet's context of 2048 tokens",
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
        (
            # CEL has no rule for context parallelism: only preflight refuses it.
            CPU_TRAINER,
            CPU_TRAINER + "      processesPerNode: 2\n      context: 2\n",
            "error",
            "spec.trainer.parallelism.context",
            "context parallelism 2",
        ),
        (
            "      gpusPerNode: 0                   # vLLM's CPU build\n",
            "      gpusPerNode: 0                   # vLLM's CPU build\n    weightSync: {method: NCCL}\n",
            "error",
            "spec.fleet.weightSync.method",
            "NCCL weight sync needs GPUs on the engines",
        ),
        (
            # The inline fleet syncs over the filesystem (the default): vLLM loads legorl's plugin at start.
            "    replicas: 1\n",
            "    replicas: 1\n    engine: {image: vllm/vllm-openai:v0.32.0}\n",
            "warning",
            "spec.fleet.engine.image",
            "vllm/vllm-openai:v0.32.0 is not legorl's engine image",
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


@pytest.mark.parametrize(
    ("split", "error"),
    [
        ("heldOutPercent: 0", "heldOutPercent is 0"),
        ("heldOutTaskIds: []", "heldOutTaskIds is empty"),
        ("taskSetSplit: validation", None),
        ("taskSetSplit: test", None),
        ("heldOutPercent: 25", None),
    ],
)
def test_target_reward_needs_held_out_tasks(split: str, error: str | None) -> None:
    old = "      heldOutPercent: 25 "
    assert old in BASE
    text = BASE.replace(old, f"      {split} ").replace(
        "    maxSteps: 6", '    maxSteps: 6\n    targetReward: "0.5"'
    )
    found = [p for p in problems(text) if p.path == "spec.stop.targetReward"]
    if error is None:
        assert found == []  # taskSetSplit always holds tasks out (a task set without labels fails the plan)
    else:
        (problem,) = found
        assert error in problem.message and "taskSetSplit" in problem.message


def test_preflight_waits_for_schema_errors() -> None:
    # An invalid document gets schema/CEL problems only; preflight needs a parsed resource.
    text = BASE.replace("groupSize: 4", "groupSize: 0")
    checks = {p.check for p in problems(text)}
    assert "schema" in checks
    assert "preflight" not in checks


def test_two_training_runs_on_one_fleet_are_flagged() -> None:
    shared = (Path(__file__).parents[2] / "examples" / "shared-fleet-and-pool.yaml").read_text()
    both_train = shared.replace("mode: Evaluate", "mode: Train")
    reports = validate_documents(parse_documents(both_train, "s.yaml"))
    flagged = [
        r.document.body["metadata"]["name"] for r in reports for p in r.problems if p.path == "spec.fleetRef"
    ]
    assert sorted(flagged) == ["coder-benchmark", "coder-grpo"]


def test_a_cpu_trainer_of_several_ranks_is_clean() -> None:
    assert CPU_TRAINER in BASE
    text = BASE.replace(
        CPU_TRAINER, CPU_TRAINER + "      processesPerNode: 4\n      tensor: 2\n      expert: 2\n"
    )
    assert problems(text) == []


@pytest.mark.parametrize(
    ("layout", "fields"),
    [
        # 3 ranks split neither into TP 2 nor into TP 2 × EP 1; 4 ranks do not hold TP 2 × EP 4.
        ("      processesPerNode: 3\n      tensor: 2\n", ["tensor", "expert"]),
        ("      processesPerNode: 4\n      tensor: 2\n      expert: 4\n", ["expert"]),
    ],
)
def test_layout_problems_are_told_once_and_also_without_cel(layout: str, fields: list[str]) -> None:
    paths = [f"spec.trainer.parallelism.{field}" for field in fields]
    (report,) = validate_documents(parse_documents(BASE.replace(CPU_TRAINER, CPU_TRAINER + layout), "t.yaml"))
    # `legorl validate`: CEL says it; preflight (which waits for a document CEL passed) does not repeat it.
    assert [(p.check, p.path) for p in report.problems] == [("cel", path) for path in paths]
    # An API server without CEL (1.20) lets it through; the operator's preflight then says it in its words.
    assert isinstance(report.resource, RLRun)
    found = check_resource(report.resource)
    assert [(p.check, p.severity, p.path) for p in found] == [("preflight", "error", path) for path in paths]
    assert all("must divide the" in p.message for p in found)


def test_a_gpu_trainer_runs_one_rank_per_gpu_also_without_cel() -> None:
    text = (EXAMPLES / "gpu-swe-verified.yaml").read_text()
    old = "      gpusPerNode: 8\n      tensor: 2\n"
    assert old in text
    (report,) = validate_documents(
        parse_documents(
            text.replace(old, "      gpusPerNode: 8\n      processesPerNode: 4\n      tensor: 2\n"), "g.yaml"
        )
    )
    assert [(p.check, p.path) for p in report.problems if p.severity == "error"] == [
        ("cel", "spec.trainer.parallelism.processesPerNode")
    ]
    assert isinstance(report.resource, RLRun)
    (found,) = [p for p in check_resource(report.resource) if p.severity == "error"]
    assert found.path == "spec.trainer.parallelism.processesPerNode" and "one rank per GPU" in found.message


def test_the_gpu_example_passes_the_layout_and_nccl_checks() -> None:
    # 4 nodes × 8 GPUs, TP 2 × EP 8, NCCL weight sync between GPU engines and a GPU trainer.
    (report,) = validate_documents(
        parse_documents((EXAMPLES / "gpu-swe-verified.yaml").read_text(), "g.yaml")
    )
    assert [p for p in report.problems if p.severity == "error"] == []
    assert isinstance(report.resource, RLRun)
    assert report.resource.spec.fleet is not None and report.resource.spec.fleet.weight_sync.method == "NCCL"


def test_nccl_weight_sync_needs_a_gpu_trainer() -> None:
    # An inline fleet on GPUs, the trainer on CPU.
    text = (EXAMPLES / "gpu-swe-verified.yaml").read_text()
    old = "      nodes: 4\n      gpusPerNode: 8\n      tensor: 2\n      expert: 8\n"
    assert old in text
    (report,) = validate_documents(parse_documents(text.replace(old, "      gpusPerNode: 0\n"), "g.yaml"))
    errors = [p for p in report.problems if p.severity == "error"]
    assert [(p.check, p.path) for p in errors] == [("preflight", "spec.fleet.weightSync.method")]
    assert "GPUs on the trainer too" in errors[0].message
    # A referenced fleet that syncs over NCCL, a training run on CPU.
    shared = (EXAMPLES / "shared-fleet-and-pool.yaml").read_text()
    old = "      nodes: 2\n      gpusPerNode: 8\n      tensor: 2\n      expert: 8\n"
    assert old in shared and "    method: Filesystem\n" in shared
    text = shared.replace("    method: Filesystem\n", "    method: NCCL\n").replace(
        old, "      gpusPerNode: 0\n"
    )
    reports = validate_documents(parse_documents(text, "s.yaml"))
    by_run = [
        (r.document.body["metadata"]["name"], p) for r in reports for p in r.problems if p.severity == "error"
    ]
    assert [(name, p.path) for name, p in by_run] == [("coder-grpo", "spec.trainer.parallelism.gpusPerNode")]
    assert "fleet 'coder-fleet' syncs weights over NCCL" in by_run[0][1].message


SHARED = (EXAMPLES / "shared-fleet-and-pool.yaml").read_text()
SHARED_IMAGE = "    image: ghcr.io/legorl/engine:0.1.0\n"


def fleet_problems(image: str, method: str = "Filesystem") -> list[Problem]:
    """Problems of the shared example's RolloutFleet with another engine image and weight-sync method."""
    assert SHARED_IMAGE in SHARED and "    method: Filesystem\n" in SHARED
    text = SHARED.replace(SHARED_IMAGE, f"    image: {image}\n").replace(
        "    method: Filesystem\n", f"    method: {method}\n"
    )
    reports = validate_documents(parse_documents(text, "s.yaml"))
    return next(r.problems for r in reports if r.document.body["kind"] == "RolloutFleet")


def test_a_custom_engine_image_needs_legorls_plugin_for_filesystem_sync() -> None:
    (problem,) = fleet_problems("registry.example.com/ml/vllm:0.33.0-patched")
    assert (problem.severity, problem.path, problem.check) == ("warning", "spec.engine.image", "preflight")
    # What must be inside the image, and how to get it there.
    for words in (
        "registry.example.com/ml/vllm:0.33.0-patched is not legorl's engine image",
        "--worker-extension-cls legorl.trainer.engine.plugin.FilesystemWeightTransfer",
        "--middleware legorl.trainer.engine.versions.WeightVersions",
        "backend legorl_filesystem",
        "vLLM exits at start",
        "Use ghcr.io/legorl/engine:0.1.0",
        "docker build -f engine/Dockerfile --build-arg VLLM_IMAGE=<your image>",
    ):
        assert words in problem.message, problem.message
    assert (Path(__file__).parents[2] / "engine/Dockerfile").is_file()


@pytest.mark.parametrize(
    "image",
    [
        "ghcr.io/legorl/engine:0.1.0",
        "ghcr.io/legorl/engine:0.1.0-cpu",
        "ghcr.io/legorl/engine@sha256:" + "a" * 64,
        "ghcr.io/legorl/engine:0.1.0@sha256:" + "b" * 64,
        "registry.example.com:5000/mirror/legorl/engine:0.1.0",
    ],
)
def test_legorls_engine_image_by_any_tag_digest_or_mirror_is_quiet(image: str) -> None:
    assert fleet_problems(image) == []


def test_nccl_weight_sync_needs_no_plugin_in_the_image() -> None:
    # vLLM's own nccl backend: the renderer names no legorl module.
    assert fleet_problems("vllm/vllm-openai:v0.33.0", method="NCCL") == []


def test_the_default_engine_image_is_legorls() -> None:
    text = SHARED.replace("  engine:\n" + SHARED_IMAGE, "")
    assert text != SHARED
    reports = validate_documents(parse_documents(text, "s.yaml"))
    fleet = next(r for r in reports if r.document.body["kind"] == "RolloutFleet")
    assert fleet.problems == []
    assert isinstance(fleet.resource, RolloutFleet)
    assert fleet.resource.spec.engine.image == "ghcr.io/legorl/engine:0.1.0"
    assert check_resource(fleet.resource) == []


STORE_CLAIM = "    storeClaim: rl-store\n"
TRAIN_STORE = "    uri: pvc://rl-store/coder-grpo\n"


def shared_run_problems(text: str) -> dict[str, list[Problem]]:
    """Problems of each RLRun of the shared example (edited)."""
    reports = validate_documents(parse_documents(text, "s.yaml"))
    return {
        r.document.body["metadata"]["name"]: r.problems for r in reports if r.document.body["kind"] == "RLRun"
    }


def test_a_shared_filesystem_fleet_must_mount_the_training_runs_store_claim() -> None:
    assert STORE_CLAIM in SHARED and TRAIN_STORE in SHARED
    assert shared_run_problems(SHARED) == {"coder-grpo": [], "coder-benchmark": []}
    # No claim: the engines could never open the paths the trainer sends. The Evaluate run publishes nothing.
    found = shared_run_problems(SHARED.replace(STORE_CLAIM, ""))
    assert found["coder-benchmark"] == []
    (problem,) = found["coder-grpo"]
    assert (problem.severity, problem.path, problem.check) == ("error", "spec.fleetRef.name", "preflight")
    assert "fleet 'coder-fleet' loads published weights from a path in the run store" in problem.message
    assert "set the fleet's weightSync.storeClaim to 'rl-store'" in problem.message
    # Another claim than the store's.
    (problem,) = shared_run_problems(SHARED.replace(STORE_CLAIM, "    storeClaim: other\n"))["coder-grpo"]
    assert (problem.severity, problem.path) == ("error", "spec.fleetRef.name")
    assert (
        "mounts claim 'other'" in problem.message
        and "set weightSync.storeClaim to 'rl-store'" in problem.message
    )
    # An NCCL fleet needs no store.
    nccl = SHARED.replace("    method: Filesystem\n" + STORE_CLAIM, "    method: NCCL\n")
    assert shared_run_problems(nccl) == {"coder-grpo": [], "coder-benchmark": []}


def test_a_run_on_the_default_store_is_checked_against_the_operators_store() -> None:
    text = SHARED.replace(STORE_CLAIM, "").replace("  store:\n" + TRAIN_STORE, "")
    reports = validate_documents(parse_documents(text, "s.yaml"))
    # `legorl validate` does not know the operator's default store: it says what to set if it is a claim.
    (problem,) = next(r.problems for r in reports if r.document.body["metadata"]["name"] == "coder-grpo")
    assert (problem.severity, problem.path) == ("warning", "spec.fleetRef.name")
    assert "if that is pvc://CLAIM/..., set weightSync.storeClaim: CLAIM on the fleet" in problem.message
    # The operator does: it refuses a fleet without that claim, or any Filesystem fleet on an object store.
    run = next(
        r.resource for r in reports if isinstance(r.resource, RLRun) and r.resource.spec.mode == "Train"
    )
    fleet = next(r.resource for r in reports if isinstance(r.resource, RolloutFleet))
    assert isinstance(run, RLRun) and isinstance(fleet, RolloutFleet)
    (problem,) = check_run_against_fleet(run, fleet, "pvc://legorl-store/runs")
    assert problem.severity == "error" and "weightSync.storeClaim to 'legorl-store'" in problem.message
    assert "the operator's default store" in problem.message
    (problem,) = check_run_against_fleet(run, fleet, "s3://bucket/runs")
    assert problem.severity == "error" and "is an object store" in problem.message
    sync = fleet.spec.weight_sync.model_copy(update={"store_claim": "legorl-store"})
    mounted = fleet.model_copy(update={"spec": fleet.spec.model_copy(update={"weight_sync": sync})})
    assert list(check_run_against_fleet(run, mounted, "pvc://legorl-store/runs")) == []


@pytest.mark.parametrize("fleet", ["inline", "shared"])
def test_an_object_store_cannot_feed_a_filesystem_weight_sync(fleet: str) -> None:
    # The trainer refuses it at start (the engines load weights from a path): preflight says so first.
    if fleet == "inline":
        text = BASE.replace("  stop:\n", "  store:\n    uri: s3://bucket/runs\n  stop:\n")
        found = problems(text)
    else:
        text = SHARED.replace(TRAIN_STORE, "    uri: s3://bucket/runs\n")
        found = shared_run_problems(text)["coder-grpo"]
    (problem,) = found
    assert (problem.severity, problem.path) == ("error", "spec.store.uri")
    assert "s3://bucket/runs (spec.store.uri) is an object store" in problem.message
    assert "pvc://CLAIM/path" in problem.message and "use weightSync.method NCCL" in problem.message


def test_an_inline_fleet_takes_its_store_claim_from_the_store() -> None:
    store = "  store:\n    uri: pvc://runs/x\n  stop:\n"
    # The operator sets the claim; one the user names must be the store's.
    assert problems(BASE.replace("  stop:\n", store)) == []
    fleet = "  fleet:\n    replicas: 1\n"
    assert fleet in BASE
    named = BASE.replace("  stop:\n", store).replace(fleet, fleet + "    weightSync: {storeClaim: runs}\n")
    assert problems(named) == []
    (problem,) = problems(named.replace("storeClaim: runs", "storeClaim: other"))
    assert (problem.severity, problem.path) == ("error", "spec.fleet.weightSync.storeClaim")
    assert "set weightSync.storeClaim to 'runs' or remove it" in problem.message
    # On the operator's default store: only an object store is a problem (a claim is set from it).
    (report,) = validate_documents(parse_documents(BASE, "t.yaml"))
    assert isinstance(report.resource, RLRun)
    assert check_resource(report.resource, "pvc://legorl-store/runs") == []
    (problem,) = check_resource(report.resource, "s3://bucket/runs")
    assert (problem.severity, problem.path) == ("error", "spec.fleet.weightSync.method")
    assert "the operator's default store" in problem.message
