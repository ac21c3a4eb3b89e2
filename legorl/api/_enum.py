"""A string enum whose members carry a one-line meaning; no dependencies."""

from __future__ import annotations

from enum import StrEnum


class DocumentedEnum(StrEnum):
    """A string enum whose members carry a one-line meaning (used by docs and the UI)."""

    description: str

    def __new__(cls, value: str, description: str = "") -> DocumentedEnum:
        member = str.__new__(cls, value)
        member._value_ = value
        member.description = description
        return member
