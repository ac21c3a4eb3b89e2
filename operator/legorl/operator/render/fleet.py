"""RolloutFleet → vLLM workloads: the engine command line, a Deployment or one group per
replica (LeaderWorkerSet, else StatefulSets), a Service, a PodDisruptionBudget, a NetworkPolicy."""

from __future__ import annotations

import json
import shlex
from typing import Any

from legorl.api.fleet import (
    ENGINE_MIDDLEWARE,
    ENGINE_WORKER_EXTENSION,
    PLUGIN_WEIGHT_SYNC,
    WEIGHT_TRANSFER_BACKENDS,
)
from legorl.api.kinds import RolloutFleet
from legorl.api.labels import COMPONENT_LABEL, REPLICA_LABEL
from legorl.operator.render.common import (
    RESTRICTED_POD_SECURITY,
    STORE_MOUNT,
    RenderContext,
    env_list,
    headless_service,
    metadata,
    pod_placement,
    resources,
    restricted_container,
    selector_labels,
    service_account,
    with_hash,
)

APP = "vllm"
COMPONENT = "engine"
RAY_PORT = 6379
CACHE_DIR = "/cache"
MODELS_DIR = "/models"
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
STS_POD_INDEX = "apps.kubernetes.io/pod-index"


class RenderError(ValueError):
    """The spec cannot be rendered on a cluster; `message` says what to change at `path`."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def engine_name(fleet_name: str) -> str:
    """Name of the Deployment / LeaderWorkerSet / Service / PDB of a fleet."""
    return f"{fleet_name}-engine"


def model_location(fleet: RolloutFleet) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """(model argument, volumes, volume mounts, extra args) for the fleet's model URI."""
    uri = fleet.spec.model.uri
    scheme, _, rest = uri.partition("://")
    if scheme == "hf":
        extra = ["--revision", fleet.spec.model.revision] if fleet.spec.model.revision else []
        return rest, [], [], extra
    if scheme in {"s3", "gs"}:
        return uri, [], [], ["--load-format", "runai_streamer"]
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        mount = {"name": "model", "mountPath": f"{MODELS_DIR}/{claim}", "readOnly": True}
        return f"{MODELS_DIR}/{claim}/{path}".rstrip("/"), [volume], [mount], []
    raise RenderError(
        "spec.model.uri",
        f"{uri!r}: {scheme}:// models exist only in local runs (`legorl run`); "
        "on a cluster use hf://, s3://, gs:// or pvc://",
    )


def store_volume(fleet: RolloutFleet) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volume mounts) of the run store under Filesystem weight sync: `weightSync.storeClaim`,
    read-only at the path the trainer's pod mounts it at, where the weight paths the trainer sends lie.
    Nothing under NCCL (the weights come over the wire) or without a claim."""
    sync = fleet.spec.weight_sync
    if sync.method != "Filesystem" or sync.store_claim is None:
        return [], []
    volume = {"name": "store", "persistentVolumeClaim": {"claimName": sync.store_claim, "readOnly": True}}
    return [volume], [{"name": "store", "mountPath": STORE_MOUNT, "readOnly": True}]


def vllm_args(fleet: RolloutFleet, model_arg: str, extra: list[str]) -> list[str]:
    """The `vllm serve` arguments built from the spec."""
    spec = fleet.spec
    par, settings = spec.parallelism, spec.settings
    args = [
        model_arg,
        *extra,
        "--served-model-name",
        spec.served_model_name,
        "--host",
        "0.0.0.0",  # noqa: S104 - the pod IP; the NetworkPolicy limits who can connect
        "--port",
        str(spec.port),
        "--dtype",
        settings.dtype,
        "--tensor-parallel-size",
        str(par.tensor_parallel_size),
        "--pipeline-parallel-size",
        str(par.pipeline_parallel_size),
    ]
    if par.expert_parallel == "Enabled":
        args.append("--enable-expert-parallel")
    if par.nodes_per_replica > 1:
        args += ["--distributed-executor-backend", "ray"]
    if settings.max_model_len is not None:
        args += ["--max-model-len", str(settings.max_model_len)]
    if settings.max_num_seqs is not None:
        args += ["--max-num-seqs", str(settings.max_num_seqs)]
    if par.gpus_per_node > 0:
        args += ["--gpu-memory-utilization", f"{settings.gpu_memory_utilization_percent / 100:.2f}"]
    elif "--enforce-eager" not in settings.extra_args:
        # vLLM's CPU build compiles its kernels with a C++ compiler at start unless eager; the engine image
        # ships none ("InvalidCxxCompiler: No working C++ compiler found", seen on a real node).
        args.append("--enforce-eager")
    args.append(
        "--enable-prefix-caching" if settings.prefix_caching == "Enabled" else "--no-enable-prefix-caching"
    )
    if settings.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", settings.kv_cache_dtype]
    if settings.routed_experts_capture == "Enabled":
        args.append("--enable-return-routed-experts")
    if settings.tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", settings.tool_call_parser]
    # Behaviour log-probs of the distribution actually sampled from (after temperature), which is what
    # the trainer's importance weights and fidelity figures compare against; vLLM's default reports
    # the raw model's.
    args += ["--logprobs-mode", "processed_logprobs"]
    # Sampling defaults come from the run (through the proxy), never from the checkpoint's
    # generation_config.json (Qwen3's top_k 20 / top_p 0.95 would truncate the distribution the
    # trainer recomputes, biasing every importance weight).
    args += ["--generation-config", "vllm"]
    backend = WEIGHT_TRANSFER_BACKENDS[spec.weight_sync.method]
    args += ["--weight-transfer-config", json.dumps({"backend": backend}, separators=(",", ":"))]
    if spec.weight_sync.method in PLUGIN_WEIGHT_SYNC:
        # The backend, this extension and the middleware are legorl's engine plugin: the image must hold it
        # (legorl's engine image does: engine/Dockerfile). Several API server processes would each see only
        # the swaps they served: there the proxies read /weight_info.
        args += ["--worker-extension-cls", ENGINE_WORKER_EXTENSION]
        if not _several_api_servers(settings.extra_args):
            # Names the weight versions that served each answer: the proxies need no /weight_info per call.
            args += ["--middleware", ENGINE_MIDDLEWARE]
    return args + list(settings.extra_args)


def _several_api_servers(extra_args: list[str]) -> bool:
    """Whether `extra_args` asks vLLM for more than one API server process (`--api-server-count N`,
    `--api-server-count=N`, `-asc N`)."""
    for i, arg in enumerate(extra_args):
        name, eq, value = arg.partition("=")
        if name not in ("--api-server-count", "-asc"):
            continue
        if not eq:
            value = extra_args[i + 1] if i + 1 < len(extra_args) else ""
        return not value.isdigit() or int(value) != 1
    return False


def _engine_env(fleet: RolloutFleet) -> list[dict[str, Any]]:
    base = {
        # The RL control routes (/pause, /update_weights, ...) exist only in dev mode; the
        # fleet's NetworkPolicy keeps them to legorl's own pods.
        "VLLM_SERVER_DEV_MODE": "1",
        "HOME": CACHE_DIR,
        "HF_HOME": f"{CACHE_DIR}/huggingface",
        "VLLM_CACHE_ROOT": f"{CACHE_DIR}/vllm",
        "XDG_CACHE_HOME": CACHE_DIR,
        # The engine runs as a uid the image's /etc/passwd does not know; torch asks getpass for a
        # user name at import, which reads USER first instead of failing on getpwuid().
        "USER": "vllm",
        "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_DIR}/inductor",
        "TRITON_CACHE_DIR": f"{CACHE_DIR}/triton",
    }
    if fleet.spec.parallelism.gpus_per_node == 0:
        base["VLLM_CPU_KVCACHE_SPACE"] = "4"
    return env_list(fleet.spec.settings.env, base)


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _engine_container(fleet: RolloutFleet, role: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(container, volumes) for an engine pod; role is `single`, `leader` or `worker`."""
    spec = fleet.spec
    model_arg, volumes, mounts, extra = model_location(fleet)
    store_volumes, store_mounts = store_volume(fleet)
    volumes, mounts = volumes + store_volumes, mounts + store_mounts
    args = vllm_args(fleet, model_arg, extra)
    serve = shlex.join(["vllm", "serve", *args])
    if role == "single":
        command, container_args = ["vllm", "serve"], args
    elif role == "leader":
        command = ["/bin/bash", "-c"]
        container_args = [f"ray start --head --port={RAY_PORT} && exec {serve}"]
    else:
        command = ["/bin/bash", "-c"]
        # LeaderWorkerSet injects LWS_LEADER_ADDRESS; StatefulSet groups set LEADER_ADDRESS.
        container_args = [
            f'exec ray start --address="${{LEADER_ADDRESS:-$LWS_LEADER_ADDRESS}}:{RAY_PORT}" --block'
        ]
    container: dict[str, Any] = {
        "name": "vllm",
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.pull_policy,
        "command": command,
        "args": container_args,
        "env": _engine_env(fleet),
        "resources": resources(spec.resources, spec.parallelism.gpus_per_node),
        "securityContext": restricted_container(),
        "volumeMounts": [
            {"name": "cache", "mountPath": CACHE_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *mounts,
        ],
    }
    if spec.model.credentials_secret_ref is not None:
        container["envFrom"] = [{"secretRef": {"name": spec.model.credentials_secret_ref.name}}]
    if role != "worker":
        container["ports"] = [{"name": "http", "containerPort": spec.port, "protocol": "TCP"}]
        startup_failures = max(1, spec.startup_seconds // 10)
        container["startupProbe"] = _probe("/health", 10, startup_failures)
        container["readinessProbe"] = _probe("/health", 5, 3)
        container["livenessProbe"] = _probe("/health", 30, 3)
    volumes = [
        {"name": "cache", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        *volumes,
    ]
    return container, volumes


def _pod_template(
    fleet: RolloutFleet, role: str, extra_labels: dict[str, str] | None = None
) -> dict[str, Any]:
    container, volumes = _engine_container(fleet, role)
    meta = metadata(fleet, "", COMPONENT, APP)
    pod_labels = dict(meta["labels"])
    pod_labels.update(extra_labels or {})
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "securityContext": {**RESTRICTED_POD_SECURITY, "fsGroup": 65532},
        "terminationGracePeriodSeconds": 60,
        "containers": [container],
        "volumes": volumes,
    }
    spec.update(pod_placement(fleet.spec.placement, fleet.spec.identity, engine_name(fleet.metadata.name)))
    return {"metadata": {"labels": pod_labels}, "spec": spec}


def _deployment(fleet: RolloutFleet) -> dict[str, Any]:
    name = engine_name(fleet.metadata.name)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(fleet, name, COMPONENT, APP),
        "spec": {
            "replicas": fleet.spec.replicas,
            "selector": {"matchLabels": selector_labels(fleet, COMPONENT)},
            # GPUs are scarce: replace in place instead of surging extra replicas.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 0, "maxUnavailable": max(1, fleet.spec.max_unavailable)},
            },
            "progressDeadlineSeconds": fleet.spec.startup_seconds,
            "template": _pod_template(fleet, "single"),
        },
    }


def _leader_worker_set(fleet: RolloutFleet) -> dict[str, Any]:
    name = engine_name(fleet.metadata.name)
    worker = _pod_template(fleet, "worker")
    return {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": metadata(fleet, name, COMPONENT, APP),
        "spec": {
            "replicas": fleet.spec.replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {
                    "maxSurge": 0,
                    "maxUnavailable": max(1, fleet.spec.max_unavailable),
                },
            },
            "leaderWorkerTemplate": {
                "size": fleet.spec.parallelism.nodes_per_replica,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": _pod_template(fleet, "leader"),
                "workerTemplate": worker,
            },
        },
    }


def group_name(fleet_name: str, index: int) -> str:
    """StatefulSet of replica `index` when LeaderWorkerSet is not installed."""
    return f"{engine_name(fleet_name)}-{index}"


def _stateful_groups(fleet: RolloutFleet) -> list[dict[str, Any]]:
    """One StatefulSet per replica: ordinal 0 leads (Ray head + vllm serve), the rest join it."""
    out = []
    headless = f"{engine_name(fleet.metadata.name)}-hl"
    for index in range(fleet.spec.replicas):
        name = group_name(fleet.metadata.name, index)
        group = {REPLICA_LABEL: str(index)}
        leader = _pod_template(fleet, "leader", group)
        worker = _pod_template(fleet, "worker", group)["spec"]["containers"][0]
        leader_container = leader["spec"]["containers"][0]
        # One template for every ordinal: the shell picks the role from the pod index.
        leader_container["command"] = ["/bin/bash", "-c"]
        leader_container["args"] = [
            f'if [ "$POD_INDEX" = "0" ]; then {leader_container["args"][0]}; else {worker["args"][0]}; fi'
        ]
        leader_container["env"] += [
            {
                "name": "POD_INDEX",
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{STS_POD_INDEX}']"}},
            },
            {"name": "LEADER_ADDRESS", "value": f"{name}-0.{headless}"},
        ]
        # Workers run no HTTP server; only the leader's /health says whether the group serves.
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            leader_container[probe] = {
                "exec": {
                    "command": [
                        "/bin/bash",
                        "-c",
                        f'[ "$POD_INDEX" != "0" ] || curl -sf http://127.0.0.1:{fleet.spec.port}/health',
                    ]
                },
                **{k: v for k, v in leader_container[probe].items() if k != "httpGet"},
            }
        out.append(
            {
                "apiVersion": "apps/v1",
                "kind": "StatefulSet",
                "metadata": metadata(fleet, name, COMPONENT, APP),
                "spec": {
                    "replicas": fleet.spec.parallelism.nodes_per_replica,
                    "serviceName": headless,
                    "podManagementPolicy": "Parallel",
                    "selector": {"matchLabels": {**selector_labels(fleet, COMPONENT), **group}},
                    "template": leader,
                },
            }
        )
    return out


def _service(fleet: RolloutFleet, multi_node: bool, lws: bool) -> dict[str, Any]:
    selector = dict(selector_labels(fleet, COMPONENT))
    if multi_node:
        selector[LWS_WORKER_INDEX if lws else STS_POD_INDEX] = "0"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(fleet, engine_name(fleet.metadata.name), COMPONENT, APP),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            # A harness's turns share a prefix: keep a client on one replica for prefix-cache hits.
            "sessionAffinity": "ClientIP",
            "ports": [{"name": "http", "port": fleet.spec.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def replicas_name(fleet_name: str) -> str:
    """Headless Service whose addresses are the fleet's serving pods, one per replica (weight sync)."""
    return f"{engine_name(fleet_name)}-replicas"


def _replicas_service(fleet: RolloutFleet, multi_node: bool, lws: bool) -> dict[str, Any]:
    """Every ready replica's serving pod as one address of a DNS name: the trainer looks it up at each weight
    sync and loads the new weights into every replica (the ClusterIP Service would reach only one)."""
    service = _service(fleet, multi_node, lws)
    service["metadata"] = metadata(fleet, replicas_name(fleet.metadata.name), COMPONENT, APP)
    spec = service["spec"]
    spec.pop("sessionAffinity")
    spec.update(type="ClusterIP", clusterIP="None", publishNotReadyAddresses=False)
    return service


def _headless_service(fleet: RolloutFleet) -> dict[str, Any]:
    name = f"{engine_name(fleet.metadata.name)}-hl"
    return headless_service(fleet, name, COMPONENT, APP, ("ray", RAY_PORT))


def _pdb(fleet: RolloutFleet) -> dict[str, Any]:
    pods = max(1, fleet.spec.max_unavailable) * fleet.spec.parallelism.nodes_per_replica
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(fleet, engine_name(fleet.metadata.name), COMPONENT, APP),
        "spec": {
            "maxUnavailable": pods,
            "selector": {"matchLabels": selector_labels(fleet, COMPONENT)},
        },
    }


def _network_policy(fleet: RolloutFleet) -> dict[str, Any]:
    """Only legorl's own pods in the namespace reach the engines (the control routes are open)."""
    engine = selector_labels(fleet, COMPONENT)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(fleet, engine_name(fleet.metadata.name), COMPONENT, APP),
        "spec": {
            "podSelector": {"matchLabels": engine},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    # Trials (through their proxy), trainers (weight sync) and the operator (the run
                    # controller) reach the serving port; warm sandboxes and other pods do not.
                    "from": [
                        {"podSelector": {"matchLabels": {COMPONENT_LABEL: "trial"}}},
                        {"podSelector": {"matchLabels": {COMPONENT_LABEL: "trainer"}}},
                        {
                            "podSelector": {
                                "matchLabels": {
                                    "app.kubernetes.io/name": "legorl",
                                    "app.kubernetes.io/component": "operator",
                                }
                            },
                            "namespaceSelector": {},
                        },
                    ],
                    "ports": [{"protocol": "TCP", "port": fleet.spec.port}],
                },
                # Members of a multi-node group talk among themselves on any port (Ray, NCCL).
                {"from": [{"podSelector": {"matchLabels": engine}}]},
                *(
                    # NCCL weight transfer opens connections from the trainer on ephemeral ports.
                    [{"from": [{"podSelector": {"matchLabels": {COMPONENT_LABEL: "trainer"}}}]}]
                    if fleet.spec.weight_sync.method == "NCCL"
                    else []
                ),
            ],
        },
    }


def _service_account(fleet: RolloutFleet) -> dict[str, Any]:
    return service_account(fleet, engine_name(fleet.metadata.name), COMPONENT, APP)


def render_fleet(fleet: RolloutFleet, ctx: RenderContext) -> list[dict[str, Any]]:
    """Every child object of a RolloutFleet, each stamped with its desired-state hash."""
    multi_node = fleet.spec.parallelism.nodes_per_replica > 1
    objects: list[dict[str, Any]] = []
    if fleet.spec.identity.service_account_name is None:
        objects.append(_service_account(fleet))
    if not multi_node:
        objects.append(_deployment(fleet))
    elif ctx.lws_available:
        objects.append(_leader_worker_set(fleet))
    else:
        objects.append(_headless_service(fleet))
        objects += _stateful_groups(fleet)
    objects += [
        _service(fleet, multi_node, ctx.lws_available),
        _replicas_service(fleet, multi_node, ctx.lws_available),
        _pdb(fleet),
        _network_policy(fleet),
    ]
    return [with_hash(obj) for obj in objects]


def engine_selector(fleet: RolloutFleet) -> dict[str, str]:
    """Labels of the fleet's engine pods (status.selector; the scale subresource's HPA target)."""
    return selector_labels(fleet, COMPONENT)
