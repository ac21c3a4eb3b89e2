"""SandboxPool → image pre-pull DaemonSets, warm sandboxes, a deny-by-default NetworkPolicy,
and the trial pod template the run controller starts trials from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from legorl.api.kinds import SandboxPool
from legorl.api.labels import (
    CHUNK_LABEL,
    IMAGES_ANNOTATION,
    LOOKAHEAD_ANNOTATION,
    POOL_LABEL,
    RUN_LABEL,
    TRIAL_LABEL,
)
from legorl.api.run import Harness
from legorl.operator.render.common import (
    RESTRICTED_POD_SECURITY,
    RenderContext,
    env_list,
    label_value,
    labels,
    metadata,
    pod_placement,
    resources,
    restricted_container,
    selector_labels,
    service_account,
    short_hash,
    with_hash,
)
from legorl.operator.render.fleet import RenderError
from legorl.trialproxy.command import ProxyRun, ProxyTrial, proxy_command

APP = "legorl-sandbox"
PREPULL = "prepull"
WARM = "warm-sandbox"
VERIFY = "verify"
TRIAL = "trial"
AGENT_UID = 65532
VERIFY_PREPARE_UID = 65531
PROXY_UID = 65533
"""The proxy runs as its own user: the egress lock lets only this UID open non-loopback sockets."""
PROXY_PORT = 4000
TRIAL_GRACE_SECONDS = 10
"""A trial pod's terminationGracePeriodSeconds."""
PROXY_DRAIN_SECONDS = 8
"""How long a deleted trial pod's proxy goes on serving the journal for the controller to read (SIGTERM
reaches every container at once; within the grace period)."""
TOOLS_DIR = "/legorl"
HARNESS_DIR = "/opt/legorl-harness"
STAGED_WORKSPACE = "/staged-workspace"
TASK_DIR = "/legorl-task"
"""A trial's task ConfigMap (`task.json`: the manifest row; `problem.md`: what the agent reads)."""
BASELINE_DIR = "/legorl-baseline"
"""Setup records the staged files here; only setup (rw) and the proxy (ro) mount it, never the
agent, so the agent's changes are measured against a record it cannot edit."""
BASELINE = f"{BASELINE_DIR}/baseline.json"
PROXY_WORKSPACE = "/workspace"
"""Where the proxy sees the agent's workspace, read-only, to serve `GET /changes`."""
CHANGES_DIR = "/legorl-changes"
CLAIM_DIR = "/legorl-claim"
"""A warm trial pod's gate: the proxy mounts it read-write and makes the FIFO there, the agent read-only."""
CLAIM_FIFO = f"{CLAIM_DIR}/go"
GATE_SCRIPT = (
    f'gate={CLAIM_FIFO}; while [ ! -p "$gate" ]; do sleep 1; done; '
    'IFS= read -r go < "$gate" || go=; '
    '[ "$go" = go ] || { echo "legorl: the warm trial pod\'s gate closed without a claim" >&2; exit 125; }; '
    'exec "$@"'
)
"""A warm trial pod's agent container runs `/bin/sh -c GATE_SCRIPT legorl-gate <the agent's command>`:
it waits in `read` on the proxy's FIFO (no poll: opening a FIFO blocks until its writer comes) and, on
the proxy's `go` (the operator claimed the pod: `legorl.proxy.gate`), becomes the agent's command."""
PULL_COMMAND = ["/bin/sh", "-c", "exit 0"]
"""What a pre-pull init container runs: nothing; the kubelet pulled the image to start it.
Task images must carry /bin/sh (every SWE-bench-style image does)."""


def sandbox_account(pool_name: str) -> str:
    """The permissionless ServiceAccount trial pods run as when the pool names none."""
    return f"{pool_name}-sandbox"


def lookahead_images(pool: SandboxPool) -> list[str]:
    """Images the run controller named for the next tasks (pool annotation, JSON list)."""
    raw = (pool.metadata.annotations or {}).get(LOOKAHEAD_ANNOTATION)
    if not raw:
        return []
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return []
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def operator_reads_task_set(pool: SandboxPool) -> bool:
    """Whether the operator itself reads the task set's image list (a `configmap://` manifest).

    Object stores and volumes are read by the run controller, which holds their credentials and
    names the images through the lookahead annotation.
    """
    source = pool.spec.source.task_set
    return source is None or source.uri.startswith("configmap://")


def desired_images(pool: SandboxPool, task_set_images: list[str]) -> list[str]:
    """Distinct images to cache on every matching node, in a stable order.

    `All`: the listed images, the task set's (when the operator reads it) and every image the run
    controller named in the annotation; `Lookahead`: the first `lookahead` named images.
    """
    policy = pool.spec.pre_pull.policy
    if policy == "Never":
        return []
    if policy == "Lookahead":
        wanted = lookahead_images(pool)[: pool.spec.pre_pull.lookahead or 0]
    else:
        wanted = [*pool.spec.source.images, *task_set_images, *lookahead_images(pool)]
    return list(dict.fromkeys(wanted))


def prepull_name(pool_name: str, chunk: int) -> str:
    return f"{pool_name}-prepull-{chunk}"


def _tiny_resources() -> dict[str, Any]:
    return {"requests": {"cpu": "1m", "memory": "8Mi"}, "limits": {"cpu": "100m", "memory": "64Mi"}}


def _prepull_daemon_set(pool: SandboxPool, chunk: int, images: list[str]) -> dict[str, Any]:
    component = PREPULL
    name = prepull_name(pool.metadata.name, chunk)
    images_note = {IMAGES_ANNOTATION: json.dumps(images, separators=(",", ":"))}
    chunk_selector = {**selector_labels(pool, component), CHUNK_LABEL: str(chunk)}
    pod_labels = {**labels(pool, component, "legorl-prepull"), CHUNK_LABEL: str(chunk)}
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": RESTRICTED_POD_SECURITY,
        "terminationGracePeriodSeconds": 1,
        "initContainers": [
            {
                "name": f"pull-{i}",
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                "command": PULL_COMMAND,
                "resources": _tiny_resources(),
                "securityContext": restricted_container(),
            }
            for i, image in enumerate(images)
        ],
        "containers": [
            {
                "name": "pause",
                "image": pool.spec.pre_pull.pause_image,
                "imagePullPolicy": "IfNotPresent",
                "resources": _tiny_resources(),
                "securityContext": restricted_container(),
            }
        ],
    }
    spec.update(pod_placement(pool.spec.placement, pool.spec.identity, sandbox_account(pool.metadata.name)))
    spec.pop("priorityClassName", None)  # caching is background work; never preempt for it
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {**metadata(pool, name, component, "legorl-prepull"), "annotations": dict(images_note)},
        "spec": {
            "selector": {"matchLabels": chunk_selector},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "50%"}},
            # Each pod carries the list it pulls: a pod of an older template is judged by its own.
            "template": {"metadata": {"labels": pod_labels, "annotations": images_note}, "spec": spec},
        },
    }


@dataclass(frozen=True)
class TrialContext:
    """What a trial pod needs beyond the pool: who runs, against which fleet, on which task."""

    run_name: str
    trial_id: str
    task_image: str
    harness: Harness
    fleet_url: str
    """Base URL of the fleet's Service, e.g. `http://coder-fleet-engine.ns.svc:8000`."""
    served_model_name: str = "policy"
    max_tokens_per_turn: int = 4096
    temperature: str | None = None
    """RLRun `spec.sampling.temperature`; the proxy enforces it over the harness's."""
    top_p: str | None = None
    capture_routed_experts: bool = False
    """The fleet returns routed experts (MoE routing replay)."""
    store_uri: str = ""
    task_config_map: str | None = None
    """ConfigMap with the task's `task.json` and `problem.md` (the run controller creates it);
    setup then knows the hidden tests to remove, and the agent reads `problem.md`."""
    warm: bool = False
    """Made ready ahead: the agent waits at the gate until the operator claims the pod."""


def harness_image(harness: Harness, ctx: RenderContext) -> str:
    """The image the harness runtime is copied from: the spec's, else legorl's for that kind."""
    if harness.image is not None:
        return harness.image.image
    if harness.kind not in ctx.images.harness:
        raise RenderError("spec.harness.image", f"kind {harness.kind} needs harness.image")
    return ctx.images.harness[harness.kind]


def _proxy_sidecar(trial: TrialContext, ctx: RenderContext) -> dict[str, Any]:
    command = proxy_command(
        ProxyRun(
            name=trial.run_name,
            harness=trial.harness,
            max_tokens=trial.max_tokens_per_turn,
            temperature=trial.temperature,
            top_p=trial.top_p,
        ),
        ProxyTrial(
            trial=trial.trial_id,
            upstream=trial.fleet_url,
            journal="/journal",
            # On all pod addresses so the kubelet's startup probe (dialled from the node) reaches
            # it; the pool's NetworkPolicy admits no other pod, and the agent uses loopback.
            listen=f"0.0.0.0:{PROXY_PORT}",
            served_model_name=trial.served_model_name,
            capture_routed_experts=trial.capture_routed_experts,
            workspace=PROXY_WORKSPACE,
            baseline=BASELINE,
            store_uri=trial.store_uri or None,
            drain_seconds=PROXY_DRAIN_SECONDS,
            claim_fifo=CLAIM_FIFO if trial.warm else None,
        ),
    )
    return {
        "name": "proxy",
        "image": ctx.images.proxy,
        # A native sidecar: it starts before the agent and stops when the agent is done.
        "restartPolicy": "Always",
        "args": command.args,
        "env": [
            *({"name": name, "value": value} for name, value in command.env.items()),
            # Its spans (one per model call; the engine's hang under them through `traceparent`).
            *(ctx.trial_tracing.env() if ctx.trial_tracing is not None else []),
        ],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": restricted_container(user=PROXY_UID),
        "startupProbe": {
            "tcpSocket": {"port": PROXY_PORT},
            "periodSeconds": 1,
            "failureThreshold": 30,
        },
        "volumeMounts": [
            {"name": "journal", "mountPath": "/journal"},
            {"name": "workspace", "mountPath": PROXY_WORKSPACE, "readOnly": True},
            {"name": "baseline", "mountPath": BASELINE_DIR, "readOnly": True},
            *([{"name": "claim", "mountPath": CLAIM_DIR}] if trial.warm else []),
        ],
    }


def trial_pod(pool: SandboxPool, trial: TrialContext, ctx: RenderContext) -> dict[str, Any]:
    """The pod of one trial (stages 1–2 of DESIGN §4); the run controller creates it."""
    spec = pool.spec
    workspace = spec.workspace.path
    deadline = spec.deadlines.setup_seconds + spec.deadlines.agent_seconds
    name = f"{trial.run_name}-{trial.trial_id}"
    pod_labels = {
        **labels(pool, TRIAL, APP),
        RUN_LABEL: label_value(trial.run_name),
        TRIAL_LABEL: label_value(trial.trial_id),
    }
    harness = trial.harness
    base_env = {
        "HOME": "/home/agent",
        "TMPDIR": "/tmp",
        "OPENAI_BASE_URL": f"http://127.0.0.1:{PROXY_PORT}/v1",
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{PROXY_PORT}",
        # Harnesses insist on a key; the proxy ignores it, and the real engine needs none.
        "OPENAI_API_KEY": "legorl-proxy",
        "ANTHROPIC_API_KEY": "legorl-proxy",
        "LEGORL_MODEL_NAME": harness.model_name or trial.served_model_name,
        "LEGORL_MAX_TURNS": str(harness.max_turns),
        "LEGORL_WORKSPACE": workspace,
    }
    setup_args = [
        f"{TOOLS_DIR}/bin/legorl-sandbox",
        "setup",
        f"--workspace={workspace}",
        f"--into={STAGED_WORKSPACE}",
        f"--baseline={BASELINE}",
        f"--git-history={spec.defenses.git_history}",
        f"--egress={spec.defenses.egress}",
        f"--proxy-uid={PROXY_UID}",
    ]
    if trial.task_config_map:
        setup_args.append(f"--task-file={TASK_DIR}/task.json")
        base_env["LEGORL_TASK_FILE"] = f"{TASK_DIR}/problem.md"
    init_containers: list[dict[str, Any]] = [
        _tools_init(ctx),
        {
            "name": "harness-runtime",
            "image": harness_image(harness, ctx),
            "args": ["install", f"--into={HARNESS_DIR}"],
            "securityContext": restricted_container(user=AGENT_UID),
            "volumeMounts": [{"name": "harness", "mountPath": HARNESS_DIR}],
        },
        {
            "name": "setup",
            "image": trial.task_image,
            "command": setup_args,
            "securityContext": restricted_container(user=AGENT_UID),
            "volumeMounts": [
                {"name": "tools", "mountPath": TOOLS_DIR, "readOnly": True},
                {"name": "workspace", "mountPath": STAGED_WORKSPACE},
                {"name": "baseline", "mountPath": BASELINE_DIR},
                {"name": "tmp", "mountPath": "/tmp"},
                *_task_mount(trial),
            ],
        },
    ]
    if spec.defenses.egress == "ProxyOnly":
        # The one step that is not `restricted`: installing the UID-owner egress rule needs
        # NET_ADMIN for a moment, as a service mesh's init container does. It exits before any
        # untrusted code runs; the agent and the proxy keep no capabilities.
        init_containers.append(
            {
                "name": "egress-lock",
                "image": ctx.images.sandbox_init,
                "args": ["egress-lock", f"--allow-uid={PROXY_UID}", f"--deny-uid={AGENT_UID}", "--self-test"],
                # Legacy iptables takes a lock file under /run, which is read-only here.
                "env": [{"name": "XTABLES_LOCKFILE", "value": "/tmp/xtables.lock"}],
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    # SETUID/SETGID: the self-test connects as the agent's uid to prove it is refused.
                    "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW", "SETUID", "SETGID"]},
                    "readOnlyRootFilesystem": True,
                    "runAsNonRoot": False,
                    "runAsUser": 0,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
            }
        )
    init_containers.append(_proxy_sidecar(trial, ctx))
    command = harness.command or [f"{HARNESS_DIR}/bin/legorl-harness", harness.kind]
    if trial.warm:
        command = ["/bin/sh", "-c", GATE_SCRIPT, "legorl-gate", *command]
    agent: dict[str, Any] = {
        "name": "agent",
        "image": trial.task_image,
        "command": command,
        "workingDir": workspace,
        "env": env_list(harness.env, base_env),
        "resources": resources(spec.resources),
        "securityContext": restricted_container(user=AGENT_UID),
        "volumeMounts": [
            {"name": "workspace", "mountPath": workspace},
            {"name": "harness", "mountPath": HARNESS_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "home", "mountPath": "/home/agent"},
            *_task_mount(trial),
            *([{"name": "claim", "mountPath": CLAIM_DIR, "readOnly": True}] if trial.warm else []),
        ],
    }
    if harness.config_map_ref is not None:
        agent["volumeMounts"].append(
            {"name": "harness-config", "mountPath": "/etc/legorl/harness", "readOnly": True}
        )
    volumes: list[dict[str, Any]] = [
        {"name": "tools", "emptyDir": {}},
        {"name": "harness", "emptyDir": {}},
        {"name": "workspace", "emptyDir": {"sizeLimit": str(spec.workspace.size_limit)}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "2Gi"}},
        {"name": "home", "emptyDir": {"sizeLimit": "1Gi"}},
        {"name": "journal", "emptyDir": {"sizeLimit": "1Gi"}},
        {"name": "baseline", "emptyDir": {"sizeLimit": "256Mi"}},
        *_task_volume(trial),
        *([{"name": "claim", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}] if trial.warm else []),
    ]
    if harness.config_map_ref is not None:
        volumes.append({"name": "harness-config", "configMap": {"name": harness.config_map_ref.name}})
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "activeDeadlineSeconds": deadline,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {**RESTRICTED_POD_SECURITY, "fsGroup": AGENT_UID},
        "terminationGracePeriodSeconds": TRIAL_GRACE_SECONDS,
        "initContainers": init_containers,
        "containers": [agent],
        "volumes": volumes,
    }
    if spec.runtime_class_name:
        pod_spec["runtimeClassName"] = spec.runtime_class_name
    pod_spec.update(pod_placement(spec.placement, spec.identity, sandbox_account(pool.metadata.name)))
    meta = metadata(pool, name, TRIAL, APP)
    meta["labels"] = pod_labels
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def _tools_init(ctx: RenderContext) -> dict[str, Any]:
    """Init container copying `legorl-sandbox` (and its interpreter) into the `tools` volume."""
    return {
        "name": "tools",
        "image": ctx.images.sandbox_init,
        "args": ["install", f"--into={TOOLS_DIR}"],
        "securityContext": restricted_container(user=AGENT_UID),
        "volumeMounts": [{"name": "tools", "mountPath": TOOLS_DIR}],
    }


def _task_mount(trial: TrialContext) -> list[dict[str, Any]]:
    return [{"name": "task", "mountPath": TASK_DIR, "readOnly": True}] if trial.task_config_map else []


def _task_volume(trial: TrialContext) -> list[dict[str, Any]]:
    return [{"name": "task", "configMap": {"name": trial.task_config_map}}] if trial.task_config_map else []


def verify_pod(
    pool: SandboxPool, trial: TrialContext, ctx: RenderContext, *, changes_config_map: str
) -> dict[str, Any]:
    """Stage 3 of a trial: a fresh pod from the pristine task image, where the agent never was.

    It applies the agent's sanitized changes (the run controller puts the proxy's `GET /changes`
    into `changes_config_map`), restores the hidden tests and runs them; the reward is in the
    container's termination message (and its log). No proxy, no egress: the pool's NetworkPolicy
    admits nothing but DNS."""
    if not trial.task_config_map:
        raise RenderError("task", "a verify pod needs the trial's task ConfigMap (task.json)")
    spec = pool.spec
    workspace = spec.workspace.path
    pod_labels = {
        **labels(pool, VERIFY, APP),
        RUN_LABEL: label_value(trial.run_name),
        TRIAL_LABEL: label_value(trial.trial_id),
    }

    def verify_args(phase: str) -> list[str]:
        return [
            f"{TOOLS_DIR}/bin/legorl-sandbox",
            "verify",
            f"--phase={phase}",
            f"--task-file={TASK_DIR}/task.json",
            *([f"--changes={CHANGES_DIR}/changes.json"] if phase == "prepare" else []),
            f"--workspace={workspace}",
            "--into=/verify/repo",
            "--out=/verify/out",
        ]

    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "activeDeadlineSeconds": spec.deadlines.verify_seconds,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {**RESTRICTED_POD_SECURITY, "fsGroup": AGENT_UID},
        "terminationGracePeriodSeconds": 10,
        "initContainers": [
            _tools_init(ctx),
            {
                # Builds the tree as another uid and leaves it read-only: the code under test
                # cannot rewrite the hidden tests before pytest imports them.
                "name": "prepare",
                "image": trial.task_image,
                "command": verify_args("prepare"),
                "securityContext": restricted_container(user=VERIFY_PREPARE_UID),
                "volumeMounts": [
                    {"name": "tools", "mountPath": TOOLS_DIR, "readOnly": True},
                    {"name": "task", "mountPath": TASK_DIR, "readOnly": True},
                    {"name": "changes", "mountPath": CHANGES_DIR, "readOnly": True},
                    {"name": "verify", "mountPath": "/verify"},
                    {"name": "tmp", "mountPath": "/tmp"},
                ],
            },
        ],
        "containers": [
            {
                "name": "verify",
                "image": trial.task_image,
                "command": verify_args("run"),
                "workingDir": "/verify",
                "env": [{"name": "HOME", "value": "/tmp"}, {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}],
                "resources": resources(spec.resources),
                "securityContext": restricted_container(user=AGENT_UID),
                "terminationMessagePolicy": "File",
                "volumeMounts": [
                    {"name": "tools", "mountPath": TOOLS_DIR, "readOnly": True},
                    {"name": "task", "mountPath": TASK_DIR, "readOnly": True},
                    {"name": "verify", "mountPath": "/verify"},
                    {"name": "tmp", "mountPath": "/tmp"},
                ],
            }
        ],
        "volumes": [
            {"name": "tools", "emptyDir": {}},
            {"name": "verify", "emptyDir": {"sizeLimit": str(spec.workspace.size_limit)}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "2Gi"}},
            *_task_volume(trial),
            {"name": "changes", "configMap": {"name": changes_config_map}},
        ],
    }
    if spec.runtime_class_name:
        pod_spec["runtimeClassName"] = spec.runtime_class_name
    pod_spec.update(pod_placement(spec.placement, spec.identity, sandbox_account(pool.metadata.name)))
    meta = metadata(pool, f"{trial.run_name}-{trial.trial_id}-verify", VERIFY, APP)
    meta["labels"] = pod_labels
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


TEMPLATE_PROBE = TrialContext(
    run_name="run",
    trial_id="trial",
    task_image="task:latest",
    harness=Harness(kind="MiniSweAgent"),
    fleet_url="http://fleet:8000",
)


def pod_template_hash(pool: SandboxPool, ctx: RenderContext) -> str:
    """Hash of the trial pod template with placeholder trial inputs (status.podTemplateHash)."""
    return short_hash(trial_pod(pool, TEMPLATE_PROBE, ctx)["spec"], 12)


def _warm_deployment(pool: SandboxPool) -> dict[str, Any]:
    """Warm sandboxes: the pool's single image, staged and idle until the run controller leases one."""
    name = f"{pool.metadata.name}-warm"
    image = pool.spec.source.images[0]
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {**RESTRICTED_POD_SECURITY, "fsGroup": AGENT_UID},
        "containers": [
            {
                "name": "sandbox",
                "image": image,
                "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"],
                "workingDir": pool.spec.workspace.path,
                "resources": resources(pool.spec.resources),
                "securityContext": restricted_container(user=AGENT_UID),
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
            }
        ],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "2Gi"}}],
    }
    if pool.spec.runtime_class_name:
        pod_spec["runtimeClassName"] = pool.spec.runtime_class_name
    pod_spec.update(
        pod_placement(pool.spec.placement, pool.spec.identity, sandbox_account(pool.metadata.name))
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(pool, name, WARM, APP),
        "spec": {
            "replicas": pool.spec.replicas,
            "selector": {"matchLabels": selector_labels(pool, WARM)},
            "template": {"metadata": {"labels": labels(pool, WARM, APP)}, "spec": pod_spec},
        },
    }


def _network_policy(pool: SandboxPool) -> dict[str, Any]:
    """Nothing reaches a sandbox; a sandbox reaches only DNS. Each RLRun adds a policy that lets
    its own trials reach its fleet, so the union is: DNS + that fleet, nothing else."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(pool, sandbox_account(pool.metadata.name), TRIAL, APP),
        "spec": {
            "podSelector": {
                "matchLabels": {
                    POOL_LABEL: label_value(pool.metadata.name),
                    "app.kubernetes.io/name": APP,
                }
            },
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            "egress": [
                {
                    "to": [
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}
                            },
                            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
                        }
                    ],
                    "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
                }
            ],
        },
    }


def _service_account(pool: SandboxPool) -> dict[str, Any]:
    return service_account(pool, sandbox_account(pool.metadata.name), TRIAL, APP)


def render_pool(pool: SandboxPool, ctx: RenderContext, task_set_images: list[str]) -> list[dict[str, Any]]:
    """Every child object of a SandboxPool, each stamped with its desired-state hash."""
    del ctx  # the pool's own children need no legorl images; trial pods do
    objects: list[dict[str, Any]] = []
    if pool.spec.identity.service_account_name is None:
        objects.append(_service_account(pool))
    images = desired_images(pool, task_set_images)
    size = pool.spec.pre_pull.images_per_daemon_set
    for chunk, start in enumerate(range(0, len(images), size)):
        objects.append(_prepull_daemon_set(pool, chunk, images[start : start + size]))
    if pool.spec.replicas > 0:
        objects.append(_warm_deployment(pool))
    objects.append(_network_policy(pool))
    return [with_hash(obj) for obj in objects]


def warm_selector(pool: SandboxPool) -> dict[str, str]:
    """Labels of warm sandbox pods (status.selector for the scale subresource)."""
    return selector_labels(pool, WARM)
