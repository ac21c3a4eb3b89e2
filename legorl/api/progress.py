"""The run controller's progress snapshot (`controller/state.json`): what it writes as it goes, and what the
operator's RLRun status, the CLI's display and the UI read. One type, one encoder, one decoder."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["Progress"]


@dataclass
class Progress:
    """A snapshot of the run, for the display, the RLRun status and the UI."""

    run: str
    step: int = 0
    """The newest committed training step."""
    policy_version: str = "v0"
    """The version the fleet serves."""
    max_steps: int | None = None
    trials_total: int = 0
    """Training trials finished (held-out ones are counted in `eval_trials`)."""
    eval_trials: int = 0
    trials_running: int = 0
    trials_dropped: int = 0
    zero_variance_groups: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    reward_mean: float | None = None
    """Mean reward of the newest committed step's trained-on trials."""
    held_out_solve_rate: float | None = None
    held_out_interval: tuple[float, float] | None = None
    baseline_solve_rate: float | None = None
    """Held-out solve rate of the initial policy (v0)."""
    fidelity_correlation: float | None = None
    max_abs_logprob_delta: float | None = None
    tokens_per_second: float | None = None
    trials_per_minute: float | None = None
    eta_seconds: float | None = None
    elapsed_seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    """Wall time spent in trial stages summed over trials, and waiting for the trainer."""
    fidelity_below_steps: int = 0
    """Newest consecutive steps whose correlation is below fidelity.minCorrelation (the guard's count)."""
    fidelity_guard_after: int = 0
    """The guard counts only steps after this one: where it last paused the run (a resume re-arms it)."""
    degraded_reason: str | None = None
    """`FidelityBelowThreshold` while the guard has fired (the RLRun's Degraded condition)."""
    degraded_message: str = ""
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["held_out_interval"] = list(self.held_out_interval) if self.held_out_interval else None
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None, *, run: str = "") -> Progress:
        """The snapshot as `to_json` wrote it (`controller/state.json`). Tolerant, as a reader of a file
        another version may have written: unknown keys are ignored, missing ones take their defaults, a
        value of the wrong type its field's default. RUN: the name when the document names none."""
        data = dict(data or {})
        out = cls(run=str(data.get("run") or run))
        for f in fields(cls):
            value = data.get(f.name)
            if f.name == "run" or value is None:
                continue
            try:
                setattr(out, f.name, _DECODE[str(f.type)](value))
            except (TypeError, ValueError, IndexError):
                continue
        return out


_DECODE: dict[str, Callable[[Any], Any]] = {
    "int": int,
    "int | None": int,
    "float": float,
    "float | None": float,
    "str": str,
    "str | None": str,
    "dict[str, int]": lambda v: {str(k): int(x) for k, x in dict(v).items()},
    "dict[str, float]": lambda v: {str(k): float(x) for k, x in dict(v).items()},
    "tuple[float, float] | None": lambda v: (float(v[0]), float(v[1])),
}
"""How each field's JSON value is read, by the field's annotation (a test keeps every field covered)."""
