"""The trainer's parallel layout: how many ranks, the megatron group sizes they imply, what a layout needs.

One definition shared by the CRD's rules, `legorl validate`'s preflight, the operator (which renders the
trainer Job's world size) and the trainer (which builds megatron's groups from it and refuses a layout its
model cannot take before anything heavy is imported). Light: standard library only.

Megatron's groups, outermost last (its default order `tp-cp-ep-dp-pp`):

- tensor (TP, with sequence parallelism whenever TP > 1) × context (CP) × data (DP) × pipeline (PP) = world;
- experts are split over expert-parallel ranks (EP) carved out of data parallelism, each expert sharded over
  expert-tensor ranks (ETP = TP here, megatron's default), so world must be a multiple of TP × EP × PP and
  the experts' own data parallelism is EDP = world / (TP × EP × PP).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayoutProblem", "ModelShape", "ParallelLayout"]

FIELD = "spec.trainer.parallelism"
"""Where an RLRun keeps the layout (problems name their field under it)."""


@dataclass(frozen=True)
class ModelShape:
    """What a layout check needs to know of the model (read from its config.json)."""

    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int
    """0 for a dense model."""
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    """Width of a dense MLP."""
    moe_ffn_hidden_size: int
    """Width of one expert (0 for a dense model)."""
    shared_expert_ffn_hidden_size: int = 0
    """Width of the shared expert (0: none)."""
    linear_num_key_heads: int = 0
    """Gated DeltaNet key heads (0: no linear-attention layers)."""
    linear_num_value_heads: int = 0
    attention_output_gate: bool = False


@dataclass(frozen=True)
class LayoutProblem:
    """One reason a layout cannot run, with the RLRun field to change."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass(frozen=True)
class ParallelLayout:
    """A trainer's ranks and megatron parallel sizes."""

    nodes: int = 1
    ranks_per_node: int = 1
    """Processes per node: one per GPU, or gloo ranks on CPU."""
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    context: int = 1
    gpus_per_node: int = 0
    """0: the ranks train on CPU (gloo)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def data(self) -> int:
        """Data-parallel size of the dense parameters (each DP rank trains on its own share of a batch)."""
        return self.world_size // max(1, self.tensor * self.pipeline * self.context)

    @property
    def expert_tensor(self) -> int:
        """Tensor parallelism inside each expert (megatron's default: the dense TP size)."""
        return self.tensor

    @property
    def expert_data(self) -> int:
        """Data-parallel size of the expert parameters (replicas of each expert shard)."""
        return self.world_size // max(1, self.expert_tensor * self.expert * self.pipeline)

    @property
    def sequence_parallel(self) -> bool:
        """Megatron refuses MoE with TP > 1 unless activations are also split over the sequence."""
        return self.tensor > 1

    def describe(self) -> str:
        """`TP2 × EP2 × DP2` style, every size > 1 (`one rank` when none)."""
        parts = [
            f"{name}{size}"
            for name, size in (
                ("TP", self.tensor),
                ("PP", self.pipeline),
                ("CP", self.context),
                ("EP", self.expert),
                ("DP", self.data),
            )
            if size > 1
        ]
        return " × ".join(parts) if parts else "one rank"

    def problems(self, model: ModelShape | None = None) -> list[LayoutProblem]:
        """Everything that keeps this layout from running (empty when it can run).

        Without `model`, the arithmetic of the sizes alone; with it, what the model's shape needs too (heads
        by TP, experts by EP, layers by PP, ...).
        """
        out: list[LayoutProblem] = []
        world = self.world_size
        for name, size in (
            ("nodes", self.nodes),
            ("tensor", self.tensor),
            ("pipeline", self.pipeline),
            ("expert", self.expert),
            ("context", self.context),
        ):
            if size < 1:
                out.append(LayoutProblem(f"{FIELD}.{name}", f"must be at least 1, got {size}"))
        if self.ranks_per_node < 1:
            out.append(
                LayoutProblem(f"{FIELD}.processesPerNode", f"must be at least 1, got {self.ranks_per_node}")
            )
        if out:
            return out
        model_parallel = self.tensor * self.pipeline * self.context
        if world % model_parallel:
            out.append(
                LayoutProblem(
                    f"{FIELD}.tensor",
                    f"tensor × pipeline × context = {self.tensor} × {self.pipeline} × {self.context} = "
                    f"{model_parallel} must divide the {world} trainer ranks (nodes × ranks per node)",
                )
            )
        if self.tensor > self.ranks_per_node:
            out.append(
                LayoutProblem(
                    f"{FIELD}.tensor",
                    f"tensor parallelism {self.tensor} spans nodes ({self.ranks_per_node} ranks per node); "
                    "keep tensor ≤ ranks per node (TP needs the fast links inside a node)",
                )
            )
        expert_group = self.expert_tensor * self.expert * self.pipeline
        if world % expert_group:
            out.append(
                LayoutProblem(
                    f"{FIELD}.expert",
                    f"tensor × expert × pipeline = {self.tensor} × {self.expert} × {self.pipeline} = "
                    f"{expert_group} must divide the {world} trainer ranks (experts are split over ranks "
                    "taken from data parallelism, each expert over the tensor-parallel ranks)",
                )
            )
        if self.context > 1:
            out.append(
                LayoutProblem(
                    f"{FIELD}.context",
                    f"context parallelism {self.context}: megatron's context parallelism needs Transformer "
                    "Engine's attention, which this trainer does not build (it uses megatron's local layer "
                    "spec on every device); set context to 1 and split long sequences over tensor "
                    "parallelism (sequence parallel) instead",
                )
            )
        if model is not None:
            out += self._model_problems(model)
        return out

    def _model_problems(self, model: ModelShape) -> list[LayoutProblem]:
        out: list[LayoutProblem] = []
        tp, ep, pp = self.tensor, self.expert, self.pipeline
        if model.num_attention_heads % tp:
            out.append(
                LayoutProblem(
                    f"{FIELD}.tensor",
                    f"the model's {model.num_attention_heads} attention heads do not split over {tp} "
                    "tensor-parallel ranks",
                )
            )
        if model.num_key_value_heads % tp:
            out.append(
                LayoutProblem(
                    f"{FIELD}.tensor",
                    f"the model's {model.num_key_value_heads} key/value heads do not split over {tp} "
                    "tensor-parallel ranks (each rank needs whole query groups)",
                )
            )
        if model.vocab_size % tp:
            out.append(
                LayoutProblem(
                    f"{FIELD}.tensor",
                    f"the model's vocabulary of {model.vocab_size} does not split evenly over {tp} "
                    "tensor-parallel ranks",
                )
            )
        if model.ffn_hidden_size % tp or (model.moe_ffn_hidden_size and model.moe_ffn_hidden_size % tp):
            out.append(
                LayoutProblem(
                    f"{FIELD}.tensor",
                    f"the MLP widths ({model.ffn_hidden_size}, experts {model.moe_ffn_hidden_size}) do not "
                    f"split over {tp} tensor-parallel ranks",
                )
            )
        if model.shared_expert_ffn_hidden_size % tp:
            out.append(
                LayoutProblem(
                    f"{FIELD}.tensor",
                    f"the shared expert's width {model.shared_expert_ffn_hidden_size} does not split over "
                    f"{tp} "
                    "tensor-parallel ranks",
                )
            )
        if model.linear_num_key_heads and (
            model.linear_num_key_heads % tp or model.linear_num_value_heads % tp
        ):
            out.append(
                LayoutProblem(
                    f"{FIELD}.tensor",
                    f"the Gated DeltaNet layers' {model.linear_num_key_heads} key / "
                    f"{model.linear_num_value_heads} value heads do not split over {tp} tensor-parallel "
                    "ranks",
                )
            )
        if model.linear_num_key_heads and self.context > 1:
            out.append(
                LayoutProblem(
                    f"{FIELD}.context",
                    "Gated DeltaNet layers have no context parallelism in megatron-core 0.16 (a TODO in "
                    "ssm/gated_delta_net.py); set context to 1",
                )
            )
        if ep > 1 and model.num_experts == 0:
            out.append(
                LayoutProblem(
                    f"{FIELD}.expert", f"expert parallelism {ep} on a dense model (no experts); set 1"
                )
            )
        elif model.num_experts and model.num_experts % ep:
            out.append(
                LayoutProblem(
                    f"{FIELD}.expert",
                    f"the model's {model.num_experts} experts do not split over {ep} expert-parallel ranks",
                )
            )
        if model.num_layers % pp:
            out.append(
                LayoutProblem(
                    f"{FIELD}.pipeline",
                    f"the model's {model.num_layers} layers do not split evenly over {pp} pipeline stages",
                )
            )
        return out
