"""The Helm chart: lint, render, schema validation, CRD parity, least-privilege RBAC, restricted pods."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.api.test_kube_yaml import reader_differences

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "legorl"
CRDS = REPO / "crds"
RELEASE = "demo"
NAMESPACE = "legorl-system"
FULLNAME = f"{RELEASE}-legorl"
OPERATOR_ROLE = f"{FULLNAME}-operator"
K8S_VERSIONS = ("1.30", "1.33")
CUSTOM_RESOURCES = ("rlruns", "sandboxpools", "rolloutfleets")

Doc = dict[str, Any]

VALUE_SETS: dict[str, list[str]] = {
    "default": [],
    "ui": ["ui.enabled=true"],
    "watch-namespaces": ["watchNamespaces={a,b}"],
    "existing-service-account": ["serviceAccount.create=false", "serviceAccount.name=existing-sa"],
    "peering": ["operator.peering.enabled=true", "operator.replicas=2"],
    "peering-namespaces": ["operator.peering.enabled=true", "operator.replicas=2", "watchNamespaces={a,b}"],
    "store-claims": ["ui.enabled=true", "storeClaims={rl-store,runs.shared}"],
}
KOPF_PEERING_CRDS = {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}

pytestmark = [pytest.mark.helm, pytest.mark.integration]


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run helm with ARGS; never raises on a non-zero exit."""
    return subprocess.run([helm, *args], capture_output=True, text=True, check=False, timeout=120)


def set_flags(values: list[str]) -> list[str]:
    return [flag for value in values for flag in ("--set", value)]


def render(helm: str, values: list[str] | None = None, *, include_crds: bool = False) -> list[Doc]:
    """`helm template` the chart with VALUES (`key=value` strings); the non-empty parsed documents."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *set_flags(values or [])]
    if include_crds:
        args.append("--include-crds")
    result = run_helm(helm, *args)
    assert result.returncode == 0, f"helm template {values} failed:\n{result.stderr}"
    # What the chart renders means the same to Kubernetes as to these tests (no `1e-6`, `y`).
    differences = reader_differences(result.stdout)
    assert not differences, differences
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [doc for doc in docs if doc["kind"] == kind]


def named(docs: list[Doc], kind: str, name: str) -> Doc:
    matches = [doc for doc in of_kind(docs, kind) if doc["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name!r}, found {len(matches)}"
    return matches[0]


def rules(docs: list[Doc]) -> list[tuple[str, Doc]]:
    """Every RBAC rule of every (Cluster)Role, labelled with its owner."""
    return [
        (f"{doc['kind']}/{doc['metadata']['name']}", rule)
        for doc in docs
        if doc["kind"] in ("ClusterRole", "Role")
        for rule in doc.get("rules", [])
    ]


# --- lint and render ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [[], ["ui.enabled=true"], ["watchNamespaces={a,b}"], VALUE_SETS["store-claims"]],
    ids=["default", "ui", "watch-namespaces", "store-claims"],
)
def test_lint_strict(helm: str, values: list[str]) -> None:
    result = run_helm(helm, "lint", "--strict", str(CHART), *set_flags(values))
    assert result.returncode == 0, f"helm lint --strict {values} failed:\n{result.stdout}\n{result.stderr}"


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_rendered_objects_validate(helm: str, values: list[str], k8s_version: str) -> None:
    docs = render(helm, values, include_crds=True)
    assert of_kind(docs, "Deployment"), "no Deployment rendered"
    assert len(of_kind(docs, "CustomResourceDefinition")) == 5
    for doc in docs:
        if doc["apiVersion"] == "kopf.dev/v1":
            assert set(doc) == {"apiVersion", "kind", "metadata"}  # peering objects carry no spec
            continue
        try:
            kubernetes_validate.validate(doc, k8s_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} is invalid for {k8s_version}: {exc}")


def test_existing_service_account_is_used(helm: str) -> None:
    docs = render(helm, VALUE_SETS["existing-service-account"])
    assert not of_kind(docs, "ServiceAccount")
    pod = named(docs, "Deployment", OPERATOR_ROLE)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "existing-sa"
    for binding in of_kind(docs, "ClusterRoleBinding") + of_kind(docs, "RoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "existing-sa", "namespace": NAMESPACE}
        ]


# --- CRDs -----------------------------------------------------------------------------------------


def test_chart_crds_match_generated_crds(helm: str) -> None:
    chart_crds = {path.name: path.read_bytes() for path in sorted((CHART / "crds").glob("*.yaml"))}
    repo_crds = {path.name: path.read_bytes() for path in sorted(CRDS.glob("*.yaml"))}
    assert repo_crds, "crds/ holds no CRDs"
    # The chart also carries kopf's peering CRDs (for operator.peering); the rest are ours.
    assert chart_crds.pop("kopf.dev_peerings.yaml")
    assert chart_crds.keys() == repo_crds.keys(), "charts/legorl/crds and crds/ hold different files"
    for name, content in repo_crds.items():
        assert chart_crds[name] == content, f"charts/legorl/crds/{name} differs from crds/{name}"

    rendered = {
        doc["metadata"]["name"]: doc
        for doc in of_kind(render(helm, include_crds=True), "CustomResourceDefinition")
    }
    expected = {}
    for content in repo_crds.values():
        crd = yaml.safe_load(content)
        expected[crd["metadata"]["name"]] = crd
    assert {k: v for k, v in rendered.items() if k not in KOPF_PEERING_CRDS} == expected
    assert set(rendered) == {f"{plural}.legorl.dev" for plural in CUSTOM_RESOURCES} | KOPF_PEERING_CRDS


# --- RBAC -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_rbac_has_no_wildcards_and_no_secrets(helm: str, values: list[str]) -> None:
    found = rules(render(helm, values))
    assert found, "no RBAC rules rendered"
    for owner, rule in found:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule.get(key, []), f"{owner} uses '*' in {key}: {rule}"
        resources = rule.get("resources", [])
        assert not any(r == "secrets" or r.startswith("secrets/") for r in resources), (
            f"{owner} grants access to secrets: {rule}"
        )


def test_operator_patches_its_resources_and_never_updates(helm: str) -> None:
    role = named(render(helm), "ClusterRole", OPERATOR_ROLE)
    verbs: dict[str, set[str]] = {}
    for rule in role["rules"]:
        if "legorl.dev" in rule["apiGroups"]:
            for resource in rule["resources"]:
                verbs.setdefault(resource, set()).update(rule["verbs"])
    for plural in CUSTOM_RESOURCES:
        for resource in (plural, f"{plural}/status"):
            assert "patch" in verbs.get(resource, set()), f"{OPERATOR_ROLE} cannot patch {resource}"
            assert "update" not in verbs[resource], f"{OPERATOR_ROLE} grants update on {resource}"
        # Blocking ownerReferences need update on the owner's finalizers, and nothing else.
        assert verbs[f"{plural}/finalizers"] == {"update"}
    # An RLRun's inline fleet and pool are created (and deleted) by the operator; RLRuns never.
    for plural in ("rolloutfleets", "sandboxpools"):
        assert {"create", "delete"} <= verbs[plural]
    assert not {"create", "delete"} & verbs["rlruns"]


def test_cluster_wide_by_default(helm: str) -> None:
    docs = render(helm)
    binding = named(docs, "ClusterRoleBinding", OPERATOR_ROLE)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": OPERATOR_ROLE,
    }
    assert not of_kind(docs, "RoleBinding")


def test_watch_namespaces_bind_per_namespace(helm: str) -> None:
    docs = render(helm, ["watchNamespaces={a,b}"])
    cluster_bound = [
        doc["metadata"]["name"]
        for doc in of_kind(docs, "ClusterRoleBinding")
        if doc["roleRef"]["name"] == OPERATOR_ROLE
    ]
    assert not cluster_bound, (
        f"watchNamespaces set, yet {OPERATOR_ROLE} is bound cluster-wide: {cluster_bound}"
    )
    role_bindings = [doc for doc in of_kind(docs, "RoleBinding") if doc["roleRef"]["name"] == OPERATOR_ROLE]
    assert sorted(doc["metadata"]["namespace"] for doc in role_bindings) == ["a", "b"]
    for binding in role_bindings:
        assert binding["roleRef"]["kind"] == "ClusterRole"
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]
    args = named(docs, "Deployment", OPERATOR_ROLE)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=a" in args
    assert "--namespace=b" in args


def test_ui_reads_only_the_watched_namespaces(helm: str) -> None:
    docs = render(helm, ["ui.enabled=true", "watchNamespaces={a,b}"])
    ui_role = f"{FULLNAME}-ui"
    assert not [d for d in of_kind(docs, "ClusterRoleBinding") if d["roleRef"]["name"] == ui_role]
    bindings = [d for d in of_kind(docs, "RoleBinding") if d["roleRef"]["name"] == ui_role]
    assert sorted(d["metadata"]["namespace"] for d in bindings) == ["a", "b"]


def test_ui_action_token_adds_only_rlrun_patch(helm: str) -> None:
    docs = render(helm, ["ui.enabled=true", "ui.actionTokenSecret=ui-token"])
    role = named(docs, "ClusterRole", f"{FULLNAME}-ui")
    writes = [r for r in role["rules"] if set(r["verbs"]) - {"get", "list", "watch"}]
    assert writes == [{"apiGroups": ["legorl.dev"], "resources": ["rlruns"], "verbs": ["patch"]}]
    env = named(docs, "Deployment", f"{FULLNAME}-ui")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env == [
        {
            "name": "LEGORL_UI_ACTION_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "ui-token", "key": "token"}},
        }
    ]


def test_ui_role_is_read_only(helm: str) -> None:
    docs = render(helm, ["ui.enabled=true"])
    role = named(docs, "ClusterRole", f"{FULLNAME}-ui")
    assert role["rules"]
    for rule in role["rules"]:
        assert set(rule["verbs"]) <= {"get", "list", "watch"}, f"UI role grants more than reads: {rule}"
    ui_services = [s for s in of_kind(render(helm), "Service") if s["metadata"]["name"] == f"{FULLNAME}-ui"]
    assert not ui_services, "the UI renders although ui.enabled is false"


# --- run-store claims -------------------------------------------------------------------------------

PVC_ROOT = "/var/run/legorl/pvc"


def pod_spec(docs: list[Doc], name: str) -> Doc:
    spec: Doc = named(docs, "Deployment", name)["spec"]["template"]["spec"]
    return spec


def test_pvc_root_is_the_operators() -> None:
    from legorl.operator.trials import TrialSettings  # noqa: PLC0415 - the operator's imports, only here

    assert TrialSettings().pvc_root == PVC_ROOT


def test_store_claims_are_mounted_into_the_operator_and_read_only_into_the_ui(helm: str) -> None:
    docs = render(helm, VALUE_SETS["store-claims"])
    claims = ["rl-store", "runs.shared"]
    for name, read_only in ((OPERATOR_ROLE, False), (f"{FULLNAME}-ui", True)):
        pod = pod_spec(docs, name)
        volumes = {v["name"]: v for v in pod["volumes"] if "persistentVolumeClaim" in v}
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"] if m["name"] in volumes}
        assert sorted(v["persistentVolumeClaim"]["claimName"] for v in volumes.values()) == claims, name
        assert mounts.keys() == volumes.keys(), name
        for volume_name, volume in volumes.items():
            claim = volume["persistentVolumeClaim"]["claimName"]
            assert mounts[volume_name]["mountPath"] == f"{PVC_ROOT}/{claim}", name
            assert mounts[volume_name].get("readOnly", False) is read_only, f"{name}: {claim}"
            assert volume["persistentVolumeClaim"].get("readOnly", False) is read_only, f"{name}: {claim}"
        names = [v["name"] for v in pod["volumes"]]
        assert len(names) == len(set(names)), f"{name}: duplicate volume names {names}"
    assert f"--pvc-root={PVC_ROOT}" in pod_spec(docs, f"{FULLNAME}-ui")["containers"][0]["args"]


def test_no_store_claims_mount_nothing(helm: str) -> None:
    docs = render(helm, ["ui.enabled=true"])
    for name in (OPERATOR_ROLE, f"{FULLNAME}-ui"):
        pod = pod_spec(docs, name)
        assert [v["name"] for v in pod["volumes"]] == ["tmp"], name
        assert [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]] == ["/tmp"], name
        assert not [a for a in pod["containers"][0]["args"] if a.startswith("--pvc-root")], name


# --- pod security ---------------------------------------------------------------------------------


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_pods_meet_restricted_standard(helm: str, values: list[str]) -> None:
    deployments = of_kind(render(helm, values), "Deployment")
    assert deployments
    if "ui.enabled=true" in values:
        assert len(deployments) == 2, "ui.enabled=true renders no UI Deployment"
    for deployment in deployments:
        name = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]["spec"]
        security = pod.get("securityContext", {})
        assert security.get("runAsNonRoot") is True, f"{name}: runAsNonRoot is not true"
        assert security.get("seccompProfile") == {"type": "RuntimeDefault"}, f"{name}: seccompProfile"
        assert not pod.get("hostNetwork"), f"{name}: hostNetwork"
        assert not pod.get("hostPID"), f"{name}: hostPID"
        assert not pod.get("hostIPC"), f"{name}: hostIPC"
        for volume in pod.get("volumes", []):
            assert "hostPath" not in volume, f"{name}: hostPath volume {volume['name']}"
        containers = pod["containers"] + pod.get("initContainers", [])
        assert containers
        for container in containers:
            where = f"{name}/{container['name']}"
            context = container.get("securityContext", {})
            assert context.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation"
            assert context.get("readOnlyRootFilesystem") is True, f"{where}: readOnlyRootFilesystem"
            assert "ALL" in context.get("capabilities", {}).get("drop", []), f"{where}: capabilities"
            assert context.get("privileged") is not True, f"{where}: privileged"
            requests = container.get("resources", {}).get("requests", {})
            assert requests.get("cpu") and requests.get("memory"), f"{where}: resources.requests"
            assert "livenessProbe" in container, f"{where}: no livenessProbe"
            assert "readinessProbe" in container, f"{where}: no readinessProbe"


# --- values schema --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("podSecurityContext.runAsNonRoot=false", "runAsNonRoot"),
        ("securityContext.allowPrivilegeEscalation=true", "allowPrivilegeEscalation"),
        ("unknownKey=1", "unknownKey"),
        ("operator.healthPort=80", "healthPort"),
        ("operator.logLevel=verbose", "logLevel"),
        ("operator.defaultStoreUri=ftp://x", "defaultStoreUri"),
        ("watchNamespaces={Bad_NS}", "watchNamespaces"),
        ("storeClaims={Bad_Claim}", "storeClaims"),
        ("storeClaims={a.}", "storeClaims"),
        ("storeClaims={a,a}", "storeClaims"),
        ("ui.service.type=ExternalName", "type"),
        ("securityContext.readOnlyRootFilesystem=false", "readOnlyRootFilesystem"),
        ("securityContext.privileged=true", "privileged"),
        ("securityContext.capabilities=null", "capabilities"),
        ("securityContext.capabilities.drop={NET_RAW}", "drop"),
        ("podSecurityContext.seccompProfile=null", "seccompProfile"),
        ("podSecurityContext.seccompProfile.type=Unconfined", "type"),
    ],
)
def test_schema_rejects_bad_values(helm: str, value: str, key: str) -> None:
    result = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--set", value)
    assert result.returncode != 0, f"helm template accepted --set {value}"
    assert key in result.stderr, f"the error for --set {value} does not name {key!r}:\n{result.stderr}"


# --- replicas and peering ---------------------------------------------------------------------------


def test_one_standalone_replica_by_default(helm: str) -> None:
    docs = render(helm)
    deploy = named(docs, "Deployment", OPERATOR_ROLE)
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}
    assert not any(
        a.startswith("--peering") for a in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert not of_kind(docs, "ClusterKopfPeering")


def test_replicas_without_peering_are_refused(helm: str) -> None:
    result = run_helm(helm, "template", RELEASE, str(CHART), "--set", "operator.replicas=2")
    assert result.returncode != 0
    assert "operator.replicas > 1 needs operator.peering.enabled=true" in result.stderr


def test_peering_runs_several_replicas_with_one_active(helm: str) -> None:
    docs = render(helm, VALUE_SETS["peering"])
    deploy = named(docs, "Deployment", OPERATOR_ROLE)
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["strategy"] == {"type": "RollingUpdate"}
    assert f"--peering={FULLNAME}" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    named(docs, "ClusterKopfPeering", FULLNAME)
    verbs = {
        (res, verb)
        for _, rule in rules(docs)
        if "kopf.dev" in rule["apiGroups"]
        for res in rule["resources"]
        for verb in rule["verbs"]
    }
    assert ("clusterkopfpeerings", "patch") in verbs

    scoped = render(helm, VALUE_SETS["peering-namespaces"])
    assert sorted(p["metadata"]["namespace"] for p in of_kind(scoped, "KopfPeering")) == ["a", "b"]
    assert not of_kind(scoped, "ClusterKopfPeering")
