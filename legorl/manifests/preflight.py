"""Preflight: checks beyond what the CRD schema and CEL can express, needing no cluster.

Each check is a small function over one valid resource (or the set of them, for
references between documents) that yields problems with a field path and a fix.
Errors block `legorl validate`; warnings are printed and do not.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

from pydantic import BaseModel

from legorl.api._base import parse_quantity
from legorl.api.common import ContainerImage, EnvVar, ResourceRequirements, pvc_claim
from legorl.api.fleet import (
    DEFAULT_ENGINE_IMAGE,
    ENGINE_MIDDLEWARE,
    ENGINE_WORKER_EXTENSION,
    PLUGIN_WEIGHT_SYNC,
    WEIGHT_TRANSFER_BACKENDS,
    FleetTemplate,
    WeightSync,
    is_engine_image,
)
from legorl.api.kinds import Resource, RLRun, RolloutFleet, SandboxPool
from legorl.api.layout import FIELD as LAYOUT_FIELD
from legorl.api.pool import ImageSource
from legorl.manifests.problems import DocumentReport, Problem

_SECRETISH = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)


def _walk(obj: Any, path: str, kind: type[Any]) -> Iterator[tuple[str, Any]]:
    """Every instance of `kind` inside a model tree, with its field path."""
    if isinstance(obj, kind):
        yield path, obj
    if isinstance(obj, list):
        for i, item in enumerate(obj):
            yield from _walk(item, f"{path}[{i}]", kind)
    elif isinstance(obj, BaseModel):
        for name, info in type(obj).model_fields.items():
            alias = info.alias or name
            yield from _walk(getattr(obj, name), f"{path}.{alias}" if path else alias, kind)


def check_requests_within_limits(res: Resource) -> Iterator[Problem]:
    for path, req in _walk(res.spec, "spec", ResourceRequirements):
        for name, limit in req.limits.items():
            if name in req.requests and parse_quantity(req.requests[name]) > parse_quantity(limit):
                yield Problem(
                    "error",
                    f"{path}.requests.{name}",
                    f"request {req.requests[name]} is above the limit {limit}; "
                    "lower the request or raise the limit",
                    "preflight",
                )
        for name in ("nvidia.com/gpu", "amd.com/gpu"):
            if name in req.requests or name in req.limits:
                yield Problem(
                    "warning",
                    f"{path}",
                    f"{name} is set by hand; legorl adds GPUs from the parallelism settings, remove it here",
                    "preflight",
                )


def check_secrets_not_inline(res: Resource) -> Iterator[Problem]:
    for path, env in _walk(res.spec, "spec", EnvVar):
        if env.value and _SECRETISH.search(env.name):
            yield Problem(
                "warning",
                f"{path}.value",
                f"{env.name} looks like a credential written in the manifest; put it in a Secret and "
                "use valueFrom.secretKeyRef",
                "preflight",
            )


def _unpinned(ref: str) -> bool:
    tail = ref.rsplit("/", 1)[-1]
    return "@sha256:" not in ref and (":" not in tail or tail.endswith(":latest"))


def check_images_pinned(res: Resource) -> Iterator[Problem]:
    refs = [(f"{path}.image", image.image) for path, image in _walk(res.spec, "spec", ContainerImage)]
    for path, source in _walk(res.spec, "spec", ImageSource):
        refs += [(f"{path}.images[{i}]", ref) for i, ref in enumerate(source.images)]
    for path, ref in refs:
        if _unpinned(ref):
            yield Problem(
                "warning",
                path,
                f"{ref} is not pinned; use a version tag or a digest so runs are reproducible",
                "preflight",
            )


def check_run_settings(res: Resource) -> Iterator[Problem]:
    if not isinstance(res, RLRun):
        return
    spec = res.spec
    algo = spec.algorithm
    batch = algo.tasks_per_step * algo.group_size
    if algo.mini_batches > batch:
        yield Problem(
            "error",
            "spec.algorithm.miniBatches",
            f"{algo.mini_batches} mini-batches cannot be cut from a batch of {batch} trials "
            "(tasksPerStep × groupSize); lower miniBatches",
            "preflight",
        )
    split = spec.tasks.split
    # taskSetSplit always holds tasks out: a task set without the label fails the plan instead.
    holds_none = split.task_set_split is None and (
        split.held_out_percent == 0 or split.held_out_task_ids == []
    )
    if spec.stop.target_reward is not None and holds_none:
        what = "heldOutPercent is 0" if split.held_out_percent == 0 else "heldOutTaskIds is empty"
        yield Problem(
            "error",
            "spec.stop.targetReward",
            f"targetReward is measured on the held-out split, but {what}; hold out tasks "
            "(heldOutPercent, heldOutTaskIds or taskSetSplit) or drop targetReward",
            "preflight",
        )
    if spec.mode == "Train" and spec.schedule.max_concurrent_trials < algo.group_size:
        yield Problem(
            "warning",
            "spec.schedule.maxConcurrentTrials",
            f"{spec.schedule.max_concurrent_trials} concurrent trials is below groupSize "
            f"{algo.group_size}; each group runs in pieces, raise it for throughput",
            "preflight",
        )
    max_steps = spec.stop.max_steps
    if max_steps is not None and spec.evaluation.interval_steps > max_steps:
        yield Problem(
            "warning",
            "spec.evaluation.intervalSteps",
            f"validation every {spec.evaluation.interval_steps} steps never happens mid-run with "
            f"maxSteps {max_steps}; only the start and the end are scored",
            "preflight",
        )
    if spec.harness.kind == "Custom" and spec.harness.image is None:
        yield Problem(
            "error",
            "spec.harness.image",
            "kind Custom needs harness.image: the image whose runtime is copied into the sandbox "
            "(legorl ships images only for the harnesses it knows)",
            "preflight",
        )
    if (
        spec.harness.kind == "Custom"
        and spec.harness.command
        and not any("{prompt}" in part for part in spec.harness.command)
    ):
        yield Problem(
            "warning",
            "spec.harness.command",
            "no {prompt} placeholder: the harness will not receive the task text on its command line",
            "preflight",
        )
    if spec.mode == "Train" and Decimal(algo.sampling.top_p) != 1:
        # The trainer refuses it at start (legorl.trainer.settings): say so before launch.
        yield Problem(
            "error",
            "spec.algorithm.sampling.topP",
            f"topP {algo.sampling.top_p}: the trainer computes log-probs of the whole temperature-scaled "
            "distribution, so nucleus truncation would bias every importance weight; set topP to 1.0 to "
            "train (Evaluate runs may truncate)",
            "preflight",
        )
    if spec.fleet is not None:
        yield from _fidelity_dtypes(
            spec.trainer.dtype, spec.fleet.settings.dtype, "spec.fleet.settings.dtype"
        )
        yield from _tokens_fit(
            algo.sampling.max_tokens_per_turn, spec.fleet.settings.max_model_len, "spec.fleet"
        )


def _tokens_fit(max_tokens: int, max_model_len: int | None, fleet: str) -> Iterator[Problem]:
    """A turn's token cap must leave room for a prompt in the engine's context: vLLM answers every call
    asking for more with 400, and the harness retries until its deadline."""
    if max_model_len is not None and max_tokens >= max_model_len:
        yield Problem(
            "error",
            "spec.algorithm.sampling.maxTokensPerTurn",
            f"maxTokensPerTurn {max_tokens} leaves no room for a prompt in the fleet's context of "
            f"{max_model_len} tokens ({fleet}.settings.maxModelLen): the engine would refuse every call; "
            "lower maxTokensPerTurn (the default is 4096) or raise maxModelLen",
            "preflight",
        )


def _fidelity_dtypes(trainer_dtype: str, engine_dtype: str, path: str) -> Iterator[Problem]:
    if engine_dtype not in ("auto", trainer_dtype):
        yield Problem(
            "warning",
            path,
            f"the engine samples in {engine_dtype} but the trainer computes in {trainer_dtype}; "
            "expect rollout/training correlation below 0.999 — use the same dtype",
            "preflight",
        )


def check_trainer_layout(res: Resource) -> Iterator[Problem]:
    """The trainer's ranks and parallel sizes, as arithmetic (the trainer checks them against the model's
    shape when it starts).

    The CRD's CEL rules say most of this, but an API server without CEL (1.20) does not, and the operator
    re-runs these checks on what such a server let through; `context > 1` is refused here only. Preflight runs
    only on documents that passed schema and CEL (`legorl validate` gates it on `report.ok`), so a problem
    CEL reported is never reported again in other words."""
    if not isinstance(res, RLRun) or res.spec.mode != "Train":
        return  # no trainer runs
    par = res.spec.trainer.parallelism
    if par.gpus_per_node > 0 and par.processes_per_node not in (None, par.gpus_per_node):
        yield Problem(
            "error",
            f"{LAYOUT_FIELD}.processesPerNode",
            f"a GPU trainer runs one rank per GPU, not {par.processes_per_node} for "
            f"{par.gpus_per_node} GPUs; leave processesPerNode unset or equal to gpusPerNode",
            "preflight",
        )
    for problem in par.layout().problems():
        yield Problem("error", problem.field, problem.message, "preflight")


_NCCL_FIX = "use weightSync.method Filesystem"


def check_nccl_weight_sync(res: Resource) -> Iterator[Problem]:
    """NCCL weight sync broadcasts from the trainer's GPU to the engines' GPUs: both sides need GPUs."""
    fleet: FleetTemplate
    if isinstance(res, RolloutFleet):
        path, fleet = "spec", res.spec
    elif isinstance(res, RLRun) and res.spec.fleet is not None:
        path, fleet = "spec.fleet", res.spec.fleet
    else:
        return  # a referenced fleet: check_run_against_fleet
    if fleet.weight_sync.method != "NCCL":
        return
    if fleet.parallelism.gpus_per_node == 0:
        yield Problem(
            "error",
            f"{path}.weightSync.method",
            "NCCL weight sync needs GPUs on the engines, but parallelism.gpusPerNode is 0 (vLLM's CPU "
            f"build); {_NCCL_FIX}",
            "preflight",
        )
    if (
        isinstance(res, RLRun)
        and res.spec.mode == "Train"
        and res.spec.trainer.parallelism.gpus_per_node == 0
    ):
        yield Problem(
            "error",
            f"{path}.weightSync.method",
            "NCCL weight sync needs GPUs on the trainer too, but spec.trainer.parallelism.gpusPerNode is 0 "
            f"(a CPU trainer); {_NCCL_FIX} or give the trainer GPUs",
            "preflight",
        )


def _own_fleet(res: Resource) -> tuple[str, FleetTemplate] | None:
    """The fleet a resource defines (a RolloutFleet, or an RLRun's inline fleet) and its field path."""
    if isinstance(res, RolloutFleet):
        return "spec", res.spec
    if isinstance(res, RLRun) and res.spec.fleet is not None:
        return "spec.fleet", res.spec.fleet
    return None  # a referenced fleet is checked as its own document


def check_engine_image(res: Resource) -> Iterator[Problem]:
    """A weight sync that loads legorl's plugin into vLLM needs the plugin inside the engine image: vLLM
    imports the worker extension and the middleware at start and exits when it cannot."""
    own = _own_fleet(res)
    if own is None:
        return
    path, fleet = own
    method, image = fleet.weight_sync.method, fleet.engine.image
    if method not in PLUGIN_WEIGHT_SYNC or is_engine_image(image):
        return
    yield Problem(
        "warning",
        f"{path}.engine.image",
        f"{image} is not legorl's engine image, and weightSync.method {method} starts vLLM with legorl's "
        f"plugin (--weight-transfer-config backend {WEIGHT_TRANSFER_BACKENDS[method]}, "
        f"--worker-extension-cls {ENGINE_WORKER_EXTENSION}, --middleware {ENGINE_MIDDLEWARE}): unless this "
        f"image can import those modules, vLLM exits at start. Use {DEFAULT_ENGINE_IMAGE} (its `-cpu` build "
        "for gpusPerNode 0), or add the plugin to your vLLM image with legorl's engine/Dockerfile: "
        "`docker build -f engine/Dockerfile --build-arg VLLM_IMAGE=<your image> -t <new image> .`",
        "preflight",
    )


_PATH_SYNC = "loads published weights from a path in the run store (weightSync.method Filesystem)"


def _filesystem_sync_store(
    run: RLRun, sync: WeightSync, fleet: str | None, default_store_uri: str | None
) -> Iterator[Problem]:
    """Under Filesystem weight sync the trainer sends the engines the path of each version it publishes in the
    run store, so the engines must mount that store where the trainer does: a `pvc://CLAIM/...` store is the
    fleet's `weightSync.storeClaim` (an inline fleet gets it from the store; `fleet` None), an object store
    cannot be (the trainer refuses it at start). `default_store_uri` is the operator's store for runs without
    `spec.store` (None: unknown, as in `legorl validate`)."""
    if run.spec.mode != "Train" or sync.method != "Filesystem":
        return
    store = run.spec.store.uri if run.spec.store is not None else default_store_uri
    where = "spec.fleet.weightSync" if fleet is None else "spec.fleetRef.name"
    subject = "the run's fleet" if fleet is None else f"fleet {fleet!r}"
    if store is None:
        if fleet is not None and sync.store_claim is None:
            yield Problem(
                "warning",
                where,
                f"{subject} {_PATH_SYNC} but sets no weightSync.storeClaim, so its engines mount no store; "
                "this run keeps its store in the operator's default store: if that is pvc://CLAIM/..., set "
                "weightSync.storeClaim: CLAIM on the fleet, else set spec.store to a pvc:// store and the "
                "fleet's storeClaim to its claim, or use a fleet whose weightSync.method is NCCL",
                "preflight",
            )
        return
    own_store = run.spec.store is not None
    what = "spec.store.uri" if own_store else "the operator's default store"
    if store.partition("://")[0] in ("s3", "gs"):
        yield Problem(
            "error",
            "spec.store.uri" if own_store else where if fleet is not None else f"{where}.method",
            f"the run store {store} ({what}) is an object store, but {subject} {_PATH_SYNC}, which the "
            "trainer refuses at start: keep the store on a volume the engines can mount (pvc://CLAIM/path, "
            "which they mount through weightSync.storeClaim) or use weightSync.method NCCL",
            "preflight",
        )
        return
    claim = pvc_claim(store)
    if claim is None or sync.store_claim == claim:
        return  # file://: a directory the engines read as it is (local runs)
    if sync.store_claim is None:
        if fleet is None:
            return  # the operator sets the inline fleet's storeClaim from the store
        yield Problem(
            "error",
            where,
            f"{subject} {_PATH_SYNC} but mounts no store: its engines would never find the weights this run "
            f"publishes in {store} ({what}); set the fleet's weightSync.storeClaim to {claim!r}, or use a "
            "fleet whose weightSync.method is NCCL",
            "preflight",
        )
        return
    yield Problem(
        "error",
        f"{where}.storeClaim" if fleet is None else where,
        f"{subject} mounts claim {sync.store_claim!r} (weightSync.storeClaim) for its weights, but this run "
        f"publishes them in {store} ({what}), on claim {claim!r}: set weightSync.storeClaim to {claim!r}"
        + (" or remove it (the operator then sets it from the store)" if fleet is None else ""),
        "preflight",
    )


def check_run_store(res: Resource, default_store_uri: str | None = None) -> Iterator[Problem]:
    """A training run's inline fleet must reach the run store under Filesystem weight sync
    (`_filesystem_sync_store`); a referenced fleet is checked in `check_run_against_fleet`."""
    if isinstance(res, RLRun) and res.spec.fleet is not None:
        yield from _filesystem_sync_store(res, res.spec.fleet.weight_sync, None, default_store_uri)


def check_pool_defenses(res: Resource) -> Iterator[Problem]:
    pools: list[tuple[str, Any]] = []
    if isinstance(res, SandboxPool):
        pools.append(("spec", res.spec))
    elif isinstance(res, RLRun) and res.spec.pool is not None:
        pools.append(("spec.pool", res.spec.pool))
    for path, pool in pools:
        d = pool.defenses
        relaxed = [
            name
            for name, value, safe in (
                ("egress", d.egress, "ProxyOnly"),
                ("gitHistory", d.git_history, "BaseCommitOnly"),
            )
            if value != safe
        ]
        for name in relaxed:
            yield Problem(
                "warning",
                f"{path}.defenses.{name}",
                "this defense is relaxed: rewards from this pool can be gamed; "
                "use it only to debug harnesses",
                "preflight",
            )


SINGLE_CHECKS: list[Callable[[Resource], Iterator[Problem]]] = [
    check_requests_within_limits,
    check_secrets_not_inline,
    check_images_pinned,
    check_run_settings,
    check_trainer_layout,
    check_nccl_weight_sync,
    check_engine_image,
    check_pool_defenses,
]


def _key(res: Resource) -> tuple[str, str]:
    return (res.metadata.namespace or "", res.metadata.name)


def _raw_key(report: DocumentReport) -> tuple[str, str, str] | None:
    body = report.body
    meta = body.get("metadata") if body else None
    if not body or not isinstance(meta, dict):
        return None
    return (str(body.get("kind")), str(meta.get("namespace") or ""), str(meta.get("name")))


def _missing_reference(
    kind: str, name: str, path: str, invalid: set[tuple[str, str, str]], ns: str
) -> Problem:
    if (kind, ns, name) in invalid:
        message = f"{kind} {name!r} is among the given files but invalid; fix its errors first"
    else:
        message = (
            f"{kind} {name!r} is not among the given files; it must exist in the run's namespace "
            "before the run can start"
        )
    return Problem("warning", path, message, "preflight")


def check_references(all_reports: list[DocumentReport]) -> None:
    """Resolve fleetRef/poolRef against the documents given; check what the pair implies."""
    reports = [r for r in all_reports if r.resource is not None and r.ok]
    invalid = {key for r in all_reports if not r.ok and (key := _raw_key(r)) is not None}
    fleets = {_key(r.resource): r.resource for r in reports if isinstance(r.resource, RolloutFleet)}
    pools = {_key(r.resource): r.resource for r in reports if isinstance(r.resource, SandboxPool)}
    trainers_by_fleet: dict[tuple[str, str], list[str]] = {}
    for report in reports:
        run = report.resource
        if not isinstance(run, RLRun):
            continue
        ns = run.metadata.namespace or ""
        spec = run.spec
        if spec.fleet_ref is not None:
            fleet = fleets.get((ns, spec.fleet_ref.name))
            if fleet is None:
                report.problems.append(
                    _missing_reference("RolloutFleet", spec.fleet_ref.name, "spec.fleetRef.name", invalid, ns)
                )
            else:
                report.problems += list(check_run_against_fleet(run, fleet))
                if spec.mode == "Train":
                    trainers_by_fleet.setdefault((ns, fleet.metadata.name), []).append(run.metadata.name)
        if spec.pool_ref is not None and (ns, spec.pool_ref.name) not in pools:
            report.problems.append(
                _missing_reference("SandboxPool", spec.pool_ref.name, "spec.poolRef.name", invalid, ns)
            )
    for report in reports:
        run = report.resource
        if isinstance(run, RLRun) and run.spec.fleet_ref is not None and run.spec.mode == "Train":
            names = trainers_by_fleet.get((run.metadata.namespace or "", run.spec.fleet_ref.name), [])
            if len(names) > 1:
                others = ", ".join(n for n in names if n != run.metadata.name)
                report.problems.append(
                    Problem(
                        "warning",
                        "spec.fleetRef",
                        f"training runs {others} use the same fleet; only one holds its weight lease at a "
                        "time and the others wait — share a fleet with Evaluate runs instead",
                        "preflight",
                    )
                )


def check_run_against_fleet(
    run: RLRun, fleet: RolloutFleet, default_store_uri: str | None = None
) -> Iterator[Problem]:
    """What a run implies for the fleet it references (same checkpoint, capture on, dtypes, the run store
    mounted under Filesystem weight sync). `default_store_uri`: the operator's store for runs without
    `spec.store` (None: unknown)."""
    if run.spec.policy.checkpoint.uri != fleet.spec.model.uri:
        yield Problem(
            "error",
            "spec.policy.checkpoint.uri",
            f"the run's policy {run.spec.policy.checkpoint.uri} differs from what fleet "
            f"{fleet.metadata.name!r} serves ({fleet.spec.model.uri}); point both at the same checkpoint",
            "preflight",
        )
    if (
        run.spec.trainer.routing_replay == "Enabled"
        and fleet.spec.settings.routed_experts_capture != "Enabled"
    ):
        yield Problem(
            "error",
            "spec.trainer.routingReplay",
            f"routing replay needs routed experts, but fleet {fleet.metadata.name!r} has "
            "settings.routedExpertsCapture Disabled; enable capture on the fleet or set routingReplay Auto",
            "preflight",
        )
    if run.spec.mode == "Train":
        yield from _fidelity_dtypes(run.spec.trainer.dtype, fleet.spec.settings.dtype, "spec.trainer.dtype")
    yield from _tokens_fit(
        run.spec.algorithm.sampling.max_tokens_per_turn,
        fleet.spec.settings.max_model_len,
        f"RolloutFleet {fleet.metadata.name!r} spec",
    )
    if (
        run.spec.mode == "Train"
        and fleet.spec.weight_sync.method == "NCCL"
        and run.spec.trainer.parallelism.gpus_per_node == 0
    ):
        yield Problem(
            "error",
            "spec.trainer.parallelism.gpusPerNode",
            f"fleet {fleet.metadata.name!r} syncs weights over NCCL (weightSync.method NCCL), which needs "
            "GPUs on the trainer too, but this trainer runs on CPU; give it GPUs or use a fleet whose "
            "weightSync.method is Filesystem",
            "preflight",
        )
    yield from _filesystem_sync_store(run, fleet.spec.weight_sync, fleet.metadata.name, default_store_uri)


def preflight(reports: list[DocumentReport]) -> None:
    """Append preflight problems to each report whose document passed schema and CEL."""
    for report in reports:
        if report.resource is not None and report.ok:
            report.problems += list(_run_single(report.resource))
    check_references(reports)


def _run_single(res: Resource, default_store_uri: str | None = None) -> Iterator[Problem]:
    for check in SINGLE_CHECKS:
        yield from check(res)
    yield from check_run_store(res, default_store_uri)


def check_resource(res: Resource, default_store_uri: str | None = None) -> list[Problem]:
    """Every single-object preflight check of one valid resource (what the operator re-runs, with its default
    run store for runs that set no `spec.store`; None: unknown, as in `legorl validate`)."""
    return list(_run_single(res, default_store_uri))
