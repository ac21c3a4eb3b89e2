"""Kubernetes and JSON timestamps read one way everywhere: RFC 3339 with `Z` or an offset, as aware UTC."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

__all__ = ["format_time", "parse_time"]


def parse_time(value: Any) -> datetime | None:
    """`value` as an aware datetime (naive ones taken as UTC); None when it is not a timestamp (absent,
    empty, not a string or not ISO 8601). A datetime passes through, made aware the same way."""
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def format_time(value: datetime) -> str:
    """RFC 3339 in UTC with microseconds and `Z` (what `parse_time` reads back exactly)."""
    aware = value if value.tzinfo else value.replace(tzinfo=UTC)
    return aware.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
