"""The label and annotation keys on what legorl creates, and the names of a run's children: spelled once.

The operator renders them, reads them back from the objects it watches, and the UI and the run
controller select by them; every one of those imports its keys from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from legorl.api._base import API_GROUP

if TYPE_CHECKING:
    from legorl.api.kinds import RLRun

PREFIX: Final = f"{API_GROUP}/"
"""Every key below starts with it; the operator copies annotations with it into what it observes."""

# -- labels ------------------------------------------------------------------------------------------

OWNER_LABEL: Final = f"{PREFIX}owner"
"""`<kind>.<name>` of the custom resource a child belongs to (lowercase kind); the operator's index key."""
COMPONENT_LABEL: Final = f"{PREFIX}component"
"""What a child is, among the parts of a run, a fleet or a pool (`trial`, `trainer`, ...)."""
RUN_LABEL: Final = f"{PREFIX}run"
"""The RLRun a trial, verify or trainer pod works for."""
TRIAL_LABEL: Final = f"{PREFIX}trial"
"""The trial id of a trial or verify pod."""
STEP_LABEL: Final = f"{PREFIX}step"
"""The training step a trial pod's trial belongs to."""
SPLIT_LABEL: Final = f"{PREFIX}split"
"""`train` or `validation`: which split a trial pod's task comes from."""
POOL_LABEL: Final = f"{PREFIX}pool"
"""The SandboxPool a pod belongs to (network policies select on it)."""
CHUNK_LABEL: Final = f"{PREFIX}chunk"
"""Which pre-pull DaemonSet (a chunk of the pool's images) a pod belongs to."""
REPLICA_LABEL: Final = f"{PREFIX}replica"
"""The index of a fleet's engine replica (a group of pods for a multi-node replica)."""
LEASED_LABEL: Final = f"{PREFIX}leased"
"""`true` on a warm sandbox pod a trial has taken."""
WARM_LABEL: Final = f"{PREFIX}warm"
"""On a trial pod made ready ahead (`spec.schedule.warmTrials`): `waiting` while its agent waits at the
gate, `claimed` once its trial was launched and the gate opened."""

# -- annotations -------------------------------------------------------------------------------------

HASH_ANNOTATION: Final = f"{PREFIX}desired-hash"
"""Hash of the rendered child; the operator re-applies a child only when it changes."""
POLICY_VERSION_ANNOTATION: Final = f"{PREFIX}policy-version"
"""On engine pods: the policy version the pod last said it serves (`GET /weight_info`, asked by the operator,
or set by whoever loads weights); the fleet reports it as the served version."""
LOOKAHEAD_ANNOTATION: Final = f"{PREFIX}lookahead-images"
"""On a SandboxPool with prePull Lookahead: JSON list of the next tasks' images (run controller)."""
IMAGES_ANNOTATION: Final = f"{PREFIX}images"
"""On a pre-pull DaemonSet: JSON list of the images its pods pull."""
REQUEST_ANNOTATION: Final = f"{PREFIX}trial-request"
"""On trial and verify pods: the `TrialRequest` (task id, group, split, step, policy version) as JSON,
so a restarted operator can adopt the pod."""
AGENT_OUTCOME_ANNOTATION: Final = f"{PREFIX}agent-outcome"
"""On verify pods: how the agent stage ended (`reason`, `exitCode`, `detail`, `stageSeconds`)."""
VALIDATE_ANNOTATION: Final = f"{PREFIX}validate-requested"
"""Set (to any new value, by convention the time) to ask the operator for a canary of the run; the
result lands in `status.validation` with the same value in `requested`."""

FINALIZER: Final = f"{PREFIX}operator"
"""kopf's finalizer on RLRuns, so the run controller daemon stops before the run goes away."""

# -- the names of a run's children -------------------------------------------------------------------


def owned_fleet_name(run_name: str) -> str:
    """The RolloutFleet a run creates when it references none."""
    return f"{run_name}-fleet"


def owned_pool_name(run_name: str) -> str:
    """The SandboxPool a run creates when it references none."""
    return f"{run_name}-pool"


def fleet_name(run: RLRun) -> str:
    """The fleet a run uses: its reference, or the one it owns."""
    return run.spec.fleet_ref.name if run.spec.fleet_ref else owned_fleet_name(run.metadata.name)


def pool_name(run: RLRun) -> str:
    """The pool a run uses: its reference, or the one it owns."""
    return run.spec.pool_ref.name if run.spec.pool_ref else owned_pool_name(run.metadata.name)


def trainer_name(run_name: str) -> str:
    """The run's trainer Job (and its Service)."""
    return f"{run_name}-trainer"
