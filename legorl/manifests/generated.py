"""The generated files of the repository (CRDs, chart CRDs, API reference) and their drift check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from legorl.api.crd import GENERATED_HEADER, SCHEMA_KEYWORDS, all_crds
from legorl.api.docs import api_reference

CRD_DIRS = ("crds", "charts/legorl/crds")
API_REFERENCE = "docs/api-reference.md"


def _order_schema(node: Any) -> Any:
    if isinstance(node, list):
        return [_order_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    if "type" not in node and "properties" not in node and "x-kubernetes-int-or-string" not in node:
        return {k: _order_schema(v) for k, v in node.items()}
    ordered: dict[str, Any] = {}
    for key in SCHEMA_KEYWORDS:
        if key in node:
            value = node[key]
            if key == "properties":
                value = {name: _order_schema(sub) for name, sub in value.items()}
            elif key in ("items", "additionalProperties"):
                value = _order_schema(value)
            elif key == "x-kubernetes-validations":
                order = ("rule", "message", "messageExpression", "fieldPath", "reason")
                value = [{k: rule[k] for k in order if k in rule} for rule in value]
            ordered[key] = value
    ordered.update({k: v for k, v in node.items() if k not in ordered})
    return ordered


class _Dumper(yaml.SafeDumper):
    """Block style, lists indented under their key (the style kubectl and helm print)."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)

    def ignore_aliases(self, data: Any) -> bool:
        return True  # shared sub-schemas are written out in full, never as &anchors


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_representer)


def to_yaml(obj: Any) -> str:
    """Dump YAML deterministically: insertion order, readable unicode, wide lines."""
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)


def crd_yaml(crd: dict[str, Any]) -> str:
    """One CRD as a YAML file with the generated-file header."""
    crd = dict(crd)
    spec = dict(crd["spec"])
    version = dict(spec["versions"][0])
    version["schema"] = {"openAPIV3Schema": _order_schema(version["schema"]["openAPIV3Schema"])}
    spec["versions"] = [version]
    crd["spec"] = spec
    return GENERATED_HEADER + to_yaml(crd)


def generated_files() -> dict[str, str]:
    """Every generated file, by path relative to the repository root."""
    files: dict[str, str] = {}
    for name, crd in all_crds().items():
        text = crd_yaml(crd)
        for folder in CRD_DIRS:
            files[f"{folder}/{name}"] = text
    files[API_REFERENCE] = api_reference()
    return files


def stale_files(root: Path, files: dict[str, str] | None = None) -> list[str]:
    """Generated files that are missing or differ from what the models produce (`files`,
    when the caller has them already)."""
    files = generated_files() if files is None else files
    stale = []
    for rel, text in files.items():
        path = root / rel
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            stale.append(rel)
    for folder in CRD_DIRS:
        expected = {Path(rel).name for rel in files if rel.startswith(folder + "/")}
        directory = root / folder
        if directory.is_dir():
            stale += [
                f"{folder}/{p.name}" for p in sorted(directory.glob("*.yaml")) if p.name not in expected
            ]
    return stale


def write_generated(root: Path) -> list[str]:
    """Write every generated file under `root`; remove stale CRD files; return what changed."""
    files = generated_files()
    changed = stale_files(root, files)
    for rel in changed:
        path = root / rel
        if rel in files:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(files[rel], encoding="utf-8")
        else:
            path.unlink()
    return changed
