"""The Kubernetes backend of the run controller: the real operator (kopf, our registry, the RL loop)
against the API mock, with this test playing the kubelet.

What is real: kopf and the operator's handlers, the run controller (`legorl.controller.loop`), the
`KubeTrialBackend`, the run store on a local folder, the **proxy** of each trial (the real `ProxyApp`,
one per trial pod, listening on that pod's IP `127.0.0.N` at the port the backend dials, journaling
turns from a fake vLLM and serving `/finish`, `/changes` and `/trajectory`), and the **verifier**
(`legorl-sandbox verify`, run by this test on the change set and task the operator put into the verify
pod's ConfigMaps, its JSON becoming the verify container's termination message, as in the pod).

What this test stands in for: the kubelet (pod phases, container states, termination messages, pod
IPs), the harness (two chat calls to the proxy and an edit of the workspace), the setup stage (the
workspace and its baseline are made here) and the trainer: the test writes `trainer/state.json` into
the store (`RunStore.write_trainer_state`) once a batch is committed, as the trainer Job does after
training it and syncing the weights, and bumps the fake engine's `/weight_info` version as the weight
sync would. The mock has no NetworkPolicy, RBAC or garbage collection (see tests/support/kubeapi.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import re
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import kopf
import kubernetes_validate
import pytest
import uvicorn
from prometheus_client import generate_latest

from legorl.api.annotations import AgentOutcomeNote, TrialRequestNote
from legorl.api.conditions import find_condition
from legorl.api.kinds import KINDS, RLRun, SandboxPool
from legorl.api.labels import (
    AGENT_OUTCOME_ANNOTATION,
    LOOKAHEAD_ANNOTATION,
    REQUEST_ANNOTATION,
    VALIDATE_ANNOTATION,
    WARM_LABEL,
)
from legorl.api.store import RunStore
from legorl.controller.backend import TrialRequest
from legorl.operator.canary import canary_trial_id
from legorl.operator.handlers import build_registry
from legorl.operator.main import make_reconciler
from legorl.operator.observe import Observed
from legorl.operator.render.common import RenderContext
from legorl.operator.render.pool import GATE_SCRIPT
from legorl.operator.render.tree import PLACEHOLDER_UID
from legorl.operator.render.trial import (
    CLAIMED_AT_ANNOTATION,
    COLLECT_GRACE_SECONDS,
    HOLD,
    WARM_WAIT_SECONDS,
    FleetAccess,
    agent_task_row,
    claim_patch,
    lookahead_value,
    trial_objects,
    verify_objects,
)
from legorl.operator.runs import StartProblem, resolve_uri
from legorl.operator.status.run import ControllerReport, compute_run_status
from legorl.operator.status.trial import agent_end, parse_verify_message, verify_result
from legorl.operator.trials import TrialSettings
from legorl.proxy.app import ProxyApp
from legorl.proxy.settings import ProxySettings
from legorl.proxy.testing import FakeEngine
from legorl.sandbox import changes as sandbox_changes
from legorl.sandbox import cli as sandbox_cli
from legorl.sandbox.task import Task
from tests.operator.test_operator_integration import (
    engine_pod,
    kopf_test_settings,
    manifests,
    operator_test_settings,
    ready_deployment,
    ready_pool,
)
from tests.support.asgi_server import serve
from tests.support.kubeapi import MockApi, OperatorHandle, run_operator

REPO = Path(__file__).resolve().parents[2]
NS = "default"
GV = "legorl.dev/v1alpha1"
RUN = "coder-grpo"
TIMEOUT = 30.0
K8S_VERSION = "1.30"
IMAGE = "ghcr.io/example/calc:1"
HIDDEN_TEST = "from calc import add\n\n\ndef test_fix():\n    assert add(1, 2) == 3\n"
GOLD = (
    "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n"
    " def add(a, b):\n-    return a - b\n+    return a + b\n"
)


# --- the task set: three copies of a tiny repository whose add() subtracts -------------------------------


def make_repo(root: Path) -> Path:
    (root / "tests").mkdir(parents=True)
    (root / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (root / "tests" / "test_visible.py").write_text(
        "from calc import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n"
    )
    return root


def task_rows(pristine: Path, count: int = 3) -> list[dict[str, Any]]:
    lines = HIDDEN_TEST.splitlines()
    test_patch = (
        "diff --git a/tests/test_hidden.py b/tests/test_hidden.py\nnew file mode 100644\n--- /dev/null\n"
        f"+++ b/tests/test_hidden.py\n@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{line}\n" for line in lines)
    )
    return [
        {
            "instance_id": f"calc-{i}",
            "repo": "example/calc",
            "base_commit": "a" * 40,
            "problem_statement": f"calc-{i}: add(1, 2) returns -1; it should add.",
            "test_patch": test_patch,
            "patch": GOLD,
            "FAIL_TO_PASS": ["tests/test_hidden.py::test_fix"],
            "PASS_TO_PASS": ["tests/test_visible.py::test_zero"],
            "image": IMAGE,
            # The verify pod's image holds the repository here; this test runs the verifier locally.
            "workspace_dir": str(pristine),
            "test_command": (
                f"{sys.executable} -m pytest -rA -p no:cacheprovider -o junit_family=xunit1 "
                "--junitxml={junit} {tests}"
            ),
        }
        for i in range(1, count + 1)
    ]


# --- the kubelet, the harness and the verifier this test plays --------------------------------------------


@contextlib.contextmanager
def serve_on(app: Any, host: str, port: int) -> Iterator[str]:
    """uvicorn serving `app` on host:port in a thread (a trial pod's proxy at the pod's IP)."""
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, lifespan="on", log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the proxy at {host}:{port} did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def stamp(offset: float = 0.0) -> str:
    return (datetime.now(UTC) + timedelta(seconds=offset)).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Script:
    """What happens in one trial: `solve` (fix, exit 0), `wrong` (a wrong fix, exit 1), `defense` (the
    egress lock's self-test fails); `hold` keeps the agent running until released."""

    kind: str
    hold: bool = False


@dataclass
class PodPlay:
    ip: str
    workspace: Path
    proxy: contextlib.ExitStack
    agent_done: bool = False
    turns_done: bool = False
    gate: threading.Event | None = None
    """A warm pod's gate (its proxy has `--claim-fifo`): set once the agent read its `go` from the FIFO,
    as the pod's `GATE_SCRIPT` would; the played agent works only then."""


@dataclass
class Kubelet:
    """Moves trial and verify pods through their lives, as a node's kubelet would report them."""

    mock: MockApi
    tmp: Path
    pristine: Path
    engine_url: str
    port: int
    scripts: dict[str, Script]
    plays: dict[str, PodPlay] = field(default_factory=dict)
    verified: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Trial id → the verify pod, its ConfigMaps and the verifier's payload."""
    errors: list[BaseException] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kubelet", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        for play in self.plays.values():
            play.proxy.close()

    def release(self, trial: str) -> None:
        self.scripts[trial].hold = False

    def check(self) -> None:
        if self.errors:
            raise AssertionError("the test's kubelet failed") from self.errors[0]

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                for pod in self.mock.objects("v1", "pods", NS):
                    labels = pod["metadata"].get("labels") or {}
                    component = labels.get("legorl.dev/component")
                    if component == "trial":
                        self._trial(pod)
                    elif component == "verify":
                        self._verify(pod)
            except Exception as exc:  # noqa: BLE001 - re-raised in the test's thread by check()
                self.errors.append(exc)
                return
            self._stop.wait(0.05)

    def _set(self, name: str, status: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):  # the operator may have deleted it meanwhile
            self.mock.set_status("v1", "pods", NS, name, status)

    def _trial(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        trial = pod["metadata"]["labels"]["legorl.dev/trial"]
        script = self.scripts[trial]
        play = self.plays.get(name)
        if play is None:
            play = self._start_pod(pod, trial)
            self.plays[name] = play
            if script.kind == "defense":
                self._set(
                    name,
                    {
                        "phase": "Failed",
                        "podIP": play.ip,
                        "startTime": stamp(),
                        "initContainerStatuses": [
                            *self._init_done(["tools", "harness-runtime", "setup"]),
                            {
                                "name": "egress-lock",
                                "image": "init",
                                "ready": False,
                                "restartCount": 0,
                                "state": {
                                    "terminated": {
                                        "exitCode": 3,
                                        "reason": "Error",
                                        "message": '{"stage": "egress-lock", "result": "Failed", '
                                        '"checks": [{"name": "egress.blocked", "passed": false}]}',
                                    }
                                },
                            },
                            self._waiting("proxy", "PodInitializing"),
                        ],
                        "containerStatuses": [
                            self._waiting("agent", "PodInitializing"),
                            self._waiting(HOLD, "PodInitializing"),
                        ],
                    },
                )
                play.agent_done = True
                return
            self._set(name, self._running_status(play.ip))
        if play.gate is not None and not play.gate.is_set():
            return  # the agent waits at the gate for the claim
        if not play.turns_done:
            self._harness(play, script)
            play.turns_done = True
        if not play.agent_done and not script.hold:
            self._set(name, self.agent_exited(play.ip, 0 if script.kind == "solve" else 1))
            play.agent_done = True

    def _start_pod(self, pod: dict[str, Any], trial: str) -> PodPlay:
        ip = f"127.0.0.{10 + len(self.plays)}"
        root = self.tmp / "pods" / pod["metadata"]["name"]
        workspace = shutil.copytree(self.pristine, root / "workspace")
        baseline = root / "baseline" / "baseline.json"
        baseline.parent.mkdir(parents=True)
        sandbox_changes.save_baseline(sandbox_changes.baseline(workspace), baseline)
        args = next(c for c in pod["spec"]["initContainers"] if c["name"] == "proxy")["args"]
        assert f"--trial={trial}" in args and f"--run={RUN}" in args
        settings = ProxySettings(
            upstream=self.engine_url,
            journal=root / "journal",
            run=RUN,
            trial=trial,
            workspace=str(workspace),
            baseline=str(baseline),
            fsync=False,
        )
        gated = any(a.startswith("--claim-fifo=") for a in args)
        if gated:
            settings = settings.model_copy(update={"claim_fifo": str(root / "claim-go")})
        stack = contextlib.ExitStack()
        stack.enter_context(serve_on(ProxyApp(settings), ip, self.port))
        play = PodPlay(ip, workspace, stack)
        if gated:  # the agent's `read -r go < FIFO`, on the FIFO the proxy made before it listened
            gate = play.gate = threading.Event()

            def wait_at_gate() -> None:
                with (root / "claim-go").open() as fifo:
                    if fifo.readline() == "go\n":
                        gate.set()

            threading.Thread(target=wait_at_gate, name=f"gate-{trial}", daemon=True).start()
        return play

    def _harness(self, play: PodPlay, script: Script) -> None:
        """Two turns through the trial's proxy (the second extends the first), then the edit."""
        url = f"http://{play.ip}:{self.port}/v1/chat/completions"
        messages: list[dict[str, Any]] = [{"role": "user", "content": "SAY:looking at calc.py"}]
        with httpx.Client(timeout=30) as client:
            first = client.post(url, json={"model": "any", "messages": messages})
            first.raise_for_status()
            messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "SAY:fixed"}]
            client.post(url, json={"model": "any", "messages": messages}).raise_for_status()
        body = "return a + b" if script.kind == "solve" else "return a * b"
        (play.workspace / "calc.py").write_text(f"def add(a, b):\n    {body}\n")

    def _verify(self, pod: dict[str, Any]) -> None:
        trial = pod["metadata"]["labels"]["legorl.dev/trial"]
        name = pod["metadata"]["name"]
        if trial in self.verified and self.verified[trial]["pod"] == name:
            return
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        task_cm = self.mock.fetch("v1", "configmaps", NS, volumes["task"]["configMap"]["name"])
        changes_cm = self.mock.fetch("v1", "configmaps", NS, volumes["changes"]["configMap"]["name"])
        work = self.tmp / "verify" / name
        work.mkdir(parents=True)
        (work / "task.json").write_text(task_cm["data"]["task.json"])
        (work / "changes.json").write_text(changes_cm["data"]["changes.json"])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = sandbox_cli.main(
                [
                    "verify",
                    f"--task-file={work / 'task.json'}",
                    f"--changes={work / 'changes.json'}",
                    f"--workspace={self.pristine}",
                    f"--into={work / 'repo'}",
                    f"--out={work / 'out'}",
                ]
            )
        payload = json.loads(out.getvalue())
        self.verified[trial] = {
            "pod": name,
            "body": pod,
            "task": task_cm,
            "changes": changes_cm,
            "payload": payload,
        }
        self._set(
            name,
            {
                "phase": "Running",
                "startTime": stamp(-1),
                "initContainerStatuses": self._init_done(["tools", "prepare"]),
                "containerStatuses": [
                    {
                        "name": "verify",
                        "image": IMAGE,
                        "ready": False,
                        "restartCount": 0,
                        "state": {
                            "terminated": {
                                "exitCode": code,
                                "reason": "Completed",
                                "finishedAt": stamp(),
                                # What legorl-sandbox writes to /dev/termination-log.
                                "message": json.dumps(payload)[:4000],
                            }
                        },
                    }
                ],
            },
        )

    @staticmethod
    def _init_done(names: list[str]) -> list[dict[str, Any]]:
        return [
            {
                "name": n,
                "image": "init",
                "ready": False,
                "restartCount": 0,
                "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
            }
            for n in names
        ]

    @staticmethod
    def _waiting(name: str, reason: str) -> dict[str, Any]:
        return {
            "name": name,
            "image": "x",
            "ready": False,
            "restartCount": 0,
            "state": {"waiting": {"reason": reason}},
        }

    def agent_exited(self, ip: str, code: int) -> dict[str, Any]:
        """The pod's status once its agent container exited with CODE (just now, after 2 s of work)."""
        status = self._running_status(ip)
        status["containerStatuses"][0] = {
            "name": "agent",
            "image": IMAGE,
            "ready": False,
            "restartCount": 0,
            "state": {
                "terminated": {
                    "exitCode": code,
                    "reason": "Completed" if code == 0 else "Error",
                    "startedAt": stamp(-2),
                    "finishedAt": stamp(),
                }
            },
        }
        return status

    def _running_status(self, ip: str) -> dict[str, Any]:
        return {
            "phase": "Running",
            "podIP": ip,
            "startTime": stamp(-3),
            "conditions": [{"type": "Ready", "status": "True"}],
            "initContainerStatuses": [
                *self._init_done(["tools", "harness-runtime", "setup", "egress-lock"]),
                {
                    "name": "proxy",
                    "image": "proxy",
                    "ready": True,
                    "started": True,
                    "restartCount": 0,
                    "state": {"running": {"startedAt": stamp(-3)}},
                },
            ],
            "containerStatuses": [
                {
                    "name": "agent",
                    "image": IMAGE,
                    "ready": True,
                    "restartCount": 0,
                    "state": {"running": {"startedAt": stamp(-2)}},
                },
                {
                    "name": HOLD,
                    "image": "pause",
                    "ready": True,
                    "restartCount": 0,
                    "state": {"running": {"startedAt": stamp(-2)}},
                },
            ],
        }


# --- the operator ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def operator(mock: MockApi, port: int) -> Iterator[OperatorHandle]:
    settings = operator_test_settings()
    trial_settings = TrialSettings(
        proxy_port=port,
        tick_seconds=0.1,
        poll_seconds=0.2,
        appear_seconds=5.0,
        api_retry_seconds=20.0,
        proxy_attempts=2,
        proxy_timeout_seconds=30.0,
    )
    registry = build_registry(login=lambda **_: kopf.ConnectionInfo(server=mock.url))
    memo = kopf.Memo(reconciler=make_reconciler(settings), trial_settings=trial_settings)
    with run_operator(mock, registry, memo=memo, settings=kopf_test_settings(settings)) as handle:
        yield handle


def rlrun(mock: MockApi) -> dict[str, Any]:
    return mock.fetch(GV, "rlruns", NS, RUN)


def condition(mock: MockApi, type_: str) -> dict[str, Any]:
    for cond in (rlrun(mock).get("status") or {}).get("conditions") or []:
        if cond["type"] == type_:
            return dict(cond)
    raise KeyError(type_)


def pods_of(mock: MockApi, component: str) -> dict[str, dict[str, Any]]:
    return {
        p["metadata"]["name"]: p
        for p in mock.objects("v1", "pods", NS)
        if (p["metadata"].get("labels") or {}).get("legorl.dev/component") == component
    }


def trial_config_maps(mock: MockApi) -> list[str]:
    return sorted(
        c["metadata"]["name"]
        for c in mock.objects("v1", "configmaps", NS)
        if (c["metadata"].get("labels") or {}).get("legorl.dev/run") == RUN
    )


@dataclass
class Cluster:
    """The mock, the kubelet and the operator (stopped and started at will), and the run's store."""

    mock: MockApi
    kubelet: Kubelet
    engine: FakeEngine
    store: RunStore
    rows: list[dict[str, Any]]
    port: int
    current: Any = None
    handle: OperatorHandle | None = None

    def start_operator(self) -> None:
        self.current = operator(self.mock, self.port)
        self.handle = self.current.__enter__()

    def stop_operator(self) -> None:
        if self.current is not None:
            current, self.current = self.current, None
            current.__exit__(None, None, None)

    def wait(self, predicate: Any, what: str, timeout: float = TIMEOUT) -> Any:
        def check() -> Any:
            self.kubelet.check()
            return predicate()

        assert self.handle is not None
        return self.handle.wait_for(check, timeout=timeout, what=what)


@pytest.fixture
def cluster_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A run `coder-grpo` (GRPO, 2 trials per task, 1 task per step, 2 steps) on the example's fleet
    and pool, its tasks in a ConfigMap, its store in a local folder; the fleet and pool made ready."""
    # The verifier's task Python loads no entry-point plugins, as in a task image (taskenv locally).
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    with contextlib.ExitStack() as stack:

        def make(
            scripts: dict[str, Script],
            spec: dict[str, Any] | None = None,
            annotations: dict[str, str] | None = None,
        ) -> Cluster:
            pristine = make_repo(tmp_path / "pristine")
            store_dir = tmp_path / "store"
            fleet, pool, run, _ = manifests("shared-fleet-and-pool.yaml")
            del pool["spec"]["source"]["taskSet"]  # the run names its own task set (a ConfigMap)
            run["spec"].update(
                {
                    "tasks": {
                        "source": {"uri": "configmap://tasks/tasks.jsonl"},
                        "split": {"heldOutPercent": 0},
                    },
                    "algorithm": {"name": "GRPO", "groupSize": 2, "tasksPerStep": 1},
                    "store": {"uri": f"file://{store_dir}"},
                    "stop": {"maxSteps": 2},
                    **(spec or {}),
                }
            )
            if annotations:
                run["metadata"]["annotations"] = {**run["metadata"].get("annotations", {}), **annotations}
            port = free_port()
            engine = FakeEngine()
            engine.version = "v0"  # what the fleet's /weight_info reports before any sync
            mock = stack.enter_context(MockApi())
            engine_url = stack.enter_context(serve(engine))
            kubelet = Kubelet(mock, tmp_path, pristine, engine_url, port, scripts)
            kubelet.start()
            stack.callback(kubelet.stop)
            rows = task_rows(pristine)
            mock.create(
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": "tasks", "namespace": NS},
                    "data": {"tasks.jsonl": "\n".join(json.dumps(r) for r in rows) + "\n"},
                }
            )
            for obj in (fleet, pool, run):
                mock.create(obj)
            cluster = Cluster(mock, kubelet, engine, RunStore(str(store_dir / NS / RUN)), rows, port)
            cluster.start_operator()
            stack.callback(cluster.stop_operator)
            cluster.wait(
                lambda: mock.fetch("apps/v1", "deployments", NS, "coder-fleet-engine"), "the Deployment"
            )
            cluster.wait(lambda: mock.objects("apps/v1", "daemonsets", NS), "the pool's pre-pull DaemonSets")
            ready_deployment(mock, "coder-fleet-engine", 2)
            engine_pod(mock, "coder-fleet-engine", 0, ready=True, version="v0")
            engine_pod(mock, "coder-fleet-engine", 1, ready=True, version="v0")
            ready_pool(mock, "python-repos", ["node-a"])
            return cluster

        yield make


@pytest.mark.slow
def test_trials_run_as_pods_report_status_and_survive_an_operator_restart(cluster_factory: Any) -> None:
    scripts = {
        "s1-t0-r0": Script("solve"),
        "s1-t0-r1": Script("defense"),
        "s2-t0-r0": Script("solve", hold=True),
        "s2-t0-r1": Script("wrong", hold=True),
    }
    cluster: Cluster = cluster_factory(scripts)
    mock, kubelet, engine, store, rows, wait = (
        cluster.mock,
        cluster.kubelet,
        cluster.engine,
        cluster.store,
        cluster.rows,
        cluster.wait,
    )
    # Step 1: two trial pods, built from the pool's template for this run.
    training = wait(
        lambda: condition(mock, "Training")["status"] == "True" and condition(mock, "Training"),
        "Training=True",
    )
    assert training["reason"] == "Stepping"
    trial_pods = wait(lambda: len(pods_of(mock, "trial")) == 2 and pods_of(mock, "trial"), "two trial pods")
    uid = rlrun(mock)["metadata"]["uid"]
    for name, pod in trial_pods.items():
        meta, spec = pod["metadata"], pod["spec"]
        labels = meta["labels"]
        assert name == f"{RUN}-{labels['legorl.dev/trial']}"
        assert (labels["legorl.dev/run"], labels["legorl.dev/step"], labels["legorl.dev/split"]) == (
            RUN,
            "1",
            "train",
        )
        assert labels["legorl.dev/pool"] == "python-repos" and labels["legorl.dev/owner"] == f"rlrun.{RUN}"
        (ref,) = meta["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("RLRun", RUN, uid, True)
        assert json.loads(meta["annotations"][REQUEST_ANNOTATION])["taskId"] in {
            r["instance_id"] for r in rows
        }
        assert [c["name"] for c in spec["initContainers"]] == [
            "tools",
            "harness-runtime",
            "setup",
            "egress-lock",
            "proxy",
        ]
        assert [c["name"] for c in spec["containers"]] == ["agent", HOLD]
        assert spec["runtimeClassName"] == "gvisor" and spec["containers"][0]["image"] == IMAGE
        proxy_args = spec["initContainers"][-1]["args"]
        assert "--upstream=http://coder-fleet-engine.default.svc:8000" in proxy_args
        assert "--capture-routed-experts" in proxy_args
        # The agent's copy of the task: problem statement and hidden file names, no fix, no tests.
        (task_volume,) = [v for v in spec["volumes"] if v["name"] == "task"]
        task_cm = mock.fetch("v1", "configmaps", NS, task_volume["configMap"]["name"])
        assert task_cm["data"]["problem.md"].endswith("it should add.")
        assert "a + b" not in json.dumps(task_cm["data"])  # the gold fix
        assert "assert add(1, 2)" not in task_cm["data"]["task.json"]
        assert "tests/test_hidden.py" in json.loads(task_cm["data"]["task.json"])["test_patch"]

    # The kubelet runs them: one agent fixes the bug, the other trial's egress lock fails closed.
    wait(lambda: store.committed_steps() == [1], "step 1 committed", timeout=60)
    batch = store.read_batch(1)
    by_trial = {r.trial: r for r in batch.trials}
    solved, defense = by_trial["s1-t0-r0"], by_trial["s1-t0-r1"]
    assert (solved.termination_reason.value, solved.reward) == ("completed", 1.0)
    assert solved.num_turns == 2 and len(solved.segments) == 1 and solved.merged_turn_share == 1.0
    assert solved.tool_call_turns == 0  # the played harness only chats; the proxy counted no tool calls
    assert solved.policy_versions == ["v0"] and solved.segments[0].loss_mask.count(1) > 0
    assert set(solved.stage_seconds) >= {"setup", "agent", "verify"}
    assert (defense.termination_reason.value, defense.reward) == ("defense_failed", None)
    assert defense.error is not None and "egress-lock exited 3" in defense.error
    # The change set the verifier got is the one the proxy read from the agent's workspace.
    verified = kubelet.verified["s1-t0-r0"]
    assert json.loads(verified["changes"]["data"]["changes.json"])["files"] == {
        "calc.py": "def add(a, b):\n    return a + b\n"
    }
    assert Task.from_dict(json.loads(verified["task"]["data"]["task.json"])).patch == GOLD
    outcome = json.loads(verified["body"]["metadata"]["annotations"][AGENT_OUTCOME_ANNOTATION])
    assert outcome["reason"] == "completed" and outcome["exitCode"] == 0
    recorded = store.read_run_spec()  # what the trainer Job starts from
    assert recorded is not None and recorded["spec"]["algorithm"]["groupSize"] == 2

    # Status follows; the finished trials' pods and ConfigMaps are gone.
    def step_one_status() -> dict[str, Any] | None:
        status = rlrun(mock)["status"]
        return status if status["step"] == 1 and status["trials"]["total"] == 2 else None

    status = wait(step_one_status, "status.step 1")
    assert {c["reason"]: c["count"] for c in status["trials"]["byReason"]} == {
        "completed": 1,
        "defense_failed": 1,
    }
    assert status["trials"]["dropped"] == 1 and status["trials"]["zeroVarianceGroups"] == 1
    assert status["metrics"]["rewardMean"] == 1.0 and status["phase"] == "Running"
    wait(lambda: not pods_of(mock, "trial") and not pods_of(mock, "verify"), "step 1 pods deleted")
    assert trial_config_maps(mock) == []
    # The run named its images for the pool's pre-pull.
    pool_body = mock.fetch(GV, "sandboxpools", NS, "python-repos")
    assert IMAGE in json.loads(pool_body["metadata"]["annotations"][LOOKAHEAD_ANNOTATION])

    # The trainer (played here) trains step 1 and syncs v1 into the fleet: step 2 starts.
    engine.version = "v1"
    store.write_trainer_state({"policy_version": "v1", "step": 1})
    step_two = wait(lambda: len(pods_of(mock, "trial")) == 2 and pods_of(mock, "trial"), "step 2 pods")
    assert {p["metadata"]["labels"]["legorl.dev/step"] for p in step_two.values()} == {"2"}
    wait(
        lambda: all(kubelet.plays.get(n) and kubelet.plays[n].turns_done for n in step_two),
        "step 2 agents at work",
    )
    uids = {n: p["metadata"]["uid"] for n, p in step_two.items()}

    # The operator restarts while both agents work: their pods stay.
    cluster.stop_operator()
    assert {n: p["metadata"]["uid"] for n, p in pods_of(mock, "trial").items()} == uids
    assert len(trial_config_maps(mock)) == 2
    # While no operator runs, one agent finishes.
    kubelet.release("s2-t0-r0")
    wait_until(lambda: kubelet.plays[f"{RUN}-s2-t0-r0"].agent_done, kubelet)
    mock.reset_requests()
    cluster.start_operator()

    # The new operator adopts both pods: the finished agent is verified, the other one released.
    wait(lambda: "s2-t0-r0" in kubelet.verified, "the adopted finished trial verified")
    kubelet.release("s2-t0-r1")
    wait(lambda: store.committed_steps() == [1, 2], "step 2 committed", timeout=60)
    writes = [
        (verb, path) for verb, path, _ in mock.request_log() if verb in ("PATCH", "POST") and "/pods" in path
    ]
    relaunched = [p for v, p in writes if p.rstrip("/").endswith(tuple(f"{RUN}-{t}" for t in scripts))]
    assert relaunched == [], f"adopted or finished trials were launched again: {relaunched}"
    step2 = {r.trial: r for r in store.read_batch(2).trials}
    assert (step2["s2-t0-r0"].termination_reason.value, step2["s2-t0-r0"].reward) == ("completed", 1.0)
    assert (step2["s2-t0-r1"].termination_reason.value, step2["s2-t0-r1"].reward) == ("agent_error", 0.0)
    assert step2["s2-t0-r1"].error is not None and "exited 1" in step2["s2-t0-r1"].error
    assert step2["s2-t0-r0"].policy_versions == ["v1"]
    assert sorted(store.saved_trials("train", 1), key=lambda r: r.trial) == sorted(
        batch.trials, key=lambda r: r.trial
    )

    # The trainer publishes v2: the run has trained its two steps and succeeds.
    engine.version = "v2"
    store.write_trainer_state({"policy_version": "v2", "step": 2})
    wait(lambda: condition(mock, "Succeeded")["status"] == "True", "Succeeded=True")
    final = rlrun(mock)["status"]
    assert condition(mock, "Succeeded")["reason"] == "MaxStepsReached"
    assert (final["phase"], final["step"], final["policyVersion"]) == ("Succeeded", 2, "v2")
    assert {c["reason"]: c["count"] for c in final["trials"]["byReason"]} == {
        "agent_error": 1,
        "completed": 2,
        "defense_failed": 1,
    }
    assert condition(mock, "Training")["reason"] == "Stopped"
    wait(
        lambda: not pods_of(mock, "trial") and not pods_of(mock, "verify") and not trial_config_maps(mock),
        "cleanup",
    )
    wait(
        lambda: mock.fetch("batch/v1", "jobs", NS, "coder-grpo-trainer")["spec"]["suspend"] is True,
        "trainer suspended",
    )


@pytest.mark.slow
def test_suspend_cancels_running_trials_and_cleans_up(cluster_factory: Any) -> None:
    scripts = {"s1-t0-r0": Script("solve", hold=True), "s1-t0-r1": Script("wrong", hold=True)}
    cluster: Cluster = cluster_factory(scripts)
    mock, kubelet, store = cluster.mock, cluster.kubelet, cluster.store
    pods = cluster.wait(lambda: len(pods_of(mock, "trial")) == 2 and pods_of(mock, "trial"), "trial pods")
    cluster.wait(
        lambda: all(n in kubelet.plays and kubelet.plays[n].turns_done for n in pods), "agents at work"
    )
    mock.patch(GV, "rlruns", NS, RUN, {"spec": {"suspend": True}})
    # The loop cancels its trials: pods and ConfigMaps are deleted, nothing is recorded as finished.
    cluster.wait(lambda: not pods_of(mock, "trial") and not trial_config_maps(mock), "trial objects deleted")
    training = cluster.wait(
        lambda: condition(mock, "Training")["reason"] == "Suspended" and condition(mock, "Training"),
        "Suspended",
    )
    assert training["status"] == "False" and rlrun(mock)["status"]["phase"] == "Suspended"
    assert store.saved_trials("train", 1) == [] and store.committed_steps() == []
    # Resumed, the loop runs the cancelled trials again (same ids, new pods).
    mock.patch(GV, "rlruns", NS, RUN, {"spec": {"suspend": False}})
    again = cluster.wait(
        lambda: len(pods_of(mock, "trial")) == 2 and pods_of(mock, "trial"), "trial pods again"
    )
    assert set(again) == set(pods) and {p["metadata"]["uid"] for p in again.values()}.isdisjoint(
        p["metadata"]["uid"] for p in pods.values()
    )


@pytest.mark.slow
def test_a_trial_pod_deleted_mid_agent_keeps_the_turns_its_proxy_acknowledged(cluster_factory: Any) -> None:
    """`kubectl delete pod` of a trial whose agent works: the kubelet stops the agent (143) and the proxy
    drains (`--drain-seconds`; played here by a proxy that stays up). The trial is a sandbox_error, not
    graded, and its record keeps the turns the proxy had acknowledged: before, it had none."""
    scripts = {"s1-t0-r0": Script("solve", hold=True), "s1-t0-r1": Script("solve")}
    cluster: Cluster = cluster_factory(scripts)
    mock, kubelet, store = cluster.mock, cluster.kubelet, cluster.store
    name = f"{RUN}-s1-t0-r0"
    cluster.wait(lambda: name in kubelet.plays and kubelet.plays[name].turns_done, "the agent at work")
    play = kubelet.plays[name]
    play.agent_done = True  # the kubelet below stops it, not the script
    # The API server marks the pod (this emulator keeps a deleted object that has a finalizer, as the
    # grace period keeps a pod); the kubelet stops the agent.
    mock.patch("v1", "pods", NS, name, {"metadata": {"finalizers": ["tests.legorl.dev/grace"]}})
    mock.delete("v1", "pods", NS, name)
    mock.set_status("v1", "pods", NS, name, kubelet.agent_exited(play.ip, 143))

    def recorded() -> Any:
        return next((r for r in store.saved_trials("train", 1) if r.trial == "s1-t0-r0"), None)

    record = cluster.wait(recorded, "the deleted trial recorded")
    assert (record.termination_reason.value, record.reward) == ("sandbox_error", None), record.error
    assert record.error is not None and "deleted" in record.error
    assert record.num_turns == 2 and record.segments, "the acknowledged turns were not kept"
    assert "s1-t0-r0" not in kubelet.verified  # never graded
    mock.patch("v1", "pods", NS, name, {"metadata": {"finalizers": None}})  # the grace period is over


@pytest.mark.slow
def test_warm_trials_get_ready_while_the_step_before_trains_and_a_launch_claims_them(
    cluster_factory: Any,
) -> None:
    """`schedule.warmTrials: 2`: step 2's pods are made while step 1 trains, every stage done but the
    agent's, which waits at the gate (a real FIFO, a real proxy's `POST /claim`); they survive an operator
    restart as warm pods, not running trials; once v1 is served the loop launches step 2 by claiming them:
    the same pods, no new ones, the agent's clock started at the claim."""
    scripts = {
        "s1-t0-r0": Script("solve"),
        "s1-t0-r1": Script("wrong"),
        "s2-t0-r0": Script("solve", hold=True),
        "s2-t0-r1": Script("wrong"),
    }
    cluster: Cluster = cluster_factory(scripts, spec={"schedule": {"warmTrials": 2}})
    mock, kubelet, engine, store, wait = (
        cluster.mock,
        cluster.kubelet,
        cluster.engine,
        cluster.store,
        cluster.wait,
    )
    wait(lambda: store.committed_steps() == [1], "step 1 committed", timeout=60)
    warm = wait(
        lambda: (
            {n: p for n, p in pods_of(mock, "trial").items() if p["metadata"]["labels"].get(WARM_LABEL)}
            if len(pods_of(mock, "trial")) == 2
            else None
        ),
        "step 2's warm pods",
    )
    assert set(warm) == {f"{RUN}-s2-t0-r0", f"{RUN}-s2-t0-r1"}
    for pod in warm.values():
        assert pod["metadata"]["labels"][WARM_LABEL] == "waiting"
        agent = pod["spec"]["containers"][0]
        assert agent["command"][:4] == ["/bin/sh", "-c", GATE_SCRIPT, "legorl-gate"]
        assert {"name": "claim", "mountPath": "/legorl-claim", "readOnly": True} in agent["volumeMounts"]
        assert pod["spec"]["activeDeadlineSeconds"] > WARM_WAIT_SECONDS
    uids = {n: p["metadata"]["uid"] for n, p in warm.items()}
    # Ready, and waiting: the played agents have not worked (the gate is shut) and nothing served v1.
    wait(lambda: all(n in kubelet.plays for n in warm), "the warm pods running")
    time.sleep(1.0)
    assert not any(kubelet.plays[n].turns_done for n in warm)
    assert all(not kubelet.plays[n].gate.is_set() for n in warm)  # type: ignore[union-attr]

    # An operator restart: the new one keeps them as warm pods (not running trials, not deleted).
    cluster.stop_operator()
    mock.reset_requests()
    cluster.start_operator()
    time.sleep(2.0)
    assert {n: p["metadata"]["uid"] for n, p in pods_of(mock, "trial").items()} == uids
    assert not any(kubelet.plays[n].turns_done for n in warm)

    # The trainer (played) serves v1: the loop launches step 2 by claiming the two pods.
    engine.version = "v1"
    store.write_trainer_state({"policy_version": "v1", "step": 1})
    wait(lambda: all(kubelet.plays[n].turns_done for n in warm), "the claimed agents at work")
    claimed = pods_of(mock, "trial")
    assert {n: p["metadata"]["uid"] for n, p in claimed.items()} == uids  # the same pods
    for pod in claimed.values():
        meta = pod["metadata"]
        assert meta["labels"][WARM_LABEL] == "claimed" and meta["annotations"][CLAIMED_AT_ANNOTATION]
        assert json.loads(meta["annotations"][REQUEST_ANNOTATION])["policyVersion"] == "v1"
        assert pod["spec"]["activeDeadlineSeconds"] < WARM_WAIT_SECONDS  # the claim lowered it
    kubelet.release("s2-t0-r0")
    wait(lambda: store.committed_steps() == [1, 2], "step 2 committed", timeout=60)
    writes = [p for verb, p, _ in mock.request_log() if verb == "POST" and p.rstrip("/").endswith("/pods")]
    assert writes == [], f"pods were created after the restart: {writes}"
    step2 = {r.trial: r for r in store.read_batch(2).trials}
    assert (step2["s2-t0-r0"].termination_reason.value, step2["s2-t0-r0"].reward) == ("completed", 1.0)
    assert (step2["s2-t0-r1"].termination_reason.value, step2["s2-t0-r1"].reward) == ("agent_error", 0.0)
    for record in step2.values():
        assert record.policy_versions == ["v1"] and record.num_turns == 2
        # Launch -> the proxy's answer that the agent has its `go` (a played pod's proxy on loopback).
        assert 0 < record.stage_seconds["claim"] < 5, record.stage_seconds
        # The agent's clock starts at the claim, not at the pod's start long before.
        assert record.stage_seconds["agent"] < 30 and record.stage_seconds.get("setup", 0.0) == 0.0
    step1 = {r.trial: r for r in store.read_batch(1).trials}
    assert all("claim" not in r.stage_seconds for r in step1.values())  # launched cold

    engine.version = "v2"
    store.write_trainer_state({"policy_version": "v2", "step": 2})
    wait(lambda: condition(mock, "Succeeded")["status"] == "True", "Succeeded=True")
    wait(lambda: not pods_of(mock, "trial") and not trial_config_maps(mock), "cleanup")


@pytest.mark.slow
def test_fidelity_guard_suspends_the_run_and_a_resume_goes_on(cluster_factory: Any) -> None:
    scripts = {
        "s1-t0-r0": Script("solve"),
        "s1-t0-r1": Script("wrong"),
        "s2-t0-r0": Script("solve", hold=True),
        "s2-t0-r1": Script("wrong", hold=True),
    }
    guard = {"fidelity": {"minCorrelation": "0.99", "windowSteps": 1, "action": "Pause"}}
    cluster: Cluster = cluster_factory(scripts, spec=guard)
    mock, engine, store, wait = cluster.mock, cluster.engine, cluster.store, cluster.wait
    wait(lambda: store.committed_steps() == [1], "step 1 committed", timeout=60)
    # The finished trials' proxies were read once for their figures, summed under the run's name.
    assert cluster.handle is not None
    exposition = generate_latest(cluster.handle.memo["metrics"].registry).decode()
    assert re.search(r'legorl_proxy_request_seconds_count\{[^}]*run="coder-grpo"[^}]*\} [1-9]', exposition), [
        line for line in exposition.splitlines() if line.startswith("legorl_proxy")
    ][:20]
    # The trainer (played here) trains step 1 with a correlation far below the guard's floor.
    store.write_metrics(1, {"step": 1, "fidelity_pearson": 0.42})
    engine.version = "v1"
    store.write_trainer_state({"policy_version": "v1", "step": 1})
    wait(lambda: rlrun(mock)["spec"].get("suspend") is True, "the guard suspended the run")
    degraded = wait(
        lambda: condition(mock, "Degraded")["status"] == "True" and condition(mock, "Degraded"), "Degraded"
    )
    assert degraded["reason"] == "FidelityBelowThreshold"
    assert "step 1: 0.4200" in degraded["message"] and "suspended" in degraded["message"]
    wait(lambda: rlrun(mock)["status"]["phase"] in ("Suspended", "Degraded"), "paused phase")
    events = [e for e in mock.objects("v1", "events", NS) if e.get("reason") == "FidelityBelowThreshold"]
    assert events and events[0]["type"] == "Warning" and "suspended" in events[0]["message"]
    wait(lambda: not pods_of(mock, "trial"), "no trial pods while paused")
    assert store.committed_steps() == [1]

    # A person looks, then resumes: the guard re-arms (step 1 no longer counts) and step 2 runs.
    mock.patch(GV, "rlruns", NS, RUN, {"spec": {"suspend": False}})
    wait(lambda: len(pods_of(mock, "trial")) == 2, "step 2 trial pods after the resume")
    wait(lambda: condition(mock, "Degraded")["status"] == "False", "Degraded cleared")
    assert rlrun(mock)["spec"].get("suspend") is False


def play_trainer_scoring(store: RunStore, pearson: float) -> list[str]:
    """The trainer Job's side of a canary (`TrainingService.serve_scoring`, tested for real in
    test_trainer_service.py): answer each scoring request with figures of the weights held (v0)."""
    answered = []
    for request in store.scoring_requests():
        (record,) = store.read_scoring_request(request)
        tokens = sum(sum(s.loss_mask) for s in record.segments)
        store.answer_scoring(
            request,
            {
                "policy_version": "v0",
                "tokens": float(tokens),
                "pearson": pearson,
                "max_abs_logprob_delta": 0.0 if pearson == 1.0 else 1.5,
                "mean_abs_logprob_delta": 0.0 if pearson == 1.0 else 0.4,
                "replayed_share": 1.0,
                "routing_agreement": 1.0,
                "routing_compared": float(tokens),
            },
        )
        answered.append(request)
    return answered


def validation(mock: MockApi) -> dict[str, Any]:
    return rlrun(mock).get("status", {}).get("validation") or {}


@pytest.mark.slow
def test_a_canary_asked_for_in_the_manifest_runs_first_and_a_failed_one_keeps_the_run_from_starting(
    cluster_factory: Any,
) -> None:
    requested = "2026-12-01T10:00:00Z"
    canary = canary_trial_id(requested)
    scripts = {canary: Script("solve"), "s1-t0-r0": Script("solve"), "s1-t0-r1": Script("wrong")}
    cluster: Cluster = cluster_factory(scripts, annotations={VALIDATE_ANNOTATION: requested})
    mock, store, wait = cluster.mock, cluster.store, cluster.wait
    # Only the canary's trial pod is launched: the loop waits for the canary.
    pods = wait(lambda: pods_of(mock, "trial"), "the canary's trial pod")
    assert set(pods) == {f"{RUN}-{canary}"}
    # Its trial ends; it waits for the trainer to score it, and says so.
    waiting = wait(
        lambda: "waiting for the trainer" in validation(mock).get("message", "") and validation(mock),
        "the canary waits for the trainer",
    )
    assert waiting["state"] == "Running" and waiting["requested"] == requested
    training = condition(mock, "Training")
    assert training["status"] == "False" and "a canary runs first" in training["message"]
    # The trainer (played here) scores the trial's tokens far from what the engine sampled.
    assert wait(lambda: play_trainer_scoring(store, pearson=0.31), "a scoring request") == [canary]
    failed = wait(lambda: validation(mock).get("state") == "Failed" and validation(mock), "canary Failed")
    results = {c["check"]: c["result"] for c in failed["checks"]}
    # The example's evaluation interval outlasts this 2-step run (a preflight warning); the fake engine
    # records no routed experts, which the routing check says rather than passing.
    assert results == {
        "preflight": "Warning",
        "trial": "Passed",
        "token-parity": "Failed",
        "routing-parity": "Warning",
    }
    assert "Pearson 0.3100" in failed["message"] and failed["trial"] == canary and failed["completionTime"]
    # Fail closed: nothing was trained yet, so the run is suspended before its first trial.
    wait(lambda: rlrun(mock)["spec"].get("suspend") is True, "the failed canary suspended the run")
    events = {e["reason"]: e for e in mock.objects("v1", "events", NS)}
    assert (
        events["ValidationFailed"]["type"] == "Warning"
        and "token-parity" in events["ValidationFailed"]["message"]
    )
    wait(lambda: not pods_of(mock, "trial") and not pods_of(mock, "verify"), "the canary's pods deleted")
    assert store.committed_steps() == [] and store.saved_trials("train", 0) == []
    report = store.read_validation()
    assert report is not None and report["result"] == "Failed" and report["trial"] == canary
    # The same request is not run again; resuming starts the loop.
    mock.patch(GV, "rlruns", NS, RUN, {"spec": {"suspend": False}})
    wait(
        lambda: (
            {p["metadata"]["labels"]["legorl.dev/trial"] for p in pods_of(mock, "trial").values()}
            == {"s1-t0-r0", "s1-t0-r1"}
        ),
        "step 1 pods",
    )
    assert validation(mock)["state"] == "Failed" and store.scoring_requests() == []


@pytest.mark.slow
def test_a_canary_asked_for_mid_run_hands_the_loop_over_and_it_adopts_its_trials(
    cluster_factory: Any,
) -> None:
    requested = "2026-12-01T11:00:00Z"
    canary = canary_trial_id(requested)
    scripts = {
        canary: Script("solve"),
        "s1-t0-r0": Script("solve", hold=True),
        "s1-t0-r1": Script("wrong", hold=True),
    }
    cluster: Cluster = cluster_factory(scripts)
    mock, kubelet, store, wait = cluster.mock, cluster.kubelet, cluster.store, cluster.wait
    step_one = wait(lambda: len(pods_of(mock, "trial")) == 2 and pods_of(mock, "trial"), "step 1 pods")
    uids = {n: p["metadata"]["uid"] for n, p in step_one.items()}
    wait(
        lambda: all(kubelet.plays.get(n) and kubelet.plays[n].turns_done for n in step_one), "agents at work"
    )
    # The UI's Validate button (or kubectl annotate) while step 1's agents work.
    mock.patch(GV, "rlruns", NS, RUN, {"metadata": {"annotations": {VALIDATE_ANNOTATION: requested}}})
    wait(lambda: f"{RUN}-{canary}" in pods_of(mock, "trial"), "the canary's trial pod")
    assert wait(lambda: play_trainer_scoring(store, pearson=1.0), "a scoring request") == [canary]
    passed = wait(lambda: validation(mock).get("completionTime") and validation(mock), "canary ended")
    results = {c["check"]: c["result"] for c in passed["checks"]}
    assert results == {
        "preflight": "Warning",
        "trial": "Passed",
        "token-parity": "Passed",
        "routing-parity": "Warning",
    }
    assert passed["state"] == "Warning" and "Pearson 1.00000" in passed["checks"][2]["message"]
    events = {e["reason"]: e for e in mock.objects("v1", "events", NS)}
    assert "Validated" in events and events["Validated"]["type"] == "Normal"
    # The loop was handed over, not stopped: step 1's pods are the same ones, adopted by the new loop.
    wait(lambda: f"{RUN}-{canary}" not in pods_of(mock, "trial"), "the canary's pod deleted")
    assert {n: p["metadata"]["uid"] for n, p in pods_of(mock, "trial").items()} == uids
    assert rlrun(mock)["spec"].get("suspend") is not True
    kubelet.release("s1-t0-r0")
    kubelet.release("s1-t0-r1")
    wait(lambda: store.committed_steps() == [1], "step 1 committed", timeout=60)
    assert sorted(r.trial for r in store.read_batch(1).trials) == ["s1-t0-r0", "s1-t0-r1"]
    assert condition(mock, "Training")["status"] == "True"
    assert validation(mock)["requested"] == requested and validation(mock)["state"] == passed["state"]


def wait_until(predicate: Any, kubelet: Kubelet, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        kubelet.check()
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


# --- pure parts: the objects a trial is made of, and how pods are read ------------------------------------


def _stored(res: Any) -> Any:
    body = res.to_wire()
    body["metadata"] = {"namespace": NS, **body["metadata"], "uid": PLACEHOLDER_UID}
    return type(res).model_validate(body)


def _example() -> tuple[RLRun, SandboxPool, TrialRequest]:
    _, pool, run, _ = (KINDS[d["kind"]].model_validate(d) for d in manifests("shared-fleet-and-pool.yaml"))
    assert isinstance(pool, SandboxPool) and isinstance(run, RLRun)
    # Dataset rows carry more than legorl reads: extra columns must not reach the agent either.
    task = Task.from_dict(
        {**task_rows(Path("/testbed"), 1)[0], "legorl_wrong_patch": "WRONG", "hints_text": "HINT"}
    )
    request = TrialRequest(
        trial="s3-t1-r0", task=task, group_id="s3-t1-calc-1", split="train", step=3, policy_version="v2"
    )
    return _stored(run), _stored(pool), request


FLEET = FleetAccess(url="http://coder-fleet-engine.default.svc:8000", capture_routed_experts=True)


def test_trial_objects_are_valid_children_of_the_run_and_hide_the_answers() -> None:
    run, pool, request = _example()
    config_map, pod = trial_objects(run, pool, request, FLEET, RenderContext())
    for obj in (config_map, pod):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        assert obj["metadata"]["ownerReferences"][0]["kind"] == "RLRun"
        assert obj["metadata"]["labels"]["legorl.dev/trial"] == "s3-t1-r0"
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "legorl-operator"
    deadlines = pool.spec.deadlines
    assert pod["spec"]["activeDeadlineSeconds"] == (
        deadlines.setup_seconds + deadlines.agent_seconds + deadlines.verify_seconds + COLLECT_GRACE_SECONDS
    )
    hold = pod["spec"]["containers"][-1]
    assert (hold["name"], hold["image"]) == (HOLD, pool.spec.pre_pull.pause_image)
    assert hold["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    row = json.loads(config_map["data"]["task.json"])
    agent_view = Task.from_dict(row)  # setup reads it: still a valid task
    assert agent_view.hidden_test_files == request.task.hidden_test_files == ("tests/test_hidden.py",)
    assert row["patch"] == "" and "assert" not in row["test_patch"]
    assert "test_fix" not in json.dumps(row) and row == agent_task_row(request.task)
    assert "WRONG" not in json.dumps(row) and "HINT" not in json.dumps(row) and "a + b" not in json.dumps(row)
    task_cm, changes_cm, verify = verify_objects(
        run,
        pool,
        request,
        FLEET,
        RenderContext(),
        changes={"files": {"calc.py": "x"}},
        agent_outcome=AgentOutcomeNote("completed"),
    )
    for obj in (task_cm, changes_cm, verify):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert Task.from_dict(json.loads(task_cm["data"]["task.json"])) == request.task
    volumes = {v["name"]: v.get("configMap", {}).get("name") for v in verify["spec"]["volumes"]}
    assert (
        volumes["task"] == task_cm["metadata"]["name"]
        and volumes["changes"] == changes_cm["metadata"]["name"]
    )
    outcome = verify["metadata"]["annotations"][AGENT_OUTCOME_ANNOTATION]
    assert json.loads(outcome) == {"reason": "completed", "exitCode": None, "detail": "", "stageSeconds": {}}
    assert AgentOutcomeNote.from_json(outcome) == AgentOutcomeNote("completed")
    note = TrialRequestNote.from_json(verify["metadata"]["annotations"][REQUEST_ANNOTATION])
    assert TrialRequest.from_note(note, request.task) == request


def test_the_pod_notes_round_trip_and_refuse_what_they_cannot_use() -> None:
    _, _, request = _example()
    note = request.note()
    assert json.loads(note.to_json()) == {
        "trial": "s3-t1-r0",
        "taskId": request.task.instance_id,
        "groupId": request.group_id,
        "split": request.split,
        "step": request.step,
        "policyVersion": request.policy_version,
    }
    assert TrialRequestNote.from_json(note.to_json()) == note
    for bad in (None, "", "[]", '{"trial": "x"}', note.to_json().replace('"train"', '"test"')):
        with pytest.raises(ValueError, match="trial-request annotation"):
            TrialRequestNote.from_json(bad)
    outcome = AgentOutcomeNote("agent_error", 1, "x" * 3000, {"setup": 1.5})
    again = AgentOutcomeNote.from_json(outcome.to_json())
    assert again == AgentOutcomeNote("agent_error", 1, "x" * 2000, {"setup": 1.5})  # the detail is capped
    for bad in ("{}", '{"reason": "x", "exitCode": "one"}', '"completed"'):
        with pytest.raises(ValueError, match="agent-outcome annotation"):
            AgentOutcomeNote.from_json(bad)


def test_a_warm_trial_pod_is_valid_gated_and_its_claim_restores_the_deadline() -> None:
    run, pool, request = _example()
    cold = trial_objects(run, pool, request, FLEET, RenderContext())[1]
    _, pod = trial_objects(run, pool, request, FLEET, RenderContext(), warm=True)
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    assert pod["metadata"]["labels"][WARM_LABEL] == "waiting" and WARM_LABEL not in cold["metadata"]["labels"]
    agent, proxy = pod["spec"]["containers"][0], pod["spec"]["initContainers"][-1]
    # The agent runs its usual command behind the gate; only the proxy may write the gate's FIFO.
    assert agent["command"] == [
        "/bin/sh",
        "-c",
        GATE_SCRIPT,
        "legorl-gate",
        *cold["spec"]["containers"][0]["command"],
    ]
    assert {"name": "claim", "mountPath": "/legorl-claim", "readOnly": True} in agent["volumeMounts"]
    assert {"name": "claim", "mountPath": "/legorl-claim"} in proxy["volumeMounts"]
    assert "--claim-fifo=/legorl-claim/go" in proxy["args"]
    assert not any(a.startswith("--claim-fifo") for a in cold["spec"]["initContainers"][-1]["args"])

    # Everything else is the cold pod's.
    def rest(body: dict[str, Any]) -> dict[str, Any]:
        skip = ("containers", "initContainers", "volumes", "activeDeadlineSeconds")
        return {k: v for k, v in body["spec"].items() if k not in skip}

    assert rest(pod) == rest(cold)
    assert pod["spec"]["activeDeadlineSeconds"] == cold["spec"]["activeDeadlineSeconds"] + WARM_WAIT_SECONDS
    claimed_at = datetime(2026, 12, 1, 12, 0, 0, 250000, tzinfo=UTC)
    later = dataclasses.replace(request, policy_version="v7")
    patch = claim_patch(pool, later, 3600.4, claimed_at)
    assert patch["metadata"]["labels"] == {WARM_LABEL: "claimed"}
    assert json.loads(patch["metadata"]["annotations"][REQUEST_ANNOTATION])["policyVersion"] == "v7"
    assert patch["metadata"]["annotations"][CLAIMED_AT_ANNOTATION] == "2026-12-01T12:00:00.250000Z"
    # The backstop counts from the claim again (a pod's deadline may only go down: it does).
    assert patch["spec"]["activeDeadlineSeconds"] == 3601 + cold["spec"]["activeDeadlineSeconds"]
    assert patch["spec"]["activeDeadlineSeconds"] < pod["spec"]["activeDeadlineSeconds"]


def test_a_warm_pods_agent_clock_starts_at_the_claim() -> None:
    """The agent container of a warm pod started an hour before its claim: neither the deadline nor the
    agent's seconds count that hour."""
    pod = _pod(mains=[_c("agent", running={"startedAt": "2026-12-01T11:00:05Z"})])
    claimed = datetime(2026, 12, 1, 11, 59, 0, tzinfo=UTC)
    kwargs: dict[str, Any] = {"setup_seconds": 60, "agent_seconds": 120, "launched": claimed}
    assert agent_end(pod, now=NOW, claimed=claimed, **kwargs) is None  # 60 s after the claim: running
    late = agent_end(pod, now=claimed + timedelta(seconds=181), claimed=claimed, **kwargs)
    assert late is not None and late.reason == "agent_timeout"
    assert late.stage_seconds == {"setup": 0.0, "agent": 181.0}
    cold = agent_end(pod, now=NOW, **kwargs)  # the same pod read as a cold one: long past its deadline
    assert cold is not None and cold.reason == "agent_timeout"
    done = _pod(
        mains=[
            _c(
                "agent",
                terminated={
                    "exitCode": 0,
                    "startedAt": "2026-12-01T11:00:05Z",
                    "finishedAt": "2026-12-01T11:59:30Z",
                },
            )
        ]
    )
    end = agent_end(done, now=NOW, claimed=claimed, **kwargs)
    assert end is not None and end.reason == "completed" and end.stage_seconds["agent"] == 30.0


NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def _pod(
    phase: str = "Running", *, inits: list[Any] | None = None, mains: list[Any] | None = None, **status: Any
) -> dict[str, Any]:
    return {
        "metadata": {"name": "p"},
        "status": {
            "phase": phase,
            "startTime": "2026-12-01T11:00:00Z",
            "initContainerStatuses": list(inits or []),
            "containerStatuses": list(mains or []),
            **status,
        },
    }


def _c(name: str, **state: Any) -> dict[str, Any]:
    return {"name": name, "state": state}


RUNNING_AGENT = _c("agent", running={"startedAt": "2026-12-01T11:01:00Z"})


@pytest.mark.parametrize(
    ("pod", "now_offset", "expected"),
    [
        (_pod(mains=[RUNNING_AGENT]), 0, None),
        (
            _pod(
                mains=[
                    _c(
                        "agent",
                        terminated={
                            "exitCode": 0,
                            "startedAt": "2026-12-01T11:01:00Z",
                            "finishedAt": "2026-12-01T11:31:00Z",
                        },
                    )
                ]
            ),
            0,
            ("completed", True),
        ),
        (
            _pod(mains=[_c("agent", terminated={"exitCode": 137, "reason": "OOMKilled"})]),
            0,
            ("agent_error", True),
        ),
        (
            _pod(
                "Failed",
                inits=[_c("setup", terminated={"exitCode": 3, "message": "history.single_commit failed"})],
            ),
            0,
            ("defense_failed", False),
        ),
        (
            _pod("Failed", inits=[_c("setup", terminated={"exitCode": 5, "message": "no workspace"})]),
            0,
            ("sandbox_error", False),
        ),
        # The kubelet retries pulls: a registry hiccup is not a failure yet, a lasting one is.
        (_pod("Pending", inits=[_c("tools", waiting={"reason": "ImagePullBackOff"})]), 0, None),
        (
            _pod("Pending", inits=[_c("tools", waiting={"reason": "ImagePullBackOff"})]),
            121,
            ("sandbox_error", False),
        ),
        (
            _pod("Pending", mains=[_c("agent", waiting={"reason": "InvalidImageName"})]),
            0,
            ("sandbox_error", False),
        ),
        (
            _pod("Pending", mains=[_c("agent", waiting={"reason": "CreateContainerConfigError"})]),
            0,
            ("sandbox_error", False),
        ),
        (_pod(inits=[_c("proxy", waiting={"reason": "CrashLoopBackOff"})]), 0, ("proxy_error", False)),
        (_pod("Failed", reason="Evicted", message="low on memory"), 0, ("sandbox_error", False)),
        (_pod("Failed", reason="DeadlineExceeded"), 0, ("agent_timeout", False)),
        # The operator's own deadline: setupSeconds 600 + agentSeconds 1800 after the pod started.
        (_pod(mains=[RUNNING_AGENT]), 2401, ("agent_timeout", True)),
        (_pod("Pending"), 601, ("sandbox_error", False)),
        (_pod("Pending"), 599, None),
    ],
)
def test_agent_stage_end_is_classified_from_the_pod(
    pod: dict[str, Any], now_offset: int, expected: Any
) -> None:
    start = datetime(2026, 12, 1, 11, 0, tzinfo=UTC)
    end = agent_end(
        pod, now=start + timedelta(seconds=now_offset), setup_seconds=600, agent_seconds=1800, launched=start
    )
    assert (None if end is None else (end.reason, end.collect)) == expected
    if end is not None and end.reason == "completed":
        assert end.stage_seconds == {"setup": 60.0, "agent": 1800.0}
    deleting = {**pod, "metadata": {"name": "p", "deletionTimestamp": "2026-12-01T11:05:00Z"}}
    if expected is None:
        gone = agent_end(deleting, now=start, setup_seconds=600, agent_seconds=1800, launched=start)
        assert gone is not None and gone.reason == "sandbox_error"


@pytest.mark.parametrize(
    ("finished", "expected"),
    [
        # `kubectl delete pod` at 11:05:00 (grace 30 s): the kubelet's SIGTERM ends the agent after.
        ("2026-12-01T11:05:01Z", ("sandbox_error", False)),
        # The agent had ended before anyone asked: its outcome stands, the journal is collected.
        ("2026-12-01T11:04:00Z", ("agent_error", True)),
    ],
)
def test_an_agent_stopped_by_the_pods_deletion_is_not_its_own_outcome(finished: str, expected: Any) -> None:
    """The agent's exit (143) of a deleted pod is the deletion's, also when the controller looks only after
    the agent has exited (a busy controller): before, such a trial was classified agent_error, its dying
    proxy was asked for the journal and a verify pod graded what was left."""
    stopped = _c(
        "agent", terminated={"exitCode": 143, "startedAt": "2026-12-01T11:01:00Z", "finishedAt": finished}
    )
    pod = _pod(mains=[stopped])
    pod["metadata"].update({"deletionTimestamp": "2026-12-01T11:05:30Z", "deletionGracePeriodSeconds": 30})
    start = datetime(2026, 12, 1, 11, 0, tzinfo=UTC)
    end = agent_end(
        pod, now=start + timedelta(minutes=6), setup_seconds=600, agent_seconds=1800, launched=start
    )
    assert end is not None and (end.reason, end.collect) == expected


def test_verify_verdicts_come_from_the_termination_message() -> None:
    created = NOW - timedelta(minutes=1)

    def verdict(**state: Any) -> Any:
        return verify_result(
            _pod(mains=[_c("verify", **state)], startTime="2026-12-01T11:59:00Z"),
            now=NOW,
            verify_seconds=1800,
            created=created,
        )

    payload = {
        "stage": "verify",
        "reward": 1.0,
        "grade": {},
        "tamperFindings": [{"kind": "test_file_modified", "path": "tests/t.py", "detail": ""}],
    }
    ok = verdict(terminated={"exitCode": 0, "message": json.dumps(payload)})
    assert (ok.reward, ok.error, [f["kind"] for f in ok.findings]) == (1.0, None, ["test_file_modified"])
    assert verdict(
        terminated={"exitCode": 4, "message": '{"error": "test patch does not apply"}'}
    ).error.startswith("the verifier exited 4")
    assert "no readable result" in verdict(terminated={"exitCode": 0, "message": ""}).error
    assert verdict(running={}) is None
    late = verify_result(
        _pod(mains=[_c("verify", running={})]),
        now=NOW + timedelta(hours=2),
        verify_seconds=1800,
        created=created,
    )
    assert late is not None and "verifySeconds" in (late.error or "")
    pull = verify_result(
        _pod("Pending", inits=[_c("prepare", waiting={"reason": "ErrImagePull"})]),
        now=NOW,
        verify_seconds=1800,
        created=created,
    )
    assert pull is not None and "cannot start" in (pull.error or "")
    # legorl-sandbox cuts its message at 4000 characters: the reward (first) survives, findings do not.
    long = json.dumps({"stage": "verify", "reward": 0.0, "grade": {"x": "y" * 5000}})[:4000]
    cut = parse_verify_message(long)
    assert (cut.reward, cut.error) == (0.0, None) and cut.note is not None
    assert parse_verify_message('{"stage": "verify", "reward": null}').error is not None


def test_lookahead_names_the_next_images_or_all_of_them() -> None:
    assert lookahead_value("Never", [], ["a"]) is None
    assert lookahead_value("Lookahead", ["old"], ["b", "a", "b"]) == ["b", "a"]
    assert lookahead_value("All", ["old"], ["b", "old"]) == ["old", "b"]
    assert lookahead_value("All", ["old", "b"], ["b"]) is None  # unchanged: no patch


def test_run_status_follows_the_controller_report() -> None:
    run, _, _ = _example()
    fleet, pool = None, None
    report = ControllerReport(
        running=True,
        step=3,
        policy_version="v3",
        trials_total=40,
        trials_running=8,
        trials_dropped=4,
        by_reason={"completed": 30, "agent_error": 6, "sandbox_error": 4},
        metrics={"reward_mean": 0.123456, "fidelity_correlation": 0.95, "trials_per_minute": 12.0},
        message="step 3/200, policy v3: 8 trial(s) running, 40 finished",
        has_progress=True,
        degraded=("FidelityBelowThreshold", "correlation below 0.99 for 3 consecutive step(s)"),
    )
    # One low step is only a figure; Degraded needs the loop's guard (fidelity.windowSteps steps).
    calm = compute_run_status(
        run,
        Observed(),
        NOW,
        fleet=fleet,
        pool=pool,
        problems=[],
        store_uri="s3://x",
        controller=dataclasses.replace(report, degraded=None),
    )
    assert find_condition(calm.conditions, "Degraded").status == "False"  # type: ignore[union-attr]
    status = compute_run_status(
        run, Observed(), NOW, fleet=fleet, pool=pool, problems=[], store_uri="s3://x", controller=report
    )
    training = find_condition(status.conditions, "Training")
    assert training is not None and (training.status, training.reason) == ("True", "Stepping")
    assert (status.step, status.policy_version, status.trials.total, status.trials.running) == (
        3,
        "v3",
        40,
        8,
    )
    assert [(c.reason.value, c.count) for c in status.trials.by_reason] == [
        ("agent_error", 6),
        ("completed", 30),
        ("sandbox_error", 4),
    ]
    assert status.metrics.reward_mean == 0.1235
    degraded = find_condition(status.conditions, "Degraded")
    assert degraded is not None and (degraded.status, degraded.reason) == ("True", "FidelityBelowThreshold")
    assert "3 consecutive step(s)" in degraded.message
    done = ControllerReport(
        has_progress=True, step=200, outcome=("Succeeded", "MaxSteps", "trained 200 steps")
    )
    ended = compute_run_status(
        run, Observed(), NOW, fleet=fleet, pool=pool, problems=[], store_uri="s3://x", controller=done
    )
    succeeded = find_condition(ended.conditions, "Succeeded")
    assert succeeded is not None and (succeeded.status, succeeded.reason) == ("True", "MaxStepsReached")
    assert ended.phase == "Succeeded" and ended.completion_time is not None
    failed_report = ControllerReport(outcome=("Failed", "InfraFailures", "step 4: 9 of 16 trials failed"))
    failed = compute_run_status(
        run,
        Observed(),
        NOW,
        fleet=fleet,
        pool=pool,
        problems=[],
        store_uri="s3://x",
        controller=failed_report,
    )
    assert (failed.phase, failed.reason) == ("Failed", "TooManyInfraFailures")
    assert failed.step == 0  # no progress reported: status keeps what it had


def test_store_and_task_set_uris_resolve_inside_the_operator(tmp_path: Path) -> None:
    settings = TrialSettings(pvc_root=str(tmp_path))
    with pytest.raises(StartProblem, match="no volume for PersistentVolumeClaim 'rl-store'"):
        resolve_uri("pvc://rl-store/runs/default/r", settings)
    (tmp_path / "rl-store").mkdir()
    assert resolve_uri("pvc://rl-store/runs/default/r", settings) == str(tmp_path / "rl-store/runs/default/r")
    assert resolve_uri("file:///var/lib/legorl/r", settings) == "/var/lib/legorl/r"
    assert resolve_uri("s3://bucket/r", settings) == "s3://bucket/r"


@pytest.mark.parametrize("loop_state", ["closed", "stopped"])
def test_api_calls_against_a_gone_loop_leave_no_coroutine_unawaited(loop_state: str) -> None:
    """The run controller's thread calls the API through the operator's event loop. When the loop has
    closed (the operator stopped) or no longer runs, the call fails with a BackendError and the coroutine
    it made is closed, never left to the garbage collector un-awaited (which surfaced as a
    `PytestUnraisableExceptionWarning` in whatever test ran next)."""
    import gc  # noqa: PLC0415
    import warnings  # noqa: PLC0415

    from legorl.controller.backend import BackendError  # noqa: PLC0415
    from legorl.operator.trials import LoopApi  # noqa: PLC0415

    loop = asyncio.new_event_loop()
    if loop_state == "closed":
        loop.close()
    settings = TrialSettings(api_timeout_seconds=0.2, api_retry_seconds=0.5)

    class Client:
        async def get(self, kind: str, namespace: str, name: str) -> None:
            return None

    api = LoopApi(loop, Client, settings)  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(BackendError):
            api.get("Pod", "ns", "p")
        if loop_state == "stopped":
            loop.close()
        gc.collect()
    never_awaited = [str(w.message) for w in caught if "was never awaited" in str(w.message)]
    assert never_awaited == []
