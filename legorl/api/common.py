"""Kubernetes-shaped building blocks shared by the three kinds: references, env, placement, resources."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from legorl.api._base import (
    MAX_LIST,
    MAX_SHORT,
    ApiModel,
    CelRule,
    DnsSubdomain,
    ImageRef,
    NamedList,
    Quantity,
    Seconds,
    Text,
    Uri,
    rules,
)

ENV_NAME_RE = r"^[A-Za-z_][A-Za-z0-9_]*$"
LABEL_KEY_RE = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
# A container's resource, as the API server accepts it for a Pod: a standard one, or an extended
# resource, which is always qualified (`nvidia.com/gpu`).
RESOURCE_NAME_RE = (
    r"^(cpu|memory|ephemeral-storage|hugepages-[A-Za-z0-9]+|"
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$"
)


class LocalObjectReference(ApiModel):
    """A reference to an object in the same namespace."""

    name: DnsSubdomain
    """Name of the referenced object."""


class SecretKeySelector(ApiModel):
    """A key of a Secret in the same namespace."""

    name: DnsSubdomain
    """Name of the Secret."""
    key: Annotated[str, Field(min_length=1, max_length=MAX_SHORT, pattern=r"^[-._a-zA-Z0-9]+$")]
    """Key within the Secret."""


class EnvVarSource(ApiModel):
    """Where an environment variable's value comes from."""

    secret_key_ref: SecretKeySelector
    """Read the value from a Secret key (never put credentials in `value`)."""


class EnvVar(ApiModel):
    """An environment variable for a container."""

    model_config = rules(
        CelRule(
            rule="!(has(self.value) && has(self.valueFrom))",
            message="set value or valueFrom, not both",
            field_path=".valueFrom",
            reason="FieldValueForbidden",
        )
    )

    name: Annotated[str, Field(min_length=1, max_length=MAX_SHORT * 2, pattern=ENV_NAME_RE)]
    """Variable name (a C identifier)."""
    value: Text | None = None
    """Literal value."""
    value_from: EnvVarSource | None = None
    """Take the value from a Secret instead."""


class Toleration(ApiModel):
    """A pod toleration, as in core/v1."""

    model_config = rules(
        CelRule(
            rule="self.operator == 'Exists' || has(self.key)",
            message="a toleration without a key must use operator Exists (it then tolerates every taint)",
            field_path=".key",
            reason="FieldValueRequired",
        ),
        CelRule(
            rule="self.operator != 'Exists' || !has(self.value)",
            message="a toleration with operator Exists must not set value",
            field_path=".value",
        ),
        CelRule(
            rule="!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            message="tolerationSeconds only applies to effect NoExecute",
            field_path=".tolerationSeconds",
        ),
    )

    key: Annotated[str, Field(max_length=MAX_SHORT * 4, pattern=LABEL_KEY_RE)] | None = None
    """Taint key to tolerate; empty with operator Exists tolerates everything."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """How `value` is compared with the taint's value."""
    value: Annotated[str, Field(max_length=MAX_SHORT)] | None = None
    """Taint value to match when operator is Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches all effects."""
    toleration_seconds: Annotated[int, Field(ge=0, le=30 * 24 * 3600)] | None = None
    """How long a NoExecute taint is tolerated before eviction."""


ResourceMap = Annotated[
    dict[Annotated[str, Field(max_length=MAX_SHORT, pattern=RESOURCE_NAME_RE)], Quantity],
    Field(max_length=16),
]


class ResourceRequirements(ApiModel):
    """Compute resources for a container, as in core/v1 (`cpu`, `memory`, `nvidia.com/gpu`, ...)."""

    requests: ResourceMap = Field(default_factory=dict)
    """Minimum resources the scheduler reserves."""
    limits: ResourceMap = Field(default_factory=dict)
    """Maximum resources the container may use."""


class Placement(ApiModel):
    """Where pods are scheduled."""

    node_selector: Annotated[
        dict[
            Annotated[str, Field(max_length=MAX_SHORT * 4, pattern=LABEL_KEY_RE)],
            Annotated[str, Field(max_length=MAX_SHORT)],
        ],
        Field(max_length=16),
    ] = Field(default_factory=dict)
    """Node labels a pod's node must carry."""
    tolerations: Annotated[list[Toleration], Field(max_length=MAX_LIST)] = Field(default_factory=list)
    """Taints the pods tolerate (e.g. dedicated GPU or sandbox node pools)."""
    affinity: dict[str, Any] | None = None
    """A core/v1 Affinity, passed through to the pods unchanged."""
    priority_class_name: DnsSubdomain | None = None
    """PriorityClass for the pods (e.g. let rollout pods preempt batch work)."""


class PodIdentity(ApiModel):
    """Identity and registry access of pods."""

    service_account_name: DnsSubdomain | None = None
    """ServiceAccount the pods run as; defaults to one the operator creates with no permissions."""
    image_pull_secrets: NamedList[LocalObjectReference] = Field(default_factory=list)
    """Secrets for pulling images from private registries."""


class ContainerImage(ApiModel):
    """A container image and when to pull it."""

    image: ImageRef
    """Image reference, e.g. `ghcr.io/legorl/engine:0.1.0`; prefer a digest for reproducible runs."""
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """When the kubelet pulls the image."""


class ModelSource(ApiModel):
    """Where a model checkpoint is read from (Hugging Face layout: config.json, tokenizer, safetensors)."""

    model_config = rules(
        CelRule(
            rule=(
                "self.uri.startsWith('hf://') || self.uri.startsWith('s3://') || "
                "self.uri.startsWith('gs://') || self.uri.startsWith('pvc://') || "
                "self.uri.startsWith('file://') || self.uri.startsWith('builtin://')"
            ),
            message=(
                "uri must start with hf://, s3://, gs://, pvc://, file:// or builtin:// "
                "(e.g. hf://Qwen/Qwen3-30B-A3B or pvc://models/qwen3)"
            ),
            field_path=".uri",
        ),
    )

    uri: Uri
    """Checkpoint location: `hf://org/name`, `s3://bucket/prefix`, `gs://...`, `pvc://claim/path`,
    `file:///abs/path` (local runs), `builtin://tiny-moe` (a random test model made on the fly) or
    `builtin://tiny-swe` (the warm-started policy of the embedded default, made by `legorl sft`)."""
    revision: Annotated[str, Field(max_length=MAX_SHORT * 2)] | None = None
    """Branch, tag or commit for `hf://` sources; pin a commit for reproducible runs."""
    credentials_secret_ref: LocalObjectReference | None = None
    """Secret with credentials for the source (e.g. `HF_TOKEN`, AWS keys), mounted as env."""


class StorageLocation(ApiModel):
    """A storage URI the run reads and writes (fsspec: local dir, PVC, s3, gcs)."""

    model_config = rules(
        CelRule(
            rule=(
                "self.uri.startsWith('s3://') || self.uri.startsWith('gs://') || "
                "self.uri.startsWith('pvc://') || self.uri.startsWith('file://')"
            ),
            message="uri must start with s3://, gs://, pvc:// or file://",
            field_path=".uri",
        ),
    )

    uri: Uri
    """Location, e.g. `pvc://rl-store/runs`, `s3://bucket/legorl`, `file:///var/lib/legorl`."""
    credentials_secret_ref: LocalObjectReference | None = None
    """Secret with credentials for the store (e.g. AWS keys), mounted as env."""


def pvc_claim(uri: str) -> str | None:
    """The PersistentVolumeClaim of a `pvc://CLAIM/path` URI; None for any other scheme."""
    scheme, _, rest = uri.partition("://")
    if scheme != "pvc":
        return None
    return rest.partition("/")[0] or None


class TaskSetSource(ApiModel):
    """A task-set manifest: SWE-bench-style instances as JSONL or Parquet, each naming its image."""

    model_config = rules(
        CelRule(
            rule=(
                "self.uri.startsWith('builtin://') || self.uri.startsWith('s3://') || "
                "self.uri.startsWith('gs://') || self.uri.startsWith('pvc://') || "
                "self.uri.startsWith('file://') || self.uri.startsWith('configmap://')"
            ),
            message=(
                "uri must start with builtin://, s3://, gs://, pvc://, file:// or configmap:// "
                "(e.g. s3://bucket/swe-verified.jsonl)"
            ),
            field_path=".uri",
        ),
    )

    uri: Uri
    """Manifest location: `s3://bucket/tasks.parquet`, `pvc://claim/tasks.jsonl`,
    `configmap://name/key`, `file:///abs/tasks.jsonl` (local runs), `builtin://tiny-python` (the bundled
    task set) or `builtin://tiny-read` (bundled tasks whose fix is read from the test output, labelled
    train / validation / test: see `tasks.split.taskSetSplit`)."""
    format: Literal["Auto", "JSONL", "Parquet"] = "Auto"
    """Manifest format; `Auto` goes by the file extension."""
    credentials_secret_ref: LocalObjectReference | None = None
    """Secret with credentials to read the manifest."""


CONDITION_STATUS = Literal["True", "False", "Unknown"]


class Condition(ApiModel):
    """One observation of an object's state, as in metav1.Condition."""

    type: Annotated[str, Field(min_length=1, max_length=316)]
    """Condition type, e.g. `Ready`."""
    status: CONDITION_STATUS
    """`True`, `False` or `Unknown`."""
    reason: Annotated[
        str,
        Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"),
    ]
    """A CamelCase reason from the kind's documented reason set."""
    message: Annotated[str, Field(max_length=32768)] = ""
    """What a person needs to know, including what to do next."""
    last_transition_time: Annotated[str, Field(max_length=MAX_SHORT)]
    """When `status` last changed (RFC 3339)."""
    observed_generation: Annotated[int, Field(ge=0)] = 0
    """The `.metadata.generation` this condition was computed from."""


Conditions = Annotated[
    list[Condition],
    Field(
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    ),
]
"""A status's conditions, one per type."""


class Deadlines(ApiModel):
    """Time limits of a trial's stages."""

    setup_seconds: Seconds = 600
    """Limit for stage 1 (workspace, history reduction, egress lock, self-tests)."""
    agent_seconds: Seconds = 3600
    """Limit for stage 2 (the harness run); exceeding it ends the trial as `agent_timeout`."""
    verify_seconds: Seconds = 1800
    """Limit for stage 3 (verification in a pristine sandbox)."""
