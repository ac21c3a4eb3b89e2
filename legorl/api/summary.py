"""What a trial's proxy answers to `GET /trajectory` and `POST /finish`: `TrajectorySummary`, `TrialEnd`.

The proxy encodes it (`TrajectorySummary.to_json`); the run controller's records and both trial backends
decode it (`TrajectorySummary.from_json`), so no part reads the body by string keys. The wire stays
camelCase (`policyVersions`, `mergedTurnShare`, ...), except the segments, which are `Segment.to_json`
rows (snake_case, routing as base64 arrays) or, for `?tokens=false`, their count. `TrialEnd` is also the
`end` record of the proxy's journal.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_serializer

from legorl.api._base import ApiModel
from legorl.api.termination import TerminationReason
from legorl.api.trajectory import Segment, TrajectoryError

__all__ = ["EndSource", "TrajectorySummary", "TrialEnd"]

EndSource = Literal["proxy", "harness"]
"""Who ended the trial: the proxy (it saw the failure) or the harness (`POST /finish`)."""


class TrialEnd(ApiModel):
    """How a trial ended, and who said so."""

    model_config = ConfigDict(extra="ignore")  # see `TrajectorySummary`

    reason: TerminationReason = Field(strict=False)
    """Why the trial ended (a termination reason's value on the wire)."""
    source: EndSource
    """`proxy` when the proxy saw the failure itself, `harness` when it came with `POST /finish`."""
    detail: str | None = None
    """What went wrong, in words (the proxy's error, or the harness's exit)."""
    exit_code: int | None = None
    """The harness's exit code, when it exited."""
    ended_at: datetime = Field(strict=False)
    """When the proxy recorded the end (ISO 8601 on the wire)."""

    @field_serializer("ended_at")
    def _iso(self, value: datetime) -> str:
        # `datetime.isoformat` (`+00:00`), as the proxy always wrote it, not pydantic's `Z`.
        return value.isoformat()

    def to_json(self) -> dict[str, Any]:
        """The wire form: camelCase, every key present (nulls kept)."""
        return self.model_dump(mode="json", by_alias=True)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TrialEnd:
        """The inverse of `to_json`; a malformed end state raises `TrajectoryError`."""
        try:
            return cls.model_validate(obj)
        except ValidationError as exc:
            raise TrajectoryError(f"the trial's end state is malformed: {_errors(exc)}") from exc


class TrajectorySummary(ApiModel):
    """A trial as its proxy saw it: how it ended, its segments and how well its turns merged."""

    # Keys a newer proxy adds are ignored, as they always were: an operator is upgraded apart from the
    # proxies of trials already running.
    model_config = ConfigDict(arbitrary_types_allowed=True, extra="ignore")

    run: str
    """The RLRun the trial belongs to."""
    trial: str
    """The trial's id."""
    state: Literal["running", "ended"]
    """`ended` once the trial has an end state (`end`)."""
    end: TrialEnd | None = None
    """How the trial ended; None while it runs."""
    turns: int = Field(default=0, ge=0)
    """Model calls journaled."""
    policy_versions: list[str] = Field(default_factory=list)
    """Every policy version that answered a turn, in order of first use."""
    merged_turn_share: float | None = None
    """Share of turns that extended the previous turn's segment; None before two turns."""
    errors: dict[str, int] = Field(default_factory=dict)
    """Failed calls by error kind (`engine_error`, `context_overflow`, ...)."""
    journal_dropped_bytes: int = Field(default=0, ge=0)
    """Bytes of a torn record cut off the journal at start (a crash mid-write; never acknowledged)."""
    finish_reasons: dict[str, int] | None = None
    """Turns by the engine's finish reason (`stop`, `length`, `tool_calls`); None from a proxy that
    predates it."""
    segments: list[Segment] | int = Field(default_factory=list)
    """The segments (`Segment.to_json` rows on the wire), or only their count (`?tokens=false`)."""

    @property
    def segment_list(self) -> list[Segment]:
        """The segments; a summary fetched without tokens has none to give."""
        if isinstance(self.segments, int):
            raise TrajectoryError("the trajectory was fetched without tokens (?tokens=false)")
        return self.segments

    def to_json(self) -> dict[str, Any]:
        """The wire form of `GET /trajectory` (key order as the proxy always sent it)."""
        out = self.model_dump(mode="json", by_alias=True, exclude={"segments"})
        segments = self.segments
        out["segments"] = segments if isinstance(segments, int) else [s.to_json() for s in segments]
        return out

    @classmethod
    def from_json(cls, obj: Any) -> TrajectorySummary:
        """The inverse of `to_json` (older proxies' flat routing lists still read); a malformed body
        raises `TrajectoryError` saying what is wrong."""
        if not isinstance(obj, Mapping):
            raise TrajectoryError(f"the trajectory is not a JSON object but {type(obj).__name__}")
        data = dict(obj)
        rows = data.get("segments", [])
        if isinstance(rows, list):
            segments = []
            for i, row in enumerate(rows):
                try:
                    segment = Segment.from_json(row)
                except (KeyError, TypeError, ValueError) as exc:
                    what = f"lacks {exc}" if isinstance(exc, KeyError) else str(exc)
                    raise TrajectoryError(f"the trajectory's segment {i} is malformed: {what}") from exc
                # Where segments enter the run controller: checked here, once (`TrialRecord.check`).
                segment.check()
                segments.append(segment)
            data["segments"] = segments
        elif not isinstance(rows, int) or isinstance(rows, bool):
            raise TrajectoryError(f"the trajectory's segments are neither a list nor a count: {rows!r}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise TrajectoryError(f"the trajectory is malformed: {_errors(exc)}") from exc


def _errors(exc: ValidationError) -> str:
    """Pydantic's errors in one line: `end.reason: Input should be ...; turns: ...`."""
    return "; ".join(
        f"{'.'.join(str(p) for p in error['loc']) or '(body)'}: {error['msg']}" for error in exc.errors()
    )
