"""The generated CRDs: valid apiextensions.k8s.io/v1 objects, structural, complete, and never stale."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from legorl.api import KINDS
from legorl.api.crd import all_crds, crd_for, structural_problems
from legorl.manifests import kubeyaml
from legorl.manifests.generated import generated_files, stale_files
from legorl.manifests.structural import cel_violations, iter_nodes

REPO = Path(__file__).resolve().parents[2]

K8S_VERSIONS = ("1.30", "1.33", "1.37")


@pytest.mark.parametrize("name", sorted(all_crds()))
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_crd_is_a_valid_apiextensions_object(name: str, version: str) -> None:
    kubernetes_validate.validate(all_crds()[name], version, strict=True)


def test_validation_catches_a_broken_crd() -> None:
    crd = crd_for(KINDS["RLRun"])
    crd["spec"]["versions"][0]["served"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(crd, "1.33", strict=True)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_schema_is_structural_and_bounded(kind: str) -> None:
    root = crd_for(KINDS[kind])["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert structural_problems(root["properties"]["spec"], ".spec") == []
    assert structural_problems(root["properties"]["status"], ".status") == []


def test_structural_check_finds_problems() -> None:
    bad = {
        "type": "object",
        "properties": {
            "free": {"type": "string"},
            "list": {"type": "array", "items": {"type": "integer"}},
            "untyped": {"description": "no type"},
            "both": {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {}},
        },
    }
    problems = structural_problems(bad)
    assert any(".free: unbounded string" in p for p in problems)
    assert any(".list: unbounded list" in p for p in problems)
    assert any(".untyped: no type" in p for p in problems)
    assert any(".both: properties and additionalProperties" in p for p in problems)


def _root(kind: str) -> dict[str, Any]:
    root: dict[str, Any] = crd_for(KINDS[kind])["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return root


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_rule_field_path_resolves(kind: str) -> None:
    """The API server refuses a CRD whose rule points its fieldPath at an undeclared field."""
    for where, node in iter_nodes(_root(kind)):
        for rule in node.get("x-kubernetes-validations", []):
            if "fieldPath" not in rule:
                continue
            target = node
            for part in rule["fieldPath"].lstrip(".").split("."):
                assert part in target.get("properties", {}), (
                    f"{kind}{where}: {rule['fieldPath']} does not resolve"
                )
                target = target["properties"][part]


def _root_as_installed(kind: str, folder: str) -> dict[str, Any]:
    """The schema of the committed CRD file, read as the API server reads it (`kubeyaml`)."""
    plural = crd_for(KINDS[kind])["spec"]["names"]["plural"]
    crd = kubeyaml.load((REPO / folder / f"legorl.dev_{plural}.yaml").read_text())
    root: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return root


@pytest.mark.parametrize("folder", ["crds", "charts/legorl/crds"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_default_passes_its_own_schema_and_rules(kind: str, folder: str) -> None:
    """The API server checks each default as written (no nested defaulting first) against the
    schema and the CEL rules of its node; a default that fails makes the CRD uninstallable. The
    file is read as Kubernetes reads it: an unquoted `default: 1e-6` is a number there, and broke
    `helm install` of a string field."""
    checked = 0
    for where, node in iter_nodes(_root_as_installed(kind, folder)):
        if "default" not in node:
            continue
        default = node["default"]
        jsonschema.Draft7Validator(node).validate(default)
        violations = cel_violations(node, default)
        assert violations == [], f"{kind}{where}: default {default} breaks {violations}"
        checked += 1
    assert checked > 20


def _version(kind: str) -> dict[str, Any]:
    version: dict[str, Any] = crd_for(KINDS[kind])["spec"]["versions"][0]
    return version


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_crd_metadata(kind: str) -> None:
    crd = crd_for(KINDS[kind])
    names = crd["spec"]["names"]
    assert crd["metadata"]["name"] == f"{names['plural']}.legorl.dev"
    assert names["kind"] == kind
    assert "legorl" in names["categories"]
    assert names["shortNames"]
    version = _version(kind)
    assert version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[-1] == "Age" or "Age" in columns
    assert "Reason" in columns


def test_scale_subresource_for_fleets_and_pools_only() -> None:
    for kind in ("RolloutFleet", "SandboxPool"):
        scale = _version(kind)["subresources"]["scale"]
        assert scale == {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
        props = _version(kind)["schema"]["openAPIV3Schema"]["properties"]
        assert props["spec"]["properties"]["replicas"]["type"] == "integer"
        assert props["status"]["properties"]["replicas"]["type"] == "integer"
        assert props["status"]["properties"]["selector"]["type"] == "string"
    assert "scale" not in _version("RLRun")["subresources"]


def test_printer_columns_point_at_real_fields() -> None:
    for kind in KINDS:
        version = _version(kind)
        root = version["schema"]["openAPIV3Schema"]
        for column in version["additionalPrinterColumns"]:
            path = column["jsonPath"]
            if path.startswith(".metadata"):
                continue
            node = root
            # `.status.conditions[?(@.type=="Ready")].status` -> `.status.conditions[].status`
            path = re.sub(r'\[\?\(@\.type=="[A-Za-z]+"\)\]', "[]", path)
            for part in path.lstrip(".").split("."):
                name = part.split("[", 1)[0]
                node = node["properties"][name]
                if "[" in part:
                    node = node["items"]
            assert node, f"{kind} column {column['name']} points at nothing"


def test_every_spec_field_is_documented() -> None:
    def walk(node: dict[str, Any], path: str) -> list[str]:
        missing = []
        for name, sub in node.get("properties", {}).items():
            if not sub.get("description"):
                missing.append(f"{path}.{name}")
            missing += walk(sub, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            missing += walk(node["items"], f"{path}[]")
        return missing

    for kind in KINDS:
        root = _version(kind)["schema"]["openAPIV3Schema"]
        assert walk(root["properties"]["spec"], f"{kind}.spec") == []
        assert walk(root["properties"]["status"], f"{kind}.status") == []


def test_generated_files_are_committed_and_current(repo: Path) -> None:
    assert stale_files(repo) == [], "run `legorl crds` and commit the result"
    for rel in generated_files():
        if rel.endswith(".yaml"):
            assert all(doc is not None for doc in yaml.safe_load_all((repo / rel).read_text())), rel


def test_crds_check_fails_after_a_model_change_without_regeneration(repo: Path, tmp_path: Path) -> None:
    """`legorl crds --check` is what CI runs; change a model in a copy of the tree and it must fail."""
    copy = tmp_path / "checkout"
    shutil.copytree(repo / "legorl", copy / "legorl", ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("crds", "charts", "docs"):
        shutil.copytree(repo / folder, copy / folder)
    run_py = copy / "legorl" / "api" / "run.py"
    source = run_py.read_text()
    assert "group_size: Annotated[int, Field(ge=1, le=512)] = 8" in source
    run_py.write_text(source.replace("Field(ge=1, le=512)] = 8", "Field(ge=1, le=256)] = 8"))
    env = {**os.environ, "PYTHONPATH": str(copy)}
    check = [sys.executable, "-m", "legorl.cli", "crds", "--check", "--root", str(copy)]

    stale = subprocess.run(check, capture_output=True, text=True, env=env, cwd=copy, check=False)
    assert stale.returncode == 1, stale.stdout + stale.stderr
    assert "stale generated file: crds/legorl.dev_rlruns.yaml" in stale.stderr
    assert "stale generated file: charts/legorl/crds/legorl.dev_rlruns.yaml" in stale.stderr

    regenerate = [sys.executable, "-m", "legorl.cli", "crds", "--root", str(copy)]
    subprocess.run(regenerate, capture_output=True, text=True, env=env, cwd=copy, check=True)
    fresh = subprocess.run(check, capture_output=True, text=True, env=env, cwd=copy, check=False)
    assert fresh.returncode == 0, fresh.stderr
    regenerated = yaml.safe_load((copy / "crds" / "legorl.dev_rlruns.yaml").read_text())
    spec = regenerated["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["algorithm"]["properties"]["groupSize"]["maximum"] == 256
