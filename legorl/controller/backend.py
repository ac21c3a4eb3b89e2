"""The run controller's view of where trials run: one interface, two backends.

The controller decides *which* trials run (task, group, split, step); a backend runs them and hands back
one `TrialRecord` per trial: the proxy's segments, the verifier's reward, the termination reason from the
closed set, tamper findings and stage timings. Two implementations:

- `legorl.embedded.local.LocalTrialBackend`: processes and the local sandbox backend (bubblewrap), one
  proxy process per trial, on this machine (`legorl run`).
- `legorl.operator.trials.KubeTrialBackend`: trial and verify pods from the SandboxPool's template,
  inside the operator's per-RLRun daemon.

A backend never raises for a failed trial: every failure becomes a record with an infrastructure
termination reason (`sandbox_error`, `proxy_error`, `verifier_error`, ...), so the loop can count,
filter and explain it. It raises only when it cannot run trials at all (`BackendError`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from legorl.api.annotations import TrialRequestNote
from legorl.api.trajectory import TrialRecord
from legorl.sandbox.task import Task

TRIAL_ID = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
"""Trial ids name pods, folders and proxy journals: a DNS label."""


class BackendError(RuntimeError):
    """The backend cannot run trials at all (not one trial's failure): the run stops with this message."""


@dataclass(frozen=True)
class TrialRequest:
    """One trial the controller wants run."""

    trial: str
    """Unique within the run, stable across restarts (derived from step, task and replica): a
    restarted controller recognises a finished trial by its id and never runs it twice."""
    task: Task
    group_id: str
    """Trials of one task in one step share a group (their rewards are compared with each other)."""
    split: Literal["train", "validation"]
    step: int
    """The batch this trial feeds (train), or the policy step it evaluates (validation)."""
    policy_version: str
    """Version the fleet served when the trial was launched (the proxy records what it really saw)."""

    def __post_init__(self) -> None:
        if not TRIAL_ID.match(self.trial):
            raise ValueError(f"trial id {self.trial!r} must be a DNS label (lowercase letters, digits, '-')")

    def note(self) -> TrialRequestNote:
        """What a pod carries of this request (`legorl.dev/trial-request`): the task by its id."""
        return TrialRequestNote(
            trial=self.trial,
            task_id=self.task.instance_id,
            group_id=self.group_id,
            split=self.split,
            step=self.step,
            policy_version=self.policy_version,
        )

    @classmethod
    def from_note(cls, note: TrialRequestNote, task: Task) -> TrialRequest:
        """The request a pod's note names, its task looked up by the caller (ValueError: a bad trial id)."""
        return cls(
            trial=note.trial,
            task=task,
            group_id=note.group_id,
            split=note.split,
            step=note.step,
            policy_version=note.policy_version,
        )


class TrialBackend(Protocol):
    """Runs trials; see the module docstring for the contract."""

    def launch(self, request: TrialRequest) -> None:
        """Start one trial and return at once (the backend bounds nothing: the controller limits how
        many run)."""

    def collect(self, timeout: float) -> list[TrialRecord]:
        """Records of trials that finished since the last call; waits up to `timeout` seconds for at
        least one. Each launched trial is returned exactly once (also after `cancel`, as `cancelled`)."""

    def running(self) -> list[str]:
        """Ids of launched trials not yet returned by `collect`."""

    def adopt(self) -> list[TrialRequest]:
        """Trials a previous controller launched that are still running here (pods survive an operator
        restart); from now on they are this controller's, and `collect` will return them. Backends
        whose trials die with the controller return []."""

    def release(self, trial: str) -> None:
        """Let go of a trial the controller has saved (or found saved): delete what it still holds. A
        returned trial keeps its objects (on a cluster, its pods and the proxy's journal in them) until
        this is called, so a controller that dies between `collect` and saving the record loses nothing:
        the next one adopts the trial again. Idempotent; a trial this backend never held is fine."""

    def prefetch(self, tasks: Sequence[Task]) -> None:
        """The next tasks to run, in order: a hint to pre-pull their images (SandboxPool lookahead)."""

    def prepare(self, requests: Sequence[TrialRequest]) -> None:
        """The trials the controller will launch next, in order (at most `spec.schedule.warmTrials` of
        them): a backend may make them ready ahead (warm trial pods), so that launching one only claims
        what is ready, and lets go of those it made for trials no longer named. A hint: `launch` works
        for any trial, prepared or not, and a backend may ignore it."""

    def cancel(self, trial: str) -> None:
        """Stop a running trial; `collect` returns it as `cancelled`."""

    def close(self) -> None:
        """Stop every running trial and release what the backend holds."""
