"""How an engine says which weight versions served a model call (the engine → proxy contract).

The fleet's vLLM runs legorl's middleware (`legorl.trainer.engine.versions.WeightVersions`), which
tracks every model call in flight and every weight version that became current while it was: the
versions whose weights can have sampled one of its tokens. It hands them to the proxy with the answer,
so the proxy needs no `GET /weight_info` of its own and the versions come from the replica that served
the call (not from whichever replica a second connection reached):

- an unstreamed answer carries them in the `x-legorl-weight-versions` response header;
- a stream ends with one SSE comment line after its last event, `: legorl-weight-versions <json>`
  (standard SSE clients skip comment lines; the proxy is the only reader of the engine's stream).

The value is a JSON array of version strings, oldest first, ASCII only (a header must be latin-1).
"""

from __future__ import annotations

import json

__all__ = [
    "ENGINE_STARTUP",
    "HEADER",
    "SSE_PREFIX",
    "decode",
    "encode",
    "from_weight_info",
    "policy_version",
    "policy_versions",
    "sse_comment",
]

HEADER = "x-legorl-weight-versions"
SSE_PREFIX = b": legorl-weight-versions "
ENGINE_STARTUP = "default"
"""vLLM's weight version until a weight update names one: the weights the engine started from."""
STARTUP_POLICY = "v0"
"""What those weights are to a run: its policy checkpoint, version 0 (`store.policy_version(0)`)."""


def encode(versions: list[str]) -> str:
    """The header value (also the SSE comment's payload) for `versions`."""
    return json.dumps(versions, separators=(",", ":"), ensure_ascii=True)


def sse_comment(versions: list[str]) -> bytes:
    """The stream's closing comment event for `versions`."""
    return SSE_PREFIX + encode(versions).encode("ascii") + b"\n\n"


def decode(value: str | bytes) -> list[str] | None:
    """The versions in a header value or SSE comment payload; None if it is not a non-empty JSON
    array of non-empty strings (a reader then treats the versions as unreported)."""
    try:
        data = json.loads(value)
    except ValueError:
        return None
    if not isinstance(data, list) or not data or not all(isinstance(v, str) and v for v in data):
        return None
    return list(dict.fromkeys(data))


def from_weight_info(body: object) -> str | None:
    """The engine weight version in vLLM's `GET /weight_info` answer (`{"weight_version": "v3"}`, decoded
    JSON), or None when the answer names none (not an object, no non-empty string `weight_version`). The
    one reader of that answer: the operator, the UI and the trainer's weight sync all ask it."""
    if not isinstance(body, dict):
        return None
    version = body.get("weight_version")
    return version if isinstance(version, str) and version else None


def policy_version(engine_version: str) -> str:
    """The policy version an engine's weight version stands for, as the proxy records it. vLLM names the
    weights it started from `default`; those are the run's checkpoint, `v0` (an RLRun's fleet serves the
    run's checkpoint, and preflight holds a shared fleet to it). `legorl run` renames its engine's startup
    version itself; a fleet's pods are not renamed, and their `default` made step 1's trials look sampled
    by no known version (no fidelity figure for the step, seen on a real node)."""
    return STARTUP_POLICY if engine_version == ENGINE_STARTUP else engine_version


def policy_versions(engine_versions: list[str] | None) -> list[str] | None:
    """`policy_version` of each (None stays None: the versions are unreported)."""
    if engine_versions is None:
        return None
    return list(dict.fromkeys(policy_version(v) for v in engine_versions))
