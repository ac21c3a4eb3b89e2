"""legorl's CRDs on a current Kubernetes: a 1.36 API server (apiextensions-apiserver, built by
scripts/get-apiext.sh) checks what 1.20 cannot.

The CRDs go in exactly as generated (CEL rules included) and each rule's estimated cost is
computed by Kubernetes' own code (scripts/apiext/celcost.go) against the server's budgets. Every
invalid manifest of tests/api/test_invalid_manifests.py, and one manifest per CEL rule that only that
rule rejects (tests/support/cel_rule_cases.py), is sent with strict field validation, as kubectl sends it:
the server and `legorl validate` must agree on each, either way. A minimal manifest of each kind is
stored and compared, field by field, with what `legorl render` and the API models say the server
stores; unknown fields are pruned as the emulation prunes them. The operator's status patches and
server-side applies of custom resources, printer columns, the scale subresource and CRD
validation ratcheting are checked on this server too.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from legorl.api import GROUP_VERSION, KINDS
from legorl.api.crd import openapi_schema
from legorl.manifests import kubeyaml, parse_documents, validate_documents
from legorl.manifests.generated import to_yaml
from legorl.manifests.structural import apply_defaults, prune_nulls
from tests.api.test_invalid_manifests import BASES, CASES, _manifest
from tests.support.kube136 import CrdServer, apiext_bin, crd_server, resource_path

REPO = Path(__file__).resolve().parents[2]
CRD_FILES = sorted((REPO / "crds").glob("legorl.dev_*.yaml"))
KOPF_CRDS = REPO / "charts/legorl/crds/kopf.dev_peerings.yaml"
TABLE_DOC = REPO / "docs/operator.md"

if apiext_bin() is None:
    if os.environ.get("LEGORL_REQUIRE_KUBE") == "1":
        raise RuntimeError(
            "LEGORL_REQUIRE_KUBE=1 but no apiextensions-apiserver: run `bash scripts/get-apiext.sh`"
        )
    pytest.skip("no apiextensions-apiserver built: run `bash scripts/get-apiext.sh`", allow_module_level=True)

pytestmark = pytest.mark.slow


def _crd(path: Path) -> dict[str, Any]:
    crd: dict[str, Any] = kubeyaml.load(path.read_text())
    return crd


def _install(server: CrdServer, crd: dict[str, Any], manager: str = "legorl-test") -> None:
    reply = server.apply(crd, manager=manager, force=True)
    assert reply.status in (200, 201), f"{crd['metadata']['name']} refused ({reply.status}): {reply.message}"
    server.wait_established(crd["metadata"]["name"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CrdServer]:
    with crd_server(tmp_path_factory.mktemp("k136")) as s:
        for path in CRD_FILES:
            _install(s, _crd(path))
        for crd in kubeyaml.load_all(KOPF_CRDS.read_text()):
            if crd:
                _install(s, crd)
        yield s


# --- the CRDs as generated, and what their rules cost -----------------------------------------------


def test_the_server_is_1_36(server: CrdServer) -> None:
    assert re.fullmatch(r"v1\.36\.\d+.*", server.version()), server.version()


@pytest.mark.parametrize("path", CRD_FILES, ids=lambda p: p.stem)
def test_the_crd_is_stored_as_generated_cel_rules_included(server: CrdServer, path: Path) -> None:
    crd = _crd(path)
    got = server.request("GET", resource_path(crd)).body
    assert got["spec"]["versions"] == crd["spec"]["versions"], "the server changed or dropped part of the CRD"
    assert json.dumps(got).count('"x-kubernetes-validations"') == path.read_text().count(
        "x-kubernetes-validations:"
    )
    conditions = {c["type"]: c for c in got["status"]["conditions"]}
    assert conditions["NamesAccepted"]["status"] == "True"
    assert conditions["Established"]["status"] == "True"


def cel_costs(path: Path) -> dict[str, Any]:
    """scripts/apiext/celcost.go's figures for the CRD at PATH."""
    binary = apiext_bin()
    assert binary is not None
    out = subprocess.run(
        [str(binary / "celcost")], input=json.dumps(_crd(path)), capture_output=True, text=True,
        check=True, timeout=120,
    ).stdout  # fmt: skip
    report: dict[str, Any] = json.loads(out)
    return report


COST_START = "<!-- cel-cost-table:start -->"
COST_END = "<!-- cel-cost-table:end -->"


def _cost_table() -> str:
    rows = [
        "| CRD | rules | total estimated cost | per-CRD limit | share | costliest rule (path) | its cost "
        "| per-rule limit |"
    ]
    rows.append("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    for path in CRD_FILES:
        report = cel_costs(path)
        (version,) = report["versions"]
        top = max(version["rules"], key=lambda r: r["cost"])
        rows.append(
            f"| {report['crd']} | {len(version['rules'])} | {version['total']:,} | {report['perCrdLimit']:,} "
            f"| {version['total'] / report['perCrdLimit']:.2%} | `{top['path'] or '.'}` | {top['cost']:,} "
            f"| {report['perRuleLimit']:,} |"
        )
    return "\n".join(rows)


def test_every_rule_is_within_the_cost_budgets_and_the_docs_say_by_how_much() -> None:
    for path in CRD_FILES:
        report = cel_costs(path)
        (version,) = report["versions"]
        # As many rules as the generated file has (the tool walks the whole schema).
        assert len(version["rules"]) == path.read_text().count("- rule: "), path.name
        for rule in version["rules"]:
            assert not rule.get("error"), rule
            assert rule["cost"] <= report["perRuleLimit"], rule
        assert version["total"] <= report["perCrdLimit"], (path.name, version["total"])
    text = TABLE_DOC.read_text()
    documented = text.split(COST_START, 1)[1].split(COST_END, 1)[0].strip()
    assert documented == _cost_table(), (
        f"docs/operator.md's CEL cost table is stale; measured:\n{_cost_table()}"
    )


def test_the_cost_tool_agrees_with_the_server_on_a_rule_over_budget(server: CrdServer) -> None:
    # The same RLRun CRD with a quadratic rule over an unbounded list added: the tool must call it
    # over budget, and the server must refuse the CRD for that rule (a tool that under-estimates
    # would let the docs' figures drift from what the server enforces).
    crd = copy.deepcopy(_crd(REPO / "crds/legorl.dev_rlruns.yaml"))
    crd["metadata"]["name"] = "costlies.legorl.dev"
    crd["spec"]["names"] = {
        "kind": "Costly",
        "plural": "costlies",
        "singular": "costly",
        "listKind": "CostlyList",
    }
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["extra"] = {
        "type": "array",
        "items": {"type": "string"},
        "x-kubernetes-validations": [{"rule": "self.all(x, self.all(y, x == y || x != y))", "message": "q"}],
    }
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"costly-{os.getpid()}.yaml"
    tmp.write_text(to_yaml(crd))
    try:
        report = cel_costs(tmp)
    finally:
        tmp.unlink()
    (version,) = report["versions"]
    (rule,) = [r for r in version["rules"] if r["path"] == ".spec.extra"]
    assert rule["cost"] > report["perRuleLimit"], rule
    reply = server.apply(crd, manager="legorl-test", dryRun="All")
    assert reply.status == 422, reply.message
    assert "properties[extra]" in reply.message and "exceeds budget" in reply.message, reply.message


# --- invalid manifests: the 1.36 server, the 1.20 server and legorl validate ----------------------------

TABLE_START = "<!-- real-server-table:start -->"
TABLE_END = "<!-- real-server-table:end -->"


def verdict_136(server: CrdServer, obj: dict[str, Any]) -> tuple[str, str]:
    """(`refused` or `accepted`, the server's message) for creating OBJ (dry run, strict fields)."""
    verdict, reply = _send_136(server, obj)
    return verdict, reply.message


def _send_136(server: CrdServer, obj: dict[str, Any]) -> tuple[str, Any]:
    sent = copy.deepcopy(obj)
    if isinstance(sent.get("metadata"), dict):
        sent["metadata"]["namespace"] = "invalid"
    kind = sent.get("kind")
    if kind not in KINDS or sent.get("apiVersion") != GROUP_VERSION:
        # A resource the server does not serve: POST to where kubectl would send it.
        path = f"/apis/{sent.get('apiVersion')}/namespaces/invalid/{str(kind).lower()}s"
        reply = server.request("POST", path, sent, params={"dryRun": "All", "fieldValidation": "Strict"})
    else:
        reply = server.create(sent, dryRun="All")
    return ("accepted" if reply.status in (200, 201) else "refused"), reply


def verdict_validate(obj: dict[str, Any]) -> str:
    (report,) = validate_documents(parse_documents(to_yaml(obj), "case.yaml"))
    return "refused" if any(p.severity == "error" for p in report.problems) else "accepted"


def table_rows() -> dict[str, dict[str, str]]:
    """docs/operator.md's rejection table: case → column → verdict."""
    body = TABLE_DOC.read_text().split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip().splitlines()
    header = [c.strip() for c in body[0].strip().strip("|").split("|")]
    rows = {}
    for line in body[2:]:
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = dict(zip(header[1:], cells[1:], strict=True))
    return rows


def test_every_invalid_manifest_gets_the_same_verdict_from_the_server_and_legorl_validate(
    server: CrdServer,
) -> None:
    measured: dict[str, str] = {}
    disagreements = []
    for name, kind, edit, path in CASES:
        obj = _manifest(kind, edit)
        real, message = verdict_136(server, obj)
        local = verdict_validate(obj)
        measured[name] = real
        if real != local:
            disagreements.append(f"{name}: 1.36 {real}, legorl validate {local} ({message})")
        if real == "refused" and name != "wrong-api-version":
            # The server names the field (or the object holding the conflicting fields).
            top = path.split(".")[0].split("[")[0]
            assert top in message, (name, message)
    assert not disagreements, "\n".join(disagreements)
    table = table_rows()
    assert {n: row["1.36"] for n, row in table.items()} == measured, (
        "docs/operator.md's table is stale; 1.36 measured:\n"
        + "\n".join(f"{n}: {v}" for n, v in measured.items())
    )
    assert {n: row["legorl validate"] for n, row in table.items()} == {
        n: verdict_validate(_manifest(k, e)) for n, k, e, _ in CASES
    }


# --- one manifest per CEL rule, refused by that rule alone ----------------------------------------------

COVERAGE_START = "<!-- cel-coverage-table:start -->"
COVERAGE_END = "<!-- cel-coverage-table:end -->"


def _rule_cases() -> list[Any]:
    from tests.support.cel_rule_cases import RULE_CASES  # noqa: PLC0415

    return list(RULE_CASES)


def test_each_cel_rule_refuses_its_case_on_the_server_with_its_own_message(server: CrdServer) -> None:
    from tests.support.cel_rule_cases import UNCOVERABLE, rule_entries  # noqa: PLC0415

    failures = []
    for case in _rule_cases():
        obj = _manifest(case.kind, case.edit)
        real, reply = _send_136(server, obj)
        entry = next(
            e for k, p, e in rule_entries() if (k, p, e["rule"]) == (case.kind, case.path, case.rule)
        )
        causes = (reply.body.get("details") or {}).get("causes", []) if isinstance(reply.body, dict) else []
        if real != "refused" or entry["message"] not in reply.message:
            failures.append(f"{case.name} ({case.kind}{case.path}): {real}: {reply.message}")
        elif len(causes) != 1:
            failures.append(f"{case.name}: refused for more than its rule: {causes}")
        elif verdict_validate(obj) != "refused":
            failures.append(f"{case.name}: the server refuses it, legorl validate does not")
    assert not failures, "\n".join(failures)
    # Every rule of every CRD has its case (or a written reason it cannot have one).
    assert len(rule_entries()) == len(_rule_cases()) + len(UNCOVERABLE)
    rows = ["| CRD kind | rule at | message | case |", "| --- | --- | --- | --- |"]
    for case in _rule_cases():
        entry = next(
            e for k, p, e in rule_entries() if (k, p, e["rule"]) == (case.kind, case.path, case.rule)
        )
        message = entry["message"] if len(entry["message"]) <= 70 else entry["message"][:69] + "…"
        rows.append(f"| {case.kind} | `{case.path}` | {message.replace('|', '&#124;')} | `{case.name}` |")
    for (kind, path, _rule), why in UNCOVERABLE.items():
        rows.append(f"| {kind} | `{path}` | (no case) | {why} |")
    text = TABLE_DOC.read_text()
    documented = text.split(COVERAGE_START, 1)[1].split(COVERAGE_END, 1)[0].strip()
    assert documented == "\n".join(rows), (
        "docs/operator.md's rule coverage table is stale; measured:\n" + "\n".join(rows)
    )


# --- examples and documented manifests ----------------------------------------------------------------


def documented_manifests() -> list[tuple[str, dict[str, Any]]]:
    """Every legorl manifest in examples/ and in the YAML blocks of README.md and docs/*.md."""
    found: list[tuple[str, dict[str, Any]]] = []
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for i, doc in enumerate(kubeyaml.load_all(path.read_text())):
            if doc and str(doc.get("apiVersion", "")).startswith("legorl.dev/"):
                found.append((f"{path.relative_to(REPO)}#{i}", doc))
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for j, block in enumerate(re.findall(r"```ya?ml\n(.*?)```", path.read_text(), flags=re.S)):
            if "apiVersion: legorl.dev/" not in block:
                continue
            for i, doc in enumerate(kubeyaml.load_all(block)):
                if doc and str(doc.get("apiVersion", "")).startswith("legorl.dev/") and "spec" in doc:
                    found.append((f"{path.relative_to(REPO)}:block{j}#{i}", doc))
    return found


def test_every_example_and_documented_manifest_is_accepted(server: CrdServer) -> None:
    manifests = documented_manifests()
    assert len(manifests) >= 5
    refused = []
    for label, doc in manifests:
        obj = copy.deepcopy(doc)
        obj["metadata"]["namespace"] = "docs"
        reply = server.create(obj, dryRun="All")
        if reply.status not in (200, 201):
            refused.append(f"{label}: {reply.message}")
        elif reply.warnings:
            refused.append(f"{label}: accepted with warnings {reply.warnings}")
    assert not refused, "\n".join(refused)


# --- defaults and pruning -----------------------------------------------------------------------------


def _diff(a: Any, b: Any, path: str = "", *, empty_is_absent: bool = False) -> list[str]:
    """Paths where A (the server's) and B (ours) differ: a field only one has, or another value.
    With EMPTY_IS_ABSENT, an empty list or map only B has is no difference: the models read an
    absent list or map as empty, and the CRD leaves empty collections out of its defaults."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            if key not in b:
                out.append(f"{path}.{key}: only the server")
            elif key not in a:
                if not (empty_is_absent and b[key] in ([], {})):
                    out.append(f"{path}.{key}: only ours")
            else:
                out += _diff(a[key], b[key], f"{path}.{key}", empty_is_absent=empty_is_absent)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in _diff(x, y, f"{path}[{i}]", empty_is_absent=empty_is_absent)
        ]
    return [] if a == b else [f"{path}: server {a!r}, ours {b!r}"]


@pytest.mark.parametrize("kind", sorted(BASES))
def test_a_minimal_manifest_is_stored_with_the_defaults_legorl_says(server: CrdServer, kind: str) -> None:
    obj = _manifest(kind, lambda o: None)
    obj["metadata"]["namespace"] = "defaults"
    reply = server.create(obj)
    assert reply.status == 201, reply.message
    stored = reply.body
    # What `legorl render` prints as "as the API server stores it".
    schema = openapi_schema(kind)
    emulated = apply_defaults(schema, prune_nulls(schema, obj))
    assert _diff(stored["spec"], emulated["spec"]) == []
    # What the API models make of the same manifest (the operator reads the stored object through them).
    model = KINDS[kind].model_validate(obj, by_alias=True, by_name=False)
    dumped = model.spec.to_wire()
    assert _diff(stored["spec"], dumped, empty_is_absent=True) == [], "the models default differently"
    # The defaults are not trivially equal: the server filled in fields the manifest left out.
    assert len(json.dumps(stored["spec"])) > 2 * len(json.dumps(obj["spec"]))


def prune_unknown(schema: dict[str, Any], obj: Any) -> Any:
    """OBJ without the fields SCHEMA does not declare (structural pruning, as the API server does)."""
    if isinstance(obj, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields") or "properties" not in schema:
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict):
                return {k: prune_unknown(extra, v) for k, v in obj.items()}
            return obj
        props = schema["properties"]
        return {k: prune_unknown(props[k], v) for k, v in obj.items() if k in props}
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [prune_unknown(schema["items"], item) for item in obj]
    return obj


UNKNOWN = {
    "RLRun": ["spec.algorithim", "spec.harness.maxTurn", "spec.fleet.placement.tolerations[0].colour"],
    "SandboxPool": ["spec.sourceImages", "spec.source.mirror"],
    "RolloutFleet": ["spec.model.sha", "spec.parallelism.dataParallel"],
}


@pytest.mark.parametrize("kind", sorted(BASES))
def test_unknown_fields_are_pruned_and_reported_as_legorl_says(server: CrdServer, kind: str) -> None:
    from tests.api.test_invalid_manifests import set_  # noqa: PLC0415

    obj = _manifest(kind, lambda o: None)
    for path in UNKNOWN[kind]:
        set_(path, "x")(obj)
    obj["metadata"]["namespace"] = "pruning"
    # Strict (kubectl's default): refused, naming every unknown field, as legorl validate does.
    strict = server.create(obj, dryRun="All")
    assert strict.status == 400, strict.message
    (report,) = validate_documents(parse_documents(to_yaml(obj), "unknown.yaml"))
    ours = {p.path for p in report.problems if p.severity == "error"}
    for path in UNKNOWN[kind]:
        assert f'unknown field "{path}"' in strict.message, (path, strict.message)
        assert path in ours, (path, ours)
    # Warn (other clients' default): stored without them, as the emulated pruning says.
    warned = server.create(obj, fieldValidation="Warn")
    assert warned.status == 201, warned.message
    assert len(warned.warnings) == len(UNKNOWN[kind]), warned.warnings
    schema = openapi_schema(kind)
    expected = apply_defaults(schema, prune_unknown(schema, obj))
    assert _diff(warned.body["spec"], expected["spec"]) == []


# --- what the operator does to custom resources -------------------------------------------------------


def _operator_client(server: CrdServer) -> Any:
    from legorl.kube.credentials import Credentials  # noqa: PLC0415
    from legorl.operator.kube import KubeClient  # noqa: PLC0415

    creds = Credentials(
        server=server.url,
        ca_path=str(server.pki / "apiserver.crt"),
        cert_path=str(server.pki / "admin.crt"),
        key_path=str(server.pki / "admin.key"),
    )
    return KubeClient(creds)


def _get(server: CrdServer, obj: dict[str, Any]) -> dict[str, Any]:
    reply = server.request("GET", resource_path(obj))
    assert reply.status == 200, reply.message
    body: dict[str, Any] = reply.body
    return body


def test_the_operators_status_patches_go_through_the_status_subresource(server: CrdServer) -> None:
    from legorl.api import RolloutFleet  # noqa: PLC0415
    from legorl.operator.observe import Observed  # noqa: PLC0415
    from legorl.operator.patch import merge_patch  # noqa: PLC0415
    from legorl.operator.status.fleet import compute_fleet_status  # noqa: PLC0415

    obj = _manifest("RolloutFleet", lambda o: None)
    obj["metadata"].update(name="status-fleet", namespace="status")
    assert server.create(obj).status == 201
    body = _get(server, obj)
    fleet = RolloutFleet.model_validate(body)
    status = compute_fleet_status(fleet, Observed(), datetime(2026, 12, 6, 12, 0, tzinfo=UTC)).to_wire()
    assert status["conditions"], status

    async def patch() -> None:
        client = _operator_client(server)
        try:
            await client.patch_status("RolloutFleet", "status", "status-fleet", merge_patch({}, status))
        finally:
            await client.close()

    asyncio.run(patch())
    after = _get(server, obj)
    assert after["status"] == status, _diff(after["status"], status)
    assert after["spec"] == body["spec"] and after["metadata"]["generation"] == body["metadata"]["generation"]
    # A status sent to the main resource is ignored (status is a subresource) ...
    changed = copy.deepcopy(after)
    changed["status"]["replicas"] = 7
    changed["spec"]["replicas"] = 2
    reply = server.request("PUT", resource_path(obj), changed)
    assert reply.status == 200, reply.message
    again = _get(server, obj)
    assert again["status"] == status and again["spec"]["replicas"] == 2
    assert again["metadata"]["generation"] == body["metadata"]["generation"] + 1
    # ... and a spec change sent to the status subresource too.
    changed = copy.deepcopy(again)
    changed["spec"]["replicas"] = 5
    changed["status"]["replicas"] = 1
    reply = server.request("PUT", resource_path(obj) + "/status", changed)
    assert reply.status == 200, reply.message
    last = _get(server, obj)
    assert last["spec"]["replicas"] == 2 and last["status"]["replicas"] == 1


def test_server_side_apply_of_an_rlruns_custom_resource_children(server: CrdServer) -> None:
    from legorl.api import RLRun  # noqa: PLC0415
    from legorl.operator.kube import FIELD_MANAGER  # noqa: PLC0415
    from legorl.operator.render.common import RenderContext  # noqa: PLC0415
    from legorl.operator.render.run import render_run  # noqa: PLC0415
    from legorl.operator.render.tree import DEFAULT_PORT  # noqa: PLC0415

    obj = _manifest("RLRun", lambda o: None)
    obj["metadata"].update(name="ssa-run", namespace="ssa")
    assert server.create(obj).status == 201
    run = RLRun.model_validate(_get(server, obj))
    children = [c for c in render_run(run, RenderContext(), DEFAULT_PORT) if c["kind"] in KINDS]
    assert {c["kind"] for c in children} == {"RolloutFleet", "SandboxPool"}

    async def apply_all() -> None:
        client = _operator_client(server)
        try:
            for child in children:
                await client.apply(child)
        finally:
            await client.close()

    asyncio.run(apply_all())
    fleet = next(c for c in children if c["kind"] == "RolloutFleet")
    stored = _get(server, fleet)
    managers = {(m["manager"], m["operation"]) for m in stored["metadata"]["managedFields"]}
    assert managers == {(FIELD_MANAGER, "Apply")}, managers
    assert stored["metadata"]["ownerReferences"][0]["kind"] == "RLRun"
    # Another manager changing a field the operator owns is a conflict naming the operator ...
    theirs = {
        "apiVersion": GROUP_VERSION, "kind": "RolloutFleet",
        "metadata": {"name": fleet["metadata"]["name"], "namespace": "ssa"},
        "spec": {"replicas": 3},
    }  # fmt: skip
    conflict = server.apply(theirs, manager="kubectl")
    assert conflict.status == 409 and FIELD_MANAGER in conflict.message, conflict.message
    # ... forced, it takes the field; the operator's next apply (forced, as always) takes it back.
    assert server.apply(theirs, manager="kubectl", force=True).status == 200
    assert _get(server, fleet)["spec"]["replicas"] == 3
    asyncio.run(apply_all())
    assert _get(server, fleet)["spec"]["replicas"] == fleet["spec"].get("replicas", 1)
    # Re-applying the same children changes nothing (no new generation).
    generation = _get(server, fleet)["metadata"]["generation"]
    asyncio.run(apply_all())
    assert _get(server, fleet)["metadata"]["generation"] == generation


def test_printer_columns_show_the_status(server: CrdServer) -> None:
    obj = _manifest("RLRun", lambda o: None)
    obj["metadata"].update(name="columns-run", namespace="columns")
    assert server.create(obj).status == 201
    status = {"phase": "Running", "step": 3, "policyVersion": "v3", "reason": "Training",
              "metrics": {"rewardMean": 0.5, "heldOutSolveRate": 0.25}}  # fmt: skip
    reply = server.request("PATCH", resource_path(obj) + "/status", {"status": status},
                           content_type="application/merge-patch+json")  # fmt: skip
    assert reply.status == 200, reply.message
    # What `kubectl get rlruns -o wide` asks for and prints: the server's Table of the printer columns.
    table = server.request(
        "GET", f"/apis/{GROUP_VERSION}/namespaces/columns/rlruns",
        accept="application/json;as=Table;v=v1;g=meta.k8s.io",
    ).body  # fmt: skip
    assert table["kind"] == "Table", table
    crd = _crd(REPO / "crds/legorl.dev_rlruns.yaml")
    columns = [c["name"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", *columns]
    (row,) = table["rows"]
    cells = dict(zip(["Name", *columns], row["cells"], strict=True))
    assert cells["Name"] == "columns-run" and cells["Phase"] == "Running" and cells["Step"] == 3
    assert cells["Policy"] == "v3" and cells["Reward"] == 0.5 and cells["Held-out"] == 0.25


@pytest.mark.parametrize("kind", ["RolloutFleet", "SandboxPool"])
def test_the_scale_subresource(server: CrdServer, kind: str) -> None:
    obj = _manifest(kind, lambda o: None)
    obj["metadata"].update(name=f"scale-{kind.lower()}", namespace="scale")
    assert server.create(obj).status == 201
    selector = "app.kubernetes.io/name=x"
    reply = server.request("PATCH", resource_path(obj) + "/status",
                           {"status": {"replicas": 1, "selector": selector}},
                           content_type="application/merge-patch+json")  # fmt: skip
    assert reply.status == 200, reply.message
    scale = server.request("GET", resource_path(obj) + "/scale").body
    assert scale["kind"] == "Scale" and scale["status"] == {"replicas": 1, "selector": selector}
    scale["spec"]["replicas"] = 4
    assert server.request("PUT", resource_path(obj) + "/scale", scale).status == 200
    assert _get(server, obj)["spec"]["replicas"] == 4
    # What `kubectl scale --replicas=2` sends.
    reply = server.request("PATCH", resource_path(obj) + "/scale", {"spec": {"replicas": 2}},
                           content_type="application/merge-patch+json")  # fmt: skip
    assert reply.status == 200, reply.message
    assert _get(server, obj)["spec"]["replicas"] == 2


# --- ratcheting ---------------------------------------------------------------------------------------


def test_an_object_stored_before_a_stricter_crd_can_still_be_updated_elsewhere(server: CrdServer) -> None:
    # A copy of the RLRun CRD under another name, so the other tests' CRD is left alone.
    crd = copy.deepcopy(_crd(REPO / "crds/legorl.dev_rlruns.yaml"))
    crd["metadata"]["name"] = "ratchets.legorl.dev"
    crd["spec"]["names"] = {
        "kind": "Ratchet",
        "plural": "ratchets",
        "singular": "ratchet",
        "listKind": "RatchetList",
    }
    _install(server, crd)
    obj = _manifest("RLRun", lambda o: None)
    obj["kind"] = "Ratchet"
    obj["metadata"].update(name="old", namespace="ratchet")
    obj["spec"]["stop"] = {"maxSteps": 300}
    path = f"/apis/{GROUP_VERSION}/namespaces/ratchet/ratchets"
    assert server.request("POST", path, obj).status == 201
    # The CRD tightens: maxSteps at most 250 (schema), and a new CEL rule the object breaks (the
    # default, 100, passes both, as the server requires of a default).
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["stop"]["properties"]["maxSteps"]["maximum"] = 250
    rule = {
        "rule": "!has(self.maxSteps) || self.maxSteps % 3 != 0",
        "message": "maxSteps may not be a multiple of 3",
    }
    spec["properties"]["stop"].setdefault("x-kubernetes-validations", []).append(rule)
    _install(server, crd)

    def patch(spec_patch: dict[str, Any]) -> Any:
        return server.request("PATCH", f"{path}/old", {"spec": spec_patch},
                              params={"fieldValidation": "Strict"},
                              content_type="application/merge-patch+json")  # fmt: skip

    # A field the tightened rules do not touch: accepted, the old value kept.
    reply = patch({"suspend": True})
    assert reply.status == 200, reply.message
    assert reply.body["spec"]["stop"]["maxSteps"] == 300
    # The offending field changed to another invalid value: refused, by both new rules.
    reply = patch({"stop": {"maxSteps": 303}})
    assert reply.status == 422, reply.message
    assert "less than or equal to 250" in reply.message and "multiple of 3" in reply.message, reply.message
    # To a valid one: accepted.
    assert patch({"stop": {"maxSteps": 200}}).status == 200
    # A new object is held to the new rules at once.
    fresh = copy.deepcopy(obj)
    fresh["metadata"]["name"] = "new"
    assert server.request("POST", path, fresh).status == 422
