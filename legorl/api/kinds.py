"""The three custom resources as whole objects, with the CRD metadata declared next to each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from legorl.api._base import GROUP_VERSION, MAX_SHORT, ApiModel, CelRule
from legorl.api.fleet import RolloutFleetSpec, RolloutFleetStatus
from legorl.api.pool import SandboxPoolSpec, SandboxPoolStatus
from legorl.api.run import RLRunSpec, RLRunStatus

MAX_RESOURCE_NAME = 40
"""Names of our resources are capped so that derived child names and label values fit in 63."""

NAME_RULE = CelRule(
    rule=(
        f"self.metadata.name.size() <= {MAX_RESOURCE_NAME} && "
        "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')"
    ),
    message=(
        f"must be at most {MAX_RESOURCE_NAME} characters of lowercase letters, digits and '-', "
        "starting with a letter (child objects and labels are named after it)"
    ),
    field_path=".metadata.name",
)


@dataclass(frozen=True)
class PrinterColumn:
    """An `additionalPrinterColumns` entry (`kubectl get` columns)."""

    name: str
    json_path: str
    type: Literal["string", "integer", "number", "boolean", "date"] = "string"
    description: str = ""
    priority: int = 0

    def to_crd(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "type": self.type, "jsonPath": self.json_path}
        if self.description:
            out["description"] = self.description
        if self.priority:
            out["priority"] = self.priority
        return out


@dataclass(frozen=True)
class CrdInfo:
    """What a CRD needs beyond the schema."""

    kind: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    printer_columns: tuple[PrinterColumn, ...]
    scale: bool = False
    categories: tuple[str, ...] = ("legorl",)
    root_rules: tuple[CelRule, ...] = field(default=(NAME_RULE,))


def _ready_columns() -> tuple[PrinterColumn, PrinterColumn]:
    return (
        PrinterColumn(
            "Ready", '.status.conditions[?(@.type=="Ready")].status', description="Ready condition"
        ),
        PrinterColumn(
            "Reason",
            '.status.conditions[?(@.type=="Ready")].reason',
            description="Why (Ready condition)",
        ),
    )


AGE = PrinterColumn("Age", ".metadata.creationTimestamp", "date")


class ObjectMeta(BaseModel):
    """The parts of metav1.ObjectMeta that manifests set; server-set fields pass through."""

    model_config = ConfigDict(extra="allow", strict=True)

    name: Annotated[str, Field(min_length=1, max_length=253)]
    namespace: Annotated[str, Field(min_length=1, max_length=MAX_SHORT)] | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    generation: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None


SpecT = TypeVar("SpecT", bound=ApiModel)
StatusT = TypeVar("StatusT", bound=ApiModel)


class _Resource(ApiModel, Generic[SpecT, StatusT]):
    """A whole object: apiVersion, kind, metadata (server-set fields pass through), spec, status."""

    crd: ClassVar[CrdInfo]

    api_version: Annotated[Literal["legorl.dev/v1alpha1"], Field(alias="apiVersion")] = GROUP_VERSION
    kind: str  # each kind narrows this to its own Literal
    metadata: ObjectMeta
    spec: SpecT
    status: StatusT | None = None


class RolloutFleet(_Resource[RolloutFleetSpec, RolloutFleetStatus]):
    """vLLM replicas serving a policy, with routed-expert capture and weight sync."""

    crd: ClassVar[CrdInfo] = CrdInfo(
        kind="RolloutFleet",
        plural="rolloutfleets",
        singular="rolloutfleet",
        short_names=("rf", "fleet"),
        scale=True,
        printer_columns=(
            *_ready_columns(),
            PrinterColumn("Replicas", ".spec.replicas", "integer", "Desired replicas"),
            PrinterColumn("Available", ".status.readyReplicas", "integer", "Replicas answering /health"),
            PrinterColumn("Policy", ".status.servedPolicyVersion", description="Policy version served"),
            AGE,
            PrinterColumn("Model", ".spec.model.uri", description="Initial checkpoint", priority=1),
        ),
    )

    kind: Literal["RolloutFleet"] = "RolloutFleet"


class SandboxPool(_Resource[SandboxPoolSpec, SandboxPoolStatus]):
    """Where trials run: cached task images, the trial pod shape and staged defenses."""

    crd: ClassVar[CrdInfo] = CrdInfo(
        kind="SandboxPool",
        plural="sandboxpools",
        singular="sandboxpool",
        short_names=("sbp", "pool"),
        scale=True,
        printer_columns=(
            *_ready_columns(),
            PrinterColumn("Images", ".status.imagesDesired", "integer", "Images to cache"),
            PrinterColumn("Cached", ".status.imagesCached", "integer", "Images on every matching node"),
            PrinterColumn("Warm", ".status.readyReplicas", "integer", "Warm sandboxes ready"),
            AGE,
            PrinterColumn(
                "Defenses",
                '.status.conditions[?(@.type=="DefensesVerified")].reason',
                description="Defense self-test",
                priority=1,
            ),
        ),
    )

    kind: Literal["SandboxPool"] = "SandboxPool"


class RLRun(_Resource[RLRunSpec, RLRunStatus]):
    """One RL experiment: policy, harness, tasks, algorithm, trainer and stop conditions."""

    crd: ClassVar[CrdInfo] = CrdInfo(
        kind="RLRun",
        plural="rlruns",
        singular="rlrun",
        short_names=("rlr",),
        printer_columns=(
            PrinterColumn("Phase", ".status.phase", description="Summary derived from conditions"),
            PrinterColumn("Step", ".status.step", "integer", "Training steps completed"),
            PrinterColumn("Policy", ".status.policyVersion", description="Policy version served"),
            PrinterColumn("Reward", ".status.metrics.rewardMean", "number", "Mean reward, last batch"),
            PrinterColumn("Reason", ".status.reason", description="Why the run is in this phase"),
            AGE,
            PrinterColumn(
                "Held-out",
                ".status.metrics.heldOutSolveRate",
                "number",
                "Held-out solve rate",
                priority=1,
            ),
            PrinterColumn(
                "Fidelity",
                ".status.metrics.fidelityCorrelation",
                "number",
                "Rollout vs. training probability correlation",
                priority=1,
            ),
        ),
    )

    kind: Literal["RLRun"] = "RLRun"


KINDS: dict[str, type[RolloutFleet] | type[SandboxPool] | type[RLRun]] = {
    "RolloutFleet": RolloutFleet,
    "SandboxPool": SandboxPool,
    "RLRun": RLRun,
}
"""Every kind of the API group, by kind name."""

Resource = RolloutFleet | SandboxPool | RLRun
