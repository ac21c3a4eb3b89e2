"""What the API server does with a custom resource before storing it: defaulting and CEL rules.

`apply_defaults` mirrors structural-schema defaulting (top-down; a defaulted
object gets its nested defaults too). `cel_violations` evaluates every
`x-kubernetes-validations` rule at every schema node that is present, with
cel-python, the way the API server does with its own CEL runtime.
"""

from __future__ import annotations

import copy
import datetime as dt
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import celpy
from celpy import celtypes
from celpy.adapter import json_to_cel
from celpy.celparser import CELParseError
from celpy.evaluation import CELEvalError

_ENV = celpy.Environment()


class CelRuleError(RuntimeError):
    """A rule could not be compiled or returned something other than a boolean."""


@functools.lru_cache(maxsize=1024)
def compile_rule(rule: str) -> celpy.Runner:
    """Compile a rule once; raises CelRuleError with the position on a syntax error."""
    try:
        return _ENV.program(_ENV.compile(rule))
    except CELParseError as exc:
        raise CelRuleError(f"CEL syntax error in {rule!r}: {exc.args[0] if exc.args else exc}") from exc


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Return a copy of `obj` with the schema's defaults filled in, as the API server would."""
    obj = copy.deepcopy(obj)
    _default_in_place(schema, obj)
    return obj


def prune_nulls(schema: dict[str, Any], obj: Any) -> Any:
    """Return a copy of `obj` without explicit nulls where the schema does not allow them.

    The API server does this before defaulting, so `fleet: null` means "no fleet" and
    `stop: null` gets the default, instead of failing validation.
    """
    if isinstance(obj, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        out = {}
        for key, value in obj.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if value is None and sub is not None and not sub.get("nullable"):
                continue
            out[key] = prune_nulls(sub, value) if sub is not None else value
        return out
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [prune_nulls(schema["items"], item) for item in obj]
    return obj


def _default_in_place(schema: dict[str, Any], obj: Any) -> None:
    if isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                _default_in_place(sub, obj[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for value in obj.values():
                _default_in_place(extra, value)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            _default_in_place(schema["items"], item)


def _to_cel_input(obj: Any, schema: dict[str, Any]) -> Any:
    # The API server turns integers into doubles where the schema says `number`, and has no
    # YAML dates; cel-python needs both done by hand.
    if isinstance(obj, dt.date):
        return obj.isoformat()
    if isinstance(obj, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        return {
            k: _to_cel_input(v, props.get(k, extra if isinstance(extra, dict) else {}))
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        items = schema.get("items")
        return [_to_cel_input(v, items if isinstance(items, dict) else {}) for v in obj]
    if schema.get("type") == "number" and isinstance(obj, int) and not isinstance(obj, bool):
        return float(obj)
    return obj


def eval_rule(rule: str, self_obj: Any, schema: dict[str, Any] | None = None) -> bool:
    """Evaluate one rule with `self` bound to `self_obj`.

    Raises CELEvalError when the rule cannot be evaluated on this input (a missing
    field without has(), a value of the wrong type), and CelRuleError for a broken rule.
    """
    activation = {"self": json_to_cel(_to_cel_input(self_obj, schema or {}))}
    result = compile_rule(rule).evaluate(activation)
    if isinstance(result, CELEvalError):
        raise result
    if not isinstance(result, celtypes.BoolType):
        raise CelRuleError(f"rule {rule!r} returned {type(result).__name__}, not a boolean")
    return bool(result)


@dataclass(frozen=True)
class RuleViolation:
    """A CEL rule that failed (or could not be evaluated) on part of an object."""

    path: str
    rule: str
    message: str
    evaluated: bool
    """False when the rule raised instead of returning false (usually a malformed value)."""


def _join(path: str, field_path: str) -> str:
    return (path + field_path) if field_path.startswith((".", "[")) else f"{path}.{field_path}"


def cel_violations(schema: dict[str, Any], obj: Any, path: str = "") -> list[RuleViolation]:
    """Every rule in `schema` that `obj` breaks, walking the object and the schema together."""
    out: list[RuleViolation] = []
    for entry in schema.get("x-kubernetes-validations", []):
        rule = entry["rule"]
        where = _join(path, entry["fieldPath"]) if entry.get("fieldPath") else path
        try:
            ok = eval_rule(rule, obj, schema)
        except (CELEvalError, ValueError, TypeError, OverflowError, RecursionError) as exc:
            # CELEvalError: the rule cannot run on this value (a missing field, a wrong type);
            # the others: cel-python cannot represent the value at all (ints beyond int64,
            # bytes, sets). Either way the schema stage has something to say about it.
            detail = exc.args[0] if exc.args else type(exc).__name__
            out.append(
                RuleViolation(where, rule, f"{entry['message']} (rule not evaluable: {detail})", False)
            )
            continue
        if not ok:
            out.append(RuleViolation(where, rule, entry["message"], True))
    if isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in obj:
                out += cel_violations(sub, obj[name], f"{path}.{name}")
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, value in obj.items():
                out += cel_violations(extra, value, f"{path}.{key}")
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            out += cel_violations(schema["items"], item, f"{path}[{i}]")
    return out


def iter_nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every node of a schema with its path (`.spec.env[]`, `.spec.resources.requests.*`)."""
    yield path or ".", schema
    for name, sub in schema.get("properties", {}).items():
        yield from iter_nodes(sub, f"{path}.{name}")
    for key, suffix in (("items", "[]"), ("additionalProperties", ".*")):
        if isinstance(schema.get(key), dict):
            yield from iter_nodes(schema[key], path + suffix)


def all_rules(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every `x-kubernetes-validations` entry in a schema, with the schema path it sits at."""
    return [
        (path, entry)
        for path, node in iter_nodes(schema)
        for entry in node.get("x-kubernetes-validations", [])
    ]
