"""Base model, scalar types and CEL rule declarations shared by every API kind.

Everything here is light (pydantic only) so that the operator, the proxy, the
trainer and the CLI can all import the API without pulling in anything heavy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Final, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
)
from pydantic.alias_generators import to_camel

GROUP_VERSION: Final = "legorl.dev/v1alpha1"
API_GROUP, API_VERSION = GROUP_VERSION.split("/")

# Bounds that keep every CEL rule's cost estimable by the API server: every
# string has a maxLength and every list a maxItems.
MAX_NAME = 253
MAX_SHORT = 63
MAX_TEXT = 1024
MAX_URI = 2048
MAX_IMAGE = 512
MAX_LIST = 64


class ApiModel(BaseModel):
    """Base of every spec/status model: camelCase on the wire, unknown fields rejected.

    `strict=True` mirrors the API server: a string where an integer belongs is
    an error, not something to coerce. Field docstrings become the CRD's
    descriptions (`use_attribute_docstrings`).
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        extra="forbid",
        strict=True,
        use_attribute_docstrings=True,
        validate_by_alias=True,
        validate_by_name=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """Serialize as the API server stores it: camelCase, nulls omitted."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


CelReason = Literal["FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired", "FieldValueDuplicate"]


@dataclass(frozen=True)
class CelRule:
    """One `x-kubernetes-validations` entry: a CEL rule the API server enforces.

    `self` is the object the rule is attached to. The same rule is evaluated by
    `legorl validate` (cel-python), so it is written once.
    """

    rule: str
    message: str
    field_path: str | None = None
    reason: CelReason = "FieldValueInvalid"

    def to_schema(self) -> dict[str, str]:
        out = {"rule": self.rule, "message": self.message, "reason": self.reason}
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


def exactly_one(*names: str, hint: str) -> tuple[CelRule, ...]:
    """Rules for "set exactly one of `names`": one for none set (Required) and one per pair set
    together (Forbidden, reported at the later field of the pair), so each failure carries the right
    reason and names the fields to unset."""
    if len(names) < 2:
        raise ValueError(f"exactly_one needs at least two field names, got {names}")
    listed = f"{', '.join(names[:-1])} or {names[-1]}"
    required = CelRule(
        rule=" || ".join(f"has(self.{name})" for name in names),
        message=f"set one of {listed}: {hint}",
        reason="FieldValueRequired",
    )
    forbidden = []
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            both = "not both" if len(names) == 2 else f"not both {first} and {second}"
            forbidden.append(
                CelRule(
                    rule=f"!(has(self.{first}) && has(self.{second}))",
                    message=f"set only one of {listed}, {both}: {hint}",
                    field_path=f".{second}",
                    reason="FieldValueForbidden",
                )
            )
    return (required, *forbidden)


def cel(*cel_rules: CelRule) -> dict[str, Any]:
    """`json_schema_extra` carrying CEL rules, for a field."""
    return {"x-kubernetes-validations": [r.to_schema() for r in cel_rules]}


def rules(*cel_rules: CelRule) -> ConfigDict:
    """A model config carrying CEL rules attached to the model's object."""
    return ConfigDict(json_schema_extra=cel(*cel_rules))


# --- scalar types -----------------------------------------------------------

DNS_LABEL_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A Kubernetes resource quantity (k8s.io/apimachinery resource.Quantity).
QUANTITY_RE = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# A decimal number written as a string (spec fields carry no floats).
DECIMAL_RE = r"^-?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))([eE][-+]?[0-9]{1,2})?$"
# An OCI image reference: [registry/]repository[:tag][@digest].
IMAGE_RE = (
    r"^([a-zA-Z0-9.-]+(:[0-9]+)?/)?[a-z0-9]+([._-][a-z0-9]+)*(/[a-z0-9]+([._-][a-z0-9]+)*)*"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$"
)

DnsLabel = Annotated[str, Field(min_length=1, max_length=MAX_SHORT, pattern=DNS_LABEL_RE)]
"""A lowercase RFC 1123 label, like most Kubernetes object names."""

DnsSubdomain = Annotated[str, Field(min_length=1, max_length=MAX_NAME, pattern=DNS_SUBDOMAIN_RE)]
"""A lowercase RFC 1123 subdomain (Service, Secret, PriorityClass names)."""

ImageRef = Annotated[str, Field(min_length=1, max_length=MAX_IMAGE, pattern=IMAGE_RE)]
"""An OCI image reference such as `ghcr.io/org/img:tag` or `img@sha256:...`."""

Uri = Annotated[str, Field(min_length=1, max_length=MAX_URI)]

ShortText = Annotated[str, Field(max_length=MAX_SHORT)]
Text = Annotated[str, Field(max_length=MAX_TEXT)]


def _quantity_in(value: object) -> object:
    # Quantities are int-or-string on the wire (`cpu: 2` and `cpu: "500m"`).
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


Quantity = Annotated[
    str,
    BeforeValidator(_quantity_in),
    Field(max_length=MAX_SHORT, pattern=QUANTITY_RE),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_RE,
            "x-kubernetes-int-or-string": True,
        }
    ),
]
"""A Kubernetes resource quantity, e.g. `2`, `500m`, `16Gi`."""

DecimalString = Annotated[str, Field(min_length=1, max_length=32, pattern=DECIMAL_RE)]
"""A real number written as a quoted string, e.g. `"1e-6"` or `"0.2"` (spec fields carry no floats)."""

Seconds = Annotated[int, Field(ge=1, le=30 * 24 * 3600)]
"""A duration in whole seconds, at most 30 days."""


_SUFFIX: dict[str, Decimal | int] = {
    "": 1,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_QUANTITY_SPLIT = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([A-Za-z]*)$")


def parse_quantity(value: str | int) -> Decimal:
    """Parse a Kubernetes quantity into a Decimal (`"500m"` → 0.5, `"1Gi"` → 1073741824)."""
    text = str(value)
    match = _QUANTITY_SPLIT.match(text)
    if not match or match.group(2) not in _SUFFIX:
        raise ValueError(f"not a Kubernetes quantity: {text!r}")
    try:
        return Decimal(match.group(1)) * Decimal(_SUFFIX[match.group(2)])
    except InvalidOperation as exc:
        raise ValueError(f"not a Kubernetes quantity: {text!r}") from exc


T = TypeVar("T")


def _unique_names(items: list[T]) -> list[T]:
    seen: set[object] = set()
    for item in items:
        name = getattr(item, "name")  # noqa: B009 - every NamedList item has a name
        if name in seen:
            raise ValueError(f"duplicate name {name!r}: each entry needs a unique name")
        seen.add(name)
    return items


def unique_values(items: list[T]) -> list[T]:
    seen: set[object] = set()
    for item in items:
        if item in seen:
            raise ValueError(f"duplicate entry {item!r}: entries must be unique")
        seen.add(item)
    return items


NamedList = Annotated[
    list[T],
    Field(
        max_length=MAX_LIST,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    ),
    AfterValidator(_unique_names),
]
"""A list of named objects, unique by `name` (a list-map to the API server)."""

UniqueList = Annotated[
    list[T],
    Field(max_length=MAX_LIST, json_schema_extra={"x-kubernetes-list-type": "set"}),
    AfterValidator(unique_values),
]
"""A list of unique scalars (a list-set to the API server)."""
