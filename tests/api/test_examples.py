"""The examples: valid for `legorl validate`, for the CRD schemas, and rendered with defaults."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import yaml

from legorl.api import KINDS
from legorl.api.crd import openapi_schema
from legorl.manifests import validate_paths
from legorl.manifests.generated import to_yaml
from legorl.manifests.structural import apply_defaults, cel_violations

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))


def test_examples_exist() -> None:
    names = {path.name for path in EXAMPLES}
    assert {"tiny-local.yaml", "gpu-swe-verified.yaml", "shared-fleet-and-pool.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates_without_problems(path: Path) -> None:
    reports, load_errors = validate_paths([str(path)])
    assert load_errors == []
    assert reports
    for report in reports:
        assert report.problems == [], [p.format(report.document.label) for p in report.problems]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_matches_its_crd_schema(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        schema = openapi_schema(doc["kind"])
        defaulted = apply_defaults(schema, doc)
        jsonschema.Draft7Validator(schema).validate(defaulted)
        assert cel_violations(schema, defaulted) == []


def test_shared_example_has_two_runs_on_one_fleet_and_pool() -> None:
    docs = list(
        yaml.safe_load_all((Path(__file__).parents[2] / "examples/shared-fleet-and-pool.yaml").read_text())
    )
    runs = [d for d in docs if d["kind"] == "RLRun"]
    assert len(runs) == 2
    assert {r["spec"]["fleetRef"]["name"] for r in runs} == {
        d["metadata"]["name"] for d in docs if d["kind"] == "RolloutFleet"
    }
    assert {r["spec"]["poolRef"]["name"] for r in runs} == {
        d["metadata"]["name"] for d in docs if d["kind"] == "SandboxPool"
    }
    assert sorted(r["spec"]["mode"] for r in runs) == ["Evaluate", "Train"]


CLUSTER_EXAMPLES = [p for p in EXAMPLES if p.name != "tiny-local.yaml"]


@pytest.mark.parametrize("path", CLUSTER_EXAMPLES, ids=lambda p: p.name)
def test_render_prints_the_effective_resources_and_their_children(
    path: Path, run_cli: Callable[..., tuple[int, str, str]], tmp_path: Path
) -> None:
    code, out, err = run_cli("render", str(path))
    assert code == 0, err
    rendered = [doc for doc in yaml.safe_load_all(out) if doc]
    # The inputs are the documents nobody owns; everything else is created by the operator.
    inputs = [d for d in rendered if "ownerReferences" not in d["metadata"]]
    children = [d for d in rendered if "ownerReferences" in d["metadata"]]
    originals = list(yaml.safe_load_all(path.read_text()))
    assert [d["metadata"]["name"] for d in inputs] == [d["metadata"]["name"] for d in originals]
    assert children, "every example creates workloads"
    for doc, original in zip(inputs, originals, strict=True):
        assert doc == apply_defaults(openapi_schema(doc["kind"]), original)
        KINDS[doc["kind"]].model_validate(doc)
        if doc["kind"] == "RLRun":
            # Defaults the author left out are spelled out.
            assert doc["spec"]["filter"]["dropReasons"]
            assert doc["spec"]["fidelity"]["minCorrelation"] == "0.99"
    for child in children:
        assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "legorl-operator"
    # The resources render prints validate again.
    again = tmp_path / "rendered.yaml"
    again.write_text("---\n".join(map(to_yaml, inputs)))
    code, out, _ = run_cli("validate", str(again))
    assert code == 0, out


def test_render_refuses_what_only_runs_locally(run_cli: Callable[..., tuple[int, str, str]]) -> None:
    code, _, err = run_cli("render", str(Path(__file__).parents[2] / "examples/tiny-local.yaml"))
    assert code == 1
    assert (
        "spec.policy.checkpoint.uri: 'builtin://tiny-swe': builtin:// models exist only in local runs" in err
    )
