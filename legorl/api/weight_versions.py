"""How an engine says which weight versions served a model call (the engine → proxy contract).

The fleet's vLLM runs legorl's middleware (`legorl.trainer.engine_versions.WeightVersions`), which
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

__all__ = ["HEADER", "SSE_PREFIX", "decode", "encode", "sse_comment"]

HEADER = "x-legorl-weight-versions"
SSE_PREFIX = b": legorl-weight-versions "


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
