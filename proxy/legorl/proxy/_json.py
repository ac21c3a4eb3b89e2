"""The proxy's JSON codec: orjson, because JSON is most of what the proxy does.

Every call parses the harness's request and the engine's answer (thousands of prompt token ids,
a log-prob entry per sampled token) and writes a journal record and an answer; with the standard
library that costs a millisecond or more per call, with orjson a fraction of it. orjson is also
strict where the proxy must be: NaN and Infinity, lone surrogates and nesting deeper than 1024
levels are parse errors.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["JSONDecodeError", "dumps", "loads"]

JSONDecodeError = orjson.JSONDecodeError


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON."""
    return orjson.dumps(value)
