"""legorl's shared, light API tree: the custom resources, conditions and the trajectory contract.

Every component imports these and none redefines them. Importing `legorl.api`
loads pydantic only; `legorl.api.trajectory` adds pyarrow. No Kubernetes client,
no torch, no vLLM.
"""

from legorl.api._base import API_GROUP, API_VERSION, GROUP_VERSION, ApiModel, CelRule
from legorl.api.fleet import RolloutFleetSpec, RolloutFleetStatus
from legorl.api.kinds import KINDS, Resource, RLRun, RolloutFleet, SandboxPool
from legorl.api.pool import SandboxPoolSpec, SandboxPoolStatus
from legorl.api.run import RLRunSpec, RLRunStatus
from legorl.api.termination import INFRA_REASONS, TerminationReason

__version__ = "0.1.0"

__all__ = [
    "API_GROUP",
    "API_VERSION",
    "GROUP_VERSION",
    "INFRA_REASONS",
    "KINDS",
    "ApiModel",
    "CelRule",
    "RLRun",
    "RLRunSpec",
    "RLRunStatus",
    "Resource",
    "RolloutFleet",
    "RolloutFleetSpec",
    "RolloutFleetStatus",
    "SandboxPool",
    "SandboxPoolSpec",
    "SandboxPoolStatus",
    "TerminationReason",
    "__version__",
]
