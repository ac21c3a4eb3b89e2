"""Every CEL rule in the generated CRDs compiles and is evaluated on passing and failing cases.

The API server evaluates these rules with its own CEL runtime; here cel-python
stands in for it. A rule added to a model without a case below fails
`test_every_rule_has_cases`.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from lark import Tree
from lark.lexer import Token

from legorl.api import KINDS
from legorl.api.crd import openapi_schema
from legorl.manifests.structural import _ENV, all_rules, cel_violations, compile_rule, eval_rule

# Functions both the Kubernetes CEL environment and cel-python provide. A rule using anything
# else would be accepted by one evaluator and not the other.
PORTABLE_FUNCTIONS = {
    "has",
    "all",
    "exists",
    "exists_one",
    "size",
    "matches",
    "startsWith",
    "endsWith",
    "contains",
    "double",
    "int",
    "string",
}


def _rules() -> dict[str, dict[str, Any]]:
    """Each distinct rule text, with one place it sits (kind + path) and its schema node."""
    found: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        for path, entry in all_rules(openapi_schema(kind)):
            found.setdefault(entry["rule"], {"where": f"{kind}{path}", **entry})
    return found


RULES = _rules()

# needle (the start of one rule, or a substring unique to it)
#   -> (self objects that pass, self objects that fail)
CASES: dict[str, tuple[list[Any], list[Any]]] = {
    "self.metadata.name.size() <= 40": (
        [{"metadata": {"name": "run-1"}}, {"metadata": {"name": "a" * 40}}],
        [
            {"metadata": {"name": "a" * 41}},
            {"metadata": {"name": "1run"}},
            {"metadata": {"name": "Run"}},
            {"metadata": {"name": "run-"}},
            {"metadata": {"name": "my.run"}},
        ],
    ),
    "self.uri.startsWith('hf://')": (
        [{"uri": "hf://Qwen/Qwen3-8B"}, {"uri": "pvc://models/x"}, {"uri": "builtin://tiny-moe"}],
        [{"uri": "http://example.com/model"}, {"uri": "/models/x"}, {"uri": "HF://x"}],
    ),
    "self.tensorParallelSize * self.pipelineParallelSize == self.gpusPerNode * self.nodesPerReplica": (
        [
            {"gpusPerNode": 4, "nodesPerReplica": 1, "tensorParallelSize": 4, "pipelineParallelSize": 1},
            {"gpusPerNode": 8, "nodesPerReplica": 2, "tensorParallelSize": 8, "pipelineParallelSize": 2},
            {"gpusPerNode": 0, "nodesPerReplica": 1, "tensorParallelSize": 1, "pipelineParallelSize": 1},
        ],
        [
            {"gpusPerNode": 4, "nodesPerReplica": 1, "tensorParallelSize": 2, "pipelineParallelSize": 1},
            {"gpusPerNode": 0, "nodesPerReplica": 1, "tensorParallelSize": 2, "pipelineParallelSize": 1},
            {"gpusPerNode": 0, "nodesPerReplica": 2, "tensorParallelSize": 1, "pipelineParallelSize": 1},
        ],
    ),
    "self.gpusPerNode == 0 || self.tensorParallelSize <= self.gpusPerNode": (
        [{"gpusPerNode": 8, "tensorParallelSize": 8}, {"gpusPerNode": 0, "tensorParallelSize": 1}],
        [{"gpusPerNode": 4, "tensorParallelSize": 8}],
    ),
    "self.expertParallel == 'Disabled' || self.tensorParallelSize > 1": (
        [
            {"expertParallel": "Disabled", "tensorParallelSize": 1},
            {"expertParallel": "Enabled", "tensorParallelSize": 2},
        ],
        [{"expertParallel": "Enabled", "tensorParallelSize": 1}],
    ),
    "!(has(self.value) && has(self.valueFrom))": (
        [
            {"name": "A", "value": "1"},
            {"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            {"name": "EMPTY"},
        ],
        [{"name": "A", "value": "1", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
    ),
    "self.operator == 'Exists' || has(self.key)": (
        [{"operator": "Exists"}, {"operator": "Equal", "key": "gpu", "value": "x"}],
        [{"operator": "Equal"}, {"operator": "Equal", "value": "x", "effect": "NoSchedule"}],
    ),
    "self.operator != 'Exists' || !has(self.value)": (
        [{"operator": "Exists"}, {"operator": "Equal", "value": "x"}],
        [{"operator": "Exists", "value": "x"}],
    ),
    "!has(self.tolerationSeconds)": (
        [{"operator": "Exists"}, {"operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30}],
        [
            {"operator": "Exists", "tolerationSeconds": 30},
            {"operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30},
        ],
    ),
    "(has(self.images) && size(self.images) > 0) || has(self.taskSet)": (
        [
            {"images": ["a:1"]},
            {"taskSet": {"uri": "s3://b/t.jsonl"}},
            {"images": [], "taskSet": {"uri": "s3://x"}},
        ],
        [{}, {"images": []}],
    ),
    "self.uri.startsWith('builtin://')": (
        [{"uri": "builtin://tiny-python"}, {"uri": "configmap://tasks/tasks.jsonl"}, {"uri": "s3://b/t"}],
        [{"uri": "https://example.com/tasks.jsonl"}, {"uri": "tasks.jsonl"}],
    ),
    "self.replicas == 0 || (has(self.source.images)": (
        [
            {"replicas": 0, "source": {"taskSet": {"uri": "builtin://tiny-python"}}},
            {"replicas": 3, "source": {"images": ["repo/app:1"]}},
        ],
        [
            {"replicas": 1, "source": {"images": ["repo/a:1", "repo/b:1"]}},
            {"replicas": 1, "source": {"taskSet": {"uri": "builtin://tiny-python"}}},
        ],
    ),
    "!has(self.lookahead) || self.policy == 'Lookahead'": (
        [{"policy": "All"}, {"policy": "Lookahead", "lookahead": 8}],
        [{"policy": "All", "lookahead": 8}],
    ),
    "self.policy != 'Lookahead' || has(self.lookahead)": (
        [{"policy": "Never"}, {"policy": "Lookahead", "lookahead": 1}],
        [{"policy": "Lookahead"}],
    ),
    "has(self.fleetRef) || has(self.fleet)": (
        [{"fleetRef": {"name": "f"}}, {"fleet": {}}],
        [{}],
    ),
    "!(has(self.fleetRef) && has(self.fleet))": (
        [{"fleetRef": {"name": "f"}}, {"fleet": {}}, {}],
        [{"fleetRef": {"name": "f"}, "fleet": {}}],
    ),
    "has(self.poolRef) || has(self.pool)": (
        [{"poolRef": {"name": "p"}}, {"pool": {"source": {"images": ["a:1"]}}}],
        [{}],
    ),
    "!(has(self.poolRef) && has(self.pool))": (
        [{"poolRef": {"name": "p"}}, {}],
        [{"poolRef": {"name": "p"}, "pool": {"source": {"images": ["a:1"]}}}],
    ),
    "self.trainer.routingReplay != 'Enabled'": (
        [
            {"trainer": {"routingReplay": "Enabled"}},
            {
                "trainer": {"routingReplay": "Enabled"},
                "fleet": {"settings": {"routedExpertsCapture": "Enabled"}},
            },
            {
                "trainer": {"routingReplay": "Auto"},
                "fleet": {"settings": {"routedExpertsCapture": "Disabled"}},
            },
        ],
        [
            {
                "trainer": {"routingReplay": "Enabled"},
                "fleet": {"settings": {"routedExpertsCapture": "Disabled"}},
            }
        ],
    ),
    "self.kind != 'Custom' || (has(self.command)": (
        [{"kind": "Codex"}, {"kind": "Custom", "command": ["my-agent", "{prompt}"]}],
        [{"kind": "Custom"}, {"kind": "Custom", "command": []}],
    ),
    "self.kind != 'Custom' || has(self.apiFormat)": (
        [{"kind": "OpenCode"}, {"kind": "Custom", "apiFormat": "OpenAIChatCompletions"}],
        [{"kind": "Custom"}],
    ),
    "self.kind != 'ClaudeCode'": (
        [{"kind": "ClaudeCode"}, {"kind": "ClaudeCode", "apiFormat": "AnthropicMessages"}],
        [{"kind": "ClaudeCode", "apiFormat": "OpenAIResponses"}],
    ),
    "self.kind != 'Codex'": (
        [{"kind": "Codex"}, {"kind": "OpenCode", "apiFormat": "AnthropicMessages"}],
        [{"kind": "Codex", "apiFormat": "OpenAIChatCompletions"}],
    ),
    "has(self.heldOutPercent) || has(self.heldOutTaskIds)": (
        [{"heldOutPercent": 10}, {"heldOutTaskIds": ["t1"]}, {"taskSetSplit": "test"}],
        [{}],
    ),
    "!(has(self.heldOutPercent) && has(self.heldOutTaskIds))": (
        [{"heldOutPercent": 10}, {}, {"heldOutPercent": 0}, {"heldOutTaskIds": [], "taskSetSplit": "test"}],
        [{"heldOutPercent": 10, "heldOutTaskIds": ["t1"]}, {"heldOutPercent": 0, "heldOutTaskIds": []}],
    ),
    "!(has(self.heldOutPercent) && has(self.taskSetSplit))": (
        [
            {"taskSetSplit": "validation"},
            {"heldOutPercent": 10},
            {"heldOutTaskIds": ["t1"], "taskSetSplit": "test"},
        ],
        [{"heldOutPercent": 10, "taskSetSplit": "test"}, {"heldOutPercent": 0, "taskSetSplit": "validation"}],
    ),
    "!(has(self.heldOutTaskIds) && has(self.taskSetSplit))": (
        [{"taskSetSplit": "test"}, {"heldOutTaskIds": ["t1"]}, {"heldOutPercent": 5, "taskSetSplit": "test"}],
        [
            {"heldOutTaskIds": ["t1"], "taskSetSplit": "validation"},
            {"heldOutTaskIds": [], "taskSetSplit": "test"},
        ],
    ),
    # PPO's baseline is its group's mean too: with one trial per group every advantage is 0 and the
    # zero-variance filter drops every group, so PPO with groupSize 1 would validate and never train.
    "self.groupSize >= 2": (
        [{"name": "GRPO", "groupSize": 2}, {"name": "PPO", "groupSize": 2}],
        [{"name": "GRPO", "groupSize": 1}, {"name": "GSPO", "groupSize": 1}, {"name": "PPO", "groupSize": 1}],
    ),
    "double(self.learningRate) > 0.0": (
        [{"learningRate": "1e-6"}, {"learningRate": "0.5"}],
        [{"learningRate": "0"}, {"learningRate": "1"}, {"learningRate": "-1e-6"}, {"learningRate": "2.5"}],
    ),
    "!has(self.clipLow)": (
        [{}, {"clipLow": "0.2"}],
        [{"clipLow": "0"}, {"clipLow": "1.5"}],
    ),
    "!has(self.clipHigh)": (
        [{}, {"clipHigh": "0.28"}, {"clipHigh": "4e-4"}],
        [{"clipHigh": "0"}, {"clipHigh": "-0.1"}],
    ),
    "double(self.klCoef) >= 0.0": (
        [{"klCoef": "0", "entropyCoef": "0"}, {"klCoef": "0.01", "entropyCoef": "1e-3"}],
        [{"klCoef": "-0.1", "entropyCoef": "0"}, {"klCoef": "0", "entropyCoef": "-1"}],
    ),
    "double(self.cap) >= 1.0": ([{"cap": "1"}, {"cap": "2.0"}], [{"cap": "0.5"}]),
    "double(self.temperature) > 0.0": (
        [{"temperature": "1.0"}, {"temperature": "2"}],
        [{"temperature": "0"}, {"temperature": "2.5"}],
    ),
    "double(self.topP) > 0.0": ([{"topP": "1.0"}, {"topP": "0.95"}], [{"topP": "0"}, {"topP": "1.01"}]),
    "!has(self.maxStalenessSteps) || self.mode == 'Async'": (
        [{"mode": "Sync"}, {"mode": "Async", "maxStalenessSteps": 2}],
        [{"mode": "Sync", "maxStalenessSteps": 1}],
    ),
    "!has(self.processesPerNode)": (
        [
            {"gpusPerNode": 8},
            {"gpusPerNode": 8, "processesPerNode": 8},
            {"gpusPerNode": 0, "processesPerNode": 4},
        ],
        [{"gpusPerNode": 8, "processesPerNode": 4}],
    ),
    "% (self.tensor * self.pipeline * self.context) == 0": (
        [
            {"nodes": 4, "gpusPerNode": 8, "tensor": 2, "pipeline": 2, "expert": 8, "context": 1},
            {"nodes": 1, "gpusPerNode": 0, "tensor": 1, "pipeline": 1, "expert": 1, "context": 1},
            # A CPU trainer of gloo ranks (tests, layouts tried without GPUs).
            {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 4, "tensor": 2, "pipeline": 2, "context": 1},
        ],
        [
            {"nodes": 1, "gpusPerNode": 8, "tensor": 3, "pipeline": 1, "expert": 1, "context": 1},
            {"nodes": 1, "gpusPerNode": 0, "tensor": 2, "pipeline": 1, "expert": 1, "context": 1},
            {"nodes": 1, "gpusPerNode": 0, "processesPerNode": 3, "tensor": 1, "pipeline": 2, "context": 1},
        ],
    ),
    "self.tensor <= ": (
        [{"gpusPerNode": 8, "tensor": 8}, {"gpusPerNode": 0, "processesPerNode": 2, "tensor": 2}],
        [{"gpusPerNode": 4, "tensor": 8}, {"gpusPerNode": 0, "tensor": 2}],
    ),
    "% (self.tensor * self.expert * self.pipeline) == 0": (
        [
            {"nodes": 2, "gpusPerNode": 8, "tensor": 1, "pipeline": 2, "expert": 8},
            {"nodes": 4, "gpusPerNode": 8, "tensor": 2, "pipeline": 1, "expert": 8},
            {"nodes": 1, "gpusPerNode": 0, "tensor": 1, "pipeline": 1, "expert": 1},
        ],
        [
            {"nodes": 1, "gpusPerNode": 8, "tensor": 1, "pipeline": 2, "expert": 8},
            {"nodes": 1, "gpusPerNode": 6, "tensor": 1, "pipeline": 1, "expert": 4},
            {"nodes": 1, "gpusPerNode": 8, "tensor": 2, "pipeline": 1, "expert": 8},
        ],
    ),
    "self.uri.startsWith('s3://')": (
        [{"uri": "s3://bucket/runs"}, {"uri": "file:///var/lib/legorl"}, {"uri": "pvc://store/x"}],
        [{"uri": "builtin://x"}, {"uri": "/var/lib/legorl"}, {"uri": "hf://org/x"}],
    ),
    "has(self.maxSteps) || has(self.maxDurationSeconds) || has(self.targetReward)": (
        [{"maxSteps": 1}, {"maxDurationSeconds": 60}, {"targetReward": "0.5"}],
        [{}, {"maxInfraFailurePercent": 50}],
    ),
    "!has(self.targetReward)": (
        [{}, {"targetReward": "1"}, {"targetReward": "0.75"}],
        [{"targetReward": "0"}, {"targetReward": "1.5"}],
    ),
    "double(self.minCorrelation) >= 0.0": (
        [{"minCorrelation": "0.99"}, {"minCorrelation": "1"}, {"minCorrelation": "0"}],
        [{"minCorrelation": "1.01"}, {"minCorrelation": "-0.5"}],
    ),
    # Resource maps (requests, limits): Kubernetes' container resource names, the standard ones
    # or a name with a DNS-subdomain prefix (extended resources), 63 characters at most in all.
    "self.all(k, k.size() <= 63 && k.matches(": (
        [
            {},
            {"cpu": "2", "memory": "4Gi"},
            {"ephemeral-storage": "10Gi", "hugepages-2Mi": "1Gi", "hugepages-1Gi": "2Gi"},
            {"nvidia.com/gpu": 8, "amd.com/gpu": 1, "example.com/foo_bar.Baz-2": 1},
            {"example.com/" + "g" * 51: 1},  # exactly 63 characters
        ],
        [
            {"CPU!": "1"},
            {"cpu": "1", "Cpu": "1"},  # one bad key among good ones is enough
            {"-bad/key/x": "1"},
            {"": "1"},
            {"nvidia.com/": 1},  # a prefix with no name
            {"/gpu": 1},  # a name with an empty prefix
            {"gpu": 1},  # a non-standard name needs a prefix
            {"hugepages-": "1Gi"},  # a hugepages size is required
            {"Nvidia.com/gpu": 1},  # the prefix is a lowercase DNS subdomain
            {"nvidia..com/gpu": 1},
            {"example.com/-gpu": 1},  # the name starts and ends alphanumeric
            {"example.com/gpu_": 1},
            {"a/b/c": 1},
            {"cpu ": "1"},
            {"cpu\n": "1"},
            {"example.com/" + "g" * 52: 1},  # 64 characters
        ],
    ),
    # nodeSelector: Kubernetes' qualified label keys, an optional lowercase DNS-subdomain prefix
    # and a name, 252 characters at most in all.
    "self.all(k, k.size() <= 252 && k.matches(": (
        [
            {},
            {"app": "x", "Role": "gpu", "app_name.v2": "y"},
            {"kubernetes.io/hostname": "node-1", "node.kubernetes.io/instance-type": "p5.48xlarge"},
            {"legorl.dev/pool": "gpu", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            # exactly 252 characters: three 63/63/60-character DNS labels, then a 63-character name
            {"a" * 63 + "." + "b" * 63 + "." + "c" * 60 + "/" + "d" * 63: "v"},
        ],
        [
            {"-bad/key/x": "v"},
            {"app": "x", "-app": "y"},
            {"": "v"},
            {"Example.com/key": "v"},  # the prefix is lowercase
            {"example.com/": "v"},  # a prefix with no name
            {"/key": "v"},  # an empty prefix
            {"a/b/c": "v"},
            {"key-": "v"},
            {"app.kubernetes.io/-name": "v"},
            {"-example.com/key": "v"},
            {"example..com/key": "v"},
            {"key with space": "v"},
            {"key\n": "v"},
            {"a" * 63 + "." + "b" * 63 + "." + "c" * 61 + "/" + "d" * 63: "v"},  # 253 characters
        ],
    ),
}


def _rule_for(needle: str) -> str:
    # A rule that starts with the needle wins; otherwise the needle must occur in exactly one rule.
    matches = [rule for rule in RULES if rule.startswith(needle)] or [
        rule for rule in RULES if needle in rule
    ]
    assert len(matches) == 1, f"needle {needle!r} matches {len(matches)} rules: {matches}"
    return matches[0]


def test_every_rule_has_cases() -> None:
    covered = {_rule_for(needle) for needle in CASES}
    missing = [f"{RULES[r]['where']}: {r}" for r in RULES if r not in covered]
    assert not missing, "rules without pass/fail cases in tests/api/test_cel.py:\n" + "\n".join(missing)


@pytest.mark.parametrize("rule", sorted(RULES), ids=lambda r: RULES[r]["where"])
def test_rule_compiles_and_is_portable(rule: str) -> None:
    compile_rule(rule)
    called = set()
    for tree in _ENV.compile(rule).iter_subtrees():
        if tree.data in ("member_dot_arg", "ident_arg"):
            called |= {str(c) for c in tree.children if isinstance(c, Token)}
    assert called <= PORTABLE_FUNCTIONS, f"{rule}: uses {called - PORTABLE_FUNCTIONS}"
    entry = RULES[rule]
    assert entry["message"], "every rule needs a message a person can act on"
    assert entry["reason"] in {"FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired"}
    assert isinstance(_ENV.compile(rule), Tree)


@pytest.mark.parametrize("needle", sorted(CASES))
def test_rule_passes_and_fails(needle: str) -> None:
    rule = _rule_for(needle)
    passing, failing = CASES[needle]
    assert passing and failing, "each rule needs at least one passing and one failing case"
    for obj in passing:
        assert eval_rule(rule, obj) is True, f"{rule} should accept {obj}"
    for obj in failing:
        assert eval_rule(rule, obj) is False, f"{rule} should reject {obj}"


SPLIT_VALUES = {"heldOutPercent": 10, "heldOutTaskIds": ["t1"], "taskSetSplit": "test"}


@pytest.mark.parametrize(
    "fields",
    [c for n in range(len(SPLIT_VALUES) + 1) for c in itertools.combinations(SPLIT_VALUES, n)],
    ids=lambda fields: "+".join(fields) or "none",
)
def test_split_rules_accept_exactly_one_of_three(fields: tuple[str, ...]) -> None:
    """The split's rules together: exactly one of the three fields, whatever the combination."""
    schema = openapi_schema("RLRun")["properties"]["spec"]["properties"]["tasks"]["properties"]["split"]
    violations = cel_violations(schema, {f: SPLIT_VALUES[f] for f in fields})
    assert all(v.evaluated for v in violations)
    if len(fields) == 1:
        assert violations == []
    elif not fields:
        assert [v.path for v in violations] == [""]
        assert violations[0].message.startswith("set one of heldOutPercent, heldOutTaskIds or taskSetSplit")
    else:
        # One violation per pair set together, at the later field of the pair, naming both.
        pairs = list(itertools.combinations(fields, 2))
        assert [v.path for v in violations] == [f".{second}" for _, second in pairs]
        for (first, second), v in zip(pairs, violations, strict=True):
            assert f"not both {first} and {second}" in v.message
