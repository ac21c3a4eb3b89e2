"""Opt-in: what only a real API server shows (`pytest --with-cluster`, uses $KUBECONFIG).

The API mock cannot show these, so they run against a real cluster (kind, k3d, or a dev cluster):
- CEL rules and schema enforcement by the API server itself (not cel-python);
- server-side apply: the operator's field manager owns what it applies, and a second manager is
  refused on those fields unless it forces;
- garbage collection through owner references when a custom resource is deleted;
- the printer columns `kubectl get` shows.
NetworkPolicy *enforcement* needs a CNI that implements it and running engine pods; these tests check
the policies exist with the right selectors, the golden tests pin their content.

Each test module run creates a namespace `legorl-e2e-<random>` and deletes it at the end. The CRDs
are applied server-side (and left installed).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from legorl.manifests.generated import to_yaml

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.cluster


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("kubectl") or str(REPO / ".cache/tools/bin/kubectl")
    result = subprocess.run(
        [binary, *args], input=stdin, capture_output=True, text=True, check=False, timeout=120
    )
    if check and result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed:\n{result.stderr}")
    return result


def wait(predicate: Callable[[], Any], timeout: float = 120.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what or predicate}")


def get(kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    result = kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


@pytest.fixture(scope="module")
def namespace() -> Iterator[str]:
    assert os.environ.get("KUBECONFIG") or Path.home().joinpath(".kube/config").exists(), "no kubeconfig"
    for path in sorted((REPO / "crds").glob("*.yaml")):
        kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    for plural in ("rlruns", "rolloutfleets", "sandboxpools"):
        kubectl("wait", "--for=condition=Established", f"crd/{plural}.legorl.dev", "--timeout=60s")
    name = f"legorl-e2e-{secrets.token_hex(3)}"
    kubectl("create", "namespace", name)
    yield name
    kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(namespace: str) -> Iterator[None]:
    """The real operator, in-process, with the kubeconfig's credentials, watching the namespace."""
    from legorl.operator.main import run_operator  # noqa: PLC0415
    from legorl.operator.settings import OperatorSettings  # noqa: PLC0415

    stop, ready = threading.Event(), threading.Event()
    settings = OperatorSettings(namespaces=(namespace,), debounce_seconds=0.2, health_port=0)
    thread = threading.Thread(
        target=run_operator,
        args=(settings,),
        kwargs={"stop_flag": stop, "ready_flag": ready, "liveness": False},
        daemon=True,
    )
    thread.start()
    assert ready.wait(60), "the operator did not start"
    yield
    stop.set()
    thread.join(30)


def manifest(name: str, namespace: str, kind: str) -> dict[str, Any]:
    for doc in yaml.safe_load_all((REPO / "examples" / name).read_text()):
        if doc and doc["kind"] == kind:
            doc["metadata"]["namespace"] = namespace
            return dict(doc)
    raise KeyError(kind)


def test_api_server_enforces_the_cel_rules(namespace: str) -> None:
    run = manifest("shared-fleet-and-pool.yaml", namespace, "RLRun")
    run["spec"]["algorithm"] = {"name": "GRPO", "groupSize": 1}
    result = kubectl("apply", "-f", "-", stdin=to_yaml(run), check=False)
    assert result.returncode != 0
    assert "groupSize must be at least 2" in result.stderr
    run["spec"]["algorithm"] = {"name": "GRPO", "groupSize": 4}
    run["spec"]["fleet"] = {}  # fleetRef and fleet together
    result = kubectl("apply", "-f", "-", stdin=to_yaml(run), check=False)
    assert result.returncode != 0
    assert "fleetRef" in result.stderr


def test_operator_owns_what_it_applies_and_children_are_collected(namespace: str, operator: None) -> None:
    del operator
    fleet = manifest("shared-fleet-and-pool.yaml", namespace, "RolloutFleet")
    kubectl("apply", "-f", "-", stdin=to_yaml(fleet))
    deploy = wait(lambda: get("deployment", "coder-fleet-engine", namespace), what="the engine Deployment")
    managers = {m["manager"] for m in deploy["metadata"]["managedFields"]}
    assert "legorl-operator" in managers
    # Another field manager may not take spec.replicas from the operator without forcing.
    patch = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "coder-fleet-engine", "namespace": namespace},
        "spec": {"replicas": 7},
    }
    result = kubectl(
        "apply", "--server-side", "--field-manager=intruder", "-f", "-", stdin=json.dumps(patch), check=False
    )
    assert result.returncode != 0 and "conflict" in result.stderr.lower()
    # Status and printer columns come from the operator.
    wait(
        lambda: (get("rolloutfleet", "coder-fleet", namespace) or {}).get("status", {}).get("conditions"),
        what="fleet conditions",
    )
    table = kubectl("get", "rolloutfleet", "coder-fleet", "-n", namespace).stdout
    assert "READY" in table and "REASON" in table and "coder-fleet" in table
    # Deleting the fleet garbage-collects its children (owner references).
    kubectl("delete", "rolloutfleet", "coder-fleet", "-n", namespace, "--wait=true", "--timeout=60s")
    wait(lambda: get("deployment", "coder-fleet-engine", namespace) is None, what="GC of the Deployment")
    wait(lambda: get("service", "coder-fleet-engine", namespace) is None, what="GC of the Service")


def test_failed_preflight_is_visible_in_kubectl(namespace: str, operator: None) -> None:
    del operator
    run = yaml.safe_load((REPO / "examples/tiny-local.yaml").read_text())
    run["metadata"]["namespace"] = namespace
    kubectl("apply", "-f", "-", stdin=to_yaml(run))
    wait(
        lambda: (get("rlrun", "tiny-local", namespace) or {}).get("status", {}).get("phase") == "Invalid",
        what="phase Invalid",
    )
    table = kubectl("get", "rlrun", "tiny-local", "-n", namespace).stdout
    assert "Invalid" in table and "PreflightFailed" in table
    events = kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.name=tiny-local")
    assert "PreflightFailed" in events.stdout
