"""RLRun → its owned fleet and pool (when inlined), the trainer workload (an indexed Job of torchrun ranks, a
headless Service for their rendezvous and the fleet's NCCL weight sync, a NetworkPolicy for the trainer pods)
and the NetworkPolicy that opens its fleet to its trials."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from legorl.api._base import GROUP_VERSION
from legorl.api.common import pvc_claim
from legorl.api.fleet import RolloutFleetSpec
from legorl.api.kinds import RLRun
from legorl.api.labels import (
    COMPONENT_LABEL,
    OWNER_LABEL,
    POOL_LABEL,
    RUN_LABEL,
    fleet_name,
    pool_name,
    trainer_name,
)
from legorl.api.launch import TrainerLaunch
from legorl.api.pool import SandboxPoolSpec
from legorl.operator.render.common import (
    RESTRICTED_POD_SECURITY,
    STORE_MOUNT,
    RenderContext,
    headless_service,
    label_value,
    labels,
    metadata,
    owner_key,
    pod_placement,
    resources,
    restricted_container,
    selector_labels,
    service_account,
    with_hash,
)
from legorl.operator.render.fleet import COMPONENT as ENGINE
from legorl.operator.render.fleet import MODELS_DIR, engine_name, replicas_name
from legorl.operator.render.pool import PROXY_PORT

APP = "legorl-trainer"
TRAINER = "trainer"
MASTER_PORT = 29500
"""torchrun's rendezvous (its TCP store) on the trainer pod of index 0; the ranks' collectives then use
ephemeral ports between the trainer pods."""
WEIGHT_SYNC_PORT = 29650
"""Under NCCL weight sync: the writer rank's TCP rendezvous, which every engine worker of every replica joins
(vLLM's NCCL weight-transfer group; NCCL then opens ephemeral ports in both directions)."""

WeightSyncMethod = Literal["Filesystem", "NCCL"]
"""`RolloutFleet.spec.weightSync.method`."""


def writer_address(run: RLRun) -> str:
    """DNS name of the trainer pod of index 0, whose local rank 0 is the writer (global rank 0), through the
    trainer's headless Service: `<run>-trainer-0.<run>-trainer.<namespace>.svc`."""
    name = trainer_name(run.metadata.name)
    return f"{name}-0.{name}.{run.metadata.namespace or 'default'}.svc"


def sync_method(run: RLRun, referenced: WeightSyncMethod | None = None) -> WeightSyncMethod:
    """How the run's fleet syncs weights: the inline fleet's method, else the referenced fleet's
    (`referenced`, which the caller read from that fleet; None: Filesystem)."""
    if run.spec.fleet is not None:
        return run.spec.fleet.weight_sync.method
    return referenced or "Filesystem"


def _engine_pods(run: RLRun) -> dict[str, str]:
    """Labels of the engine pods (leaders and workers) of the run's fleet, its own or the referenced one."""
    return {OWNER_LABEL: owner_key("RolloutFleet", fleet_name(run)), COMPONENT_LABEL: ENGINE}


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


def _owned_fleet(run: RLRun, ctx: RenderContext) -> dict[str, Any]:
    """The run's inline fleet, serving its policy checkpoint. A training run whose fleet loads weights from
    the store's path (Filesystem sync) and whose store is a `pvc://` claim gets that claim as the fleet's
    `weightSync.storeClaim` unless it names one: the engines then mount it where the trainer does."""
    assert run.spec.fleet is not None
    template = run.spec.fleet.to_wire()
    sync = template["weightSync"]
    claim = pvc_claim(store_uri(run, ctx))
    if run.spec.mode == "Train" and sync["method"] == "Filesystem" and claim and "storeClaim" not in sync:
        template["weightSync"] = {**sync, "storeClaim": claim}
    spec = RolloutFleetSpec.model_validate({**template, "model": run.spec.policy.checkpoint.to_wire()})
    return _owned(run, "RolloutFleet", fleet_name(run), spec)


def _owned_pool(run: RLRun) -> dict[str, Any]:
    assert run.spec.pool is not None
    return _owned(run, "SandboxPool", pool_name(run), run.spec.pool)


def _trainer_service(run: RLRun, nccl: bool) -> dict[str, Any]:
    """Every trainer pod's stable name (`<name>-<index>.<name>`, the Job's pods set `subdomain`), published
    before the pods are ready: the ranks rendezvous at index 0 and, under NCCL, the engines at the writer."""
    ports = [("rendezvous", MASTER_PORT), *([("weight-sync", WEIGHT_SYNC_PORT)] if nccl else [])]
    return headless_service(run, trainer_name(run.metadata.name), TRAINER, APP, *ports)


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


def _trainer_job(run: RLRun, ctx: RenderContext, fleet_port: int, nccl: bool) -> dict[str, Any]:
    """One pod per trainer node (an indexed Job), each running torchrun with the layout's ranks per node."""
    trainer = run.spec.trainer
    par = trainer.parallelism
    layout = par.layout()
    name = trainer_name(run.metadata.name)
    store = store_mount(run, ctx)
    launch = TrainerLaunch(
        run=run.metadata.name,
        namespace=run.metadata.namespace or "default",
        store_uri=store.uri_in_pod,
        # Every replica, looked up at each sync (a dns+ name: all addresses of the serving pods' Service).
        fleet_urls=(replicas_url(run, fleet_port),),
    )
    env = [
        *launch.env(),
        # torchrun's rendezvous: index 0 is the master; the headless Service gives it a DNS name.
        {"name": "MASTER_ADDR", "value": f"{name}-0.{name}"},
        {"name": "MASTER_PORT", "value": str(MASTER_PORT)},
        {"name": "NNODES", "value": str(layout.nodes)},
        # One rank per GPU, or processesPerNode gloo ranks for a CPU trainer.
        {"name": "NPROC_PER_NODE", "value": str(layout.ranks_per_node)},
        {
            "name": "NODE_RANK",
            "valueFrom": {
                "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
            },
        },
        {"name": "HOME", "value": "/tmp"},
    ]
    ports = [{"name": "rendezvous", "containerPort": MASTER_PORT, "protocol": "TCP"}]
    if nccl:
        # The writer (global rank 0, on the pod of index 0) opens vLLM's NCCL weight-transfer rendezvous
        # here; every engine worker connects to it by this name.
        sync = TrainerLaunch(weight_sync_address=writer_address(run), weight_sync_port=WEIGHT_SYNC_PORT)
        env += sync.env()
        ports.append({"name": "weight-sync", "containerPort": WEIGHT_SYNC_PORT, "protocol": "TCP"})
    command = [
        "torchrun",
        "--nnodes=$(NNODES)",
        "--nproc-per-node=$(NPROC_PER_NODE)",
        "--node-rank=$(NODE_RANK)",
        "--master-addr=$(MASTER_ADDR)",
        "--master-port=$(MASTER_PORT)",
        "-m",
        "legorl.trainer",
        # No `--run=NAME`: torchrun refuses a script argument starting with `--run` (ambiguous with its
        # `--run-path`); the trainer reads the name from its environment (`TrainerLaunch`).
    ]
    container: dict[str, Any] = {
        "name": "trainer",
        "image": trainer.image.image if trainer.image else ctx.images.trainer,
        "imagePullPolicy": trainer.image.pull_policy if trainer.image else "IfNotPresent",
        "command": command,
        "env": env,
        "ports": ports,
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
            "completions": layout.nodes,
            "parallelism": layout.nodes,
            # A failed pod is replaced and the trainer resumes from the last checkpoint and the store
            # (one rank failing fails its peers too: each may fail `restarts` times).
            "backoffLimit": trainer.restarts * layout.nodes,
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


def _trainer_ingress(run: RLRun, nccl: bool) -> dict[str, Any]:
    """Who may connect to the run's trainer pods: the run's own trainer pods on any port (torchrun's
    rendezvous, the gloo/NCCL collectives between ranks) and, under NCCL weight sync, the engine pods of the
    run's fleet on any TCP port (the writer's rendezvous, then NCCL's ephemeral ports). Egress is left open:
    a trainer reads the run store and downloads its checkpoint wherever they are (s3, the HF hub), and the
    fleet's own policy admits it to the engines."""
    trainers = {"podSelector": {"matchLabels": selector_labels(run, TRAINER)}}
    ingress: list[dict[str, Any]] = [{"from": [trainers]}]
    if nccl:
        ingress.append(
            {"from": [{"podSelector": {"matchLabels": _engine_pods(run)}}], "ports": [{"protocol": "TCP"}]}
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(run, trainer_name(run.metadata.name), TRAINER, APP),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(run, TRAINER)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
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
                    RUN_LABEL: label_value(run.metadata.name),
                    POOL_LABEL: label_value(pool_name(run)),
                }
            },
            "policyTypes": ["Egress"],
            "egress": [
                {
                    "to": [{"podSelector": {"matchLabels": _engine_pods(run)}}],
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


def render_run(
    run: RLRun, ctx: RenderContext, fleet_port: int, *, fleet_sync: WeightSyncMethod | None = None
) -> list[dict[str, Any]]:
    """Every child object of an RLRun, each stamped with its desired-state hash.

    `fleet_port` is the port of the fleet the run uses (its own or the referenced one); `fleet_sync` the
    referenced fleet's `spec.weightSync.method` (an inline fleet's is the run's own; None: Filesystem).
    """
    nccl = sync_method(run, fleet_sync) == "NCCL"
    objects: list[dict[str, Any]] = []
    if run.spec.fleet is not None:
        objects.append(_owned_fleet(run, ctx))
    if run.spec.pool is not None:
        objects.append(_owned_pool(run))
    if run.spec.mode == "Train":
        if run.spec.trainer.identity.service_account_name is None:
            objects.append(_trainer_account(run))
        objects += [
            _trainer_service(run, nccl),
            _trainer_job(run, ctx, fleet_port, nccl),
            _trainer_ingress(run, nccl),
        ]
    objects.append(_trial_egress(run, fleet_port, ctx))
    return [with_hash(obj) for obj in objects]


def replicas_url(run: RLRun, fleet_port: int) -> str:
    """`dns+http://` URL of the run's fleet's replicas (one address per ready replica), for weight sync."""
    return (
        f"dns+http://{replicas_name(fleet_name(run))}.{run.metadata.namespace or 'default'}.svc:{fleet_port}"
    )


def fleet_url(run: RLRun, fleet_port: int) -> str:
    """In-cluster URL of the run's fleet Service."""
    return f"http://{engine_name(fleet_name(run))}.{run.metadata.namespace or 'default'}.svc:{fleet_port}"
