"""The parallel layout (legorl.api.layout): the sizes it derives and each problem it names, with its field."""

from __future__ import annotations

import pytest

from legorl.api.kinds import RLRun
from legorl.api.layout import ModelShape, ParallelLayout

# Qwen3-30B-A3B's shape (tests/fixtures/qwen3-30b-a3b/config.json).
QWEN3_30B = ModelShape(
    num_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    num_experts=128,
    vocab_size=151_936,
    hidden_size=2048,
    ffn_hidden_size=6144,
    moe_ffn_hidden_size=768,
)


def test_sizes_follow_megatron() -> None:
    layout = ParallelLayout(nodes=4, ranks_per_node=8, tensor=2, expert=8, gpus_per_node=8)
    assert (layout.world_size, layout.data, layout.expert_tensor, layout.expert_data) == (32, 16, 2, 2)
    assert layout.sequence_parallel and layout.describe() == "TP2 × EP8 × DP16"
    assert ParallelLayout().describe() == "one rank" and not ParallelLayout().problems()
    assert not layout.problems(QWEN3_30B)


@pytest.mark.parametrize(
    ("layout", "field", "words"),
    [
        (ParallelLayout(ranks_per_node=4, tensor=3), "tensor", "tensor × pipeline × context = 3 × 1 × 1"),
        (ParallelLayout(nodes=2, ranks_per_node=4, tensor=8), "tensor", "spans nodes"),
        (
            ParallelLayout(ranks_per_node=8, tensor=2, expert=8),
            "expert",
            "tensor × expert × pipeline = 2 × 8 × 1",
        ),
        (ParallelLayout(ranks_per_node=2, context=2), "context", "needs Transformer Engine"),
        (ParallelLayout(ranks_per_node=8, tensor=8), "tensor", "4 key/value heads do not split over 8"),
        (ParallelLayout(ranks_per_node=3, expert=3), "expert", "128 experts do not split over 3"),
        (ParallelLayout(ranks_per_node=5, pipeline=5), "pipeline", "48 layers do not split evenly over 5"),
    ],
)
def test_each_problem_names_its_field(layout: ParallelLayout, field: str, words: str) -> None:
    problems = layout.problems(QWEN3_30B)
    assert any(p.field == f"spec.trainer.parallelism.{field}" and words in p.message for p in problems), (
        problems
    )


def test_a_cpu_trainer_may_run_several_ranks() -> None:
    body = {
        "apiVersion": "legorl.dev/v1alpha1",
        "kind": "RLRun",
        "metadata": {"name": "r"},
        "spec": {
            "policy": {"checkpoint": {"uri": "builtin://tiny-moe"}},
            "harness": {"kind": "MiniSweAgent"},
            "tasks": {"source": {"uri": "builtin://tiny-python"}},
            "fleetRef": {"name": "f"},
            "poolRef": {"name": "p"},
            "trainer": {"parallelism": {"gpusPerNode": 0, "processesPerNode": 4, "tensor": 2, "expert": 2}},
        },
    }
    layout = RLRun.model_validate(body).spec.trainer.parallelism.layout()
    assert (layout.world_size, layout.data, layout.expert_data) == (4, 2, 1)
    # A GPU trainer defaults to one rank per GPU.
    body["spec"]["trainer"]["parallelism"] = {"nodes": 2, "gpusPerNode": 8}  # type: ignore[index]
    assert RLRun.model_validate(body).spec.trainer.parallelism.layout().world_size == 16
