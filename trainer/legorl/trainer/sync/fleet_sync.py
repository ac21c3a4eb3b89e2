"""The trainer's fleet client: load published weights into every vLLM replica over its dev-mode HTTP routes.

`FleetWeightSync` drives the sequence on every replica (pause, start, update with bounded retries, finish with
the version, reset the prefix cache, resume — always resume — and confirm `/weight_info`); the engines load
the directory with the `legorl_filesystem` backend of `engine/plugin.py`. The NCCL path (vLLM's own `nccl`
backend, GPU only) is `nccl_sync.py`, which shares this client's HTTP sequence.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from legorl.api import weight_versions
from legorl.api.weights import PublishedWeights
from legorl.trainer.sync.publish import REJECTED, WeightSyncError, read_published

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

_WORKER_ERROR = re.compile(r"Worker failed with error '(.*)', please check the stack trace", re.DOTALL)

PauseMode = Literal["keep", "wait", "abort"]


def update_info(published: PublishedWeights, *, with_sha256: bool = True) -> dict[str, str]:
    """The `update_info` of the `legorl_filesystem` backend for `published` (read from a local path)."""
    info = {"path": str(published.path), "version": published.version}
    if with_sha256:
        info["sha256"] = published.sha256
    return info


@dataclass(frozen=True)
class ReplicaSync:
    """One replica's part of a sync."""

    url: str
    seconds: float
    """Pause to resume, inclusive."""
    attempts: int
    """`/update_weights` calls made (1 unless a transient failure was retried)."""


@dataclass(frozen=True)
class SyncReport:
    """A completed sync: every replica serves `version`."""

    version: str
    replicas: tuple[ReplicaSync, ...]
    seconds: float
    """Wall time of the whole sync (replicas run concurrently)."""

    @property
    def replica_seconds(self) -> dict[str, float]:
        return {replica.url: replica.seconds for replica in self.replicas}


class _Rejected(WeightSyncError):
    """The engine refused the payload itself: retrying the same payload cannot succeed."""


@dataclass
class _Replica:
    url: str
    attempts: int = 0


class FleetWeightSync:
    """Loads published weights into every replica of a vLLM fleet over its dev-mode HTTP routes.

    Per replica: `POST /pause?mode=<pause_mode>&clear_cache=false` → `/start_weight_update` →
    `/update_weights` (a transient failure is retried, bounded, while still paused; a payload the engine
    rejects is not, and the backend leaves the previous weights in place either way) →
    `/finish_weight_update {"weight_version": v}` → `/reset_prefix_cache?reset_running_requests=true` (still
    paused, so no request runs on KV that the old weights computed: cached prefixes are dropped and kept
    requests recompute) → `/resume` (always attempted once the pause was sent, also after a failure) →
    `GET /weight_info` must report `v`. Replicas are synced concurrently; a failure on any raises
    `WeightSyncError` naming each replica's outcome.
    """

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        pause_mode: PauseMode = "keep",
        timeout: float = 600.0,
        update_attempts: int = 3,
        retry_delay: float = 1.0,
        verify_sha256: bool = True,
        resolve: Callable[[str, int], list[str]] | None = None,
    ) -> None:
        """`base_urls`: one `http://host:port` per replica, or `dns+http://name:port` for every address a
        name resolves to (the operator's headless Service of a fleet's serving pods: one address per
        replica, looked up again at every sync). `timeout`: per HTTP call, seconds.

        `verify_sha256`: the engines hash the files they load against the manifest (one extra read).
        `resolve(host, port)`: the addresses of a `dns+` name (default: the system resolver).
        """
        import httpx  # noqa: PLC0415 -- only the trainer side needs it, not vLLM's workers

        if isinstance(base_urls, str) or not base_urls:
            raise WeightSyncError("base_urls must be a non-empty list of engine URLs (one per replica)")
        urls = [str(url).rstrip("/") for url in base_urls]
        bad = [
            url for url in urls if not url.startswith(("http://", "https://", "dns+http://", "dns+https://"))
        ]
        if bad:
            raise WeightSyncError(f"engine URLs must start with http://, https:// or dns+http://, got {bad}")
        if len(set(urls)) != len(urls):
            raise WeightSyncError(f"engine URLs repeat: {urls}")
        self._given = urls
        self._resolve = resolve or _resolve_addresses
        self.base_urls = urls if not any(u.startswith("dns+") for u in urls) else []
        """The replicas' URLs as of the last `refresh()`."""
        if pause_mode not in ("keep", "wait", "abort"):
            raise WeightSyncError(f"pause_mode must be keep, wait or abort, got {pause_mode!r}")
        if update_attempts < 1:
            raise WeightSyncError(f"update_attempts must be at least 1, got {update_attempts}")
        self.pause_mode: PauseMode = pause_mode
        self.timeout = timeout
        self.update_attempts = update_attempts
        self.retry_delay = retry_delay
        self.verify_sha256 = verify_sha256
        # One connection per call: vLLM's server answers a failed control call with a 500 and then drops the
        # connection, which would fail the next call (the resume) on a reused keep-alive connection.
        self._http = httpx.Client(timeout=timeout, headers={"Connection": "close"})

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> FleetWeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public ------------------------------------------------------------------------------------------

    def refresh(self) -> list[str]:
        """Look the replicas up again (`dns+` names: every address now; plain URLs as given)."""
        urls: list[str] = []
        for url in self._given:
            if not url.startswith("dns+"):
                urls.append(url)
                continue
            parsed = httpx_url(url.removeprefix("dns+"))
            addresses = self._resolve(parsed.host, parsed.port)
            if not addresses:
                raise WeightSyncError(f"{url}: no address behind {parsed.host} (no replica is ready)")
            for address in sorted(set(addresses)):
                host = f"[{address}]" if ":" in address else address
                urls.append(f"{parsed.scheme}://{host}:{parsed.port}")
        self.base_urls = urls
        return urls

    def sync(self, published: PublishedWeights) -> SyncReport:
        """Load `published` into every replica; returns per-replica timings once all serve its version."""
        self.refresh()
        # Cheap pre-flight (no hashing: the engines hash what they read): a stale or half-written
        # directory is refused before any engine pauses.
        on_disk = read_published(Path(published.path), verify_sha256=False)
        if (on_disk.version, on_disk.sha256, on_disk.num_tensors) != (
            published.version,
            published.sha256,
            published.num_tensors,
        ):
            raise WeightSyncError(
                f"{published.path} holds version {on_disk.version} (sha256 {on_disk.sha256[:12]}…, "
                f"{on_disk.num_tensors} tensors), not the {published.version} being synced (sha256 "
                f"{published.sha256[:12]}…, {published.num_tensors} tensors)"
            )
        started = time.perf_counter()
        info = update_info(published, with_sha256=self.verify_sha256)
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(self.base_urls)) as pool:
            futures = {
                url: pool.submit(self._sync_replica, url, info, published.version) for url in self.base_urls
            }
            results: dict[str, ReplicaSync | BaseException] = {}
            for url, future in futures.items():
                try:
                    results[url] = future.result()
                except Exception as exc:  # noqa: BLE001 -- collected and reported per replica below
                    results[url] = exc
        failed = {url: r for url, r in results.items() if isinstance(r, BaseException)}
        if failed:
            ok = f"ok, serves {published.version}"
            lines = [
                f"{url}: {f'FAILED: {r}' if isinstance(r, BaseException) else ok}"
                for url, r in results.items()
            ]
            raise WeightSyncError(
                f"weight sync of {published.version} failed on {len(failed)} of {len(results)} "
                "replica(s):\n  " + "\n  ".join(lines)
            )
        replicas = tuple(r for r in results.values() if isinstance(r, ReplicaSync))
        return SyncReport(version=published.version, replicas=replicas, seconds=time.perf_counter() - started)

    def served_versions(self) -> list[str]:
        """`GET /weight_info` of every replica (looked up again), in `base_urls` order."""
        return [self._weight_version(url) for url in self.refresh()]

    # -- one replica -------------------------------------------------------------------------------------

    def _sync_replica(self, url: str, info: dict[str, str], version: str) -> ReplicaSync:
        started = time.perf_counter()
        replica = _Replica(url)
        try:
            # clear_cache=false: the reset that matters comes once the new weights are in (below); vLLM's
            # pause-time clearing is deprecated and would run before them.
            self._post(url, "/pause", params={"mode": self.pause_mode, "clear_cache": "false"})
            self._update(replica, info)
            self._post(url, "/finish_weight_update", json={"weight_version": version})
            self._reset_prefix_cache(url)
        except BaseException as exc:
            # Whatever failed (the pause included: it may have landed before the connection dropped), the
            # replica must not stay paused.
            resume_error = self._try_resume(url)
            if not isinstance(exc, WeightSyncError):
                raise
            outcome = (
                f"and resuming failed too ({resume_error}): the replica may still be paused"
                if resume_error is not None
                else "(the replica was resumed)"
            )
            raise WeightSyncError(f"{exc} {outcome}") from exc
        resume_error = self._try_resume(url)
        if resume_error is not None:
            raise WeightSyncError(f"{url} loaded {version} but did not resume: {resume_error}")
        served = self._weight_version(url)
        if served != version:
            raise WeightSyncError(f"{url} reports weight version {served!r} after syncing {version!r}")
        return ReplicaSync(url=url, seconds=time.perf_counter() - started, attempts=replica.attempts)

    def _update(self, replica: _Replica, info: dict[str, str]) -> None:
        while True:
            replica.attempts += 1
            try:
                self._start(replica.url)
                self._post(replica.url, "/update_weights", json={"update_info": info})
                return
            except _Rejected:
                raise
            except WeightSyncError as exc:
                if replica.attempts >= self.update_attempts:
                    raise WeightSyncError(f"{exc} (after {replica.attempts} attempt(s))") from exc
                log.warning("update_weights on %s failed (%s); retrying while paused", replica.url, exc)
                time.sleep(self.retry_delay * replica.attempts)

    def _start(self, url: str) -> None:
        try:
            self._post(url, "/start_weight_update")
        except WeightSyncError as exc:
            if "already active" not in str(exc):
                raise
            # A previous client died between start and finish; close that session (our backend applies
            # nothing in finish) and start ours.
            log.warning("%s had a weight update session open; finishing it before starting", url)
            self._post(url, "/finish_weight_update", json={})
            self._post(url, "/start_weight_update")

    def _reset_prefix_cache(self, url: str) -> None:
        body = self._post(url, "/reset_prefix_cache", params={"reset_running_requests": "true"})
        if isinstance(body, dict) and body.get("success") is False:
            raise WeightSyncError(f"{url} could not reset its prefix cache; cached KV may predate the update")

    def _try_resume(self, url: str) -> WeightSyncError | None:
        """`POST /resume`, retried a few times; returns the last error instead of raising."""
        error: WeightSyncError | None = None
        for attempt in range(3):
            try:
                self._post(url, "/resume")
            except WeightSyncError as exc:
                error = exc
                time.sleep(self.retry_delay * (attempt + 1))
            else:
                return None
        return error

    def _weight_version(self, url: str) -> str:
        body = self._request("GET", url, "/weight_info")
        version = weight_versions.from_weight_info(body)
        if version is None:
            raise WeightSyncError(f"{url}/weight_info answered {body!r}, not {{'weight_version': ...}}")
        return version

    # -- HTTP --------------------------------------------------------------------------------------------

    def _post(self, url: str, path: str, *, json: Any = None, params: Mapping[str, str] | None = None) -> Any:
        return self._request("POST", url, path, json=json, params=params)

    def _request(
        self,
        method: str,
        url: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
    ) -> Any:
        import httpx  # noqa: PLC0415

        try:
            response = self._http.request(method, url + path, json=json, params=params)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"{method} {url}{path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            text = _error_text(response)
            error = _Rejected if REJECTED in text else WeightSyncError
            hint = ""
            if response.status_code == 404:
                hint = " (is the engine started with VLLM_SERVER_DEV_MODE=1 and a --weight-transfer-config?)"
            raise error(f"{method} {url}{path} answered {response.status_code}: {text}{hint}")
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text


@dataclass(frozen=True)
class _Url:
    scheme: str
    host: str
    port: int


def httpx_url(url: str) -> _Url:
    """scheme, host and port (the scheme's default when absent) of an http(s) URL."""
    from urllib.parse import urlsplit  # noqa: PLC0415

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WeightSyncError(f"{url!r} is not an http(s) URL with a host")
    return _Url(parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))


def _resolve_addresses(host: str, port: int) -> list[str]:
    import socket  # noqa: PLC0415

    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise WeightSyncError(f"cannot resolve the fleet's replicas {host}: {exc}") from exc
    return [str(info[4][0]) for info in found]


def _error_text(response: httpx.Response) -> str:
    """vLLM's error message (`{"error": {"message": ...}}` or FastAPI's `{"detail": ...}`), else the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:2000]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            message = str(error["message"])
            # A worker's exception arrives wrapped in two layers of vLLM's own text; keep the worker's.
            worker = _WORKER_ERROR.search(message)
            return (worker.group(1) if worker else message)[:2000]
        if "detail" in body:
            return str(body["detail"])[:2000]
    return response.text.strip()[:2000]
