"""Validate legorl manifests the way the API server would, and then some.

Three stages, each reporting every problem it finds as one line with the field
path and the fix:

1. schema — the pydantic models (types, bounds, enums, unknown and missing fields);
2. cel — the CRD's `x-kubernetes-validations`, evaluated on the defaulted object;
3. preflight — checks the API server cannot make (see `preflight.py`).
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from legorl.api import GROUP_VERSION, KINDS
from legorl.api.crd import openapi_schema
from legorl.api.kinds import Resource
from legorl.manifests.load import Document, ManifestLoadError, load_documents
from legorl.manifests.preflight import preflight
from legorl.manifests.problems import DocumentReport, Problem
from legorl.manifests.structural import apply_defaults, cel_violations, prune_nulls


@functools.cache
def crd_schema(kind: str) -> dict[str, Any]:
    """The openAPIV3Schema of `kind`, shared read-only by every document of that kind."""
    return openapi_schema(kind)


def _schema_at(schema: dict[str, Any], loc: Sequence[int | str]) -> dict[str, Any] | None:
    node: dict[str, Any] | None = schema
    for part in loc:
        if node is None:
            return None
        if isinstance(part, int):
            node = node.get("items")
        elif part in node.get("properties", {}):
            node = node["properties"][part]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return None
    return node


def _got(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _as_written(text: str, value: Any) -> str:
    """Why an unquoted scalar is not a string to Kubernetes, and the fix."""
    what = "a number" if not isinstance(value, bool) else str(value).lower()
    return f'must be a string; Kubernetes reads the unquoted {text} as {what}: quote it: "{text}"'


def _describe(
    error: ErrorDetails, schema: dict[str, Any], texts: dict[tuple[str | int, ...], str] | None = None
) -> str:
    kind = error["type"]
    ctx = error.get("ctx", {})
    value = error.get("input")
    loc = error["loc"]
    here = _schema_at(schema, loc) or {}
    if kind == "missing":
        hint = here.get("description", "")
        return f"required field is missing{': ' + hint if hint else ''}"
    if kind == "extra_forbidden":
        parent = _schema_at(schema, loc[:-1]) or {}
        known = sorted(parent.get("properties", {}))
        name = str(loc[-1])
        close = difflib.get_close_matches(name, known, n=1)
        suggestion = f"did you mean {close[0]!r}? " if close else ""
        return f"unknown field {name!r}; {suggestion}known fields: {', '.join(known)}"
    if kind in ("greater_than_equal", "greater_than"):
        return f"must be ≥ {ctx.get('ge', ctx.get('gt'))} (got {_got(value)})"
    if kind in ("less_than_equal", "less_than"):
        return f"must be ≤ {ctx.get('le', ctx.get('lt'))} (got {_got(value)})"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']} (got {_got(value)})"
    if kind == "enum":
        return f"must be one of {ctx['expected']} (got {_got(value)})"
    if kind == "string_too_long":
        return f"must be at most {ctx['max_length']} characters (got {len(value)})"
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "too_long":
        return f"must have at most {ctx['max_length']} entries (got {ctx.get('actual_length', '?')})"
    if kind == "string_pattern_mismatch":
        pattern = ctx.get("pattern", "")
        if here.get("x-kubernetes-int-or-string"):
            return f"{_got(value)} is not a Kubernetes quantity; write e.g. 2, 500m, 16Gi"
        if "eE" in pattern:
            return f'{_got(value)} is not a number; write it as a quoted decimal, e.g. "0.2" or "1e-6"'
        if "sha256" in pattern:
            return f"{_got(value)} is not an image reference; write e.g. ghcr.io/org/image:tag"
        if pattern.startswith("^[a-z0-9]([-a-z0-9]*"):
            return f"{_got(value)} is not a valid name: use lowercase letters, digits and '-'"
        if loc and loc[-1] == "[key]" and pattern.startswith("^(cpu|memory|"):
            return (
                f"{_got(value)} is not a container resource: use cpu, memory, ephemeral-storage, "
                "hugepages-<size> or an extended resource such as nvidia.com/gpu"
            )
        if loc and loc[-1] == "[key]":
            return f"key {_got(value)} is not allowed: keys must match {pattern}"
        return f"{_got(value)} does not match the pattern {pattern}"
    if kind == "string_type":
        written = (texts or {}).get(tuple(loc))
        if written is not None:
            return _as_written(written, value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return f'must be a string; quote the number: "{value}"'
        return f"must be a string (got {type(value).__name__} {_got(value)})"
    if kind in ("int_type", "int_parsing", "int_from_float") and isinstance(value, bool):
        written = (texts or {}).get(tuple(loc), str(value).lower())
        return f"must be an integer; Kubernetes reads the unquoted {written} as {str(value).lower()}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"must be an integer (got {type(value).__name__} {_got(value)})"
    if kind == "bool_type":
        return f"must be true or false (got {_got(value)})"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return f"must be a mapping of fields (got {type(value).__name__} {_got(value)})"
    if kind == "list_type":
        return f"must be a list (got {type(value).__name__} {_got(value)})"
    if kind == "float_type":
        return f"must be a number (got {type(value).__name__} {_got(value)})"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    return f"{error['msg']} (got {_got(value)})"


def field_path(loc: Sequence[int | str], schema: dict[str, Any]) -> str:
    """`('spec', 'env', 2, 'name')` → `spec.env[2].name`, reading the schema so that an integer
    map key (`limits: {1: 2}`) is not mistaken for a list index."""
    out = ""
    node: dict[str, Any] | None = schema
    for part in loc:
        if part == "[key]":  # pydantic's marker for a bad map key: the key itself is the path
            continue
        is_index = isinstance(part, int) and node is not None and node.get("type") == "array"
        out += f"[{part}]" if is_index else (f".{part}" if out else str(part))
        node = _schema_at(node, [part]) if node is not None else None
    return out


def schema_problems(
    body: dict[str, Any],
    model: type[Resource],
    texts: dict[tuple[str | int, ...], str] | None = None,
) -> tuple[list[Problem], Resource | None]:
    """Validate with the pydantic model; returns problems and the model when valid. `texts` are the
    unquoted scalars of the document as written (`Document.texts`), for the messages.

    Field names must be the wire names (`groupSize`): the API server does not know the Python
    names, so `group_size` is an unknown field here too.
    """
    schema = crd_schema(model.crd.kind)
    try:
        return [], model.model_validate(body, by_alias=True, by_name=False)
    except ValidationError as exc:
        problems = [
            Problem("error", field_path(err["loc"], schema), _describe(err, schema, texts))
            for err in exc.errors(include_url=False)
        ]
        return problems, None


def cel_problems(body: dict[str, Any], kind: str, skip_unevaluable: bool) -> list[Problem]:
    """CEL rules of the CRD, on the object after API-server defaulting."""
    schema = crd_schema(kind)
    defaulted = apply_defaults(schema, body)
    out = []
    for violation in cel_violations(schema, defaulted):
        if not violation.evaluated and skip_unevaluable:
            continue  # a malformed value already reported by the schema stage
        out.append(Problem("error", violation.path.lstrip("."), violation.message, "cel"))
    return out


def validate_document(doc: Document) -> DocumentReport:
    """Schema and CEL checks of one document (preflight runs across documents, later)."""
    report = DocumentReport(doc)
    body = doc.body
    if not isinstance(body, dict):
        report.problems.append(
            Problem(
                "error",
                "",
                "a manifest must be a mapping with apiVersion, kind, metadata and spec",
                "load",
            )
        )
        return report
    kind = body.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        known = ", ".join(KINDS)
        report.problems.append(
            Problem("error", "kind", f"unknown kind {kind!r}; legorl manifests are one of {known}")
        )
        return report
    if body.get("apiVersion") != GROUP_VERSION:
        report.problems.append(
            Problem(
                "error",
                "apiVersion",
                f"must be {GROUP_VERSION!r} (got {_got(body.get('apiVersion'))})",
            )
        )
    if "status" in body:
        report.problems.append(
            Problem(
                "warning",
                "status",
                "status is written by the operator and ignored when you apply",
                "load",
            )
        )
        body = {k: v for k, v in body.items() if k != "status"}
    # The API server drops explicit nulls of non-nullable fields before anything else.
    body = prune_nulls(crd_schema(kind), body)
    report.body = body
    problems, resource = schema_problems(body, KINDS[kind], doc.texts)
    report.problems += problems
    report.resource = resource
    report.problems += cel_problems(body, kind, skip_unevaluable=bool(problems))
    return report


def validate_documents(docs: Iterable[Document]) -> list[DocumentReport]:
    """Validate documents, then run preflight across all of them (references resolve within the set)."""
    reports = [validate_document(doc) for doc in docs]
    preflight(reports)
    return reports


def validate_paths(paths: Sequence[str]) -> tuple[list[DocumentReport], list[str]]:
    """Validate files; returns the reports and the load errors (one line each)."""
    docs: list[Document] = []
    load_errors: list[str] = []
    for path in paths:
        try:
            found = load_documents(path)
        except ManifestLoadError as exc:
            load_errors.append(f"{exc}")
            continue
        if not found:
            load_errors.append(f"{path}: no YAML documents found")
        docs += found
    return validate_documents(docs), load_errors
