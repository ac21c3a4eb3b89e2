"""The real node's test infrastructure, pure parts: what tests/kube120's Downgrade plays for a 1.20 kubelet (a
one-completion Indexed Job, native sidecars) and the records the DNS stand-in serves
(tests/support/kubenode.py).
tests/e2e/test_node_run.py runs them for real; these pin what each does, fast and without a node."""

from __future__ import annotations

import copy
import shutil
import socket
import subprocess
from typing import Any

import pytest

from tests.support.kube120 import JOB_INDEX, SIDECAR_WAIT, _downgrade_job, _emulate_sidecars
from tests.support.kubenode import Node, cluster_hosts


def job(mode: str | None, completions: int) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "completions": completions,
        "podFailurePolicy": {"rules": []},
        "suspend": False,
        "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"subdomain": "run-trainer"}},
    }
    if mode:
        spec["completionMode"] = mode
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "run-trainer"}, "spec": spec}


def test_a_one_completion_indexed_job_gets_what_1_21_gives_its_pod() -> None:
    body = job("Indexed", 1)
    assert _downgrade_job(body)
    assert {"completionMode", "podFailurePolicy", "suspend"}.isdisjoint(body["spec"])
    template = body["spec"]["template"]
    assert template["metadata"]["annotations"] == {JOB_INDEX: "0"}
    assert template["metadata"]["labels"] == {"a": "b"}
    assert template["spec"] == {"subdomain": "run-trainer", "hostname": "run-trainer-0"}


@pytest.mark.parametrize(("mode", "completions"), [("Indexed", 2), ("NonIndexed", 1), (None, 1)])
def test_other_jobs_only_lose_the_fields_1_20_refuses(mode: str | None, completions: int) -> None:
    body = job(mode, completions)
    expected = copy.deepcopy(body)
    for name in ("completionMode", "podFailurePolicy", "suspend"):
        expected["spec"].pop(name, None)
    assert _downgrade_job(body)
    assert body == expected


def pod() -> dict[str, Any]:
    return {
        "spec": {
            "initContainers": [
                {"name": "tools"},
                {"name": "proxy", "restartPolicy": "Always", "startupProbe": {"tcpSocket": {"port": 4000}}},
                {"name": "setup"},
            ],
            "containers": [{"name": "agent"}, {"name": "hold"}],
        }
    }


def test_a_native_sidecar_runs_first_among_the_containers_once_its_port_opens() -> None:
    body = pod()
    assert _emulate_sidecars(body)
    spec = body["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["tools", "setup"]
    assert [c["name"] for c in spec["containers"]] == ["proxy", "agent", "hold"]
    proxy = spec["containers"][0]
    assert "restartPolicy" not in proxy and proxy["startupProbe"] == {"tcpSocket": {"port": 4000}}
    assert proxy["lifecycle"]["postStart"]["exec"]["command"] == [
        "bash",
        "-c",
        SIDECAR_WAIT.format(port=4000),
    ]
    plain = {"spec": {"initContainers": [{"name": "tools"}], "containers": [{"name": "agent"}]}}
    assert not _emulate_sidecars(plain)


@pytest.mark.skipif(shutil.which("bash") is None, reason="the hook runs bash")
def test_the_sidecar_hook_returns_once_the_port_accepts() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        ready = subprocess.run(["bash", "-c", SIDECAR_WAIT.format(port=port)], timeout=30, check=False)
    assert ready.returncode == 0
    closed = SIDECAR_WAIT.format(port=port).replace("seq 600", "seq 3")  # nothing listens there now
    assert (
        subprocess.run(["bash", "-c", closed], capture_output=True, timeout=30, check=False).returncode == 1
    )


def test_the_dns_stand_in_serves_cluster_ips_headless_services_and_pod_hostnames() -> None:
    services = {
        "items": [
            {"metadata": {"name": "web", "namespace": "a"}, "spec": {"clusterIP": "10.96.0.20"}},
            {"metadata": {"name": "run-trainer", "namespace": "runs"}, "spec": {"clusterIP": "None"}},
            {"metadata": {"name": "ext", "namespace": "a"}, "spec": {"type": "ExternalName"}},
        ]
    }
    endpoints = {
        "items": [
            {  # not headless: its ClusterIP is what a name lookup gives
                "metadata": {"name": "web", "namespace": "a"},
                "subsets": [{"addresses": [{"ip": "10.244.0.7"}]}],
            },
            {
                "metadata": {"name": "run-trainer", "namespace": "runs"},
                "subsets": [
                    {"addresses": [{"ip": "10.244.0.9", "hostname": "run-trainer-0"}, {"ip": "10.244.0.8"}]}
                ],
            },
        ]
    }
    assert cluster_hosts(services, endpoints).splitlines() == [
        "10.244.0.8 run-trainer.runs.svc.cluster.local",
        "10.244.0.9 run-trainer-0.run-trainer.runs.svc.cluster.local",
        "10.244.0.9 run-trainer.runs.svc.cluster.local",
        "10.96.0.20 web.a.svc.cluster.local",
    ]
    assert cluster_hosts(services) == "10.96.0.20 web.a.svc.cluster.local\n"


def test_a_readiness_probe_that_times_out_is_a_not_yet() -> None:
    """The fresh-clone run of 2026-12-07: the API server bound its port 13 s after it started (a busy
    machine), the first `kubectl get --raw=/readyz` hung past its 10 s, and the TimeoutExpired ended the
    node's start at once (all five tests of tests/e2e/test_real_node.py errored)."""
    node = Node.__new__(Node)  # only `_wait` and what it calls
    node.procs = []
    answers: list[bool | None] = [None, False, True]  # None: the probe times out

    def ready() -> bool:
        answer = answers.pop(0)
        if answer is None:
            raise subprocess.TimeoutExpired(["kubectl"], 10)
        return answer

    node._wait("the API server was not ready", ready, timeout=5, every=0.01)
    assert answers == []
    with pytest.raises(RuntimeError, match="was not ready within 0 s"):
        node._wait("the API server was not ready", lambda: False, timeout=0.05, every=0.01)
