"""RolloutFleet: vLLM replicas serving the policy, with routed-expert capture and weight sync."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from legorl.api._base import (
    MAX_LIST,
    MAX_SHORT,
    ApiModel,
    CelRule,
    DnsLabel,
    DnsSubdomain,
    NamedList,
    Seconds,
    rules,
)
from legorl.api.common import (
    Conditions,
    ContainerImage,
    EnvVar,
    ModelSource,
    Placement,
    PodIdentity,
    ResourceRequirements,
)

ENGINE_IMAGE_REPOSITORY = "ghcr.io/legorl/engine"
"""legorl's engine image (engine/Dockerfile): vLLM with the weight-transfer plugin and the weight-version
middleware that a fleet's pods load when weightSync.method is Filesystem."""
DEFAULT_ENGINE_IMAGE = f"{ENGINE_IMAGE_REPOSITORY}:0.1.0"
WEIGHT_TRANSFER_BACKENDS = {"Filesystem": "legorl_filesystem", "NCCL": "nccl"}
"""vLLM weight-transfer backend per weightSync.method (`--weight-transfer-config`); `legorl_filesystem` is
registered by legorl's worker extension, `nccl` is vLLM's own."""
ENGINE_WORKER_EXTENSION = "legorl.trainer.engine.plugin.FilesystemWeightTransfer"
"""The worker extension (`--worker-extension-cls`) that registers `legorl_filesystem`."""
ENGINE_MIDDLEWARE = "legorl.trainer.engine.versions.WeightVersions"
"""The API-server middleware (`--middleware`) that names the weight versions behind every answer."""
PLUGIN_WEIGHT_SYNC = frozenset({"Filesystem"})
"""Weight-sync methods whose engine command line names legorl's plugin (the backend, the worker extension
and the middleware above), which the engine image must be able to import."""


def is_engine_image(image: str) -> bool:
    """Whether IMAGE is legorl's engine image, by any tag or digest, from ghcr.io or a mirror that keeps
    its `legorl/engine` path."""
    name = image.split("@", 1)[0]
    if ":" in name.rsplit("/", 1)[-1]:
        name = name.rsplit(":", 1)[0]
    return name == ENGINE_IMAGE_REPOSITORY or name.endswith("/legorl/engine")


class FleetParallelism(ApiModel):
    """How one replica of the engine is split across GPUs and nodes."""

    model_config = rules(
        CelRule(
            rule=(
                "self.gpusPerNode == 0 ? (self.tensorParallelSize == 1 && "
                "self.pipelineParallelSize == 1 && self.nodesPerReplica == 1) : "
                "self.tensorParallelSize * self.pipelineParallelSize == "
                "self.gpusPerNode * self.nodesPerReplica"
            ),
            message=(
                "tensorParallelSize × pipelineParallelSize must equal gpusPerNode × "
                "nodesPerReplica (every GPU of a replica holds one shard); a CPU engine "
                "(gpusPerNode 0) runs unsharded on one node"
            ),
            field_path=".tensorParallelSize",
        ),
        CelRule(
            rule="self.gpusPerNode == 0 || self.tensorParallelSize <= self.gpusPerNode",
            message="tensor parallelism must stay within one node: tensorParallelSize ≤ gpusPerNode",
            field_path=".tensorParallelSize",
        ),
        CelRule(
            rule="self.expertParallel == 'Disabled' || self.tensorParallelSize > 1",
            message="expertParallel needs tensorParallelSize > 1 (experts are split across the TP group)",
            field_path=".expertParallel",
        ),
    )

    gpus_per_node: Annotated[int, Field(ge=0, le=16)] = 1
    """GPUs each engine pod requests; 0 runs vLLM's CPU build (small models, tests)."""
    nodes_per_replica: Annotated[int, Field(ge=1, le=64)] = 1
    """Pods (nodes) per replica; more than 1 forms a leader + workers group for multi-node serving."""
    tensor_parallel_size: Annotated[int, Field(ge=1, le=128)] = 1
    """vLLM `--tensor-parallel-size`."""
    pipeline_parallel_size: Annotated[int, Field(ge=1, le=64)] = 1
    """vLLM `--pipeline-parallel-size` (splits layers across nodes)."""
    expert_parallel: Literal["Enabled", "Disabled"] = "Disabled"
    """vLLM `--enable-expert-parallel` for MoE models."""


class EngineSettings(ApiModel):
    """vLLM engine settings (the command line is built from these)."""

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Weights and activations dtype; the trainer's dtype should match for fidelity."""
    max_model_len: Annotated[int, Field(ge=256, le=4_194_304)] | None = None
    """Maximum context length; defaults to the model's. Longer prompts end trials as `context_overflow`."""
    max_num_seqs: Annotated[int, Field(ge=1, le=65536)] | None = None
    """Maximum concurrent sequences per replica."""
    gpu_memory_utilization_percent: Annotated[int, Field(ge=10, le=99)] = 90
    """Share of GPU memory vLLM may use (`--gpu-memory-utilization`), in percent."""
    prefix_caching: Literal["Enabled", "Disabled"] = "Enabled"
    """Automatic prefix caching; the weight sync resets it after every update."""
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    """KV cache dtype."""
    routed_experts_capture: Literal["Enabled", "Disabled"] = "Enabled"
    """Return each token's routed experts (`--enable-return-routed-experts`), needed for routing replay."""
    tool_call_parser: Annotated[str, Field(max_length=MAX_SHORT, pattern=r"^[a-z0-9_]+$")] | None = None
    """vLLM tool-call parser for the policy's chat template (e.g. `hermes`, `qwen3_coder`)."""
    extra_args: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=MAX_LIST)] = Field(
        default_factory=list
    )
    """Extra vLLM arguments appended verbatim (e.g. `--max-num-batched-tokens=16384`)."""
    env: NamedList[EnvVar] = Field(default_factory=list)
    """Extra environment variables for the engine container."""


class WeightSync(ApiModel):
    """How new policy versions reach the running engines."""

    method: Literal["Filesystem", "NCCL"] = "Filesystem"
    """`Filesystem`: safetensors written to the run store are loaded layer-wise by vLLM's update
    routes. `NCCL`: vLLM's native weight transfer from the trainer's ranks (GPU only)."""
    pause_mode: Literal["Keep", "Wait", "Abort"] = "Keep"
    """What happens to in-flight requests during an update: `Keep` preempts and recomputes them
    under the new weights, `Wait` drains first, `Abort` ends them (trials see `engine_error`)."""
    timeout_seconds: Seconds = 600
    """Limit for one whole update; a replica that misses it is restarted."""
    store_claim: DnsSubdomain | None = None
    """Under `Filesystem` sync: the PersistentVolumeClaim (in the fleet's namespace) that holds the run store
    the trainer publishes into, mounted read-only at `/store` in every engine pod (leaders and workers), the
    path the trainer's pod mounts it at, so the weight paths the trainer sends resolve. A training RLRun's
    inline fleet gets it from the run's `pvc://` store (`spec.store.uri`, else the operator's default store);
    set it on a shared fleet whose training runs keep their stores on that claim. Unused by `NCCL`."""


class FleetTemplate(ApiModel):
    """Everything about a fleet except the model it starts from. An RLRun's inline `fleet` is a
    FleetTemplate serving the run's own policy checkpoint."""

    served_model_name: DnsLabel = "policy"
    """Model name the engine answers to; the proxy maps harness model names onto it."""
    replicas: Annotated[int, Field(ge=0, le=1024)] = 1
    """Number of engine replicas (scale subresource: `kubectl scale`, HPA)."""
    engine: ContainerImage = Field(default_factory=lambda: ContainerImage(image=DEFAULT_ENGINE_IMAGE))
    """The engine image: vLLM with legorl's engine plugin (engine/Dockerfile; the default is its CUDA
    build). Another image needs the plugin inside it when weightSync.method is Filesystem."""
    parallelism: FleetParallelism = Field(default_factory=FleetParallelism)
    """GPU and node layout of one replica."""
    settings: EngineSettings = Field(default_factory=EngineSettings)
    """Engine settings."""
    weight_sync: WeightSync = Field(default_factory=WeightSync)
    """How policy updates are loaded without restarting."""
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    """Resources of each engine pod; GPUs are added from parallelism.gpusPerNode."""
    placement: Placement = Field(default_factory=Placement)
    """Node selection for engine pods."""
    identity: PodIdentity = Field(default_factory=PodIdentity)
    """ServiceAccount and pull secrets of engine pods."""
    port: Annotated[int, Field(ge=1024, le=65535)] = 8000
    """Port the engine serves on."""
    startup_seconds: Seconds = 1800
    """How long a replica may take to load the model before it counts as failed."""
    max_unavailable: Annotated[int, Field(ge=0, le=1024)] = 1
    """PodDisruptionBudget: replicas that voluntary disruptions may take down at once."""


class RolloutFleetSpec(FleetTemplate):
    """Desired state of a RolloutFleet."""

    model: ModelSource
    """The policy checkpoint served at version 0 (later versions come from the trainer)."""


class FleetEndpoint(ApiModel):
    """One ready engine endpoint."""

    name: Annotated[str, Field(max_length=253)]
    """Pod (or group leader) name."""
    url: Annotated[str, Field(max_length=512)]
    """Base URL of the OpenAI-compatible API."""
    ready: bool
    """Answers /health."""
    policy_version: Annotated[str, Field(max_length=MAX_SHORT)] | None = None
    """Policy version this replica serves."""


class RolloutFleetStatus(ApiModel):
    """Observed state of a RolloutFleet."""

    observed_generation: Annotated[int, Field(ge=0)] = 0
    """The `.metadata.generation` last reconciled."""
    conditions: Conditions = Field(default_factory=list)
    """`Ready`, `Progressing`, `Degraded`."""
    replicas: Annotated[int, Field(ge=0)] = 0
    """Replicas that exist (scale subresource)."""
    ready_replicas: Annotated[int, Field(ge=0)] = 0
    """Replicas answering /health."""
    selector: Annotated[str, Field(max_length=1024)] = ""
    """Label selector of the engine pods (scale subresource, for HPAs)."""
    served_policy_version: Annotated[str, Field(max_length=MAX_SHORT)] | None = None
    """Policy version every ready replica serves; unset while they disagree."""
    endpoints: Annotated[list[FleetEndpoint], Field(max_length=1024)] = Field(default_factory=list)
    """Engine endpoints."""
    weights_owner: Annotated[str, Field(max_length=253)] | None = None
    """The RLRun that holds the lease to update this fleet's weights."""
    version_skew_since: Annotated[str, Field(max_length=MAX_SHORT)] | None = None
    """When ready replicas began serving different policy versions (RFC 3339); unset when they agree."""
