"""Weight sync over NCCL: every trainer rank feeds the writer, which broadcasts to every engine; GPU only.

The engines run vLLM's own `nccl` weight-transfer backend (`--weight-transfer-config '{"backend":"nccl"}'`,
rendered by the operator for `weightSync.method: NCCL`). The writer (global rank 0) is NCCL rank 0 of one
transfer group with every worker of every replica (their ranks follow it, offsets from each replica's
`GET /get_world_size`); it rendezvouses with them at `LEGORL_WEIGHT_SYNC_ADDRESS:PORT` (its pod's stable name
and a port the operator opens to the run's engines).

A sync, on every trainer rank at once (`sync(version)` is a collective):
1. the writer pauses every replica (`keep`: in-flight requests are recomputed with the new weights);
2. vLLM's trainer engine (`NCCLTrainerWeightTransferEngine`) iterates the weights as `HfExport` streams them:
   each part assembled from its tensor-parallel shards by the ranks holding it, sent to the writer by one
   of them (per pipeline stage, per expert-parallel rank) — every rank takes part — and the writer packs
   them into buckets (`bucket_bytes`, double-buffered) that it broadcasts to every engine worker;
3. the writer sets the version, resets each replica's prefix cache, resumes, and checks that every replica's
   `/weight_info` reports the version.

The writer holds one part and two buckets at a time, never the whole model. vLLM's `nccl` backend has one
sender (rank 0 of its group); a broadcast straight from each pipeline stage's own rank would need its
`nccl_m2n` backend and NVIDIA's `nccl.m2n` library, which this build does not use. A transfer that breaks
half way leaves the engines' layers on the meta device (vLLM starts its layer-wise reload in
`start_weight_update`): the replica must be restarted; nothing here retries a broadcast.

Nothing of NCCL can run on a CPU machine: the tests drive this class with the transfer engine replaced by a
recorder (tests/trainer/test_trainer_nccl_sync.py) — the gather, the HTTP sequence on every replica, the
report —
and `benchmarks/gpu_check.py` is where a GPU runs the real one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from legorl.trainer.sync.fleet_sync import FleetWeightSync, PauseMode, ReplicaSync
from legorl.trainer.sync.publish import WeightSyncError, check_version

__all__ = ["NcclSyncReport", "NcclWeightSync"]

DEFAULT_BUCKET_BYTES = 1 << 30
"""Packed broadcast buffer (vLLM's default: 1 GiB, two of them in flight)."""


@dataclass(frozen=True)
class NcclSyncReport:
    """A completed sync: every replica serves `version`."""

    version: str
    replicas: tuple[ReplicaSync, ...]
    seconds: float
    """Pause of the first replica to the last `/weight_info` check."""
    transfer_seconds: float
    """The gather and broadcast alone."""
    bytes: int
    """Bytes broadcast (the whole model in HF names, in its dtype)."""

    @property
    def bytes_per_second(self) -> float:
        return self.bytes / self.transfer_seconds if self.transfer_seconds > 0 else float("nan")


EngineFactory = Callable[..., Any]
"""`(init_info, *, client, source) -> engine` with `send_weights()` and `shutdown()`: vLLM's
`WeightTransferTrainerFactory.trainer_init` (the tests pass a recorder)."""


class _ExportSource:
    """vLLM's `WeightSource` over `HfExport`: metadata without moving tensors, then the streamed export."""

    def __init__(self, export: Callable[[], Any]) -> None:
        self._export = export
        self._current: Any = None

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta  # noqa: PLC0415

        # Making the export is a collective (every rank's part list): vLLM calls metadata() on every rank.
        self._current = self._export()
        return [ParamMeta(name, dtype, tuple(shape)) for name, shape, dtype in self._current.meta]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        export = self._current if self._current is not None else self._export()
        self._current = None
        yield from export


class _FanOutClient:
    """vLLM's `VLLMWeightSyncClient` over several replicas: every call goes to all of them concurrently.

    Concurrency is required, not an optimisation: each replica's init and update block inside NCCL
    collectives until every rank of the group has joined. Each replica gets its own `rank_offset`.
    """

    def __init__(self, fleet: FleetWeightSync, offsets: Sequence[int]) -> None:
        self._fleet = fleet
        self._offsets = list(offsets)

    def _all(self, call: Callable[[str, int], object]) -> None:
        urls = self._fleet.base_urls
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(urls)) as pool:
            for future in [
                pool.submit(call, url, offset) for url, offset in zip(urls, self._offsets, strict=True)
            ]:
                future.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all(
            lambda url, offset: self._fleet._post(
                url, "/init_weight_transfer_engine", json={"init_info": {**init_info, "rank_offset": offset}}
            )
        )

    def start_weight_update(self) -> None:
        self._all(lambda url, _: self._fleet._post(url, "/start_weight_update"))

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._all(lambda url, _: self._fleet._post(url, "/update_weights", json={"update_info": update_info}))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {"weight_version": weight_version} if weight_version is not None else {}
        self._all(lambda url, _: self._fleet._post(url, "/finish_weight_update", json=body))


class _NoClient:
    """The client of a non-sending rank: vLLM's engine never calls it there."""

    def __getattr__(self, name: str) -> Any:
        raise WeightSyncError(f"a non-writer trainer rank tried to drive the fleet ({name})")


class NcclWeightSync:
    """The NCCL weight sync of one trainer rank (every rank makes one; only the writer talks to the fleet)."""

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        rank: int,
        master_address: str,
        master_port: int,
        pause_mode: PauseMode = "keep",
        timeout: float = 600.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        engine_factory: EngineFactory | None = None,
    ) -> None:
        """`master_address:master_port`: the writer's rendezvous, reachable by every engine worker."""
        if bucket_bytes < 1 << 20:
            raise WeightSyncError(f"bucket_bytes={bucket_bytes}: use at least 1 MiB")
        self.rank = rank
        self.writer = rank == 0
        self.master_address = master_address
        self.master_port = master_port
        self.bucket_bytes = bucket_bytes
        self._factory = engine_factory
        self._fleet = (
            FleetWeightSync(base_urls, pause_mode=pause_mode, timeout=timeout, update_attempts=1)
            if self.writer
            else None
        )
        self._engine: Any = None
        self._bytes = 0

    def connect(self, export: Callable[[], Any]) -> None:
        """Rendezvous with every replica's workers (every rank calls it). `export()` makes the `HfExport`
        of the current weights (a collective)."""
        factory: EngineFactory | None = self._factory
        if factory is None:
            from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory  # noqa: PLC0415

            # vLLM's engine only iterates the source and asks its metadata (duck-typed `WeightSource`).
            vllm_factory: Any = WeightTransferTrainerFactory.trainer_init
            factory = vllm_factory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo  # noqa: PLC0415

        def counted() -> Any:
            made = export()
            self._bytes = int(made.nbytes)
            return made

        client: Any = _NoClient()
        world = 1
        if self._fleet is not None:
            # The transfer group is fixed from here: a replica that restarts needs a new group.
            self._fleet.refresh()
            sizes = []
            for url in self._fleet.base_urls:
                body = self._fleet._request("GET", url, "/get_world_size", params={"include_dp": "true"})
                sizes.append(int(body["world_size"]))
            offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
            world = 1 + sum(sizes)
            client = _FanOutClient(self._fleet, offsets)
        init_info = NCCLTrainerInitInfo(
            master_address=self.master_address,
            master_port=self.master_port,
            world_size=world,
            packed=True,
            packed_buffer_size_bytes=self.bucket_bytes,
            rank=self.rank,
        )
        self._engine = factory(init_info, client=client, source=_ExportSource(counted))

    def sync(self, version: str) -> NcclSyncReport | None:
        """Send the current weights to every replica as `version` (every rank calls it; the report is the
        writer's, None elsewhere)."""
        check_version(version)
        if self._engine is None:
            raise WeightSyncError("call connect() before sync()")
        if self._fleet is None:
            self._engine.send_weights()
            return None
        fleet = self._fleet
        started = time.perf_counter()
        try:
            for url in fleet.base_urls:
                fleet._post(url, "/pause", params={"mode": fleet.pause_mode, "clear_cache": "false"})
            sent = time.perf_counter()
            self._engine.send_weights()
            transfer = time.perf_counter() - sent
            for url in fleet.base_urls:
                fleet._post(url, "/update_weight_version", json={"new_version": version})
                fleet._reset_prefix_cache(url)
        except BaseException as exc:
            errors = [e for e in (fleet._try_resume(url) for url in fleet.base_urls) if e is not None]
            if not isinstance(exc, WeightSyncError):
                raise
            raise WeightSyncError(
                f"NCCL weight sync of {version} failed: {exc}; resume errors: {errors}"
            ) from exc
        errors = [e for e in (fleet._try_resume(url) for url in fleet.base_urls) if e is not None]
        if errors:
            raise WeightSyncError(f"NCCL weight sync of {version}: replicas did not resume: {errors}")
        served = fleet.served_versions()
        if any(v != version for v in served):
            raise WeightSyncError(f"after syncing {version} the replicas report {served}")
        seconds = time.perf_counter() - started
        return NcclSyncReport(
            version=version,
            replicas=tuple(ReplicaSync(url=url, seconds=seconds, attempts=1) for url in fleet.base_urls),
            seconds=seconds,
            transfer_seconds=transfer,
            bytes=self._bytes,
        )

    def served_versions(self) -> list[str]:
        """Every replica's `/weight_info` (the writer; [] elsewhere)."""
        return self._fleet.served_versions() if self._fleet is not None else []

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            if self._fleet is not None:
                for url in self._fleet.base_urls:
                    with contextlib.suppress(WeightSyncError):
                        self._fleet._post(url, "/shutdown_weight_transfer_engine")
            self._engine = None
        if self._fleet is not None:
            self._fleet.close()
