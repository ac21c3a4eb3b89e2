"""Invalid manifests are rejected twice: by the CRD (as the API server would) and by `legorl validate`.

Each case mutates a valid manifest in one way. The API server is emulated with
what can run here: jsonschema against the generated openAPIV3Schema (with
unknown fields rejected, as kubectl's default strict field validation does),
list-map key uniqueness, and the CRD's CEL rules evaluated with cel-python.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from legorl.api import GROUP_VERSION, KINDS, RLRun
from legorl.api.crd import openapi_schema
from legorl.manifests import parse_documents, validate_documents
from legorl.manifests.generated import to_yaml
from legorl.manifests.structural import apply_defaults, cel_violations, prune_nulls

RUN = """
apiVersion: legorl.dev/v1alpha1
kind: RLRun
metadata: {name: valid-run}
spec:
  policy: {checkpoint: {uri: "builtin://tiny-moe"}}
  fleet:
    parallelism: {gpusPerNode: 0}
    settings: {dtype: float32}
    placement:
      tolerations: [{key: gpu, operator: Exists, effect: NoSchedule}]
  pool: {source: {taskSet: {uri: "builtin://tiny-python"}}}
  harness:
    kind: MiniSweAgent
    env: [{name: LOG_LEVEL, value: info}]
  tasks: {source: {uri: "builtin://tiny-python"}}
  trainer:
    parallelism: {gpusPerNode: 0}
    dtype: float32
    resources: {requests: {cpu: "2", memory: 4Gi}}
  stop: {maxSteps: 30}
"""

POOL = """
apiVersion: legorl.dev/v1alpha1
kind: SandboxPool
metadata: {name: valid-pool}
spec:
  source: {images: ["ghcr.io/example/task:v1"]}
"""

FLEET = """
apiVersion: legorl.dev/v1alpha1
kind: RolloutFleet
metadata: {name: valid-fleet}
spec:
  model: {uri: "hf://Qwen/Qwen3-30B-A3B"}
  parallelism: {gpusPerNode: 4, tensorParallelSize: 4}
"""

BASES = {"RLRun": RUN, "SandboxPool": POOL, "RolloutFleet": FLEET}


def _split(path: str) -> list[str | int]:
    parts: list[str | int] = []
    for part in path.split("."):
        if part.endswith("]"):
            name, index = part[:-1].split("[")
            parts += [name, int(index)]
        else:
            parts.append(part)
    return parts


def set_(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(obj: dict[str, Any]) -> None:
        *parents, last = _split(path)
        node: Any = obj
        for part in parents:
            if isinstance(part, str) and part not in node:
                node[part] = {}
            node = node[part]
        node[last] = value

    return apply


def del_(path: str) -> Callable[[dict[str, Any]], None]:
    def apply(obj: dict[str, Any]) -> None:
        *parents, last = _split(path)
        node: Any = obj
        for part in parents:
            node = node[part]
        del node[last]

    return apply


def both(*edits: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def apply(obj: dict[str, Any]) -> None:
        for edit in edits:
            edit(obj)

    return apply


# (id, kind, edit, the field path the problem must be reported at)
CASES: list[tuple[str, str, Callable[[dict[str, Any]], None], str]] = [
    ("unknown-spec-field", "RLRun", set_("spec.algorithim", {"name": "GRPO"}), "spec.algorithim"),
    ("unknown-nested-field", "RLRun", set_("spec.harness.maxTurn", 3), "spec.harness.maxTurn"),
    ("snake-case-field", "RLRun", set_("spec.algorithm.group_size", 4), "spec.algorithm.group_size"),
    (
        "duplicate-task-images",
        "SandboxPool",
        set_("spec.source", {"images": ["ghcr.io/example/task:v1", "ghcr.io/example/task:v1"]}),
        "spec.source.images",
    ),
    (
        "toleration-without-key",
        "RLRun",
        set_(
            "spec.fleet.placement.tolerations", [{"operator": "Equal", "value": "x", "effect": "NoSchedule"}]
        ),
        "spec.fleet.placement.tolerations[0].key",
    ),
    ("huge-exponent", "RLRun", set_("spec.algorithm.clipHigh", "1e999"), "spec.algorithm.clipHigh"),
    ("int-as-string", "RLRun", set_("spec.algorithm.groupSize", "8"), "spec.algorithm.groupSize"),
    ("int-above-max", "RLRun", set_("spec.algorithm.groupSize", 1000), "spec.algorithm.groupSize"),
    ("grpo-group-of-one", "RLRun", set_("spec.algorithm.groupSize", 1), "spec.algorithm.groupSize"),
    ("missing-harness", "RLRun", del_("spec.harness"), "spec.harness"),
    ("missing-harness-kind", "RLRun", del_("spec.harness.kind"), "spec.harness.kind"),
    ("unknown-harness", "RLRun", set_("spec.harness.kind", "Cursor"), "spec.harness.kind"),
    ("fleet-and-fleetref", "RLRun", set_("spec.fleetRef", {"name": "shared"}), "spec.fleet"),
    ("no-fleet", "RLRun", del_("spec.fleet"), "spec"),
    ("no-pool", "RLRun", del_("spec.pool"), "spec"),
    (
        "staleness-in-sync-mode",
        "RLRun",
        set_("spec.schedule", {"mode": "Sync", "maxStalenessSteps": 2}),
        "spec.schedule.maxStalenessSteps",
    ),
    (
        "lr-unquoted-number",
        "RLRun",
        set_("spec.algorithm.learningRate", 0.001),
        "spec.algorithm.learningRate",
    ),
    ("lr-out-of-range", "RLRun", set_("spec.algorithm.learningRate", "2"), "spec.algorithm.learningRate"),
    ("lr-not-a-number", "RLRun", set_("spec.algorithm.learningRate", "fast"), "spec.algorithm.learningRate"),
    ("custom-harness-no-command", "RLRun", set_("spec.harness.kind", "Custom"), "spec.harness.command"),
    (
        "codex-speaks-responses-only",
        "RLRun",
        both(set_("spec.harness.kind", "Codex"), set_("spec.harness.apiFormat", "AnthropicMessages")),
        "spec.harness.apiFormat",
    ),
    (
        "trainer-tp-does-not-divide",
        "RLRun",
        set_("spec.trainer.parallelism", {"gpusPerNode": 8, "tensor": 3}),
        "spec.trainer.parallelism.tensor",
    ),
    (
        "cpu-trainer-sharded",
        "RLRun",
        set_("spec.trainer.parallelism.tensor", 2),
        "spec.trainer.parallelism.tensor",
    ),
    (
        "split-percent-and-ids",
        "RLRun",
        set_("spec.tasks.split.heldOutTaskIds", {"heldOutPercent": 10, "heldOutTaskIds": ["t1"]}),
        "spec.tasks.split.heldOutTaskIds",
    ),
    (
        "split-percent-and-task-set-split",
        "RLRun",
        set_("spec.tasks.split", {"heldOutPercent": 10, "taskSetSplit": "test"}),
        "spec.tasks.split.taskSetSplit",
    ),
    (
        "split-ids-and-task-set-split",
        "RLRun",
        set_("spec.tasks.split", {"heldOutTaskIds": ["t1"], "taskSetSplit": "validation"}),
        "spec.tasks.split.taskSetSplit",
    ),
    (
        "task-set-split-train",  # the training split is never held out
        "RLRun",
        set_("spec.tasks.split", {"taskSetSplit": "train"}),
        "spec.tasks.split.taskSetSplit",
    ),
    ("empty-split", "RLRun", set_("spec.tasks.split", {}), "spec.tasks.split"),
    (
        "held-out-too-large",
        "RLRun",
        set_("spec.tasks.split", {"heldOutPercent": 95}),
        "spec.tasks.split.heldOutPercent",
    ),
    ("empty-stop", "RLRun", set_("spec.stop", {}), "spec.stop"),
    ("name-too-long", "RLRun", set_("metadata.name", "r" * 41), "metadata.name"),
    ("name-uppercase", "RLRun", set_("metadata.name", "My-Run"), "metadata.name"),
    (
        "duplicate-env-names",
        "RLRun",
        set_("spec.harness.env", [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]),
        "spec.harness.env",
    ),
    (
        "env-value-and-valuefrom",
        "RLRun",
        set_(
            "spec.harness.env[0].valueFrom",
            {"secretKeyRef": {"name": "s", "key": "k"}},
        ),
        "spec.harness.env[0].valueFrom",
    ),
    (
        "bad-quantity",
        "RLRun",
        set_("spec.trainer.resources.requests.cpu", "lots"),
        "spec.trainer.resources.requests.cpu",
    ),
    (
        "bad-image-ref",
        "RLRun",
        set_("spec.fleet.engine", {"image": "Not An Image"}),
        "spec.fleet.engine.image",
    ),
    (
        "exists-toleration-with-value",
        "RLRun",
        set_("spec.fleet.placement.tolerations[0].value", "x"),
        "spec.fleet.placement.tolerations[0].value",
    ),
    (
        "http-checkpoint",
        "RLRun",
        set_("spec.policy.checkpoint.uri", "http://x/model"),
        "spec.policy.checkpoint.uri",
    ),
    (
        "replay-without-capture",
        "RLRun",
        both(
            set_("spec.trainer.routingReplay", "Enabled"),
            set_("spec.fleet.settings.routedExpertsCapture", "Disabled"),
        ),
        "spec.trainer.routingReplay",
    ),
    ("wrong-api-version", "RLRun", set_("apiVersion", "legorl.dev/v1"), "apiVersion"),
    ("spec-not-a-mapping", "RLRun", set_("spec", ["policy"]), "spec"),
    (
        "zero-temperature",
        "RLRun",
        set_("spec.algorithm.sampling", {"temperature": "0"}),
        "spec.algorithm.sampling.temperature",
    ),
    (
        "correlation-above-one",
        "RLRun",
        set_("spec.fidelity", {"minCorrelation": "1.5"}),
        "spec.fidelity.minCorrelation",
    ),
    ("suspend-not-bool", "RLRun", set_("spec.suspend", "yes"), "spec.suspend"),
    ("pool-without-images", "SandboxPool", set_("spec.source", {}), "spec.source"),
    (
        "lookahead-missing",
        "SandboxPool",
        set_("spec.prePull", {"policy": "Lookahead"}),
        "spec.prePull.lookahead",
    ),
    (
        "lookahead-with-all",
        "SandboxPool",
        set_("spec.prePull", {"policy": "All", "lookahead": 4}),
        "spec.prePull.lookahead",
    ),
    ("too-few-pids", "SandboxPool", set_("spec.maxPids", 10), "spec.maxPids"),
    ("relative-workspace", "SandboxPool", set_("spec.workspace", {"path": "testbed"}), "spec.workspace.path"),
    ("unknown-egress-mode", "SandboxPool", set_("spec.defenses", {"egress": "Open"}), "spec.defenses.egress"),
    ("fleet-without-model", "RolloutFleet", del_("spec.model"), "spec.model"),
    (
        "tp-beyond-node",
        "RolloutFleet",
        set_("spec.parallelism", {"gpusPerNode": 2, "tensorParallelSize": 4, "nodesPerReplica": 2}),
        "spec.parallelism.tensorParallelSize",
    ),
    ("negative-replicas", "RolloutFleet", set_("spec.replicas", -1), "spec.replicas"),
    (
        "ep-without-tp",
        "RolloutFleet",
        set_("spec.parallelism", {"gpusPerNode": 1, "tensorParallelSize": 1, "expertParallel": "Enabled"}),
        "spec.parallelism.expertParallel",
    ),
    (
        "gpu-memory-100-percent",
        "RolloutFleet",
        set_("spec.settings", {"gpuMemoryUtilizationPercent": 100}),
        "spec.settings.gpuMemoryUtilizationPercent",
    ),
    (
        "extra-args-not-a-list",
        "RolloutFleet",
        set_("spec.settings", {"extraArgs": "--x"}),
        "spec.settings.extraArgs",
    ),
    # Map keys: refused by the CRD's CEL rule over the keys (the generator makes one from the key
    # pattern) and by legorl validate, which names the key itself.
    (
        "bad-resource-name",
        "RLRun",
        set_("spec.trainer.resources.requests.CPU!", "1"),
        "spec.trainer.resources.requests.CPU!",
    ),
    (
        "bad-node-selector-key",
        "SandboxPool",
        set_("spec.placement", {"nodeSelector": {"-bad/key/x": "1"}}),
        "spec.placement.nodeSelector.-bad/key/x",
    ),
]


def _strict(schema: Any) -> Any:
    """The schema with unknown fields forbidden where the API server prunes or rejects them."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def _list_map_duplicates(schema: dict[str, Any], obj: Any, path: str = "") -> list[str]:
    """Paths of lists with duplicates where the schema says list-type map (by key) or set."""
    found = []
    list_type = schema.get("x-kubernetes-list-type")
    if isinstance(obj, list) and list_type in ("map", "set"):
        keys = schema.get("x-kubernetes-list-map-keys", [])
        seen = set()
        for item in obj:
            key = tuple(item.get(k) for k in keys) if list_type == "map" else (item,)
            if key in seen:
                found.append(path)
            seen.add(key)
    if isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in obj:
                found += _list_map_duplicates(sub, obj[name], f"{path}.{name}")
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            found += _list_map_duplicates(schema["items"], item, f"{path}[{i}]")
    return found


def api_server_rejections(obj: dict[str, Any]) -> list[tuple[str, str]]:
    """What the API server would say about creating `obj` (emulated: schema, list-maps, CEL),
    as (field path, message) pairs."""
    kind = obj.get("kind")
    if kind not in KINDS or obj.get("apiVersion") != GROUP_VERSION:
        return [("apiVersion", f"no resource {obj.get('apiVersion')}/{kind} is served")]
    schema = openapi_schema(kind)
    defaulted = apply_defaults(schema, prune_nulls(schema, obj))
    validator = jsonschema.Draft7Validator(_strict(schema))
    found = [(".".join(map(str, e.absolute_path)), e.message) for e in validator.iter_errors(defaulted)]
    found += [(path.lstrip("."), "duplicate key") for path in _list_map_duplicates(schema, defaulted)]
    if not found:  # the API server runs CEL on objects that passed the schema
        found += [(v.path.lstrip("."), v.message) for v in cel_violations(schema, defaulted)]
    return found


def _manifest(kind: str, edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    obj: dict[str, Any] = copy.deepcopy(yaml.safe_load(BASES[kind]))
    edit(obj)
    return obj


@pytest.mark.parametrize(
    ("kind", "edit"),
    [
        ("RLRun", both(set_("spec.fleetRef", {"name": "shared"}), set_("spec.fleet", None))),
        ("RLRun", set_("spec.stop", None)),
        ("RLRun", set_("spec.harness.apiFormat", None)),
        ("RLRun", set_("spec.policy.checkpoint.revision", None)),
    ],
    ids=["fleet-null", "stop-null", "api-format-null", "revision-null"],
)
def test_explicit_nulls_are_pruned_like_the_api_server_does(
    kind: str, edit: Callable[[dict[str, Any]], None]
) -> None:
    manifest = _manifest(kind, edit)
    assert api_server_rejections(manifest) == []
    (report,) = validate_documents(parse_documents(to_yaml(manifest), "nulls.yaml"))
    assert [p for p in report.problems if p.severity == "error"] == []
    assert report.resource is not None


@pytest.mark.parametrize("kind", sorted(BASES))
def test_bases_are_valid(kind: str) -> None:
    obj = yaml.safe_load(BASES[kind])
    assert api_server_rejections(obj) == []
    (report,) = validate_documents(parse_documents(BASES[kind], "base.yaml"))
    assert report.problems == []


@pytest.mark.parametrize("split", ["validation", "test"])
def test_task_set_split_alone_is_valid(split: str) -> None:
    manifest = _manifest("RLRun", set_("spec.tasks.split", {"taskSetSplit": split}))
    assert api_server_rejections(manifest) == []
    (report,) = validate_documents(parse_documents(to_yaml(manifest), "split.yaml"))
    assert [p for p in report.problems if p.severity == "error"] == []
    assert isinstance(report.resource, RLRun)
    assert report.resource.spec.tasks.split.task_set_split == split


def test_there_are_at_least_25_distinct_invalid_manifests() -> None:
    ids = [case[0] for case in CASES]
    assert len(ids) == len(set(ids)) >= 25
    rendered = {yaml.safe_dump(_manifest(kind, edit), sort_keys=True) for _, kind, edit, _ in CASES}
    assert len(rendered) == len(CASES), "two cases produce the same manifest"


@pytest.mark.parametrize(("kind", "edit", "path"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_api_server_rejects(kind: str, edit: Callable[[dict[str, Any]], None], path: str) -> None:
    rejections = api_server_rejections(_manifest(kind, edit))
    assert rejections, "the CRD schema and CEL rules accept this manifest"
    # jsonschema reports unknown and missing fields at the enclosing object: a prefix of `path`.
    assert any(path == where or path.startswith(where + ".") for where, _ in rejections), rejections


@pytest.mark.parametrize(
    ("kind", "edit", "path"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_legorl_validate_names_the_field(
    kind: str,
    edit: Callable[[dict[str, Any]], None],
    path: str,
    tmp_path: Path,
    run_cli: Callable[..., tuple[int, str, str]],
) -> None:
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(to_yaml(_manifest(kind, edit)))
    code, out, _ = run_cli("validate", str(manifest))
    assert code == 1, out
    errors = [line for line in out.splitlines() if ": error: " in line]
    assert errors, out
    # The problem is reported at the field (or the object holding the conflicting fields).
    matching = [line for line in errors if f": error: {path}: " in line]
    assert matching, f"no error at {path!r}:\n{out}"
    message = matching[0].split(f": error: {path}: ", 1)[1]
    assert len(message) > 15, f"message too terse to act on: {message!r}"
