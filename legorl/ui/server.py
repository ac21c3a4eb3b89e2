"""The UI's web application (Starlette): a JSON API over run stores and the cluster, and the front end.

Routes (all JSON but `/` and `/static/...`; every URL the front end uses is relative, so the UI works
at any path prefix, behind `kubectl port-forward` or `kubectl proxy`):

- `GET /healthz`; `GET /api/info` (version, where runs come from, whether actions are enabled).
- `GET /api/runs`; `GET /api/runs/{run}` (overview: conditions, preflight, resolved spec, events,
  batches, evaluations); `.../curves`; `.../outcomes`; `.../tasks`; `.../trials?filters` (paginated);
  `.../trials/{trial}` (the trajectory, token by token); `.../fleet`; `.../sandboxes`; `.../diagnostics`.
- `GET /api/compare?runs=a,b`; `GET /api/rules` (the diagnostics' rules).
- `POST /api/runs/{run}/actions/{pause|resume|validate}`: only with `Authorization: Bearer <token>`
  matching the configured action token; 403 when none is configured.

Every JSON answer is a model of `legorl.ui.schemas`: an `ApiRoute` takes it from its handler's return
annotation, so each endpoint's shape is declared once. Bad query parameters answer 400 with
`{"error": {"message", "param"}}`; unknown runs, steps and trials 404. Responses carry a strict
Content-Security-Policy; the front end builds every element from text (trajectories are untrusted model
output).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import re
import threading
import time
import typing
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final
from urllib.parse import parse_qs, unquote

import httpx
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from legorl.api import __version__, weight_versions
from legorl.api.common import Condition, LocalObjectReference
from legorl.api.fleet import RolloutFleetSpec, RolloutFleetStatus
from legorl.api.labels import (
    POLICY_VERSION_ANNOTATION,
    RUN_LABEL,
    TRIAL_LABEL,
    VALIDATE_ANNOTATION,
    owned_fleet_name,
    owned_pool_name,
)
from legorl.api.lenient import read_field, reported, status_of
from legorl.api.pool import SandboxPoolStatus
from legorl.api.run import RLRunSpec
from legorl.api.store import StoreError

from . import diag
from .catalog import Catalog, RunEntry
from .data import REASONS, SORT_KEYS, NotFound, StoreData, TrialQuery
from .kube import ApiError, KubeSource, pod_stage
from .schemas import (
    ActionDone,
    Compare,
    ComparedRun,
    Curves,
    Diagnostics,
    EngineFigures,
    EventView,
    Fleet,
    Health,
    Info,
    Outcomes,
    Overview,
    PodRow,
    PoolView,
    Replica,
    Rules,
    RunRow,
    Runs,
    Sandboxes,
    Schema,
    StoreCondition,
    TaskGrid,
    Trajectory,
    TrialPage,
    ValidationView,
    given,
    to_json_bytes,
)
from .settings import UiSettings

__all__ = ["CSP", "ApiRoute", "UiApp", "start_in_thread"]

log = logging.getLogger(__name__)

STATIC_DIR: Final = Path(__file__).parent / "static"
CSP: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS: Final = {
    "cache-control": "no-store",
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cross-origin-opener-policy": "same-origin",
}
_TYPES: Final = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".json": "application/json",
}
ACTIONS: Final = ("pause", "resume", "validate")
_TRIAL_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_RUN_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._~-]{0,300}")
_MAX_BODY: Final = 64 * 1024
_ANY_METHOD: Final = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


class HttpError(Exception):
    """An answer other than 200, with a message a person can act on."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class Params:
    """Query parameters, checked: unknown names, repeats and malformed values are 400s."""

    def __init__(self, request: Request, allowed: tuple[str, ...]) -> None:
        raw: bytes = request.scope["query_string"]
        query = parse_qs(raw.decode("latin-1"), keep_blank_values=True)
        for name, values in query.items():
            if name not in allowed:
                known = ", ".join(allowed) if allowed else "none"
                raise HttpError(400, f"unknown query parameter {name!r} (this endpoint takes: {known})", name)
            if len(values) > 1:
                raise HttpError(
                    400, f"query parameter {name!r} is given {len(values)} times; give it once", name
                )
        self.query = {k: v[0] for k, v in query.items()}

    def text(self, name: str, max_length: int = 256) -> str | None:
        value = self.query.get(name)
        if value is None or value == "":
            return None
        if len(value) > max_length:
            raise HttpError(400, f"{name} is longer than {max_length} characters", name)
        return value

    def integer(
        self, name: str, default: int | None = None, *, low: int = 0, high: int = 10**9
    ) -> int | None:
        value = self.text(name)
        if value is None:
            return default
        if not re.fullmatch(r"-?[0-9]{1,10}", value):
            raise HttpError(400, f"{name} must be an integer, got {value!r}", name)
        number = int(value)
        if not low <= number <= high:
            raise HttpError(400, f"{name} must be between {low} and {high}, got {number}", name)
        return number

    def number(self, name: str) -> float | None:
        value = self.text(name, 64)
        if value is None:
            return None
        try:
            number = float(value)
        except ValueError:
            raise HttpError(400, f"{name} must be a number, got {value!r}", name) from None
        if not math.isfinite(number):
            raise HttpError(400, f"{name} must be a finite number, got {value!r}", name)
        return number

    def choice(
        self, name: str, choices: tuple[str, ...] | list[str], default: str | None = None
    ) -> str | None:
        value = self.text(name)
        if value is None:
            return default
        if value not in choices:
            raise HttpError(400, f"{name} must be one of {', '.join(choices)}; got {value!r}", name)
        return value

    def flag(self, name: str) -> bool | None:
        value = self.text(name, 8)
        if value is None:
            return None
        if value.lower() in ("true", "1", "yes"):
            return True
        if value.lower() in ("false", "0", "no"):
            return False
        raise HttpError(400, f"{name} must be true or false, got {value!r}", name)


def _clean(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def json_bytes(obj: Any) -> bytes:
    """JSON that every browser parses: NaN and infinities become null."""
    try:
        return json.dumps(obj, allow_nan=False, separators=(",", ":"), default=str).encode()
    except ValueError:
        return json.dumps(_clean(obj), allow_nan=False, separators=(",", ":"), default=str).encode()


def _json(status: int, obj: Any) -> Response:
    return Response(json_bytes(obj), status, media_type="application/json")


def _error(status: int, message: str, param: str | None = None) -> Response:
    return _json(status, {"error": {"message": message, "param": param, "status": status}})


def _failure(request: Request, exc: Exception) -> Response:
    """The answer to a request that failed: the status and message a person can act on."""
    if isinstance(exc, HttpError):
        return _error(exc.status, exc.message, exc.param)
    if isinstance(exc, NotFound):
        return _error(404, str(exc))
    if isinstance(exc, ApiError):
        status = exc.status if exc.status in (404, 409, 422, 503) else 502
        return _error(status, f"Kubernetes API: {exc}")
    if isinstance(exc, StoreError):
        return _error(500, f"run store: {exc}")
    if isinstance(exc, HTTPException):  # the router's: no route, or not this method
        if exc.status_code == 404:
            return _error(404, f"no such endpoint: {request.url.path}")
        if exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "").split(", ")
            use = ", ".join(sorted(m for m in allowed if m and m != "HEAD"))
            return _error(405, f"{request.method} is not allowed here; use {use}")
        return _error(exc.status_code, str(exc.detail))
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return _error(500, "internal error while answering; the UI's log has the details")


def _api(
    handler: Callable[[Request], Awaitable[Schema]], answer: type[Schema]
) -> Callable[[Request], Awaitable[Response]]:
    """A route's endpoint: the handler's answer (an `answer`) as JSON, or the failure's answer."""

    async def endpoint(request: Request) -> Response:
        try:
            result = await handler(request)
            if not isinstance(result, answer):
                raise TypeError(
                    f"{request.url.path} answered a {type(result).__name__}, not its {answer.__name__}"
                )
            return Response(to_json_bytes(result), 200, media_type="application/json")
        except Exception as exc:  # noqa: BLE001 - every failure answers; unexpected ones are logged
            return _failure(request, exc)

    return endpoint


class ApiRoute(Route):
    """A JSON route. Its answer's model (`response_model`, a `schemas.Schema`) is its handler's return
    annotation: the shape of what it sends is declared once, where the handler is."""

    def __init__(
        self, path: str, handler: Callable[[Request], Awaitable[Schema]], *, methods: list[str] | None = None
    ) -> None:
        answer = typing.get_type_hints(handler).get("return")
        if not (isinstance(answer, type) and issubclass(answer, Schema)):
            raise TypeError(f"{path}: the handler {handler.__name__} must declare the Schema it returns")
        self.response_model: type[Schema] = answer
        super().__init__(path, _api(handler, answer), methods=methods)


async def _http_exception(request: Request, exc: Exception) -> Response:
    return _failure(request, exc)


class _SecurityHeaders:
    """Every answer, static or JSON, uncached and under a strict Content-Security-Policy."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in _HEADERS.items():
                    headers[name] = value
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class UiApp:
    """The UI: a Starlette application. Give it to any ASGI server (`legorl ui` uses uvicorn)."""

    def __init__(
        self,
        settings: UiSettings,
        *,
        kube: KubeSource | None = None,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.settings = settings
        self.kube = kube
        self._own_kube = False
        self.catalog = Catalog(settings, kube)
        self._http = http
        self._static = self._load_static()
        run = "/api/runs/{run}"
        routes = [
            Route("/", self.static, methods=_ANY_METHOD),
            Route("/index.html", self.static, methods=_ANY_METHOD),
            Route("/static/{name:path}", self.static, methods=_ANY_METHOD),
            ApiRoute("/healthz", self.healthz),
            ApiRoute("/api/info", self.info),
            ApiRoute("/api/rules", self.rules),
            ApiRoute("/api/compare", self.compare),
            ApiRoute("/api/runs", self.runs),
            ApiRoute(run, self.overview),
            ApiRoute(f"{run}/curves", self.curves),
            ApiRoute(f"{run}/outcomes", self.outcomes),
            ApiRoute(f"{run}/tasks", self.tasks),
            ApiRoute(f"{run}/trials", self.trials),
            ApiRoute(f"{run}/trials/{{trial}}", self.trajectory),
            ApiRoute(f"{run}/fleet", self.fleet),
            ApiRoute(f"{run}/sandboxes", self.sandboxes),
            ApiRoute(f"{run}/diagnostics", self.diagnostics),
            ApiRoute(f"{run}/actions/{{action}}", self.action, methods=["POST"]),
        ]
        self.app = Starlette(
            routes=routes,
            middleware=[Middleware(_SecurityHeaders)],
            exception_handlers={HTTPException: _http_exception},
            lifespan=self._lifespan,
        )
        self.app.router.redirect_slashes = False  # `/api/runs/` answers as `/api/runs`, not a redirect

    @staticmethod
    def _load_static() -> dict[str, tuple[bytes, str]]:
        """The front end, read once: a few small files of known types (nothing else under the folder)."""
        files: dict[str, tuple[bytes, str]] = {}
        for path in STATIC_DIR.rglob("*"):
            if path.is_file() and path.suffix in _TYPES:
                files[path.relative_to(STATIC_DIR).as_posix()] = (path.read_bytes(), _TYPES[path.suffix])
        return files

    # --- lifecycle ----------------------------------------------------------------------------------
    async def startup(self) -> None:
        if self.kube is None and self.settings.kube is not None:
            self.kube = KubeSource(self.settings.kube)
            self.catalog.kube = self.kube
            self._own_kube = True
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=2.0)

    async def shutdown(self) -> None:
        if self._own_kube and self.kube is not None:
            await self.kube.close()
        if self._http is not None:
            await self._http.aclose()

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.startup()
        try:
            yield
        finally:
            await self.shutdown()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self._http is None:  # served without a lifespan (httpx's ASGI transport in tests)
                await self.startup()
            path = scope["path"]
            if path != "/" and path.endswith("/") and not path.startswith("/static/"):
                scope = {**scope, "path": path.rstrip("/") or "/"}
        await self.app(scope, receive, send)

    async def static(self, request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            return _error(405, "static files are GET only")
        name = request.path_params.get("name", "index.html")
        found = self._static.get(name)
        if found is None:
            return _error(404, f"no static file {name!r}")
        body, content_type = found
        return Response(b"" if request.method == "HEAD" else body, media_type=content_type)

    # --- helpers ---------------------------------------------------------------------------------------
    async def _entry(self, request: Request) -> RunEntry:
        run = _path_param(request, "run")
        if not _RUN_RE.fullmatch(run):
            raise HttpError(404, f"no run {run!r}", "run")
        return await self.catalog.get(run)

    @staticmethod
    def _need_store(entry: RunEntry) -> StoreData:
        if entry.store is None:
            raise HttpError(
                409, f"the run store of {entry.name!r} cannot be read by this UI: {entry.store_note}", "run"
            )
        return entry.store

    async def _row(self, entry: RunEntry) -> RunRow:
        row = RunRow(
            id=entry.id,
            name=entry.name,
            namespace=entry.namespace,
            source=entry.source,
            store_note=entry.store_note,
            conditions=[],
            phase="Unknown",
        )
        if entry.store is not None:
            try:
                summary = await asyncio.to_thread(entry.store.summary)
            except (StoreError, OSError, ValueError) as exc:
                row.store_note = f"cannot read the run store: {exc}"
            else:
                row = row.model_copy(update=given(summary))
        if entry.resource is None:
            row.phase = _local_phase(row.conditions)
            return row
        status = entry.status
        metrics, trials = status.metrics, status.trials
        row.phase = status.phase
        row.conditions = list(status.conditions)
        row.reason = status.reason
        # What the status does not report (yet) leaves the store's figure standing.
        reports = {
            "step": status.step if reported(status, "step") else None,
            "policy_version": status.policy_version,
            "reward_mean": metrics.reward_mean,
            "held_out": metrics.held_out_solve_rate,
            "baseline": metrics.baseline_solve_rate,
            "fidelity": metrics.fidelity_correlation,
            "trials_per_minute": metrics.trials_per_minute,
            "trials_total": trials.total if reported(trials, "total") else None,
            "trials_running": trials.running if reported(trials, "running") else None,
            "suspended": bool(read_field(RLRunSpec, entry.resource.get("spec"), "suspend")),
        }
        return row.model_copy(update={key: value for key, value in reports.items() if value is not None})

    # --- handlers ----------------------------------------------------------------------------------------
    async def healthz(self, request: Request) -> Health:
        Params(request, ())
        return Health(ok=True)

    async def info(self, request: Request) -> Info:
        Params(request, ())
        return Info(
            version=__version__,
            cluster=self.kube is not None,
            namespaces=list(self.settings.kube.namespaces) if self.settings.kube else [],
            actions_enabled=self.settings.actions_enabled,
            actions=list(ACTIONS),
            reasons=REASONS,
            static=False,
        )

    async def rules(self, request: Request) -> Rules:
        Params(request, ())
        return await asyncio.to_thread(diag.rules)

    async def runs(self, request: Request) -> Runs:
        Params(request, ())
        entries, note = await self.catalog.runs()
        rows = [await self._row(e) for e in entries]
        return Runs(runs=rows, cluster_note=note)

    async def overview(self, request: Request) -> Overview:
        Params(request, ())
        entry = await self._entry(request)
        out = Overview(run=await self._row(entry), spec=None, conditions=[], preflight=[], events=[])
        if entry.store is not None:
            out = out.model_copy(update=given(await asyncio.to_thread(entry.store.overview)))
        if entry.resource is not None:  # the RLRun's word over its store's
            status = entry.status
            out.spec = entry.resource
            out.conditions = list(status.conditions)
            out.preflight = status.preflight
            out.status = entry.resource.get("status") or {}  # shown as the API server holds it
            validation = status.validation
            if validation is not None:  # the RLRun's status is the newest word on its canary
                out.validation = ValidationView(
                    source="cluster",
                    requested=validation.requested,
                    state=validation.state,
                    message=validation.message if reported(validation, "message") else None,
                    time=validation.completion_time or validation.start_time,
                    trial=validation.trial,
                    checks=list(validation.checks),
                )
            out.events = await self._events(entry)
        return out

    async def _events(self, entry: RunEntry) -> list[EventView]:
        if self.kube is None or entry.resource is None or entry.namespace is None:
            return []
        targets = [("RLRun", entry.name)]
        fleet, pool = _fleet_name(entry), _pool_name(entry)
        targets += [("RolloutFleet", fleet), ("SandboxPool", pool)]
        out = []
        for kind, name in targets:
            for e in await self.kube.events(entry.namespace, kind, name):
                out.append(
                    EventView(
                        kind=kind,
                        object=name,
                        type=e.get("type"),
                        reason=e.get("reason"),
                        message=e.get("message"),
                        count=e.get("count"),
                        time=e.get("lastTimestamp") or e.get("eventTime") or e.get("firstTimestamp"),
                    )
                )
        out.sort(key=lambda e: str(e.time or ""), reverse=True)
        return out[:200]

    async def curves(self, request: Request) -> Curves:
        Params(request, ())
        entry = await self._entry(request)
        return await asyncio.to_thread(self._need_store(entry).curves)

    async def outcomes(self, request: Request) -> Outcomes:
        Params(request, ())
        entry = await self._entry(request)
        return await asyncio.to_thread(self._need_store(entry).outcomes)

    async def tasks(self, request: Request) -> TaskGrid:
        Params(request, ())
        entry = await self._entry(request)
        return await asyncio.to_thread(self._need_store(entry).task_grid)

    async def trials(self, request: Request) -> TrialPage:
        p = Params(
            request,
            (
                "split",
                "step",
                "task",
                "reason",
                "group",
                "tampered",
                "min_reward",
                "max_reward",
                "q",
                "sort",
                "order",
                "offset",
                "limit",
            ),
        )
        reasons: tuple[str, ...] = ()
        reason_text = p.text("reason", 512)
        if reason_text:
            reasons = tuple(r.strip() for r in reason_text.split(",") if r.strip())
            bad = [r for r in reasons if r not in REASONS]
            if bad:
                raise HttpError(
                    400,
                    f"reason {bad[0]!r} is not a termination reason (one of {', '.join(REASONS)})",
                    "reason",
                )
        query = TrialQuery(
            split=p.choice("split", ("train", "validation")),
            step=p.integer("step"),
            task=p.text("task"),
            reason=reasons,
            group=p.text("group"),
            tampered=p.flag("tampered"),
            min_reward=p.number("min_reward"),
            max_reward=p.number("max_reward"),
            text=p.text("q", 128),
            sort=p.choice("sort", SORT_KEYS, "step") or "step",
            order=p.choice("order", ("asc", "desc"), "asc") or "asc",
            offset=p.integer("offset", 0) or 0,
            limit=p.integer("limit", 50, low=1, high=self.settings.max_page) or 50,
        )
        if (
            query.min_reward is not None
            and query.max_reward is not None
            and query.min_reward > query.max_reward
        ):
            raise HttpError(400, "min_reward is above max_reward", "min_reward")
        entry = await self._entry(request)
        store = self._need_store(entry)
        if query.step is not None:
            steps = await asyncio.to_thread(lambda: {r.summary.step for r in store.trials()})
            if query.step not in steps:
                raise HttpError(404, f"run {entry.name!r} has no trials at step {query.step}", "step")
        return await asyncio.to_thread(store.query_trials, query)

    async def trajectory(self, request: Request) -> Trajectory:
        Params(request, ())
        trial = _path_param(request, "trial")
        if not _TRIAL_RE.fullmatch(trial):
            raise HttpError(404, f"no trial {trial!r}", "trial")
        entry = await self._entry(request)
        return await asyncio.to_thread(self._need_store(entry).trajectory, trial)

    async def fleet(self, request: Request) -> Fleet:
        Params(request, ())
        entry = await self._entry(request)
        out = Fleet(available=False, replicas=[])
        if entry.store is not None:
            out.trainer_policy_version = await asyncio.to_thread(entry.store.trainer_policy_version)
            out.published_versions = await asyncio.to_thread(entry.store.published_versions)
        if entry.resource is not None and self.kube is not None and entry.namespace:
            name = _fleet_name(entry)
            body = await self.kube.get("RolloutFleet", entry.namespace, name)
            if body is None:
                out.note = f"RolloutFleet {name!r} does not exist (yet)"
                return out
            status = status_of(RolloutFleetStatus, body)
            pods = await self._selected_pods(entry.namespace, status.selector)
            by_name = {(p.get("metadata") or {}).get("name"): p for p in pods}
            replicas = []
            for ep in status.endpoints:
                pod = by_name.pop(ep.name, None)
                replicas.append(await self._replica(ep.name, ep.url, ep.ready, ep.policy_version, pod))
            for pod_name, pod in by_name.items():
                replicas.append(await self._replica(pod_name, None, None, None, pod))
            out.available = True
            out.source = "cluster"
            out.name = name
            out.spec_replicas = read_field(RolloutFleetSpec, body.get("spec"), "replicas")
            out.ready_replicas = status.ready_replicas
            out.served_policy_version = status.served_policy_version
            out.conditions = status.conditions
            out.replicas = replicas
            return out
        url = self.settings.engine_url(entry.name)
        if url is not None:
            replica = await self._replica("local engine", url, None, None, None)
            out.available = True
            out.source = "local"
            out.replicas = [replica]
            out.served_policy_version = replica.policy_version
            return out
        out.note = (
            "not available locally: this UI was not started by the process that runs the engine "
            "(`legorl run` serves the UI with its engine), and there is no cluster to read a RolloutFleet "
            "from"
        )
        return out

    async def _selected_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        assert self.kube is not None
        labels = dict(part.split("=", 1) for part in selector.split(",") if "=" in part)
        if not labels:
            return []
        return await self.kube.pods(namespace, labels)

    async def _replica(
        self,
        name: str | None,
        url: str | None,
        ready: bool | None,
        policy_version: str | None,
        pod: dict[str, Any] | None,
    ) -> Replica:
        replica = Replica(name=name, url=url, ready=ready, policy_version=policy_version)
        if pod is not None:
            meta, status = pod.get("metadata") or {}, pod.get("status") or {}
            replica.phase = status.get("phase")
            replica.node = (pod.get("spec") or {}).get("nodeName")
            replica.restarts = sum(c.get("restartCount", 0) for c in status.get("containerStatuses") or [])
            replica.policy_version = replica.policy_version or (meta.get("annotations") or {}).get(
                POLICY_VERSION_ANNOTATION
            )
        if url:
            replica = replica.model_copy(update=given(await self._engine_metrics(url)))
        return replica

    async def _engine_metrics(self, url: str) -> EngineFigures:
        """Queue and KV-cache usage from a vLLM's Prometheus metrics (best effort, 2 s)."""
        assert self._http is not None
        try:
            response = await self._http.get(url.rstrip("/") + "/metrics")
            values = _prometheus(response.text) if response.status_code == 200 else {}
        except httpx.HTTPError as exc:
            return EngineFigures(metrics_note=f"engine metrics unreachable: {type(exc).__name__}")
        out = EngineFigures(
            running=values.get("vllm:num_requests_running"),
            waiting=values.get("vllm:num_requests_waiting"),
            kv_usage=values.get("vllm:kv_cache_usage_perc", values.get("vllm:gpu_cache_usage_perc")),
        )
        try:
            info = await self._http.get(url.rstrip("/") + "/weight_info")
            version = weight_versions.from_weight_info(info.json()) if info.status_code == 200 else None
            if version is not None:
                out.policy_version = weight_versions.policy_version(version)
        except (httpx.HTTPError, ValueError):
            pass  # /weight_info exists only in vLLM's dev mode; the version then stays unknown
        return out

    async def sandboxes(self, request: Request) -> Sandboxes:
        Params(request, ())
        entry = await self._entry(request)
        out = Sandboxes(available=False)
        if entry.store is not None:
            out.stage_stats = await asyncio.to_thread(entry.store.stage_stats)
        if entry.resource is not None and self.kube is not None and entry.namespace:
            name = _pool_name(entry)
            pool = await self.kube.get("SandboxPool", entry.namespace, name)
            pods = await self.kube.pods(entry.namespace, {RUN_LABEL: entry.name})
            stages = Counter(pod_stage(p) for p in pods)
            rows = []
            for p in pods[:300]:
                meta, status = p.get("metadata") or {}, p.get("status") or {}
                rows.append(
                    PodRow(
                        name=meta.get("name"),
                        trial=(meta.get("labels") or {}).get(TRIAL_LABEL),
                        stage=pod_stage(p),
                        phase=status.get("phase"),
                        node=(p.get("spec") or {}).get("nodeName"),
                        started=status.get("startTime"),  # the Pod's (Kubernetes core), not a legorl status
                        reason=status.get("reason"),
                    )
                )
            pstatus = status_of(SandboxPoolStatus, pool)
            out.available = True
            out.source = "cluster"
            out.pool = (
                None
                if pool is None
                else PoolView(
                    name=name,
                    conditions=pstatus.conditions,
                    images_desired=pstatus.images_desired,
                    images_cached=pstatus.images_cached,
                    nodes=pstatus.nodes,
                    replicas=pstatus.replicas,
                    ready_replicas=pstatus.ready_replicas,
                    leased_replicas=pstatus.leased_replicas,
                    self_test=pstatus.self_test,
                )
            )
            out.pool_note = None if pool is not None else f"SandboxPool {name!r} does not exist (yet)"
            out.stages = dict(stages)
            out.pods = rows
            return out
        out.note = (
            "not available locally: `legorl run` runs trials in local sandboxes (bubblewrap), without a "
            "SandboxPool, trial pods or an image cache; the stage timings below come from the run store"
        )
        return out

    async def diagnostics(self, request: Request) -> Diagnostics:
        Params(request, ())
        entry = await self._entry(request)
        pods: list[dict[str, Any]] = []
        events: list[dict[str, Any]] = []
        if entry.resource is not None and self.kube is not None and entry.namespace:
            pods = await self.kube.pods(entry.namespace, {RUN_LABEL: entry.name})
            events = await self.kube.events(entry.namespace, "RLRun", entry.name)
        run = entry.resource
        if run is None and entry.store is not None:
            run = await asyncio.to_thread(entry.store.run_spec)
        data = entry.store
        if data is None:
            result = diag.diagnose_run(None, run, pods, events)
        elif pods or events:
            result = await asyncio.to_thread(diag.diagnose_run, data.store, run, pods, events)
        else:
            # Without cluster objects the findings depend on the store alone: keep them until it changes.
            def compute() -> Diagnostics:
                return diag.diagnose_run(data.store, run, pods, events)

            result = await asyncio.to_thread(lambda: data.memo("diagnostics", data.signature(), compute))
        return result.model_copy(update={"store_note": entry.store_note})  # the memo's copy stays as it was

    async def compare(self, request: Request) -> Compare:
        p = Params(request, ("runs",))
        text = p.text("runs", 2048)
        ids = [r for r in (text or "").split(",") if r]
        if len(ids) < 2:
            raise HttpError(400, "runs must name at least two runs, comma-separated (runs=a,b)", "runs")
        if len(ids) > 8:
            raise HttpError(400, "compare at most 8 runs at once", "runs")
        if len(set(ids)) != len(ids):
            raise HttpError(400, "runs names a run twice", "runs")
        out = []
        for run_id in ids:
            if not _RUN_RE.fullmatch(run_id):
                raise HttpError(404, f"no run {run_id!r}", "runs")
            entry = await self.catalog.get(run_id)
            row = await self._row(entry)
            curves = await asyncio.to_thread(entry.store.curves) if entry.store is not None else None
            out.append(ComparedRun(run=row, curves=curves))
        return Compare(runs=out)

    async def action(self, request: Request) -> ActionDone:
        await _read_body(request)
        Params(request, ())
        action = _path_param(request, "action")
        if action not in ACTIONS:
            raise HttpError(404, f"no action {action!r}; actions: {', '.join(ACTIONS)}", "action")
        token = self.settings.action_token
        if not token:
            raise HttpError(
                403,
                "actions are disabled: this UI runs read-only because no action token is configured "
                "(set LEGORL_UI_ACTION_TOKEN, or the chart's ui.actionTokenSecret)",
            )
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token.encode()):
            raise HttpError(401, "this action needs the UI's action token as `Authorization: Bearer <token>`")
        entry = await self._entry(request)
        if entry.resource is None or self.kube is None or entry.namespace is None:
            raise HttpError(
                409,
                f"{entry.name!r} is a local run store, not an RLRun in a cluster: pause, resume and validate "
                "act on RLRuns (stop a local `legorl run` with Ctrl-C; run it again to resume)",
            )
        if action in ("pause", "resume"):
            patch: dict[str, Any] = {"spec": {"suspend": action == "pause"}}
        else:
            patch = {"metadata": {"annotations": {VALIDATE_ANNOTATION: _now()}}}
        await self.kube.patch_run(entry.namespace, entry.name, patch)
        log.info("action %s on RLRun %s/%s", action, entry.namespace, entry.name)
        return ActionDone(ok=True, action=action, run=entry.id, patch=patch)


def _path_param(request: Request, name: str) -> str:
    return unquote(request.path_params[name])


async def _read_body(request: Request) -> bytes:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > _MAX_BODY:
            raise HttpError(413, f"request body over {_MAX_BODY} bytes")
    return body


def _fleet_name(entry: RunEntry) -> str:
    """The RolloutFleet the run uses: as its status names it, else its spec's reference, else its own."""
    ref: LocalObjectReference | None = read_field(RLRunSpec, (entry.resource or {}).get("spec"), "fleet_ref")
    return entry.status.fleet_name or (ref.name if ref else None) or owned_fleet_name(entry.name)


def _pool_name(entry: RunEntry) -> str:
    """The SandboxPool the run uses: as its status names it, else its spec's reference, else its own."""
    ref: LocalObjectReference | None = read_field(RLRunSpec, (entry.resource or {}).get("spec"), "pool_ref")
    return entry.status.pool_name or (ref.name if ref else None) or owned_pool_name(entry.name)


def _local_phase(conditions: list[Condition | StoreCondition]) -> str:
    by_type = {c.type: c for c in conditions}
    for kind, phase in (("Degraded", "Degraded"), ("Succeeded", "Succeeded"), ("Training", "Running")):
        found = by_type.get(kind)
        if found is not None and found.status == "True":
            return phase
    return "Unknown"


def _prometheus(text: str) -> dict[str, float]:
    """Sum of each metric over its label sets, from Prometheus' text format."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            number = float(value)
        except ValueError:
            continue
        if math.isfinite(number):
            out[name] = out.get(name, 0.0) + number
    return out


def start_in_thread(
    stores: tuple[str, ...] | list[str] = (),
    *,
    runs_dir: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    engines: dict[str, str] | None = None,
    settings: UiSettings | None = None,
) -> tuple[str, Callable[[], None]]:
    """Serve the UI from a daemon thread (for `legorl run`); returns its URL and a function that stops it.

    `port=0` picks a free port. `engines` maps run names to engine URLs for the fleet view."""
    import uvicorn  # noqa: PLC0415 - the `ui` extra

    if settings is None:
        settings = UiSettings(
            stores=tuple(stores),
            runs_dir=runs_dir,
            host=host,
            port=port,
            engines=tuple((engines or {}).items()),
        )
    app = UiApp(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="legorl-ui", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the UI did not start on {settings.host}:{settings.port} (port taken?)")
        time.sleep(0.02)
    sockets = [s for srv in server.servers for s in (srv.sockets or [])]
    bound = sockets[0].getsockname()[1] if sockets else settings.port
    shown = f"[{settings.host}]" if ":" in settings.host else settings.host
    url = f"http://{shown}:{bound}/"

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)

    return url, stop
