"""One manifest per CRD CEL rule (and per place the rule sits) that only that rule rejects.

Each `RuleCase` edits a valid base manifest from `tests/api/test_invalid_manifests.py` so that the
schema stage passes and exactly one `x-kubernetes-validations` rule returns false: a real API
server must then refuse it with that rule's message and nothing else. The edits also keep
`metadata.name` a valid DNS subdomain, because the API server checks object metadata on its
own, next to the schema, and would add its own error to the rule's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from legorl.api import KINDS
from legorl.api.common import LABEL_KEY_RE, RESOURCE_NAME_RE
from legorl.api.crd import openapi_schema
from legorl.manifests.structural import all_rules
from tests.api.test_invalid_manifests import both, del_, set_

Edit = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class RuleCase:
    """A manifest edit that breaks exactly one rule, at one schema path of one kind."""

    name: str
    kind: str
    path: str
    """The schema path as `all_rules` gives it: `.` for the root, `[]` for list items."""
    rule: str
    edit: Edit


def rule_entries() -> list[tuple[str, str, dict[str, Any]]]:
    """(kind, schema path, validation entry) for every CEL rule of every CRD, as generated."""
    return [(kind, path, entry) for kind in KINDS for path, entry in all_rules(openapi_schema(kind))]


# Rule texts that sit at several paths (shared sub-schemas), spelled once.
NAME = "self.metadata.name.size() <= 40 && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')"
MODEL_URI = (
    "self.uri.startsWith('hf://') || self.uri.startsWith('s3://') || self.uri.startsWith('gs://')"
    " || self.uri.startsWith('pvc://') || self.uri.startsWith('file://')"
    " || self.uri.startsWith('builtin://')"
)
TASKS_URI = (
    "self.uri.startsWith('builtin://') || self.uri.startsWith('s3://') || self.uri.startsWith('gs://')"
    " || self.uri.startsWith('pvc://') || self.uri.startsWith('file://')"
    " || self.uri.startsWith('configmap://')"
)
STORE_URI = (
    "self.uri.startsWith('s3://') || self.uri.startsWith('gs://') || self.uri.startsWith('pvc://')"
    " || self.uri.startsWith('file://')"
)
ENGINE_SHAPE = (
    "self.gpusPerNode == 0 ? (self.tensorParallelSize == 1 && self.pipelineParallelSize == 1"
    " && self.nodesPerReplica == 1) : self.tensorParallelSize * self.pipelineParallelSize"
    " == self.gpusPerNode * self.nodesPerReplica"
)
ENGINE_TP_IN_NODE = "self.gpusPerNode == 0 || self.tensorParallelSize <= self.gpusPerNode"
ENGINE_EP_NEEDS_TP = "self.expertParallel == 'Disabled' || self.tensorParallelSize > 1"
ENV_ONE_SOURCE = "!(has(self.value) && has(self.valueFrom))"
TOLERATION_KEY = "self.operator == 'Exists' || has(self.key)"
TOLERATION_VALUE = "self.operator != 'Exists' || !has(self.value)"
TOLERATION_SECONDS = "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')"
POOL_REPLICAS = "self.replicas == 0 || (has(self.source.images) && size(self.source.images) == 1)"
POOL_SOURCE = "(has(self.images) && size(self.images) > 0) || has(self.taskSet)"
PREPULL_LOOKAHEAD_ONLY = "!has(self.lookahead) || self.policy == 'Lookahead'"
PREPULL_LOOKAHEAD_NEEDED = "self.policy != 'Lookahead' || has(self.lookahead)"
# Map-key rules: a structural schema cannot constrain keys, so the CRD checks them with CEL.
RESOURCE_KEYS = f"self.all(k, k.size() <= 63 && k.matches(r'{RESOURCE_NAME_RE}'))"
LABEL_KEYS = f"self.all(k, k.size() <= 252 && k.matches(r'{LABEL_KEY_RE}'))"
# The trainer's ranks per node: processesPerNode, else one per GPU, else 1 (a CPU trainer).
_RANKS = (
    "(has(self.processesPerNode) ? self.processesPerNode : (self.gpusPerNode == 0 ? 1 : self.gpusPerNode))"
)


def _name_cases(kind: str) -> list[RuleCase]:
    # 41 lowercase letters: a valid DNS subdomain for the API server's own metadata check, too long
    # for the rule (child object names get suffixes). "My-Run" would draw a second error from it.
    return [RuleCase(f"{kind.lower()}-name-too-long", kind, ".", NAME, set_("metadata.name", "a" * 41))]


def _engine_cases(prefix: str, kind: str, at: str) -> list[RuleCase]:
    """The three engine-layout rules of a fleet's `parallelism` at `at` (dotted, no leading dot)."""
    path = f".{at}"
    return [
        # 2 shards on 4 GPUs: within a node, but not one shard per GPU.
        RuleCase(
            f"{prefix}-engine-shards-not-gpus",
            kind,
            path,
            ENGINE_SHAPE,
            set_(at, {"gpusPerNode": 4, "tensorParallelSize": 2}),
        ),
        # TP 4 over 2 nodes of 2 GPUs: one shard per GPU, but TP crosses the node boundary.
        RuleCase(
            f"{prefix}-engine-tp-beyond-node",
            kind,
            path,
            ENGINE_TP_IN_NODE,
            set_(at, {"gpusPerNode": 2, "nodesPerReplica": 2, "tensorParallelSize": 4}),
        ),
        RuleCase(
            f"{prefix}-engine-ep-without-tp",
            kind,
            path,
            ENGINE_EP_NEEDS_TP,
            set_(at, {"gpusPerNode": 1, "tensorParallelSize": 1, "expertParallel": "Enabled"}),
        ),
    ]


def _env_case(name: str, kind: str, at: str) -> RuleCase:
    """An env list at `at` whose first entry sets both value and valueFrom."""
    env = [{"name": "A", "value": "1", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
    return RuleCase(name, kind, f".{at}[]", ENV_ONE_SOURCE, set_(at, env))


def _toleration_cases(prefix: str, kind: str, placement: str) -> list[RuleCase]:
    """The three toleration rules of the placement at `placement` (dotted, no leading dot)."""
    at = f"{placement}.tolerations"
    path = f".{at}[]"
    return [
        RuleCase(
            f"{prefix}-toleration-equal-without-key",
            kind,
            path,
            TOLERATION_KEY,
            set_(at, [{"operator": "Equal", "value": "x", "effect": "NoSchedule"}]),
        ),
        RuleCase(
            f"{prefix}-toleration-exists-with-value",
            kind,
            path,
            TOLERATION_VALUE,
            set_(at, [{"key": "gpu", "operator": "Exists", "value": "x"}]),
        ),
        RuleCase(
            f"{prefix}-toleration-seconds-without-noexecute",
            kind,
            path,
            TOLERATION_SECONDS,
            set_(at, [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}]),
        ),
    ]


def _key_cases(prefix: str, kind: str, at: str) -> list[RuleCase]:
    """The key rules of the resources and placement of the component at `at` (dotted, no leading dot).

    Each bad key sits next to good ones and carries a valid value (a quantity, a label value), so
    that only the key rule fails.
    """
    return [
        RuleCase(
            f"{prefix}-requests-bad-key",
            kind,
            f".{at}.resources.requests",
            RESOURCE_KEYS,
            set_(f"{at}.resources.requests", {"cpu": "2", "CPU!": "1"}),
        ),
        RuleCase(
            f"{prefix}-limits-bad-key",
            kind,
            f".{at}.resources.limits",
            RESOURCE_KEYS,
            set_(f"{at}.resources.limits", {"memory": "8Gi", "nvidia.com/": "1"}),
        ),
        RuleCase(
            f"{prefix}-node-selector-bad-key",
            kind,
            f".{at}.placement.nodeSelector",
            LABEL_KEYS,
            set_(f"{at}.placement.nodeSelector", {"legorl.dev/pool": "gpu", "-bad/key/x": "gpu"}),
        ),
    ]


def _pool_cases(prefix: str, kind: str, at: str) -> list[RuleCase]:
    """The pool rules of a SandboxPool spec at `at` (dotted, no leading dot; `spec` or `spec.pool`)."""
    return [
        # A taskSet-only source serves many images: warm sandboxes cannot be pre-made for it.
        RuleCase(
            f"{prefix}-warm-replicas-without-one-image",
            kind,
            f".{at}",
            POOL_REPLICAS,
            both(
                set_(f"{at}.source", {"taskSet": {"uri": "builtin://tiny-python"}}),
                set_(f"{at}.replicas", 1),
            ),
        ),
        # replicas stays at its default 0, so only the source's own rule fails.
        RuleCase(f"{prefix}-source-empty", kind, f".{at}.source", POOL_SOURCE, set_(f"{at}.source", {})),
        RuleCase(
            f"{prefix}-task-set-https-uri",
            kind,
            f".{at}.source.taskSet",
            TASKS_URI,
            set_(f"{at}.source", {"taskSet": {"uri": "https://example.com/tasks.jsonl"}}),
        ),
        RuleCase(
            f"{prefix}-lookahead-with-policy-all",
            kind,
            f".{at}.prePull",
            PREPULL_LOOKAHEAD_ONLY,
            set_(f"{at}.prePull", {"policy": "All", "lookahead": 4}),
        ),
        RuleCase(
            f"{prefix}-lookahead-missing",
            kind,
            f".{at}.prePull",
            PREPULL_LOOKAHEAD_NEEDED,
            set_(f"{at}.prePull", {"policy": "Lookahead"}),
        ),
        *_toleration_cases(prefix, kind, f"{at}.placement"),
        *_key_cases(prefix, kind, at),
    ]


def _rlrun_cases() -> list[RuleCase]:
    kind = "RLRun"
    spec_rules = [
        ("no-fleet", "has(self.fleetRef) || has(self.fleet)", del_("spec.fleet")),
        (
            "fleet-and-fleet-ref",
            "!(has(self.fleetRef) && has(self.fleet))",
            set_("spec.fleetRef", {"name": "shared"}),
        ),
        ("no-pool", "has(self.poolRef) || has(self.pool)", del_("spec.pool")),
        (
            "pool-and-pool-ref",
            "!(has(self.poolRef) && has(self.pool))",
            set_("spec.poolRef", {"name": "shared"}),
        ),
        (
            "replay-without-capture",
            "!has(self.fleet) || self.trainer.routingReplay != 'Enabled'"
            " || self.fleet.settings.routedExpertsCapture == 'Enabled'",
            both(
                set_("spec.trainer.routingReplay", "Enabled"),
                set_("spec.fleet.settings.routedExpertsCapture", "Disabled"),
            ),
        ),
    ]
    harness_rules = [
        # apiFormat set, so only the command rule fails (a Custom harness needs both).
        (
            "custom-harness-without-command",
            "self.kind != 'Custom' || (has(self.command) && size(self.command) > 0)",
            both(set_("spec.harness.kind", "Custom"), set_("spec.harness.apiFormat", "OpenAIResponses")),
        ),
        (
            "custom-harness-without-api-format",
            "self.kind != 'Custom' || has(self.apiFormat)",
            both(set_("spec.harness.kind", "Custom"), set_("spec.harness.command", ["my-agent", "{prompt}"])),
        ),
        (
            "claude-code-speaking-responses",
            "self.kind != 'ClaudeCode' || !has(self.apiFormat) || self.apiFormat == 'AnthropicMessages'",
            both(set_("spec.harness.kind", "ClaudeCode"), set_("spec.harness.apiFormat", "OpenAIResponses")),
        ),
        (
            "codex-speaking-messages",
            "self.kind != 'Codex' || !has(self.apiFormat) || self.apiFormat == 'OpenAIResponses'",
            both(set_("spec.harness.kind", "Codex"), set_("spec.harness.apiFormat", "AnthropicMessages")),
        ),
    ]
    split_rules = [
        ("split-empty", "has(self.heldOutPercent) || has(self.heldOutTaskIds) || has(self.taskSetSplit)", {}),
        (
            "split-percent-and-ids",
            "!(has(self.heldOutPercent) && has(self.heldOutTaskIds))",
            {"heldOutPercent": 10, "heldOutTaskIds": ["t1"]},
        ),
        (
            "split-percent-and-task-set-split",
            "!(has(self.heldOutPercent) && has(self.taskSetSplit))",
            {"heldOutPercent": 10, "taskSetSplit": "test"},
        ),
        (
            "split-ids-and-task-set-split",
            "!(has(self.heldOutTaskIds) && has(self.taskSetSplit))",
            {"heldOutTaskIds": ["t1"], "taskSetSplit": "validation"},
        ),
    ]
    algorithm_rules = [
        ("group-of-one", "self.groupSize >= 2", "groupSize", 1),
        (
            "learning-rate-above-one",
            "double(self.learningRate) > 0.0 && double(self.learningRate) < 1.0",
            "learningRate",
            "2",
        ),
        (
            "clip-low-above-one",
            "!has(self.clipLow) || (double(self.clipLow) > 0.0 && double(self.clipLow) < 1.0)",
            "clipLow",
            "1.5",
        ),
        ("clip-high-zero", "!has(self.clipHigh) || double(self.clipHigh) > 0.0", "clipHigh", "0"),
        (
            "negative-kl-coef",
            "double(self.klCoef) >= 0.0 && double(self.entropyCoef) >= 0.0",
            "klCoef",
            "-0.1",
        ),
    ]
    trainer = "self.nodes * " + _RANKS
    trainer_rules = [
        # 4 ranks per pod on an 8-GPU pod; 4 still divides by tensor × pipeline × context = 1.
        (
            "gpu-trainer-fewer-ranks-than-gpus",
            "!has(self.processesPerNode) || self.gpusPerNode == 0"
            " || self.processesPerNode == self.gpusPerNode",
            {"gpusPerNode": 8, "processesPerNode": 4},
        ),
        # context 3 does not divide 8 ranks; tensor × expert × pipeline (1) still does.
        (
            "trainer-context-does-not-divide",
            f"({trainer}) % (self.tensor * self.pipeline * self.context) == 0",
            {"gpusPerNode": 8, "context": 3},
        ),
        # TP 4 over 2 pods of 2 GPUs: 4 divides the 4 ranks, but TP crosses pods.
        (
            "trainer-tp-beyond-node",
            f"self.tensor <= {_RANKS}",
            {"nodes": 2, "gpusPerNode": 2, "tensor": 4},
        ),
        (
            "trainer-expert-does-not-divide",
            f"({trainer}) % (self.tensor * self.expert * self.pipeline) == 0",
            {"gpusPerNode": 8, "expert": 3},
        ),
    ]
    return [
        *_name_cases(kind),
        *(RuleCase(f"rlrun-{name}", kind, ".spec", rule, edit) for name, rule, edit in spec_rules),
        RuleCase(
            "rlrun-checkpoint-http-uri",
            kind,
            ".spec.policy.checkpoint",
            MODEL_URI,
            set_("spec.policy.checkpoint.uri", "http://example.com/model"),
        ),
        RuleCase(
            "rlrun-reference-http-uri",
            kind,
            ".spec.policy.reference",
            MODEL_URI,
            set_("spec.policy.reference", {"uri": "http://example.com/model"}),
        ),
        *_engine_cases("rlrun-fleet", kind, "spec.fleet.parallelism"),
        _env_case("rlrun-fleet-env-value-and-value-from", kind, "spec.fleet.settings.env"),
        *_toleration_cases("rlrun-fleet", kind, "spec.fleet.placement"),
        *_key_cases("rlrun-fleet", kind, "spec.fleet"),
        *_pool_cases("rlrun-pool", kind, "spec.pool"),
        *(RuleCase(f"rlrun-{name}", kind, ".spec.harness", rule, edit) for name, rule, edit in harness_rules),
        _env_case("rlrun-harness-env-value-and-value-from", kind, "spec.harness.env"),
        RuleCase(
            "rlrun-tasks-https-uri",
            kind,
            ".spec.tasks.source",
            TASKS_URI,
            set_("spec.tasks.source.uri", "https://example.com/tasks.jsonl"),
        ),
        *(
            RuleCase(f"rlrun-{name}", kind, ".spec.tasks.split", rule, set_("spec.tasks.split", split))
            for name, rule, split in split_rules
        ),
        *(
            RuleCase(f"rlrun-{name}", kind, ".spec.algorithm", rule, set_(f"spec.algorithm.{field}", value))
            for name, rule, field, value in algorithm_rules
        ),
        RuleCase(
            "rlrun-importance-cap-below-one",
            kind,
            ".spec.algorithm.importanceCorrection",
            "double(self.cap) >= 1.0",
            set_("spec.algorithm.importanceCorrection", {"cap": "0.5"}),
        ),
        RuleCase(
            "rlrun-temperature-zero",
            kind,
            ".spec.algorithm.sampling",
            "double(self.temperature) > 0.0 && double(self.temperature) <= 2.0",
            set_("spec.algorithm.sampling", {"temperature": "0"}),
        ),
        RuleCase(
            "rlrun-top-p-zero",
            kind,
            ".spec.algorithm.sampling",
            "double(self.topP) > 0.0 && double(self.topP) <= 1.0",
            set_("spec.algorithm.sampling", {"topP": "0"}),
        ),
        RuleCase(
            "rlrun-staleness-in-sync-mode",
            kind,
            ".spec.schedule",
            "!has(self.maxStalenessSteps) || self.mode == 'Async'",
            set_("spec.schedule", {"mode": "Sync", "maxStalenessSteps": 2}),
        ),
        *(
            RuleCase(
                f"rlrun-{name}", kind, ".spec.trainer.parallelism", rule, set_("spec.trainer.parallelism", p)
            )
            for name, rule, p in trainer_rules
        ),
        *_toleration_cases("rlrun-trainer", kind, "spec.trainer.placement"),
        *_key_cases("rlrun-trainer", kind, "spec.trainer"),
        RuleCase(
            "rlrun-checkpoints-builtin-uri",
            kind,
            ".spec.checkpoints.location",
            STORE_URI,
            set_("spec.checkpoints.location", {"uri": "builtin://x"}),
        ),
        RuleCase(
            "rlrun-store-bare-path",
            kind,
            ".spec.store",
            STORE_URI,
            set_("spec.store", {"uri": "/var/lib/legorl"}),
        ),
        RuleCase(
            "rlrun-stop-empty",
            kind,
            ".spec.stop",
            "has(self.maxSteps) || has(self.maxDurationSeconds) || has(self.targetReward)",
            set_("spec.stop", {}),
        ),
        RuleCase(
            "rlrun-target-reward-above-one",
            kind,
            ".spec.stop",
            "!has(self.targetReward)"
            " || (double(self.targetReward) > 0.0 && double(self.targetReward) <= 1.0)",
            set_("spec.stop", {"targetReward": "1.5"}),
        ),
        RuleCase(
            "rlrun-correlation-above-one",
            kind,
            ".spec.fidelity",
            "double(self.minCorrelation) >= 0.0 && double(self.minCorrelation) <= 1.0",
            set_("spec.fidelity", {"minCorrelation": "1.5"}),
        ),
    ]


def _fleet_cases() -> list[RuleCase]:
    kind = "RolloutFleet"
    return [
        *_name_cases(kind),
        *_engine_cases("rolloutfleet", kind, "spec.parallelism"),
        _env_case("rolloutfleet-env-value-and-value-from", kind, "spec.settings.env"),
        *_toleration_cases("rolloutfleet", kind, "spec.placement"),
        *_key_cases("rolloutfleet", kind, "spec"),
        RuleCase(
            "rolloutfleet-model-http-uri",
            kind,
            ".spec.model",
            MODEL_URI,
            set_("spec.model.uri", "http://x/m"),
        ),
    ]


def _sandbox_pool_cases() -> list[RuleCase]:
    kind = "SandboxPool"
    return [*_name_cases(kind), *_pool_cases("sandboxpool", kind, "spec")]


RULE_CASES: list[RuleCase] = [*_rlrun_cases(), *_fleet_cases(), *_sandbox_pool_cases()]

# (kind, schema path, rule) -> why no manifest can break that rule alone. Empty: every rule
# sitting in the CRDs today has a case above.
UNCOVERABLE: dict[tuple[str, str, str], str] = {}
