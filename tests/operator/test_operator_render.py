"""Renderers: every input manifest → the exact children the operator creates (golden files),
each child valid against the upstream Kubernetes schemas, and the properties that matter
(owner references, labels, hardening, the vLLM command line) checked directly.

Regenerate the golden files after an intended change with `LEGORL_UPDATE_GOLDEN=1 pytest
tests/operator/test_operator_render.py` and review the diff.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import kubernetes_validate
import pytest
import yaml

from legorl.api.common import StorageLocation
from legorl.api.fleet import WeightSync
from legorl.api.kinds import KINDS, Resource, RLRun, RolloutFleet, SandboxPool
from legorl.api.labels import HASH_ANNOTATION
from legorl.api.run import Harness
from legorl.api.store import RunStore, StoreLayout
from legorl.manifests.generated import to_yaml
from legorl.manifests.load import Document
from legorl.manifests.validate import validate_document
from legorl.operator.render.common import RenderContext, TrialTracing, label_value, owner_key
from legorl.operator.render.fleet import RenderError, render_fleet, vllm_args
from legorl.operator.render.pool import PROXY_UID, TrialContext, render_pool, trial_pod, verify_pod
from legorl.operator.render.run import MASTER_PORT, WEIGHT_SYNC_PORT, WeightSyncMethod, render_run
from legorl.operator.render.tree import PLACEHOLDER_UID, render_all
from legorl.operator.settings import OperatorSettings, SettingsError, from_environment

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parents[1] / "golden"
K8S_VERSION = "1.30"
"""The oldest Kubernetes the chart supports (Chart.yaml kubeVersion)."""

CASES: dict[str, tuple[Path, RenderContext]] = {
    "shared-fleet-and-pool": (REPO / "examples/shared-fleet-and-pool.yaml", RenderContext()),
    "gpu-swe-verified": (REPO / "examples/gpu-swe-verified.yaml", RenderContext()),
    "fleet-multinode-statefulsets": (GOLDEN / "inputs/fleet-multinode.yaml", RenderContext()),
    "fleet-multinode-lws": (GOLDEN / "inputs/fleet-multinode.yaml", RenderContext(lws_available=True)),
    "pool-warm-and-lookahead": (GOLDEN / "inputs/pool-warm.yaml", RenderContext()),
    "run-suspended": (GOLDEN / "inputs/run-suspended.yaml", RenderContext()),
}


def load(path: Path) -> list[Resource]:
    return [KINDS[d["kind"]].model_validate(d) for d in yaml.safe_load_all(path.read_text()) if d]


R = TypeVar("R", RolloutFleet, SandboxPool, RLRun)


def stored(res: R) -> R:
    """`res` as the API server would hand it to the operator (with a uid and namespace)."""
    body = res.to_wire()
    body["metadata"] = {"namespace": "default", **body["metadata"], "uid": PLACEHOLDER_UID}
    return type(res).model_validate(body)


def check_upstream(obj: dict[str, Any]) -> None:
    """Validate a child against the upstream schema (strict: unknown fields are errors)."""
    if obj["apiVersion"].startswith("legorl.dev/"):
        report = validate_document(Document(source="rendered", index=0, line=1, body=obj))
        assert report.ok, report.problems
    elif obj["kind"] == "LeaderWorkerSet":
        # Not a built-in kind, so no bundled schema: validate its pod templates, which is where
        # mistakes would be, as core/v1 PodTemplates.
        templates = obj["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            kubernetes_validate.validate(
                {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": "t"},
                    "template": templates[key],
                },
                K8S_VERSION,
                strict=True,
            )
        assert set(obj["spec"]) == {"replicas", "startupPolicy", "rolloutStrategy", "leaderWorkerTemplate"}
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str) -> None:
    path, ctx = CASES[case]
    rendered = render_all(load(path), ctx)
    text = "---\n".join(to_yaml(obj) for obj in rendered)
    golden = GOLDEN / f"{case}.yaml"
    if os.environ.get("LEGORL_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with LEGORL_UPDATE_GOLDEN=1 to create it"
    assert text == golden.read_text(), f"{case}: rendering changed; review and regenerate {golden.name}"
    for obj in rendered:
        check_upstream(obj)


@pytest.mark.parametrize("case", sorted(CASES))
def test_children_are_owned_labelled_and_hashed(case: str) -> None:
    path, ctx = CASES[case]
    for res in load(path):
        for obj in render_all([res], ctx):
            meta = obj["metadata"]
            (owner,) = meta["ownerReferences"]
            assert owner["controller"] is True and owner["blockOwnerDeletion"] is True
            assert owner["uid"] == PLACEHOLDER_UID
            labels = meta["labels"]
            assert labels["app.kubernetes.io/managed-by"] == "legorl-operator"
            assert labels["app.kubernetes.io/part-of"] == "legorl"
            assert labels["legorl.dev/owner"] == owner_key(owner["kind"], owner["name"])
            assert all(len(v) <= 63 for v in labels.values())
            assert len(meta["name"]) <= 63
            assert len(meta["annotations"][HASH_ANNOTATION]) == 16


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {})
    if obj["kind"] == "Pod":
        pod = spec
    elif obj["kind"] == "LeaderWorkerSet":
        pod = spec["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    elif "template" in spec:
        pod = spec["template"]["spec"]
    else:
        return []
    return [*pod.get("initContainers", []), *pod["containers"]]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_container_is_restricted(case: str) -> None:
    path, ctx = CASES[case]
    for obj in render_all(load(path), ctx):
        for container in containers(obj):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, container["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], container["name"]
            assert sc["runAsNonRoot"] is True, container["name"]
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, container["name"]
            assert sc["readOnlyRootFilesystem"] is True, container["name"]


def test_content_changes_change_the_hash_and_nothing_else_does() -> None:
    (fleet,) = load(GOLDEN / "inputs/fleet-multinode.yaml")
    assert isinstance(fleet, RolloutFleet)
    before = {(o["kind"], o["metadata"]["name"]): o for o in render_fleet(stored(fleet), RenderContext())}
    again = {(o["kind"], o["metadata"]["name"]): o for o in render_fleet(stored(fleet), RenderContext())}
    assert before == again
    bigger = fleet.model_copy(update={"spec": fleet.spec.model_copy(update={"max_unavailable": 2})})
    after = {(o["kind"], o["metadata"]["name"]): o for o in render_fleet(stored(bigger), RenderContext())}
    changed = {
        n for n in before if before[n]["metadata"]["annotations"] != after[n]["metadata"]["annotations"]
    }
    assert changed == {("PodDisruptionBudget", "big-fleet-engine")}  # the only child using maxUnavailable


def fleet_from(spec: dict[str, Any]) -> RolloutFleet:
    return stored(
        RolloutFleet.model_validate(
            {
                "kind": "RolloutFleet",
                "metadata": {"name": "f"},
                "spec": {"model": {"uri": "hf://org/m"}, **spec},
            }
        )
    )


def test_vllm_command_line_follows_the_spec() -> None:
    fleet = fleet_from(
        {
            "parallelism": {"gpusPerNode": 4, "tensorParallelSize": 4, "expertParallel": "Enabled"},
            "settings": {
                "dtype": "bfloat16",
                "maxModelLen": 32768,
                "maxNumSeqs": 64,
                "gpuMemoryUtilizationPercent": 85,
                "toolCallParser": "hermes",
            },
            "servedModelName": "coder",
        }
    )
    args = vllm_args(fleet, "org/m", [])
    joined = " ".join(args)
    for expected in (
        "--served-model-name coder",
        "--dtype bfloat16",
        "--tensor-parallel-size 4",
        "--pipeline-parallel-size 1",
        "--enable-expert-parallel",
        "--max-model-len 32768",
        "--max-num-seqs 64",
        "--gpu-memory-utilization 0.85",
        "--enable-prefix-caching",
        "--enable-return-routed-experts",
        "--enable-auto-tool-choice --tool-call-parser hermes",
        '--weight-transfer-config {"backend":"legorl_filesystem"}',
        "--worker-extension-cls legorl.trainer.engine.plugin.FilesystemWeightTransfer",
        "--middleware legorl.trainer.engine.versions.WeightVersions",
    ):
        assert expected in joined, expected
    assert "--distributed-executor-backend" not in joined
    off = fleet_from({"settings": {"routedExpertsCapture": "Disabled", "prefixCaching": "Disabled"}})
    joined = " ".join(vllm_args(off, "org/m", []))
    assert "--enable-return-routed-experts" not in joined
    assert "--no-enable-prefix-caching" in joined


@pytest.mark.parametrize(
    ("spec", "middleware"),
    [
        ({}, True),
        ({"settings": {"extraArgs": ["--api-server-count", "1"]}}, True),
        ({"settings": {"extraArgs": ["--api-server-count", "4"]}}, False),
        ({"settings": {"extraArgs": ["--api-server-count=2"]}}, False),
        ({"settings": {"extraArgs": ["-asc", "2"]}}, False),
        ({"weightSync": {"method": "NCCL"}}, False),
    ],
)
def test_the_versions_middleware_runs_where_it_can_be_exact(spec: dict[str, Any], middleware: bool) -> None:
    # It needs legorl in the engine image (only the Filesystem extension guarantees it) and one API server
    # process (each process sees only the weight swaps it served); elsewhere the proxies read /weight_info.
    joined = " ".join(vllm_args(fleet_from(spec), "org/m", []))
    assert ("--middleware legorl.trainer.engine.versions.WeightVersions" in joined) is middleware


def test_cpu_fleet_requests_no_gpus_and_sizes_its_kv_cache() -> None:
    fleet = fleet_from({"parallelism": {"gpusPerNode": 0}})
    deploy = next(o for o in render_fleet(fleet, RenderContext()) if o["kind"] == "Deployment")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in str(container.get("resources"))
    assert {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "4"} in container["env"]
    assert "--gpu-memory-utilization" not in container["args"]
    # Eager: vLLM's CPU build would compile kernels with a C++ compiler at start, which the engine image
    # lacks (the first CPU fleet on a real node died of it). Once, whether or not the user asked too.
    assert container["args"].count("--enforce-eager") == 1
    asked = fleet_from({"parallelism": {"gpusPerNode": 0}, "settings": {"extraArgs": ["--enforce-eager"]}})
    assert vllm_args(asked, "org/m", []).count("--enforce-eager") == 1
    assert "--enforce-eager" not in vllm_args(fleet_from({}), "org/m", [])


def test_gpu_fleet_requests_whole_gpus_and_keeps_user_resources() -> None:
    fleet = fleet_from(
        {
            "parallelism": {"gpusPerNode": 2, "tensorParallelSize": 2},
            "resources": {"limits": {"memory": "64Gi"}},
        }
    )
    deploy = next(o for o in render_fleet(fleet, RenderContext()) if o["kind"] == "Deployment")
    resources = deploy["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources == {
        "requests": {"nvidia.com/gpu": "2"},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": "2"},
    }


@pytest.mark.parametrize("uri", ["builtin://tiny-moe", "file:///models/m"])
def test_local_only_models_cannot_render(uri: str) -> None:
    fleet = stored(
        RolloutFleet.model_validate(
            {"kind": "RolloutFleet", "metadata": {"name": "f"}, "spec": {"model": {"uri": uri}}}
        )
    )
    with pytest.raises(
        RenderError, match=r"exist only in local runs \(`legorl run`\); on a cluster use hf://"
    ):
        render_fleet(fleet, RenderContext())


def test_model_sources_map_to_engine_arguments() -> None:
    pvc = fleet_from({})
    pvc = pvc.model_copy(
        update={
            "spec": pvc.spec.model_copy(
                update={"model": pvc.spec.model.model_copy(update={"uri": "pvc://models/qwen/v1"})}
            )
        }
    )
    deploy = next(o for o in render_fleet(pvc, RenderContext()) if o["kind"] == "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    assert pod["containers"][0]["args"][0] == "/models/models/qwen/v1"
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod[
        "volumes"
    ]
    s3 = pvc.model_copy(
        update={
            "spec": pvc.spec.model_copy(
                update={"model": pvc.spec.model.model_copy(update={"uri": "s3://bucket/qwen"})}
            )
        }
    )
    args = next(o for o in render_fleet(s3, RenderContext()) if o["kind"] == "Deployment")["spec"][
        "template"
    ]["spec"]["containers"][0]["args"]
    assert args[:3] == ["s3://bucket/qwen", "--load-format", "runai_streamer"]


def example_trial(**changes: Any) -> TrialContext:
    """Trial t-0001 of the example run `coder-grpo` (Claude Code, its fleet's in-cluster URL)."""
    base: dict[str, Any] = {
        "run_name": "coder-grpo",
        "trial_id": "t-0001",
        "task_image": "ghcr.io/example/astropy-12907:1",
        "harness": Harness(kind="ClaudeCode"),
        "fleet_url": "http://coder-fleet-engine.default.svc:8000",
    }
    return TrialContext(**{**base, **changes})


def test_traced_trial_proxies_export_to_the_collector_and_only_they_may_reach_it() -> None:
    (_, pool, run, _) = load(REPO / "examples/shared-fleet-and-pool.yaml")
    assert isinstance(pool, SandboxPool) and isinstance(run, RLRun)
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}}
    tracing = TrialTracing(
        endpoint="http://otel-collector.observability.svc:4318",
        peer=peer,
        sampler="parentbased_traceidratio",
        sampler_arg="0.1",
    )
    trial = example_trial()
    pod = trial_pod(stored(pool), trial, RenderContext(trial_tracing=tracing))
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    containers = {c["name"]: c for c in [*pod["spec"]["initContainers"], *pod["spec"]["containers"]]}
    env = {e["name"]: e["value"] for e in containers["proxy"]["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability.svc:4318"
    assert (env["OTEL_TRACES_SAMPLER"], env["OTEL_TRACES_SAMPLER_ARG"]) == ("parentbased_traceidratio", "0.1")
    assert not [e for e in containers["agent"].get("env", []) if e["name"].startswith("OTEL_")]

    # The run's trial egress policy admits the collector on the endpoint's port; untraced, it does not.
    def trial_egress(ctx: RenderContext) -> list[dict[str, Any]]:
        (policy,) = [
            o for o in render_run(stored(run), ctx, 8000) if o["metadata"]["name"] == "coder-grpo-trials"
        ]
        kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
        return list(policy["spec"]["egress"])

    traced, plain = trial_egress(RenderContext(trial_tracing=tracing)), trial_egress(RenderContext())
    assert traced[:-1] == plain and len(plain) == 1
    assert traced[-1] == {"to": [peer], "ports": [{"protocol": "TCP", "port": 4318}]}
    assert TrialTracing(endpoint="https://otlp.example.com", peer=peer).port == 443


def test_trial_tracing_settings_from_the_environment() -> None:
    peer = '{"podSelector": {"matchLabels": {"app": "otel-collector"}}}'
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "LEGORL_TRIAL_TRACING_PEER": peer}
    tracing = from_environment(OperatorSettings(), env).trial_tracing
    assert tracing is not None and tracing.endpoint == "http://collector:4318" and tracing.port == 4318
    assert (
        from_environment(OperatorSettings(), {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}).trial_tracing
        is None
    )
    for bad, message in (
        ({"LEGORL_TRIAL_TRACING_PEER": peer}, "OTEL_EXPORTER_OTLP_ENDPOINT is not"),
        ({**env, "LEGORL_TRIAL_TRACING_PEER": "{nope"}, "not JSON"),
        ({**env, "LEGORL_TRIAL_TRACING_PEER": '{"ports": [4318]}'}, "one NetworkPolicy peer"),
    ):
        with pytest.raises(SettingsError, match=message):
            from_environment(OperatorSettings(), bad)


def test_trial_pod_is_hardened_and_reaches_only_its_proxy() -> None:
    (_, pool, run, _) = load(REPO / "examples/shared-fleet-and-pool.yaml")
    assert isinstance(pool, SandboxPool) and isinstance(run, RLRun)
    trial = example_trial()
    pod = trial_pod(stored(pool), trial, RenderContext())
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    text = "---\n" + to_yaml(pod)
    golden = GOLDEN / "trial-pod.yaml"
    if os.environ.get("LEGORL_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    assert (
        spec["activeDeadlineSeconds"] == pool.spec.deadlines.setup_seconds + pool.spec.deadlines.agent_seconds
    )
    init = {c["name"]: c for c in spec["initContainers"]}
    assert list(init) == ["tools", "harness-runtime", "setup", "egress-lock", "proxy"]
    # The proxy is a native sidecar under its own UID; the egress lock lets only that UID out.
    assert init["proxy"]["restartPolicy"] == "Always"
    assert init["proxy"]["securityContext"]["runAsUser"] == PROXY_UID
    assert f"--allow-uid={PROXY_UID}" in init["egress-lock"]["args"]
    assert init["egress-lock"]["securityContext"]["capabilities"] == {
        "drop": ["ALL"],
        "add": ["NET_ADMIN", "NET_RAW", "SETUID", "SETGID"],
    }
    # Setup records the baseline the agent's changes are measured against; the agent cannot
    # reach it, the proxy reads it (and the workspace) read-only to serve GET /changes.
    mounts = {
        c["name"]: {m["name"]: m for m in c["volumeMounts"]} for c in [*init.values(), *spec["containers"]]
    }
    assert "baseline" in mounts["setup"] and not mounts["setup"]["baseline"].get("readOnly")
    assert "baseline" not in mounts["agent"]
    assert mounts["proxy"]["baseline"]["readOnly"] and mounts["proxy"]["workspace"]["readOnly"]
    assert "--baseline=/legorl-baseline/baseline.json" in init["setup"]["command"]
    (agent,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:4000"
    assert "--api-format=AnthropicMessages" in init["proxy"]["args"]
    assert agent["securityContext"]["runAsUser"] != PROXY_UID
    for container in [agent, *(c for n, c in init.items() if n != "egress-lock")]:
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # No egress lock when the pool turns it off (and the pool says so in its status).
    relaxed = stored(
        pool.model_copy(
            update={
                "spec": pool.spec.model_copy(
                    update={"defenses": pool.spec.defenses.model_copy(update={"egress": "Unrestricted"})}
                )
            }
        )
    )
    names = [c["name"] for c in trial_pod(relaxed, trial, RenderContext())["spec"]["initContainers"]]
    assert "egress-lock" not in names


def test_verify_pod_runs_the_pristine_image_without_proxy_or_network() -> None:
    (_, pool, _, _) = load(REPO / "examples/shared-fleet-and-pool.yaml")
    assert isinstance(pool, SandboxPool)
    trial = example_trial(
        task_config_map="coder-grpo-t-0001-task",
    )
    pod = verify_pod(stored(pool), trial, RenderContext(), changes_config_map="coder-grpo-t-0001-changes")
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    text = "---\n" + to_yaml(pod)
    golden = GOLDEN / "verify-pod.yaml"
    if os.environ.get("LEGORL_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()
    spec = pod["spec"]
    assert spec["activeDeadlineSeconds"] == pool.spec.deadlines.verify_seconds
    assert [c["name"] for c in spec["initContainers"]] == ["tools", "prepare"]
    prepare = spec["initContainers"][1]
    (verify,) = spec["containers"]
    assert verify["image"] == prepare["image"] == trial.task_image
    assert "--phase=prepare" in prepare["command"] and "--phase=run" in verify["command"]
    # The tree is built by one uid and tested by another: the tests cannot rewrite it.
    assert prepare["securityContext"]["runAsUser"] != verify["securityContext"]["runAsUser"]
    assert "changes" not in {m["name"] for m in verify["volumeMounts"]}
    for container in (prepare, verify):
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert container["securityContext"]["runAsNonRoot"] is True
    # Same pool labels as trial pods: the pool's deny-by-default NetworkPolicy selects it.
    policy = next(o for o in render_pool(stored(pool), RenderContext(), []) if o["kind"] == "NetworkPolicy")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    with_task = trial_pod(stored(pool), trial, RenderContext())
    setup = next(c for c in with_task["spec"]["initContainers"] if c["name"] == "setup")
    assert "--task-file=/legorl-task/task.json" in setup["command"]
    agent_env = {e["name"]: e.get("value") for e in with_task["spec"]["containers"][0]["env"]}
    assert agent_env["LEGORL_TASK_FILE"] == "/legorl-task/problem.md"
    no_task = TrialContext(
        run_name="r",
        trial_id="t",
        task_image="i:1",
        harness=Harness(kind="ClaudeCode"),
        fleet_url="http://f:8000",
    )
    with pytest.raises(RenderError, match="task ConfigMap"):
        verify_pod(stored(pool), no_task, RenderContext(), changes_config_map="c")


def test_sandbox_network_policies_allow_dns_and_the_runs_fleet_only() -> None:
    _, pool, run, _ = load(REPO / "examples/shared-fleet-and-pool.yaml")
    assert isinstance(pool, SandboxPool) and isinstance(run, RLRun)
    pool, run = stored(pool), stored(run)
    pool_np = next(o for o in render_pool(pool, RenderContext(), []) if o["kind"] == "NetworkPolicy")
    assert pool_np["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert pool_np["spec"]["ingress"] == []
    (dns,) = pool_np["spec"]["egress"]
    assert {p["port"] for p in dns["ports"]} == {53}
    run_np = next(
        o for o in render_run(run, RenderContext(), 8000) if o["metadata"]["name"] == "coder-grpo-trials"
    )
    (rule,) = run_np["spec"]["egress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert rule["to"][0]["podSelector"]["matchLabels"]["legorl.dev/owner"] == owner_key(
        "RolloutFleet", "coder-fleet"
    )
    assert run_np["spec"]["podSelector"]["matchLabels"] == {
        "legorl.dev/run": "coder-grpo",
        "legorl.dev/pool": label_value("python-repos"),
    }


def test_suspended_run_scales_what_it_owns_to_zero() -> None:
    (loaded,) = load(GOLDEN / "inputs/run-suspended.yaml")
    assert isinstance(loaded, RLRun)
    run = stored(loaded)
    children = {o["kind"]: o for o in render_run(run, RenderContext(), 8000)}
    assert children["Job"]["spec"]["suspend"] is True
    assert children["RolloutFleet"]["spec"]["replicas"] == 0
    assert children["SandboxPool"]["spec"]["replicas"] == 0
    job_env = {
        e["name"]: e.get("value") for e in children["Job"]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert job_env["LEGORL_STORE_URI"] == "file:///store/runs/research/paused-grpo"
    assert job_env["NNODES"] == "2" and job_env["NPROC_PER_NODE"] == "8"
    resumed = run.model_copy(update={"spec": run.spec.model_copy(update={"suspend": False})})
    children = {o["kind"]: o for o in render_run(resumed, RenderContext(), 8000)}
    assert children["Job"]["spec"]["suspend"] is False
    assert children["RolloutFleet"]["spec"]["replicas"] == 4


def test_nccl_weight_sync_opens_the_engines_to_trainers_on_any_port() -> None:
    def ingress(method: str) -> list[dict[str, Any]]:
        fleet = fleet_from({"weightSync": {"method": method}})
        policy = next(o for o in render_fleet(fleet, RenderContext()) if o["kind"] == "NetworkPolicy")
        rules: list[dict[str, Any]] = policy["spec"]["ingress"]
        return rules

    trainer = {"podSelector": {"matchLabels": {"legorl.dev/component": "trainer"}}}
    assert {"from": [trainer]} in ingress("NCCL")
    assert {"from": [trainer]} not in ingress("Filesystem")
    # The serving port is open to trials, trainers and the operator only (not warm sandboxes).
    serving = ingress("Filesystem")[0]
    components = [peer["podSelector"]["matchLabels"].get("legorl.dev/component") for peer in serving["from"]]
    assert components == ["trial", "trainer", None]


def run_from(path: Path, name: str, **trainer: Any) -> RLRun:
    """The RLRun `name` of an example, with `trainer.parallelism` fields changed."""
    (run,) = [r for r in load(path) if isinstance(r, RLRun) and r.metadata.name == name]
    par = run.spec.trainer.parallelism.model_copy(update=trainer)
    spec = run.spec.model_copy(update={"trainer": run.spec.trainer.model_copy(update={"parallelism": par})})
    return stored(run.model_copy(update={"spec": spec}))


def child(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def trainer_env(job: dict[str, Any]) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_trainer_job_runs_the_layouts_ranks_on_pods_that_resolve_each_other() -> None:
    # A CPU trainer of 4 gloo ranks in one pod.
    cpu = run_from(REPO / "examples/tiny-local.yaml", "tiny-local", processes_per_node=4, tensor=2)
    objects = render_run(cpu, RenderContext(), 8000)
    job = child(objects, "Job", "tiny-local-trainer")
    env = trainer_env(job)
    assert (env["NNODES"], env["NPROC_PER_NODE"]) == ("1", "4")
    assert "nvidia.com/gpu" not in str(job["spec"]["template"]["spec"]["containers"][0]["resources"])
    # Four GPU nodes of eight ranks each (one per GPU), rendezvous at index 0 through the headless Service.
    gpu = run_from(REPO / "examples/gpu-swe-verified.yaml", "qwen35-a3b-claude-swe")
    objects = render_run(gpu, RenderContext(), 8000)
    name = "qwen35-a3b-claude-swe-trainer"
    job, service = child(objects, "Job", name), child(objects, "Service", name)
    env = trainer_env(job)
    assert (env["NNODES"], env["NPROC_PER_NODE"]) == ("4", "8")
    assert (job["spec"]["completions"], job["spec"]["parallelism"]) == (4, 4)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (f"{name}-0.{name}", str(MASTER_PORT))
    pod = job["spec"]["template"]
    # An indexed Job's pods are named `<job>-<index>`: with `subdomain` = the Service, `<job>-0.<job>`
    # resolves, also before the pod is ready (no rank is ready before the rendezvous).
    assert (
        job["spec"]["completionMode"] == "Indexed" and pod["spec"]["subdomain"] == service["metadata"]["name"]
    )
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    for obj in objects:
        check_upstream(obj)


def test_nccl_weight_sync_gives_the_engines_the_writers_rendezvous() -> None:
    def writer(run: RLRun, **kwargs: Any) -> tuple[dict[str, str | None], list[Any], list[Any]]:
        objects = render_run(run, RenderContext(), 8000, **kwargs)
        name = f"{run.metadata.name}-trainer"
        job = child(objects, "Job", name)
        ports = job["spec"]["template"]["spec"]["containers"][0]["ports"]
        service_ports = child(objects, "Service", name)["spec"]["ports"]
        return trainer_env(job), [(p["name"], p["containerPort"]) for p in ports], service_ports

    # The inline fleet of the GPU example syncs over NCCL.
    env, ports, service_ports = writer(
        run_from(REPO / "examples/gpu-swe-verified.yaml", "qwen35-a3b-claude-swe")
    )
    name = "qwen35-a3b-claude-swe-trainer"
    assert env["LEGORL_WEIGHT_SYNC_ADDRESS"] == f"{name}-0.{name}.rl-research.svc"
    assert env["LEGORL_WEIGHT_SYNC_PORT"] == str(WEIGHT_SYNC_PORT)
    assert ports == [("rendezvous", MASTER_PORT), ("weight-sync", WEIGHT_SYNC_PORT)]
    assert {"name": "weight-sync", "port": WEIGHT_SYNC_PORT, "protocol": "TCP"} in service_ports
    # A referenced fleet: its method comes from the caller (the fleet object), Filesystem when not given.
    shared = run_from(REPO / "examples/shared-fleet-and-pool.yaml", "coder-grpo")
    env, ports, service_ports = writer(shared)
    assert "LEGORL_WEIGHT_SYNC_ADDRESS" not in env and ports == [("rendezvous", MASTER_PORT)]
    assert [p["name"] for p in service_ports] == ["rendezvous"]
    env, ports, _ = writer(shared, fleet_sync="NCCL")
    assert env["LEGORL_WEIGHT_SYNC_ADDRESS"] == "coder-grpo-trainer-0.coder-grpo-trainer.rl-research.svc"
    # `legorl render` reads it from the fleet given alongside.
    fleet, pool, train, _ = load(REPO / "examples/shared-fleet-and-pool.yaml")
    assert isinstance(fleet, RolloutFleet)
    nccl = fleet.model_copy(
        update={
            "spec": fleet.spec.model_copy(
                update={"weight_sync": fleet.spec.weight_sync.model_copy(update={"method": "NCCL"})}
            )
        }
    )
    rendered = render_all([train], RenderContext(), others=[nccl, pool])
    assert "LEGORL_WEIGHT_SYNC_PORT" in trainer_env(child(rendered, "Job", "coder-grpo-trainer"))


def engine_pod_specs(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every engine pod template's spec among rendered objects: a Deployment's, a LeaderWorkerSet's leader
    and worker, each StatefulSet group's."""
    specs = []
    for obj in objects:
        if obj["metadata"]["labels"].get("legorl.dev/component") != "engine":
            continue
        if obj["kind"] == "LeaderWorkerSet":
            templates = obj["spec"]["leaderWorkerTemplate"]
            specs += [templates["leaderTemplate"]["spec"], templates["workerTemplate"]["spec"]]
        elif obj["kind"] in ("Deployment", "StatefulSet"):
            specs.append(obj["spec"]["template"]["spec"])
    return specs


def store_of(pod: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(volume, its mount) of the run store (the volume named `store`) in a pod spec; None without one."""
    volumes = [v for v in pod["volumes"] if v["name"] == "store"]
    mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "store"]
    if not volumes and not mounts:
        return None
    ((volume,), (mount,)) = (volumes, mounts)
    return volume, mount


def test_filesystem_sync_mounts_the_run_store_in_every_engine_pod_where_the_trainer_publishes() -> None:
    (loaded,) = load(GOLDEN / "inputs/run-suspended.yaml")
    assert isinstance(loaded, RLRun)
    spec = loaded.spec.model_copy(update={"suspend": False, "store": StorageLocation(uri="pvc://runs/x")})
    assert spec.fleet is not None and spec.fleet.weight_sync.method == "Filesystem"
    assert spec.fleet.weight_sync.store_claim is None
    run = stored(loaded.model_copy(update={"spec": spec}))
    objects = render_all([run], RenderContext())
    # The run's own fleet names the store's claim; its engines mount it read-only at /store.
    fleet = child(objects, "RolloutFleet", "paused-grpo-fleet")
    assert fleet["spec"]["weightSync"]["storeClaim"] == "runs"
    (pod,) = engine_pod_specs(objects)
    engine_store = store_of(pod)
    assert engine_store == (
        {"name": "store", "persistentVolumeClaim": {"claimName": "runs", "readOnly": True}},
        {"name": "store", "mountPath": "/store", "readOnly": True},
    )
    assert engine_store is not None
    engine_mount = str(engine_store[1]["mountPath"])
    # The trainer mounts the same claim at the same path and writes the store there: every path it sends
    # the engines (weights/vN of its store) lies under their mount.
    job = child(objects, "Job", "paused-grpo-trainer")
    trainer_store = store_of(job["spec"]["template"]["spec"])
    assert trainer_store is not None
    volume, mount = trainer_store
    assert volume["persistentVolumeClaim"]["claimName"] == "runs" and mount["mountPath"] == "/store"
    store_uri = trainer_env(job)["LEGORL_STORE_URI"]
    assert store_uri == "file:///store/x/research/paused-grpo"
    sent = RunStore(store_uri).local_path(StoreLayout.weights("v1"))
    assert sent == Path("/store/x/research/paused-grpo/weights/v1")
    assert sent.is_relative_to(engine_mount)
    for obj in objects:
        check_upstream(obj)


def test_store_claim_reaches_leaders_and_workers_and_only_under_filesystem_sync() -> None:
    (loaded,) = load(GOLDEN / "inputs/fleet-multinode.yaml")
    assert isinstance(loaded, RolloutFleet) and loaded.spec.weight_sync.method == "NCCL"
    nccl = stored(loaded)

    def with_sync(**changes: Any) -> RolloutFleet:
        sync = nccl.spec.weight_sync.model_copy(update=changes)
        return stored(nccl.model_copy(update={"spec": nccl.spec.model_copy(update={"weight_sync": sync})}))

    filesystem = with_sync(method="Filesystem", store_claim="rl-store")
    for ctx in (RenderContext(), RenderContext(lws_available=True)):
        # A leader and a worker template (LeaderWorkerSet), or one template per group (StatefulSets).
        pods = engine_pod_specs(render_fleet(filesystem, ctx))
        assert len(pods) == 2
        for pod in pods:
            store = store_of(pod)
            assert store is not None
            assert store[0]["persistentVolumeClaim"] == {"claimName": "rl-store", "readOnly": True}
            assert store[1] == {"name": "store", "mountPath": "/store", "readOnly": True}
        # NCCL sends the weights over the wire: no store, even when a claim is named.
        for fleet in (nccl, with_sync(store_claim="rl-store")):
            assert [store_of(pod) for pod in engine_pod_specs(render_fleet(fleet, ctx))] == [None, None]
    # Without a claim a Filesystem fleet mounts nothing (preflight says what to set).
    assert (
        store_of(engine_pod_specs(render_fleet(with_sync(method="Filesystem"), RenderContext()))[0]) is None
    )


def test_an_inline_fleet_gets_its_store_claim_from_the_runs_pvc_store_only() -> None:
    (loaded,) = load(GOLDEN / "inputs/run-suspended.yaml")
    assert isinstance(loaded, RLRun) and loaded.spec.fleet is not None

    def owned_sync(ctx: RenderContext | None = None, **spec: Any) -> dict[str, Any]:
        run = stored(loaded.model_copy(update={"spec": loaded.spec.model_copy(update=spec)}))
        sync: dict[str, Any] = child(
            render_run(run, ctx or RenderContext(), 8000), "RolloutFleet", "paused-grpo-fleet"
        )["spec"]["weightSync"]
        return sync

    fleet = loaded.spec.fleet
    # No spec.store: the operator's default store, when it is a claim.
    assert (
        owned_sync(RenderContext(default_store_uri="pvc://shared/runs"), store=None)["storeClaim"] == "shared"
    )
    assert "storeClaim" not in owned_sync(RenderContext(default_store_uri="s3://b/runs"), store=None)
    assert "storeClaim" not in owned_sync(store=StorageLocation(uri="s3://b/runs"))
    # NCCL, an Evaluate run (no trainer publishes) and a claim the user named are left alone.
    nccl = fleet.model_copy(update={"weight_sync": fleet.weight_sync.model_copy(update={"method": "NCCL"})})
    assert "storeClaim" not in owned_sync(fleet=nccl)
    assert "storeClaim" not in owned_sync(mode="Evaluate")
    named = fleet.model_copy(
        update={"weight_sync": fleet.weight_sync.model_copy(update={"store_claim": "mine"})}
    )
    assert owned_sync(fleet=named)["storeClaim"] == "mine"


@dataclass(frozen=True)
class FakePod:
    namespace: str
    labels: Mapping[str, str]


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # what the renderers use
    return dict(selector.get("matchLabels", {})).items() <= labels.items()


def _peer_matches(peer: Mapping[str, Any], pod: FakePod, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        return False
    namespaces = peer.get("namespaceSelector")
    in_namespace = (
        pod.namespace == policy_namespace
        if namespaces is None
        else _selects(namespaces, {"kubernetes.io/metadata.name": pod.namespace})
    )
    return in_namespace and _selects(peer.get("podSelector", {}), pod.labels)


def _side_allows(
    policies: list[dict[str, Any]], pod: FakePod, peer: FakePod, *, port: int, protocol: str, direction: str
) -> bool:
    """NetworkPolicy semantics for one side: no policy of that direction selects `pod`, or a rule admits."""
    key, peers = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    applying = [
        p
        for p in policies
        if p["metadata"]["namespace"] == pod.namespace
        and direction in p["spec"]["policyTypes"]
        and _selects(p["spec"]["podSelector"], pod.labels)
    ]
    if not applying:
        return True
    return any(
        all(k in {"from", "to", "ports"} for k in rule)
        and any(_peer_matches(other, peer, p["metadata"]["namespace"]) for other in rule.get(peers, [{}]))
        and (
            not rule.get("ports")
            or any(
                q.get("protocol", "TCP") == protocol and q.get("port", port) == port for q in rule["ports"]
            )
        )
        for p in applying
        for rule in p["spec"].get(key, [])
    )


def reachable(
    policies: list[dict[str, Any]], src: FakePod, dst: FakePod, port: int, protocol: str = "TCP"
) -> bool:
    """Whether `src` may open a connection to `dst` on `port` (egress of src and ingress of dst)."""
    return _side_allows(
        policies, src, dst, port=port, protocol=protocol, direction="Egress"
    ) and _side_allows(policies, dst, src, port=port, protocol=protocol, direction="Ingress")


def network(
    path: Path, run_name: str, fleet_sync: WeightSyncMethod | None
) -> tuple[list[dict[str, Any]], dict[str, FakePod], int]:
    """Every NetworkPolicy rendered for an example (its referenced fleet's weight sync set to `fleet_sync`),
    the pods of its run by role, and the engines' serving port."""
    resources = load(path)
    if fleet_sync is not None:
        resources = [
            r.model_copy(
                update={"spec": r.spec.model_copy(update={"weight_sync": WeightSync(method=fleet_sync)})}
            )
            if isinstance(r, RolloutFleet)
            else r
            for r in resources
        ]
    ctx = RenderContext(operator_namespace="legorl-system")
    rendered = render_all(resources, ctx)
    policies = [o for o in rendered if o["kind"] == "NetworkPolicy"]
    for policy in policies:
        kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    (run,) = [r for r in resources if isinstance(r, RLRun) and r.metadata.name == run_name]
    ns = run.metadata.namespace or "default"
    (engines,) = [
        o for o in rendered if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-engine")
    ]
    (serving,) = [
        p for p in engines["spec"]["template"]["spec"]["containers"][0]["ports"] if p["name"] == "http"
    ]
    # The run's pool: its own (a child) or the one given alongside.
    (pool_body,) = [o for o in [*rendered, *(r.to_wire() for r in resources)] if o["kind"] == "SandboxPool"]
    pool = stored(SandboxPool.model_validate(pool_body))
    trial = trial_pod(pool, example_trial(run_name=run_name), ctx)
    trainer = child(rendered, "Job", f"{run_name}-trainer")["spec"]["template"]["metadata"]["labels"]
    operator = {  # the chart's operator pods
        "app.kubernetes.io/name": "legorl",
        "app.kubernetes.io/instance": "legorl",
        "app.kubernetes.io/component": "operator",
    }
    pods = {
        "trainer": FakePod(ns, trainer),
        "other-run-trainer": FakePod(
            ns, {**trainer, "legorl.dev/owner": "rlrun.other", "legorl.dev/run": "other"}
        ),
        "engine": FakePod(ns, engines["spec"]["template"]["metadata"]["labels"]),
        "trial": FakePod(ns, trial["metadata"]["labels"]),
        "operator": FakePod("legorl-system", operator),
        "stranger": FakePod(ns, {"app": "something-else"}),
    }
    return policies, pods, int(serving["containerPort"])


EPHEMERAL = 41234
"""A port NCCL or gloo would pick."""


@pytest.mark.parametrize(
    ("example", "run_name", "fleet_sync", "nccl"),
    [
        ("gpu-swe-verified.yaml", "qwen35-a3b-claude-swe", None, True),  # its inline fleet syncs over NCCL
        ("shared-fleet-and-pool.yaml", "coder-grpo", None, False),  # a referenced Filesystem fleet
        ("shared-fleet-and-pool.yaml", "coder-grpo", "NCCL", True),  # a referenced NCCL fleet
    ],
)
def test_network_policies_admit_exactly_the_training_traffic(
    example: str, run_name: str, fleet_sync: WeightSyncMethod | None, nccl: bool
) -> None:
    policies, pods, serving = network(REPO / "examples" / example, run_name, fleet_sync)

    def can(src: str, dst: str, port: int, protocol: str = "TCP") -> bool:
        return reachable(policies, pods[src], pods[dst], port, protocol)

    # The ranks of a run reach each other on any port (rendezvous, collectives); no one else reaches them,
    # another run's trainer included — except the run's engines under NCCL, on any TCP port.
    assert can("trainer", "trainer", MASTER_PORT) and can("trainer", "trainer", EPHEMERAL)
    assert can("trainer", "trainer", EPHEMERAL, "UDP")
    for stranger in ("other-run-trainer", "trial", "operator", "stranger"):
        for port in (MASTER_PORT, WEIGHT_SYNC_PORT, EPHEMERAL):
            assert not can(stranger, "trainer", port), (stranger, port)
    assert can("engine", "trainer", WEIGHT_SYNC_PORT) is nccl
    assert can("engine", "trainer", EPHEMERAL) is nccl
    assert not can("engine", "trainer", EPHEMERAL, "UDP")
    # The trainer reaches its engines' control routes always, and any port under NCCL.
    assert can("trainer", "engine", serving)
    assert can("trainer", "engine", EPHEMERAL) is nccl
    # As before: trials reach the serving port only, the operator it and the trial proxies, strangers neither.
    assert can("trial", "engine", serving) and not can("trial", "engine", EPHEMERAL)
    assert can("operator", "engine", serving) and can("operator", "trial", 4000)
    assert not can("stranger", "engine", serving) and not can("stranger", "trial", 4000)
    assert not can("trial", "trainer", WEIGHT_SYNC_PORT)
