"""YAML read and written the way Kubernetes reads it.

kubectl, helm and the API server turn YAML into JSON with `sigs.k8s.io/yaml`, which resolves plain
(unquoted) scalars with go-yaml v2's rules, not PyYAML's YAML 1.1 ones. Where the two differ, a file
can mean one thing to legorl and another to the cluster:

| plain scalar            | PyYAML (YAML 1.1) | Kubernetes (go-yaml v2)        |
| ----------------------- | ----------------- | ------------------------------ |
| `1e-6`, `1.0e6`         | string            | number                         |
| `y`, `Y`, `n`, `N`      | string            | boolean                        |
| `0o17`                  | string            | integer 15                     |
| `08`, `1e3`             | string            | number (8, 1000 once JSON)     |
| `1:30`                  | integer 90        | string                         |
| `2024-01-01`            | date              | string                         |

`KubeLoader` reads with go-yaml v2's rules, and `to_json_value` then does what the JSON step does:
map keys become strings (`on:` is the key `"true"`), a whole-number float is the integer the API
server decodes, and NaN or an infinity (which JSON cannot carry) is an error. `KubeDumper` writes
with the same rules, so a string that Kubernetes would read as something else is quoted.
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml
from yaml.constructor import ConstructorError

STR = "tag:yaml.org,2002:str"
BOOL = "tag:yaml.org,2002:bool"
INT = "tag:yaml.org,2002:int"
FLOAT = "tag:yaml.org,2002:float"
NULL = "tag:yaml.org,2002:null"
MERGE = "tag:yaml.org,2002:merge"

# go-yaml v2's resolve table (resolve.go): looked up for a plain scalar whose first character is
# one of `yYnNtTfFoO~`, a sign, a digit or a dot.
_TABLE: dict[str, tuple[str, Any]] = {
    **{s: (BOOL, True) for s in ("y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON")},
    **{
        s: (BOOL, False) for s in ("n", "N", "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF")
    },
    **{s: (NULL, None) for s in ("", "~", "null", "Null", "NULL")},
    **{s: (FLOAT, math.nan) for s in (".nan", ".NaN", ".NAN")},
    **{s: (FLOAT, math.inf) for s in (".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF")},
    **{s: (FLOAT, -math.inf) for s in ("-.inf", "-.Inf", "-.INF")},
}
_HINTED = frozenset("yYnNtTfFoO~+-.0123456789")
# go-yaml v2's yamlStyleFloat, and what strconv.ParseFloat takes from a scalar that starts with a dot.
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_DOT_FLOAT = re.compile(r"\.[0-9]+([eE][-+]?[0-9]+)?")
# strconv.ParseInt(s, 0, 64): a sign, then a base prefix (0x, 0o, 0b, or a leading 0 for octal).
_INT = re.compile(
    r"(?P<sign>[-+]?)(?:0[xX](?P<hex>[0-9a-fA-F]+)|0[oO](?P<oct>[0-7]+)|0[bB](?P<bin>[01]+)"
    r"|0(?P<old>[0-7]*)|(?P<dec>[1-9][0-9]*))"
)
_INT64 = (-(2**63), 2**63 - 1)
_UINT64 = 2**64 - 1


def _go_int(plain: str) -> int | None:
    """strconv.ParseInt(plain, 0, 64), falling back to ParseUint as go-yaml does; None if neither."""
    match = _INT.fullmatch(plain)
    if match is None:
        return None
    for group, base in (("hex", 16), ("oct", 8), ("bin", 2), ("old", 8), ("dec", 10)):
        digits = match.group(group)
        if digits is not None:
            value = int(digits or "0", base)
            break
    if match.group("sign") == "-":
        value = -value
    if _INT64[0] <= value <= _INT64[1] or (not match.group("sign") and 0 <= value <= _UINT64):
        return value
    return None


def resolve_plain(text: str) -> tuple[str, Any]:
    """The tag and value go-yaml v2 gives a plain (unquoted, untagged) scalar."""
    if text == "<<":
        return MERGE, text
    if not text:
        return NULL, None
    if text[0] not in _HINTED:
        return STR, text
    if text in _TABLE:
        return _TABLE[text]
    if text[0] == ".":
        return (FLOAT, float(text)) if _DOT_FLOAT.fullmatch(text) else (STR, text)
    if text[0] in "+-0123456789":
        plain = text.replace("_", "")
        value = _go_int(plain)
        if value is not None:
            return INT, value
        if _FLOAT.fullmatch(plain) and math.isfinite(float(plain)):  # ParseFloat fails out of range
            return FLOAT, float(plain)
    return STR, text


def _resolve(kind: type[yaml.Node], value: Any, implicit: tuple[bool, bool]) -> str | None:
    """go-yaml v2's tag for a plain scalar; None for everything else (the base resolver's)."""
    if kind is yaml.ScalarNode and implicit[0]:
        return resolve_plain(value)[0]
    return None


def _constructor(tag: str) -> Any:
    def construct(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
        text = str(loader.construct_scalar(node))
        got, value = resolve_plain(text)
        if tag == FLOAT and got == INT:  # `!!float 1` is the float 1.0
            return float(value)
        if got != tag:
            raise ConstructorError(
                None, None, f"{text!r} is not a valid {tag.rsplit(':', 1)[-1]}", node.start_mark
            )
        return value

    return construct


class KubeLoader(yaml.SafeLoader):
    """A safe loader that reads plain scalars as Kubernetes does (see `resolve_plain`)."""

    yaml_implicit_resolvers: dict[Any, Any] = {}  # noqa: RUF012 - PyYAML's class-level table

    def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
        return _resolve(kind, value, implicit) or super().resolve(kind, value, implicit)  # type: ignore[no-untyped-call]


for _tag in (BOOL, INT, FLOAT, NULL):
    KubeLoader.add_constructor(_tag, _constructor(_tag))


_YAML11 = yaml.resolver.Resolver()


class KubeDumper(yaml.SafeDumper):
    """A safe dumper that quotes every string Kubernetes would read as something else, and every
    one YAML 1.1 readers (PyYAML) would (`1:30`, `2024-01-01`), so a file means one thing to all."""

    def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
        tag = _resolve(kind, value, implicit)
        if tag == STR:
            return _YAML11.resolve(kind, value, implicit)  # type: ignore[no-untyped-call]
        return tag or super().resolve(kind, value, implicit)  # type: ignore[no-untyped-call]


class KubeYamlError(ValueError):
    """A document Kubernetes could not turn into JSON."""


def _key(key: Any, where: str) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, bool):
        return "true" if key else "false"
    if isinstance(key, int):
        return str(key)
    if isinstance(key, float) and math.isfinite(key):
        return repr(key)  # Go writes 'g' format; a float map key has no place in a manifest anyway
    if key is None:
        raise KubeYamlError(f"{where or 'the document'}: a map key is null; quote it if it is a name")
    raise KubeYamlError(f"{where or 'the document'}: map key {key!r} cannot be a JSON object key")


def to_json_value(obj: Any, where: str = "") -> Any:
    """What the API server receives for a loaded document: the YAML-to-JSON step of kubectl."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for key, value in obj.items():
            name = _key(key, where)
            out[name] = to_json_value(value, f"{where}.{name}" if where else name)
        return out
    if isinstance(obj, list):
        return [to_json_value(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise KubeYamlError(
                f"{where or 'the document'}: {obj} cannot be sent: JSON has no NaN or infinity"
            )
        # encoding/json writes a whole float without a fraction (8.0 is `8`), which the API
        # server decodes as an integer.
        if obj.is_integer() and abs(obj) < 1e21:  # below 1e21 Go writes no exponent
            return int(obj)
        return obj
    if obj is None or isinstance(obj, (str, bool, int)):
        return obj
    raise KubeYamlError(f"{where or 'the document'}: a {type(obj).__name__} value cannot be sent as JSON")


def load(text: str) -> Any:
    """One document, as the API server would receive it."""
    return to_json_value(yaml.load(text, Loader=KubeLoader))  # noqa: S506 - KubeLoader is a safe loader


def load_all(text: str) -> list[Any]:
    """Every document, as the API server would receive them."""
    return [to_json_value(doc) for doc in yaml.load_all(text, Loader=KubeLoader)]


def plain_texts(node: yaml.Node) -> dict[tuple[str | int, ...], str]:
    """Where a composed document has an unquoted scalar that Kubernetes reads as a bool or a
    number: its path (as in the JSON document) and the text as written, e.g. `1e-6`."""
    out: dict[tuple[str | int, ...], str] = {}
    stack: list[tuple[yaml.Node, tuple[str | int, ...], int]] = [(node, (), 0)]
    while stack:
        here, path, depth = stack.pop()
        if depth > 1000:  # an alias cycle; the loader reports it
            continue
        if isinstance(here, yaml.ScalarNode):
            if here.style is None and here.tag in (BOOL, INT, FLOAT):
                out[path] = here.value
        elif isinstance(here, yaml.SequenceNode):
            stack += [(child, (*path, i), depth + 1) for i, child in enumerate(here.value)]
        elif isinstance(here, yaml.MappingNode):
            for key_node, value_node in reversed(here.value):  # popped in order: later keys win
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == MERGE:
                    continue
                key = resolve_plain(key_node.value)[1] if key_node.style is None else key_node.value
                try:
                    name = _key(key, "")
                except KubeYamlError:
                    continue
                stack.append((value_node, (*path, name), depth + 1))
    return out
