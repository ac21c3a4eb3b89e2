"""The trainer's one settings object, derived from an RLRun spec; light (no torch), so launchers validate it.

`TrainerSettings.from_run()` is the only place RLRun knobs are read; everything below the entrypoint gets
this object passed down. Decimal strings in the spec (`"1e-6"`) become floats here, defaults that depend on
the algorithm (GSPO's tiny clip range) are resolved here, and nothing reads the environment at import.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from legorl.api.kinds import RLRun
from legorl.api.layout import ModelShape, ParallelLayout
from legorl.api.run import DEFAULT_CLIP, AdvantageMode, AlgorithmName, ImportanceMode, LossAggregation
from legorl.api.termination import TerminationReason


class SettingsError(ValueError):
    """The run cannot be trained as specified; the message says what to change."""


class TrainerSettings(BaseModel):
    """Everything one trainer process needs, resolved from the RLRun plus where it runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run: str
    """RLRun name (labels metrics, names the run store's contents)."""
    store_uri: str
    """Run store URI (fsspec): batches are read from it, weights, metrics and checkpoints written to it."""
    checkpoint_dir: Path
    """Local directory of the initial policy (Hugging Face layout)."""
    fleet_urls: tuple[str, ...] = ()
    """Engine base URLs to sync new weights into; empty = publish only."""

    # Algorithm.
    algorithm: AlgorithmName = "GRPO"
    learning_rate: Annotated[float, Field(gt=0, lt=1)] = 1e-6
    clip_low: Annotated[float, Field(gt=0)] = 0.2
    clip_high: Annotated[float, Field(gt=0)] = 0.28
    kl_coef: Annotated[float, Field(ge=0)] = 0.0
    entropy_coef: Annotated[float, Field(ge=0)] = 0.0
    advantage: AdvantageMode = "GroupMeanStd"
    loss_aggregation: LossAggregation = "TokenMean"
    importance_mode: ImportanceMode = "Truncated"
    importance_cap: Annotated[float, Field(ge=1)] = 2.0
    mini_batches: Annotated[int, Field(ge=1)] = 1
    temperature: Annotated[float, Field(gt=0)] = 1.0
    """Rollout temperature: training log-probs are taken from logits / temperature, as the engine did."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Rollout nucleus threshold; the trainer models only 1.0 (no truncation)."""

    # Which trials train.
    drop_reasons: frozenset[TerminationReason] = frozenset()
    drop_zero_variance_groups: bool = True
    max_staleness: Annotated[int, Field(ge=0)] | None = 0
    """Policy versions a trial may lag the trainer (Sync: 0; Async: the spec's limit); None = no limit."""

    # Trainer.
    dtype: Literal["bfloat16", "float32", "float64"] = "float32"
    """Model dtype. The RLRun offers bfloat16 and float32; float64 exists for exactness tests (layouts
    compared without fp32 rounding: tests/trainer/test_trainer_parallel.py)."""
    routing_replay: Literal["Auto", "Enabled", "Disabled"] = "Auto"
    recompute: Literal["none", "selective", "full"] = "none"
    max_tokens_per_micro_batch: Annotated[int, Field(ge=16)] = 16_384
    grad_clip: Annotated[float, Field(ge=0)] = 1.0
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    nodes: Annotated[int, Field(ge=1)] = 1
    ranks_per_node: Annotated[int, Field(ge=1)] = 1
    """Trainer processes per node (one per GPU; gloo ranks on CPU)."""
    tensor_parallel: Annotated[int, Field(ge=1)] = 1
    pipeline_parallel: Annotated[int, Field(ge=1)] = 1
    expert_parallel: Annotated[int, Field(ge=1)] = 1
    context_parallel: Annotated[int, Field(ge=1)] = 1
    moe_token_dispatcher: Literal["allgather", "alltoall"] = "allgather"  # noqa: S105 -- not a secret
    device: Literal["auto", "cpu", "cuda"] = "auto"

    # Checkpoints and weight sync.
    checkpoint_interval: Annotated[int, Field(ge=1)] = 50
    checkpoint_keep: Annotated[int, Field(ge=1)] = 3
    checkpoint_uri: str | None = None
    """Where trainer checkpoints go; None = `<store>/checkpoints`."""
    weight_sync_method: Literal["Filesystem", "NCCL"] = "Filesystem"
    weight_sync_address: str | None = None
    """NCCL: the writer's rendezvous host that engines connect to ($LEGORL_WEIGHT_SYNC_ADDRESS)."""
    weight_sync_port: Annotated[int, Field(ge=1, le=65535)] = 29650
    pause_mode: Literal["keep", "wait", "abort"] = "keep"
    sync_timeout_seconds: Annotated[float, Field(gt=0)] = 600.0
    fleet_check_seconds: Annotated[float, Field(ge=0)] = 10.0
    """Between steps, how often the fleet's served versions are checked: a replica that came back (a
    restarted engine pod starts from the checkpoint, v0) is given the newest published version."""

    max_steps: Annotated[int, Field(ge=1)] | None = None
    seed: int = 0

    @classmethod
    def from_run(
        cls,
        run: RLRun,
        *,
        store_uri: str,
        checkpoint_dir: Path,
        fleet_urls: tuple[str, ...] = (),
        device: Literal["auto", "cpu", "cuda"] = "auto",
    ) -> TrainerSettings:
        """Resolve the RLRun's knobs (decimal strings, algorithm defaults, schedule) into settings."""
        spec = run.spec
        algo = spec.algorithm
        low_default, high_default = DEFAULT_CLIP[algo.name]
        par = spec.trainer.parallelism
        weight_sync = spec.fleet.weight_sync if spec.fleet is not None else None
        if spec.schedule.mode == "Sync":
            staleness: int | None = 0
        else:
            staleness = spec.schedule.max_staleness_steps or 1
        return cls(
            run=run.metadata.name,
            store_uri=store_uri,
            checkpoint_dir=checkpoint_dir,
            fleet_urls=fleet_urls,
            algorithm=algo.name,
            learning_rate=_num(algo.learning_rate),
            clip_low=_num(algo.clip_low) if algo.clip_low is not None else low_default,
            clip_high=_num(algo.clip_high) if algo.clip_high is not None else high_default,
            kl_coef=_num(algo.kl_coef),
            entropy_coef=_num(algo.entropy_coef),
            advantage=algo.advantage,
            loss_aggregation=algo.loss_aggregation,
            importance_mode=algo.importance_correction.mode,
            importance_cap=_num(algo.importance_correction.cap),
            mini_batches=algo.mini_batches,
            temperature=_num(algo.sampling.temperature),
            top_p=_num(algo.sampling.top_p),
            drop_reasons=frozenset(spec.filter.drop_reasons),
            drop_zero_variance_groups=spec.filter.zero_variance_groups == "Drop",
            max_staleness=staleness,
            dtype=spec.trainer.dtype,
            routing_replay=spec.trainer.routing_replay,
            recompute=spec.trainer.recompute.lower(),
            max_tokens_per_micro_batch=spec.trainer.max_tokens_per_micro_batch,
            grad_clip=_num(spec.trainer.grad_clip),
            weight_decay=_num(spec.trainer.weight_decay),
            warmup_steps=spec.trainer.warmup_steps,
            nodes=par.nodes,
            ranks_per_node=par.layout().ranks_per_node,
            tensor_parallel=par.tensor,
            pipeline_parallel=par.pipeline,
            expert_parallel=par.expert,
            context_parallel=par.context,
            # The alltoall dispatcher is the GPU path (CUDA streams); allgather works everywhere.
            moe_token_dispatcher="alltoall" if par.gpus_per_node > 0 else "allgather",
            device=device if device != "auto" else ("cpu" if par.gpus_per_node == 0 else "auto"),
            checkpoint_interval=spec.checkpoints.interval_steps,
            checkpoint_keep=spec.checkpoints.keep,
            checkpoint_uri=spec.checkpoints.location.uri if spec.checkpoints.location else None,
            weight_sync_method=weight_sync.method if weight_sync else "Filesystem",
            pause_mode=weight_sync.pause_mode.lower() if weight_sync else "keep",
            sync_timeout_seconds=float(weight_sync.timeout_seconds) if weight_sync else 600.0,
            max_steps=spec.stop.max_steps,
            seed=spec.tasks.seed,
        )

    @property
    def layout(self) -> ParallelLayout:
        """The ranks and megatron parallel sizes this trainer runs with."""
        return ParallelLayout(
            nodes=self.nodes,
            ranks_per_node=self.ranks_per_node,
            tensor=self.tensor_parallel,
            pipeline=self.pipeline_parallel,
            expert=self.expert_parallel,
            context=self.context_parallel,
            gpus_per_node=0 if self.device == "cpu" else self.ranks_per_node,
        )

    def check_supported(self, world_size: int | None = None, model: ModelShape | None = None) -> None:
        """Refuse what this trainer cannot run, before any heavy import: a layout the ranks or the model
        cannot take (`model`: the checkpoint's shape, when known), a launch with another number of ranks than
        the layout asks for (`world_size`: the launcher's, e.g. torchrun's WORLD_SIZE), nucleus sampling."""
        layout = self.layout
        problems = [str(p) for p in layout.problems(model)]
        if world_size is not None and world_size != layout.world_size:
            problems.append(
                f"spec.trainer.parallelism: the layout asks for {layout.world_size} ranks (nodes "
                f"{layout.nodes} × {layout.ranks_per_node} per node) but {world_size} were started; "
                f"launch with torchrun --nnodes={layout.nodes} --nproc-per-node={layout.ranks_per_node}"
            )
        if self.top_p != 1.0:
            problems.append(
                f"spec.algorithm.sampling.topP={self.top_p}: the trainer recomputes log-probs of the full "
                "temperature-scaled distribution; nucleus truncation would bias every importance weight. "
                "Set topP to 1.0"
            )
        if problems:
            raise SettingsError("; ".join(problems))


def _num(value: str) -> float:
    """A spec decimal string (`"1e-6"`, `"0.2"`) as a float."""
    return float(Decimal(value))
