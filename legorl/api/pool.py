"""SandboxPool: where trials run: cached task images, the trial pod shape and staged defenses."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from legorl.api._base import (
    MAX_SHORT,
    ApiModel,
    CelRule,
    DnsSubdomain,
    ImageRef,
    Quantity,
    Seconds,
    Text,
    rules,
    unique_values,
)
from legorl.api.common import (
    Conditions,
    Deadlines,
    Placement,
    PodIdentity,
    ResourceRequirements,
    TaskSetSource,
)
from legorl.sandbox.outcomes import TamperPolicy

MAX_IMAGES = 10_000
DEFAULT_PAUSE_IMAGE = "registry.k8s.io/pause:3.10"


class ImageSource(ApiModel):
    """Which task images the pool caches: an explicit list, a task set's image manifest, or both."""

    model_config = rules(
        CelRule(
            rule="(has(self.images) && size(self.images) > 0) || has(self.taskSet)",
            message="name the task images: set images, taskSet, or both",
            reason="FieldValueRequired",
        ),
    )

    images: Annotated[
        list[ImageRef],
        Field(max_length=MAX_IMAGES, json_schema_extra={"x-kubernetes-list-type": "set"}),
        AfterValidator(unique_values),
    ] = Field(default_factory=list)
    """Task images (repository + dependencies baked in), e.g. one per SWE-bench instance."""
    task_set: TaskSetSource | None = None
    """A task-set manifest whose entries name their images; its images are added to `images`."""


class PrePull(ApiModel):
    """How task images get onto nodes before trials need them."""

    model_config = rules(
        CelRule(
            rule="!has(self.lookahead) || self.policy == 'Lookahead'",
            message="lookahead only applies to policy Lookahead",
            field_path=".lookahead",
        ),
        CelRule(
            rule="self.policy != 'Lookahead' || has(self.lookahead)",
            message="policy Lookahead needs lookahead (how many upcoming tasks' images to pull)",
            field_path=".lookahead",
            reason="FieldValueRequired",
        ),
    )

    policy: Literal["All", "Lookahead", "Never"] = "All"
    """`All` caches every image on every matching node; `Lookahead` only the next tasks' images
    (named by the run controller); `Never` pulls when a trial starts (slow first trials)."""
    lookahead: Annotated[int, Field(ge=1, le=4096)] | None = None
    """With `Lookahead`: how many upcoming tasks' images to keep cached."""
    images_per_daemon_set: Annotated[int, Field(ge=1, le=256)] = 32
    """Images pulled by one DaemonSet (one init container each); larger sets are chunked."""
    pause_image: ImageRef = DEFAULT_PAUSE_IMAGE
    """Image the pre-pull pods idle on after pulling."""
    pull_timeout_seconds: Seconds = 3600
    """How long one image may take to pull before it counts as failed."""


class Defenses(ApiModel):
    """Staged defenses against reward hacking (DESIGN §4). The defaults are the safe choice;
    relaxing one marks the pool `DefensesVerified=False` with reason `DefensesRelaxedBySpec`."""

    egress: Literal["ProxyOnly", "Unrestricted"] = "ProxyOnly"
    """`ProxyOnly`: the agent reaches nothing but its proxy on loopback (self-tested).
    `Unrestricted` is for debugging harnesses only."""
    git_history: Literal["BaseCommitOnly", "Preserve"] = "BaseCommitOnly"
    """`BaseCommitOnly` leaves one commit: no future commits, refs, tags, reflog or packs."""
    tamper_policy: TamperPolicy = "StripAndReport"
    """What verification does with a diff that touches tests or test-runner hooks: strip those
    parts and record the finding, or end the trial with reward 0."""


class Workspace(ApiModel):
    """The writable repository checkout inside the sandbox."""

    path: Annotated[str, Field(max_length=255, pattern=r"^/[A-Za-z0-9._/-]*$")] = "/testbed"
    """Absolute path of the repository in the task image (SWE-bench images use /testbed)."""
    size_limit: Quantity = "20Gi"
    """Size limit of the writable workspace volume."""


class SandboxPoolSpec(ApiModel):
    """Desired state of a SandboxPool."""

    model_config = rules(
        CelRule(
            rule="self.replicas == 0 || (has(self.source.images) && size(self.source.images) == 1)",
            message=(
                "warm sandboxes (replicas > 0) need a pool of exactly one image in source.images; "
                "pools of many task images start each trial from its own image"
            ),
            field_path=".replicas",
        ),
    )

    source: ImageSource
    """Which task images this pool serves."""
    pre_pull: PrePull = Field(default_factory=PrePull)
    """Image caching on nodes."""
    replicas: Annotated[int, Field(ge=0, le=4096)] = 0
    """Warm sandboxes kept ready for pools whose trials share one image (scale subresource)."""
    runtime_class_name: DnsSubdomain | None = None
    """RuntimeClass for trial pods, e.g. `gvisor` or `kata` for kernel isolation."""
    defenses: Defenses = Field(default_factory=Defenses)
    """Staged defenses; the defaults are what a trustworthy reward needs."""
    workspace: Workspace = Field(default_factory=Workspace)
    """Where the repository lives in the sandbox."""
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    """Resources of the harness container of each trial."""
    max_pids: Annotated[int, Field(ge=64, le=1_048_576)] = 4096
    """Process limit of a trial (fork bombs end as `sandbox_error`, not a hung node)."""
    deadlines: Deadlines = Field(default_factory=Deadlines)
    """Time limits of the trial stages."""
    placement: Placement = Field(default_factory=Placement)
    """Node selection for trial and pre-pull pods."""
    identity: PodIdentity = Field(default_factory=PodIdentity)
    """ServiceAccount and pull secrets for trial pods; the default account has no permissions
    and no token is mounted."""


class ImagePullFailure(ApiModel):
    """An image that failed to pull on a node."""

    image: Annotated[str, Field(max_length=512)]
    """The image."""
    reason: Annotated[str, Field(max_length=MAX_SHORT * 2)]
    """Kubelet reason, e.g. `ErrImagePull`, `ImagePullBackOff`."""
    message: Text = ""
    """Kubelet message."""


class NodeImageStatus(ApiModel):
    """Image cache of one node."""

    name: Annotated[str, Field(max_length=253)]
    """Node name."""
    desired: Annotated[int, Field(ge=0)] = 0
    """Images that should be on this node."""
    pulled: Annotated[int, Field(ge=0)] = 0
    """Images present."""
    failed: Annotated[int, Field(ge=0)] = 0
    """Images that failed to pull."""
    failures: Annotated[list[ImagePullFailure], Field(max_length=16)] = Field(default_factory=list)
    """The first failures, with reasons."""


class DefenseCheck(ApiModel):
    """One defense self-test result."""

    name: Annotated[str, Field(max_length=MAX_SHORT)]
    """Check name, e.g. `egress-refused`, `history-single-commit`, `hidden-tests-absent`."""
    result: Literal["Passed", "Failed"]
    """Outcome."""
    message: Text = ""
    """Evidence."""


class SelfTest(ApiModel):
    """The latest defense self-test in a probe sandbox."""

    result: Literal["Passed", "Failed", "Pending"] = "Pending"
    """Overall outcome."""
    checked_at: Annotated[str, Field(max_length=MAX_SHORT)] | None = None
    """When it ran (RFC 3339)."""
    checks: Annotated[list[DefenseCheck], Field(max_length=32)] = Field(default_factory=list)
    """Each check."""


class SandboxPoolStatus(ApiModel):
    """Observed state of a SandboxPool."""

    observed_generation: Annotated[int, Field(ge=0)] = 0
    """The `.metadata.generation` last reconciled."""
    conditions: Conditions = Field(default_factory=list)
    """`Ready`, `ImagesCached`, `DefensesVerified`, `Degraded`."""
    images_desired: Annotated[int, Field(ge=0)] = 0
    """Distinct images the pool should cache."""
    images_cached: Annotated[int, Field(ge=0)] = 0
    """Images present on every matching node."""
    nodes: Annotated[list[NodeImageStatus], Field(max_length=5000)] = Field(default_factory=list)
    """Per-node cache state."""
    replicas: Annotated[int, Field(ge=0)] = 0
    """Warm sandboxes that exist (scale subresource)."""
    ready_replicas: Annotated[int, Field(ge=0)] = 0
    """Warm sandboxes ready to lease."""
    leased_replicas: Annotated[int, Field(ge=0)] = 0
    """Warm sandboxes running a trial."""
    selector: Annotated[str, Field(max_length=1024)] = ""
    """Label selector of the warm sandbox pods (scale subresource)."""
    self_test: SelfTest = Field(default_factory=SelfTest)
    """Latest defense self-test."""
    pod_template_hash: Annotated[str, Field(max_length=MAX_SHORT)] | None = None
    """Hash of the rendered trial pod template, so runs can tell when it changed."""
