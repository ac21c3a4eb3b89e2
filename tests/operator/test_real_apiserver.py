"""legorl's CRDs and manifests on a real kube-apiserver (v1.20.2, built by scripts/get-kube.sh).

What the API mock and the CEL emulation cannot show: the server's own OpenAPI validation of the
CRDs (a default must have its field's type), of the custom resources, server-side apply, and
owner-reference garbage collection by the real controller-manager. 1.20 has no CEL
(`x-kubernetes-validations` is refused), so the server gets the CRDs with the rules stripped,
made here from the committed files; the CEL rules stay checked by cel-python elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from legorl.api import GROUP_VERSION, KINDS
from legorl.api.crd import openapi_schema, without_keyword
from legorl.manifests import kubeyaml
from legorl.manifests.generated import to_yaml
from legorl.manifests.structural import apply_defaults, cel_violations, prune_nulls
from tests.api.test_invalid_manifests import CASES, _list_map_duplicates, _manifest, _strict
from tests.operator.test_helm import VALUE_SETS, set_flags
from tests.support.kubecluster import ControlPlane, control_plane, kube_bin

# A real etcd and kube-apiserver (and controller-manager) start for this module.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CRD_FILES = sorted((REPO / "crds").glob("legorl.dev_*.yaml"))
KOPF_CRDS = REPO / "charts/legorl/crds/kopf.dev_peerings.yaml"  # the chart installs these too
EXAMPLES = ["shared-fleet-and-pool.yaml", "gpu-swe-verified.yaml", "tiny-local.yaml"]

if kube_bin() is None:
    if os.environ.get("LEGORL_REQUIRE_KUBE") == "1":
        raise RuntimeError("LEGORL_REQUIRE_KUBE=1 but no kube-apiserver: run `bash scripts/get-kube.sh`")
    pytest.skip("no kube-apiserver built: run `bash scripts/get-kube.sh`", allow_module_level=True)


def crd_for_120(path: Path) -> dict[str, Any]:
    """The committed CRD as 1.20 takes it: every `x-kubernetes-validations` removed."""
    crd: dict[str, Any] = without_keyword(kubeyaml.load(path.read_text()), "x-kubernetes-validations")
    return crd


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with control_plane(tmp_path_factory.mktemp("kube")) as plane:
        for path in CRD_FILES:
            plane.kubectl("apply", "--server-side", "-f", "-", stdin=to_yaml(crd_for_120(path)))
        plane.kubectl("apply", "--server-side", "-f", str(KOPF_CRDS))
        for path in [*CRD_FILES, KOPF_CRDS]:
            for crd in kubeyaml.load_all(path.read_text()):
                name = crd["metadata"]["name"]
                plane.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
        yield plane


def example(kind: str, namespace: str) -> dict[str, Any]:
    """The first KIND of examples/shared-fleet-and-pool.yaml, placed in NAMESPACE."""
    docs = kubeyaml.load_all((REPO / "examples/shared-fleet-and-pool.yaml").read_text())
    obj: dict[str, Any] = next(d for d in docs if d and d["kind"] == kind)
    obj["metadata"]["namespace"] = namespace
    return obj


def applied_example(cluster: ControlPlane, kind: str, namespace: str) -> dict[str, Any]:
    """`example(kind, namespace)`, applied server-side (the namespace made first)."""
    cluster.kubectl("create", "namespace", namespace, check=False)
    obj = example(kind, namespace)
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=to_yaml(obj))
    return obj


def test_the_crds_install_and_are_established(cluster: ControlPlane) -> None:
    out = cluster.kubectl("get", "crd", "-o", "json").stdout
    names = {item["metadata"]["name"] for item in json.loads(out)["items"]}
    assert {"rlruns.legorl.dev", "sandboxpools.legorl.dev", "rolloutfleets.legorl.dev"} <= names


def test_the_old_generators_rlrun_crd_is_refused(cluster: ControlPlane) -> None:
    # What `legorl crds` wrote before it quoted number-like strings: `default: 1e-6`.
    text = to_yaml(crd_for_120(REPO / "crds/legorl.dev_rlruns.yaml"))
    old = text.replace("default: '1e-6'", "default: 1e-6").replace(
        "learningRate: '1e-6'", "learningRate: 1e-6"
    )
    assert old != text
    # Sent as an update of the installed CRD (dry run): the server validates defaults then too.
    result = cluster.kubectl("apply", "--server-side", "--dry-run=server", "-f", "-", stdin=old, check=False)
    assert result.returncode != 0
    assert "learningRate" in result.stderr and "must be of type string" in result.stderr, result.stderr


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_examples_apply_server_side(cluster: ControlPlane, name: str) -> None:
    namespace = "ex-" + name.split(".", maxsplit=1)[0].replace("_", "-")[:40]
    cluster.kubectl("create", "namespace", namespace, check=False)
    docs = [d for d in kubeyaml.load_all((REPO / "examples" / name).read_text()) if d]
    for doc in docs:
        doc["metadata"]["namespace"] = namespace
    text = "---\n".join(map(to_yaml, docs))
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=text)
    for doc in docs:
        got = json.loads(
            cluster.kubectl(
                "get", doc["kind"].lower(), doc["metadata"]["name"], "-n", namespace, "-o", "json"
            ).stdout
        )
        # The server kept every field it was sent (nothing pruned as unknown) ...
        assert _contains(got["spec"], doc["spec"]), doc["metadata"]["name"]


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_the_chart_applies_server_side(cluster: ControlPlane, helm: str, value_set: str) -> None:
    for namespace in ("legorl-system", "a", "b"):  # the release's, and the watched ones of two value sets
        cluster.kubectl("create", "namespace", namespace, check=False)
    rendered = subprocess.run(
        [helm, "template", "demo", str(REPO / "charts/legorl"), "--namespace", "legorl-system",
         *set_flags(VALUE_SETS[value_set])],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    docs = [d for d in kubeyaml.load_all(rendered) if d]
    assert {"ClusterRole", "Deployment"} <= {d["kind"] for d in docs}
    cluster.kubectl("apply", "--server-side", "--dry-run=server", "-f", "-", stdin=rendered)


def test_an_unquoted_learning_rate_is_refused_by_the_server_as_by_validate(cluster: ControlPlane) -> None:
    text = (
        (REPO / "examples/tiny-local.yaml").read_text().replace('learningRate: "5e-4"', "learningRate: 5e-4")
    )
    cluster.kubectl("create", "namespace", "unquoted", check=False)
    result = cluster.kubectl("apply", "--server-side", "-n", "unquoted", "-f", "-", stdin=text, check=False)
    assert result.returncode != 0
    assert "spec.algorithm.learningRate" in result.stderr and "string" in result.stderr, result.stderr


def test_children_are_garbage_collected_by_the_real_controller_manager(cluster: ControlPlane) -> None:
    fleet = applied_example(cluster, "RolloutFleet", "gc")
    owner = json.loads(
        cluster.kubectl("get", "rolloutfleet", fleet["metadata"]["name"], "-n", "gc", "-o", "json").stdout
    )
    child = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "owned",
            "namespace": "gc",
            "ownerReferences": [
                {
                    "apiVersion": owner["apiVersion"],
                    "kind": owner["kind"],
                    "name": owner["metadata"]["name"],
                    "uid": owner["metadata"]["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "data": {"k": "v"},
    }
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=to_yaml(child))
    cluster.kubectl("delete", "rolloutfleet", owner["metadata"]["name"], "-n", "gc", "--wait=true")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if cluster.kubectl("get", "configmap", "owned", "-n", "gc", check=False).returncode != 0:
            return
        time.sleep(0.5)
    pytest.fail("the owned ConfigMap outlived its owner by 60 s: no garbage collection")


def _contains(big: Any, small: Any) -> bool:
    if isinstance(small, dict):
        return isinstance(big, dict) and all(k in big and _contains(big[k], v) for k, v in small.items())
    if isinstance(small, list):
        return isinstance(big, list) and len(big) == len(small) and all(map(_contains, big, small))
    return bool(big == small)


# --- the invalid manifests of test_invalid_manifests.py, sent to the real server -------------------

TABLE_DOC = REPO / "docs/operator.md"
TABLE_START = "<!-- real-server-table:start -->"
TABLE_END = "<!-- real-server-table:end -->"


def _emulated(obj: dict[str, Any]) -> str:
    """Which part of the emulated API server refuses OBJ: `schema` (OpenAPI types, bounds, enums,
    required fields, list-map keys), `unknown-field`, `cel`, or `none`."""
    kind = obj.get("kind")
    if kind not in KINDS or obj.get("apiVersion") != GROUP_VERSION:
        return "schema"
    schema = openapi_schema(kind)
    defaulted = apply_defaults(schema, prune_nulls(schema, obj))
    if any(jsonschema.Draft7Validator(schema).iter_errors(defaulted)) or _list_map_duplicates(
        schema, defaulted
    ):
        return "schema"
    if any(jsonschema.Draft7Validator(_strict(schema)).iter_errors(defaulted)):
        return "unknown-field"
    return "cel" if cel_violations(schema, defaulted) else "none"


def _real_verdict(cluster: ControlPlane, obj: dict[str, Any], unknown: str | None) -> str:
    """`refused`, `pruned` (accepted without the UNKNOWN field's path), or `accepted`."""
    sent = dict(obj, metadata={**obj["metadata"], "namespace": "invalid"})
    # --validate=false: the server's verdict alone (kubectl's client-side check depends on whether
    # the server has published the CRD's OpenAPI yet, so it is not deterministic).
    args = ["apply", "--server-side", "--dry-run=server", "--validate=false", "-o", "json", "-f", "-"]
    result = cluster.kubectl(*args, stdin=to_yaml(sent), check=False)
    if result.returncode != 0:
        print(f"refused: {result.stderr.strip()}")  # shown when the test fails
        return "refused"
    if unknown is None:
        return "accepted"
    node: Any = json.loads(result.stdout)
    for part in unknown.split("."):
        if not isinstance(node, dict) or part not in node:
            return "pruned"
        node = node[part]
    return "accepted"


def _table_rows() -> dict[str, tuple[str, str]]:
    """docs/operator.md's rejection table: case → (its `1.20` column, its `emulated` column); the
    `1.36` and `legorl validate` columns are tests/api/test_crds_136.py's."""
    text = TABLE_DOC.read_text()
    body = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip().splitlines()
    header = [c.strip() for c in body[0].strip().strip("|").split("|")]
    rows: dict[str, tuple[str, str]] = {}
    for line in body[2:]:
        cells = dict(
            zip(header, (c.strip().strip("`") for c in line.strip().strip("|").split("|")), strict=True)
        )
        rows[cells["case"]] = (cells["1.20"], cells["emulated"])
    return rows


def test_the_invalid_manifests_on_the_real_server_match_the_table(cluster: ControlPlane) -> None:
    cluster.kubectl("create", "namespace", "invalid", check=False)
    measured: dict[str, tuple[str, str]] = {}
    for name, kind, edit, path in CASES:
        obj = _manifest(kind, edit)
        emulated = _emulated(obj)
        real = _real_verdict(cluster, obj, path if emulated == "unknown-field" else None)
        measured[name] = (real, emulated)
    # What the real server refuses is what the emulation calls a schema problem, plus the
    # metadata.name rule it applies itself; CEL-only cases pass 1.20 (it has no CEL); an unknown
    # field is never stored.
    for name, (real, emulated) in measured.items():
        if emulated == "schema" or name == "name-uppercase":
            assert real == "refused", (name, real, emulated)
        elif emulated == "unknown-field":
            assert real == "pruned", (name, real)
        else:
            assert real == "accepted", (name, real, emulated)
    table = _table_rows()
    lines = "\n".join(f"| `{n}` | {r} | {e} |" for n, (r, e) in measured.items())  # case | 1.20 | emulated
    assert table == measured, f"docs/operator.md's table is stale; measured:\n{lines}"


def test_an_empty_string_in_a_custom_resource_is_kept(cluster: ControlPlane) -> None:
    # The operator writes conditions with an empty message. Built with Go >= 1.19 and without
    # scripts/kube/openapi-empty-string.patch, this server took every "" for a null and refused it.
    fleet = applied_example(cluster, "RolloutFleet", "empty")
    condition = {
        "type": "Degraded", "status": "False", "reason": "AsExpected", "message": "",
        "lastTransitionTime": "2026-12-03T08:49:33Z", "observedGeneration": 1,
    }  # fmt: skip
    patch = json.dumps({"status": {"conditions": [condition]}})
    name = fleet["metadata"]["name"]
    cluster.kubectl(
        "patch", "rolloutfleet", name, "-n", "empty", "--subresource=status", "--type=merge", "-p", patch
    )
    got = json.loads(cluster.kubectl("get", "rolloutfleet", name, "-n", "empty", "-o", "json").stdout)
    assert got["status"]["conditions"] == [condition]
