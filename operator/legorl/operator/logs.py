"""Structured logs: one JSON object per line (time, level, logger, message, and the object a
kopf record is about), for log pipelines; secrets never reach here (pods reference them by name)."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any


class JsonFormatter(logging.Formatter):
    """Format records as single-line JSON."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        ref = getattr(record, "k8s_ref", None)  # kopf's per-object loggers attach this
        if isinstance(ref, dict):
            out["object"] = {k: ref.get(k) for k in ("apiVersion", "kind", "namespace", "name") if ref.get(k)}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure(level: str, fmt: str) -> None:
    """Root logging for the operator process: `text` for people, `json` for pipelines."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # httpx logs every request at INFO; that is the operator's own traffic, keep it at debug.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
