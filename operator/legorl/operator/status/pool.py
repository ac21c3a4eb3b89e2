"""SandboxPool status: images cached per node, warm capacity, defenses, conditions."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from legorl.api.conditions import PoolConditionType as T
from legorl.api.conditions import PoolReason as R
from legorl.api.kinds import SandboxPool
from legorl.api.labels import CHUNK_LABEL, COMPONENT_LABEL, IMAGES_ANNOTATION, LEASED_LABEL
from legorl.api.pool import ImagePullFailure, NodeImageStatus, SandboxPoolStatus
from legorl.operator.observe import PULL_FAILURES, Observed, PodView
from legorl.operator.render.common import selector_string
from legorl.operator.render.pool import PREPULL, WARM, desired_images, operator_reads_task_set, warm_selector
from legorl.operator.status.common import ConditionSet, listing, pod_problem

MAX_FAILURES_PER_NODE = 3
MAX_FAILURE_MESSAGE = 300
"""Per-node failure detail is capped: a registry outage on a large cluster must not push the status
past the API server's object size limit (the condition message names the first failure)."""
NOT_RUNNABLE = frozenset({"CrashLoopBackOff", "RunContainerError", "StartError", "CreateContainerError"})
"""Waiting reasons of a pre-pull container whose image was pulled but cannot start."""


@dataclass
class _Cache:
    """Image × node pull state from the pre-pull pods."""

    nodes: dict[str, NodeImageStatus] = field(default_factory=dict)
    pulled: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    """image → nodes that have it."""
    failures: list[tuple[str, ImagePullFailure]] = field(default_factory=list)
    matching_nodes: int = 0
    scheduled_known: bool = False
    """Whether every DaemonSet controller has reported how many nodes match."""


def _node_state(
    pods: list[PodView], chunk_images: dict[str, list[str]]
) -> tuple[set[str], list[ImagePullFailure]]:
    pulled: set[str] = set()
    failures: list[ImagePullFailure] = []
    for pod in pods:
        images = (
            list(pod.images)
            if pod.images is not None
            else chunk_images.get(pod.labels.get(CHUNK_LABEL, ""), [])
        )
        if pod.phase == "Running" or any(c.state == "running" for c in pod.containers):
            pulled.update(images)  # init containers only let the pause container start when done
            continue
        for status in pod.init_containers:
            index = int(status.name.removeprefix("pull-")) if status.name.startswith("pull-") else -1
            image = images[index] if 0 <= index < len(images) else status.image
            if status.state in {"done", "running"}:
                pulled.add(image)  # the kubelet started the container, so the image is on the node
            elif status.reason in PULL_FAILURES:
                failures.append(
                    ImagePullFailure(
                        image=image, reason=status.reason, message=status.message[:MAX_FAILURE_MESSAGE]
                    )
                )
            elif status.state == "failed" or status.reason in NOT_RUNNABLE:
                # Pulled, but `/bin/sh -c "exit 0"` cannot run in it (a distroless image): the
                # init containers after it never start, so say so instead of pulling forever.
                pulled.add(image)
                failures.append(
                    ImagePullFailure(
                        image=image,
                        reason=status.reason or "PrePullCommandFailed",
                        message=(
                            "the image is on the node, but its pre-pull container cannot run /bin/sh; "
                            f"later images of this DaemonSet are not pulled. {status.message}"
                        )[:MAX_FAILURE_MESSAGE],
                    )
                )
    return pulled, failures


def _cache(pool: SandboxPool, observed: Observed, images: list[str]) -> _Cache:
    cache = _Cache()
    daemon_sets = observed.of_kind("DaemonSet")
    chunk_images: dict[str, list[str]] = {}
    cache.scheduled_known = bool(daemon_sets) and all(ds.observed_generation >= 1 for ds in daemon_sets)
    for ds in daemon_sets:
        chunk = ds.name.rsplit("-", 1)[-1]
        chunk_images[chunk] = json.loads(ds.annotations.get(IMAGES_ANNOTATION, "[]") or "[]")
        cache.matching_nodes = max(cache.matching_nodes, ds.counters.get("desiredNumberScheduled", 0))
    by_node: dict[str, list[PodView]] = defaultdict(list)
    for pod in observed.pods:
        if pod.labels.get(COMPONENT_LABEL) == PREPULL and pod.node and not pod.deleting:
            by_node[pod.node].append(pod)
    for node in sorted(by_node):
        pulled, failures = _node_state(by_node[node], chunk_images)
        pulled &= set(images)
        for image in pulled:
            cache.pulled[image].add(node)
        cache.failures += [(node, f) for f in failures]
        cache.nodes[node] = NodeImageStatus(
            name=node,
            desired=len(images),
            pulled=len(pulled),
            failed=len(failures),
            failures=failures[:MAX_FAILURES_PER_NODE],
        )
    return cache


def _set_images_cached(
    conds: ConditionSet, pool: SandboxPool, images: list[str], cache: _Cache, cached: int
) -> None:
    policy = pool.spec.pre_pull.policy
    if policy == "Never":
        conds.set(
            T.IMAGES_CACHED, "False", R.PRE_PULL_DISABLED, "prePull.policy is Never: trials pull their images"
        )
    elif not images and (policy == "Lookahead" or not operator_reads_task_set(pool)):
        source = pool.spec.source.task_set
        where = f" from {source.uri}" if source is not None else ""
        conds.set(
            T.IMAGES_CACHED,
            "Unknown",
            R.TASK_SET_IMAGES_UNKNOWN,
            f"no task images named yet: the run controller names them{where} when it reads the task set; "
            "until then trials pull their own images",
        )
    elif not images:
        conds.set(
            T.IMAGES_CACHED, "True", R.ALL_IMAGES_CACHED, "nothing to cache: the task set names no images"
        )
    elif cache.scheduled_known and cache.matching_nodes == 0:
        conds.set(
            T.IMAGES_CACHED,
            "False",
            R.NO_MATCHING_NODES,
            "no node matches placement.nodeSelector / tolerations; fix the placement or label nodes",
        )
    elif cache.failures:
        node, failure = cache.failures[0]
        more = (
            f" ({len(cache.failures) - 1} more failures; see status.nodes)" if len(cache.failures) > 1 else ""
        )
        conds.set(
            T.IMAGES_CACHED,
            "False",
            R.PULL_FAILED,
            f"{failure.image} failed to pull on node {node}: {failure.reason} {failure.message}".rstrip()
            + more,
        )
    elif cache.scheduled_known and cached == len(images) and len(cache.nodes) >= cache.matching_nodes:
        conds.set(
            T.IMAGES_CACHED,
            "True",
            R.ALL_IMAGES_CACHED,
            f"{len(images)} image(s) on all {cache.matching_nodes} matching node(s)",
        )
    else:
        done = sum(len(nodes) for nodes in cache.pulled.values())
        total = len(images) * max(cache.matching_nodes, len(cache.nodes), 1)
        conds.set(T.IMAGES_CACHED, "False", R.PULL_IN_PROGRESS, f"{done}/{total} image × node pulls done")


def _set_defenses(conds: ConditionSet, pool: SandboxPool, previous: SandboxPoolStatus) -> None:
    defenses = pool.spec.defenses
    relaxed = []
    if defenses.egress != "ProxyOnly":
        relaxed.append(f"defenses.egress is {defenses.egress}")
    if defenses.git_history != "BaseCommitOnly":
        relaxed.append(f"defenses.gitHistory is {defenses.git_history}")
    test = previous.self_test
    if relaxed:
        conds.set(
            T.DEFENSES_VERIFIED,
            "False",
            R.DEFENSES_RELAXED_BY_SPEC,
            f"{listing(relaxed)}: rewards from this pool are not hack-proof",
        )
    elif test.result == "Passed":
        conds.set(T.DEFENSES_VERIFIED, "True", R.SELF_TEST_PASSED, f"self-test passed at {test.checked_at}")
    elif test.result == "Failed":
        failed = [f"{c.name}: {c.message}" for c in test.checks if c.result == "Failed"]
        conds.set(
            T.DEFENSES_VERIFIED,
            "False",
            R.SELF_TEST_FAILED,
            f"defense self-test failed ({listing(failed)}); trials end as defense_failed until fixed",
        )
    else:
        conds.set(
            T.DEFENSES_VERIFIED,
            "Unknown",
            R.SELF_TEST_PENDING,
            "no probe sandbox has run yet; every trial still self-tests its own defenses and fails closed",
        )


def compute_pool_status(
    pool: SandboxPool,
    observed: Observed,
    now: datetime,
    *,
    task_set_images: list[str],
    pod_template_hash: str | None,
) -> SandboxPoolStatus:
    """The whole status of a pool."""
    previous = pool.status or SandboxPoolStatus()
    generation = pool.metadata.generation or 0
    conds = ConditionSet(previous.conditions, generation, now)
    images = desired_images(pool, task_set_images)
    cache = _cache(pool, observed, images)
    cached = sum(
        1
        for image in images
        if cache.matching_nodes and len(cache.pulled.get(image, ())) >= cache.matching_nodes
    )
    _set_images_cached(conds, pool, images, cache, cached)
    _set_defenses(conds, pool, previous)

    warm_pods = [p for p in observed.pods if p.labels.get(COMPONENT_LABEL) == WARM and not p.deleting]
    warm_ready = sum(p.ready for p in warm_pods)
    leased = sum(p.labels.get(LEASED_LABEL) == "true" for p in warm_pods)
    problems = [pp for p in warm_pods if (pp := pod_problem(p)) is not None]
    images_cond = next(c for c in conds.conditions if c.type == T.IMAGES_CACHED)
    defenses_cond = next(c for c in conds.conditions if c.type == T.DEFENSES_VERIFIED)

    if images_cond.reason == R.NO_MATCHING_NODES:
        conds.set(T.READY, "False", R.NO_MATCHING_NODES, images_cond.message)
    elif defenses_cond.reason == R.SELF_TEST_FAILED:
        conds.set(T.READY, "False", R.SELF_TEST_FAILED, defenses_cond.message)
    elif warm_ready < pool.spec.replicas:
        detail = f"; {problems[0][1]}" if problems else ""
        conds.set(
            T.READY,
            "False",
            R.WARM_CAPACITY_NOT_READY,
            f"{warm_ready}/{pool.spec.replicas} warm sandboxes ready{detail}",
        )
    else:
        note = "" if images_cond.status == "True" else f" (images: {images_cond.message})"
        conds.set(T.READY, "True", R.POOL_READY, f"trials can start{note}")

    if images_cond.reason == R.PULL_FAILED:
        conds.set(T.DEGRADED, "True", R.PULL_FAILED, images_cond.message)
    elif images_cond.reason == R.NO_MATCHING_NODES:
        conds.set(T.DEGRADED, "True", R.NO_MATCHING_NODES, images_cond.message)
    elif defenses_cond.reason == R.SELF_TEST_FAILED:
        conds.set(T.DEGRADED, "True", R.SELF_TEST_FAILED, defenses_cond.message)
    elif problems:
        conds.set(T.DEGRADED, "True", R.WARM_CAPACITY_NOT_READY, problems[0][1])
    else:
        conds.set(T.DEGRADED, "False", R.AS_EXPECTED, "")

    return SandboxPoolStatus(
        observed_generation=generation,
        conditions=conds.conditions,
        images_desired=len(images),
        images_cached=cached,
        nodes=list(cache.nodes.values())[:5000],
        replicas=len(warm_pods),
        ready_replicas=warm_ready,
        leased_replicas=leased,
        selector=selector_string(warm_selector(pool)),
        self_test=previous.self_test,
        pod_template_hash=pod_template_hash,
    )
