"""RLRun → its owned fleet and pool (when inlined), the trainer workload (an indexed Job and a
headless Service for multi-node Megatron) and the NetworkPolicy that opens its fleet to its trials."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from legorl.api._base import GROUP_VERSION
from legorl.api.fleet import RolloutFleetSpec
from legorl.api.kinds import RLRun
from legorl.api.pool import SandboxPoolSpec
from legorl.operator.render.common import (
    RESTRICTED_POD_SECURITY,
    RenderContext,
    headless_service,
    label_value,
    labels,
    metadata,
    owner_key,
    pod_placement,
    resources,
    restricted_container,
    service_account,
    with_hash,
)
from legorl.operator.render.fleet import COMPONENT as ENGINE
from legorl.operator.render.fleet import MODELS_DIR, engine_name
from legorl.operator.render.pool import PROXY_PORT

APP = "legorl-trainer"
TRAINER = "trainer"
MASTER_PORT = 29500
STORE_MOUNT = "/store"


def fleet_name(run: RLRun) -> str:
    """The fleet a run uses: its reference, or the one it owns."""
    return run.spec.fleet_ref.name if run.spec.fleet_ref else f"{run.metadata.name}-fleet"


def pool_name(run: RLRun) -> str:
    """The pool a run uses: its reference, or the one it owns."""
    return run.spec.pool_ref.name if run.spec.pool_ref else f"{run.metadata.name}-pool"


def trainer_name(run_name: str) -> str:
    return f"{run_name}-trainer"


def store_uri(run: RLRun, ctx: RenderContext) -> str:
    """The run's own directory in the store: `<store>/<namespace>/<run>`."""
    base = run.spec.store.uri if run.spec.store else ctx.default_store_uri
    return f"{base.rstrip('/')}/{run.metadata.namespace or 'default'}/{run.metadata.name}"


@dataclass(frozen=True)
class StoreMount:
    """How a pod reaches the run store: a PVC mount or credentials for an object store."""

    uri_in_pod: str
    volumes: list[dict[str, Any]]
    mounts: list[dict[str, Any]]
    env_from: list[dict[str, Any]]


def store_mount(run: RLRun, ctx: RenderContext) -> StoreMount:
    uri = store_uri(run, ctx)
    scheme, _, rest = uri.partition("://")
    credentials = run.spec.store.credentials_secret_ref if run.spec.store else None
    env_from = [{"secretRef": {"name": credentials.name}}] if credentials else []
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        return StoreMount(
            uri_in_pod=f"file://{STORE_MOUNT}/{path}",
            volumes=[{"name": "store", "persistentVolumeClaim": {"claimName": claim}}],
            mounts=[{"name": "store", "mountPath": STORE_MOUNT}],
            env_from=env_from,
        )
    return StoreMount(uri_in_pod=uri, volumes=[], mounts=[], env_from=env_from)


def _child_meta(run: RLRun, name: str) -> dict[str, Any]:
    return metadata(run, name, "owned", "legorl")


def _owned(run: RLRun, kind: str, name: str, spec: RolloutFleetSpec | SandboxPoolSpec) -> dict[str, Any]:
    """A fleet or pool the run inlines, as its own custom resource (at zero while suspended)."""
    if run.spec.suspend:
        spec = spec.model_copy(update={"replicas": 0})
    return {
        "apiVersion": GROUP_VERSION,
        "kind": kind,
        "metadata": _child_meta(run, name),
        "spec": spec.to_wire(),
    }


def _owned_fleet(run: RLRun) -> dict[str, Any]:
    assert run.spec.fleet is not None
    template = run.spec.fleet.to_wire()
    spec = RolloutFleetSpec.model_validate({**template, "model": run.spec.policy.checkpoint.to_wire()})
    return _owned(run, "RolloutFleet", fleet_name(run), spec)


def _owned_pool(run: RLRun) -> dict[str, Any]:
    assert run.spec.pool is not None
    return _owned(run, "SandboxPool", pool_name(run), run.spec.pool)


def _trainer_service(run: RLRun) -> dict[str, Any]:
    return headless_service(run, trainer_name(run.metadata.name), TRAINER, APP, ("rendezvous", MASTER_PORT))


def _trainer_account(run: RLRun) -> dict[str, Any]:
    return service_account(run, trainer_name(run.metadata.name), TRAINER, APP)


def _checkpoint_volume(run: RLRun) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A `pvc://claim/path` policy checkpoint, mounted read-only at /models/<claim> (where the trainer
    looks for it, as the fleet does); other schemes need no volume."""
    scheme, _, rest = run.spec.policy.checkpoint.uri.partition("://")
    if scheme != "pvc":
        return None
    claim = rest.partition("/")[0]
    volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    return volume, {"name": "model", "mountPath": f"{MODELS_DIR}/{claim}", "readOnly": True}


def _trainer_job(run: RLRun, ctx: RenderContext, fleet_port: int) -> dict[str, Any]:
    trainer = run.spec.trainer
    par = trainer.parallelism
    name = trainer_name(run.metadata.name)
    store = store_mount(run, ctx)
    env = [
        {"name": "LEGORL_RUN", "value": run.metadata.name},
        {"name": "LEGORL_NAMESPACE", "value": run.metadata.namespace or "default"},
        {"name": "LEGORL_STORE_URI", "value": store.uri_in_pod},
        {"name": "LEGORL_FLEET_URL", "value": fleet_url(run, fleet_port)},
        # torchrun's rendezvous: index 0 is the master; the headless Service gives it a DNS name.
        {"name": "MASTER_ADDR", "value": f"{name}-0.{name}"},
        {"name": "MASTER_PORT", "value": str(MASTER_PORT)},
        {"name": "NNODES", "value": str(par.nodes)},
        {"name": "NPROC_PER_NODE", "value": str(max(1, par.gpus_per_node))},
        {
            "name": "NODE_RANK",
            "valueFrom": {
                "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
            },
        },
        {"name": "HOME", "value": "/tmp"},
    ]
    command = [
        "torchrun",
        "--nnodes=$(NNODES)",
        "--nproc-per-node=$(NPROC_PER_NODE)",
        "--node-rank=$(NODE_RANK)",
        "--master-addr=$(MASTER_ADDR)",
        "--master-port=$(MASTER_PORT)",
        "-m",
        "legorl.trainer",
        f"--run={run.metadata.name}",
    ]
    container: dict[str, Any] = {
        "name": "trainer",
        "image": trainer.image.image if trainer.image else ctx.images.trainer,
        "imagePullPolicy": trainer.image.pull_policy if trainer.image else "IfNotPresent",
        "command": command,
        "env": env,
        "ports": [{"name": "rendezvous", "containerPort": MASTER_PORT, "protocol": "TCP"}],
        "resources": resources(trainer.resources, par.gpus_per_node),
        "securityContext": restricted_container(),
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *store.mounts,
        ],
    }
    env_from = list(store.env_from)
    if run.spec.policy.checkpoint.credentials_secret_ref is not None:
        # The trainer reads the initial policy itself (e.g. an hf:// download), with the same
        # credentials the fleet gets.
        env_from.append({"secretRef": {"name": run.spec.policy.checkpoint.credentials_secret_ref.name}})
    if env_from:
        container["envFrom"] = env_from
    model_volumes = _checkpoint_volume(run)
    if model_volumes:
        container["volumeMounts"].append(model_volumes[1])
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "subdomain": name,
        "automountServiceAccountToken": False,
        "securityContext": {**RESTRICTED_POD_SECURITY, "fsGroup": 65532},
        "containers": [container],
        "volumes": [
            {"name": "tmp", "emptyDir": {}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            *store.volumes,
            *([model_volumes[0]] if model_volumes else []),
        ],
    }
    pod_spec.update(pod_placement(trainer.placement, trainer.identity, name))
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(run, name, TRAINER, APP),
        "spec": {
            "completionMode": "Indexed",
            "completions": par.nodes,
            "parallelism": par.nodes,
            # One rank failing fails the step for all; the run controller restarts from the
            # last checkpoint rather than the Job retrying one rank alone.
            "backoffLimit": 0,
            # An evicted or preempted pod (drain, spot reclaim) is replaced, not a failed run.
            "podFailurePolicy": {
                "rules": [
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
                ]
            },
            "suspend": run.spec.suspend,
            "template": {"metadata": {"labels": labels(run, TRAINER, APP)}, "spec": pod_spec},
        },
    }


def _trial_egress(run: RLRun, fleet_port: int, ctx: RenderContext) -> dict[str, Any]:
    """Let this run's trial pods reach this run's fleet engines (and nothing else beyond DNS,
    which the pool's own policy allows), and the operator reach their proxy (results leave a trial
    through the proxy's `/finish`, `/changes` and `/trajectory`, fetched at the pod's IP)."""
    policy: dict[str, Any] = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(run, f"{run.metadata.name}-trials", "trial", APP),
        "spec": {
            "podSelector": {
                "matchLabels": {
                    "legorl.dev/run": label_value(run.metadata.name),
                    "legorl.dev/pool": label_value(pool_name(run)),
                }
            },
            "policyTypes": ["Egress"],
            "egress": [
                {
                    "to": [
                        {
                            "podSelector": {
                                "matchLabels": {
                                    "legorl.dev/owner": owner_key("RolloutFleet", fleet_name(run)),
                                    "legorl.dev/component": ENGINE,
                                }
                            }
                        }
                    ],
                    "ports": [{"protocol": "TCP", "port": fleet_port}],
                }
            ],
        },
    }
    if ctx.trial_tracing is not None:
        # The proxy's spans to the collector (the pod's egress lock lets no other uid out).
        policy["spec"]["egress"].append(
            {
                "to": [dict(ctx.trial_tracing.peer)],
                "ports": [{"protocol": "TCP", "port": ctx.trial_tracing.port}],
            }
        )
    if ctx.operator_namespace:
        policy["spec"]["policyTypes"] = ["Ingress", "Egress"]
        policy["spec"]["ingress"] = [
            {
                "from": [
                    {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": ctx.operator_namespace}
                        },
                        "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}},
                    }
                ],
                "ports": [{"protocol": "TCP", "port": PROXY_PORT}],
            }
        ]
    return policy


def render_run(run: RLRun, ctx: RenderContext, fleet_port: int) -> list[dict[str, Any]]:
    """Every child object of an RLRun, each stamped with its desired-state hash.

    `fleet_port` is the port of the fleet the run uses (its own or the referenced one).
    """
    objects: list[dict[str, Any]] = []
    if run.spec.fleet is not None:
        objects.append(_owned_fleet(run))
    if run.spec.pool is not None:
        objects.append(_owned_pool(run))
    if run.spec.mode == "Train":
        if run.spec.trainer.identity.service_account_name is None:
            objects.append(_trainer_account(run))
        objects += [_trainer_service(run), _trainer_job(run, ctx, fleet_port)]
    objects.append(_trial_egress(run, fleet_port, ctx))
    return [with_hash(obj) for obj in objects]


def fleet_url(run: RLRun, fleet_port: int) -> str:
    """In-cluster URL of the run's fleet Service."""
    return f"http://{engine_name(fleet_name(run))}.{run.metadata.namespace or 'default'}.svc:{fleet_port}"
