"""An in-process Kubernetes API (kmock's emulator plus glue) and a runner for a real kopf operator against it.

What a real API server does and this mock does NOT show (test those with pure unit tests or the opt-in
real-cluster suite, never by trusting the mock):

- garbage collection: ownerReferences and namespace deletion cascade only when a test calls
  ``MockApi.collect_garbage()``; there is no GC controller, no foreground deletion, no blockOwnerDeletion;
- controllers and the kubelet: nothing creates Pods for Deployments/Jobs/LeaderWorkerSets or fills in
  status; tests simulate that with ``MockApi.set_status()`` / ``MockApi.create()``;
- schema validation, defaulting, pruning, CEL rules, enums, printer columns, CRD conversion, and discovery
  of a CRD created at run time (the served resources are fixed when the mock starts); only object names,
  label keys/values and annotation keys are validated;
- server-side apply field ownership: apply is create-or-merge-patch (no managedFields, no conflicts, fields
  dropped from a later apply are NOT removed); strategic merge patch is a plain merge patch (lists replace);
- admission (webhooks, ValidatingAdmissionPolicy, quotas, LimitRanges), RBAC and authentication (no auth);
- set-based label selectors are supported, but watch events for an object whose labels stop matching a
  selector are dropped instead of being sent as DELETED; field selectors compare any dotted path as a string;
- pagination (``limit``/``continue`` return everything at once), bookmarks (except the initial-events-end
  one), PUT on ``/scale``, deletecollection, ``/log``, ``/exec``, ``/eviction``, ``/binding``;
- the two Event APIs (v1 and events.k8s.io/v1) are separate stores, not two views of one;
- ``metadata.generation`` is bumped for every kind on any change outside metadata and status (the real server
  does not set it at all for some built-ins such as ConfigMaps);
- timing: writes are instantly visible, watch delivery is immediate and ordered, nothing is eventually
  consistent.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import dataclasses
import datetime
import functools
import importlib
import inspect
import json
import logging
import random
import re
import threading
import time
import uuid
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar, cast

import aiohttp.test_utils
import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
import kopf
import yaml
from kmock._internal import rendering  # kmock.Response is not in kmock's __all__

from legorl.manifests import kubeyaml

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
CRD_DIR = REPO / "crds"

VERBS = frozenset({"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"})
JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"

# Metadata that clients cannot change with a patch/update (the server owns it).
_SERVER_META = (
    "name",
    "namespace",
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "resourceVersion",
    "selfLink",
)
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_SELECTOR_SPLIT = re.compile(r",(?![^()]*\))")
_SELECTOR_TERM = re.compile(
    r"\s*(?:!\s*(?P<absent>[^\s!=,()]+)"
    r"|(?P<key>[^\s!=,()]+)\s*(?:(?P<op>==|=|!=)\s*(?P<value>[^\s,()]*)"
    r"|\s+(?P<setop>in|notin)\s*\((?P<values>[^()]*)\))?)\s*"
)
_NAMESPACE_PATH = re.compile(r"/api/v1/namespaces(?:/(?P<name>[^/]+)(?:/(?P<sub>status|finalize))?)?/?")
_EVENT_LOG_LIMIT = 50_000


@dataclasses.dataclass(frozen=True)
class Kind:
    """One served resource: group/version/plural plus what discovery reports about it."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: frozenset[str] = frozenset()
    # (specReplicasPath, statusReplicasPath, labelSelectorPath) of the scale subresource, as in a CRD.
    scale_paths: tuple[str, str, str | None] | None = None
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def resource(self) -> kmock.resource:
        return kmock.resource(self.group, self.version, self.plural)


def _builtin(
    api_version: str, plural: str, kind: str, *, namespaced: bool = True, sub: str = "", scale: bool = False
) -> Kind:
    group, _, version = api_version.rpartition("/")
    subresources = frozenset(s for s in sub.split(",") if s) | ({"scale"} if scale else set())
    paths = (".spec.replicas", ".status.replicas", ".status.selector") if scale else None
    return Kind(group, version, plural, kind, namespaced, subresources, paths)


BUILTIN_KINDS: tuple[Kind, ...] = (
    _builtin("v1", "namespaces", "Namespace", namespaced=False, sub="status,finalize"),
    _builtin("v1", "events", "Event"),
    _builtin("v1", "pods", "Pod", sub="status"),
    _builtin("v1", "services", "Service", sub="status"),
    _builtin("v1", "configmaps", "ConfigMap"),
    _builtin("v1", "serviceaccounts", "ServiceAccount"),
    _builtin("v1", "secrets", "Secret"),
    _builtin("v1", "nodes", "Node", namespaced=False, sub="status"),
    _builtin("v1", "persistentvolumeclaims", "PersistentVolumeClaim", sub="status"),
    _builtin("apps/v1", "deployments", "Deployment", sub="status", scale=True),
    _builtin("apps/v1", "statefulsets", "StatefulSet", sub="status", scale=True),
    _builtin("apps/v1", "daemonsets", "DaemonSet", sub="status"),
    _builtin("batch/v1", "jobs", "Job", sub="status"),
    _builtin("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", sub="status"),
    _builtin("networking.k8s.io/v1", "networkpolicies", "NetworkPolicy"),
    _builtin("events.k8s.io/v1", "events", "Event"),
    _builtin("coordination.k8s.io/v1", "leases", "Lease"),
    _builtin(
        "apiextensions.k8s.io/v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        namespaced=False,
        sub="status",
    ),
    _builtin("kopf.dev/v1", "kopfpeerings", "KopfPeering"),
    _builtin("kopf.dev/v1", "clusterkopfpeerings", "ClusterKopfPeering", namespaced=False),
)
# Used only when crds/ has no CRD files; normally the kinds come from the generated CRDs themselves.
FALLBACK_LEGORL_KINDS: tuple[Kind, ...] = (
    _builtin("legorl.dev/v1alpha1", "rlruns", "RLRun", sub="status", scale=True),
    _builtin("legorl.dev/v1alpha1", "rolloutfleets", "RolloutFleet", sub="status", scale=True),
    _builtin("legorl.dev/v1alpha1", "sandboxpools", "SandboxPool", sub="status", scale=True),
)
LWS_KIND = Kind(
    "leaderworkerset.x-k8s.io",
    "v1",
    "leaderworkersets",
    "LeaderWorkerSet",
    True,
    frozenset({"status", "scale"}),
    (".spec.replicas", ".status.replicas", ".status.hpaPodSelector"),
    ("lws",),
)


def _kinds_from_crd(crd: Mapping[str, Any]) -> list[Kind]:
    spec = crd["spec"]
    names = spec["names"]
    kinds = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        subs = version.get("subresources") or {}
        scale = subs.get("scale")
        paths = None
        if scale:
            paths = (scale["specReplicasPath"], scale["statusReplicasPath"], scale.get("labelSelectorPath"))
        kinds.append(
            Kind(
                group=spec["group"],
                version=version["name"],
                plural=names["plural"],
                kind=names["kind"],
                namespaced=spec["scope"] == "Namespaced",
                subresources=frozenset(subs),
                scale_paths=paths,
                short_names=tuple(names.get("shortNames", ())),
                categories=tuple(names.get("categories", ())),
            )
        )
    return kinds


def _crd_for(kind: Kind) -> dict[str, Any]:
    """A minimal CustomResourceDefinition object for a kind that has no CRD file (LWS, fallbacks)."""
    subresources: dict[str, Any] = {"status": {}} if "status" in kind.subresources else {}
    if kind.scale_paths:
        spec_path, status_path, selector_path = kind.scale_paths
        subresources["scale"] = {"specReplicasPath": spec_path, "statusReplicasPath": status_path}
        if selector_path:
            subresources["scale"]["labelSelectorPath"] = selector_path
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{kind.plural}.{kind.group}"},
        "spec": {
            "group": kind.group,
            "names": {"kind": kind.kind, "plural": kind.plural, "listKind": f"{kind.kind}List"},
            "scope": "Namespaced" if kind.namespaced else "Cluster",
            "versions": [
                {
                    "name": kind.version,
                    "served": True,
                    "storage": True,
                    "subresources": subresources,
                    "schema": {
                        "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                    },
                }
            ],
        },
    }


@functools.cache
def _read_yaml(path: Path, mtime_ns: int) -> list[Any]:
    """The documents of a YAML file, parsed once per version of the file (the CRDs are big)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return list(yaml.load_all(path.read_text(encoding="utf-8"), Loader=loader))


def load_crds(crd_dir: Path | None = CRD_DIR) -> list[tuple[Kind, dict[str, Any]]]:
    """The custom kinds (and their CRD objects) to serve: from crd_dir's YAML files, else the fallbacks."""
    found: list[tuple[Kind, dict[str, Any]]] = []
    for path in sorted(crd_dir.glob("*.yaml")) if crd_dir is not None and crd_dir.is_dir() else []:
        for doc in _read_yaml(path, path.stat().st_mtime_ns):
            if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                found.extend((kind, doc) for kind in _kinds_from_crd(doc))
    return found or [(kind, _crd_for(kind)) for kind in FALLBACK_LEGORL_KINDS]


class ApiError(Exception):
    """An error answered as a Kubernetes ``Status`` object (and raised by MockApi's direct helpers)."""

    def __init__(
        self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code = code
        self.reason = reason
        self.message = message
        self.details = dict(details or {})

    def status(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


def _not_found(kind: Kind, name: str) -> ApiError:
    details = {"name": name, "group": kind.group, "kind": kind.plural}
    return ApiError(404, "NotFound", f'{kind.plural}.{kind.group or "core"} "{name}" not found', details)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge recursively, ``None`` removes a key, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = copy.deepcopy(dict(target)) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _get_path(obj: Mapping[str, Any], dotted: str) -> Any:
    value: Any = obj
    for part in dotted.strip(".").split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _set_path(obj: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.strip(".").split(".")
    for part in parents:
        obj = obj.setdefault(part, {})
    obj[last] = value


def parse_label_selector(selector: str) -> Callable[[Mapping[str, str]], bool]:
    """Compile a label selector (``a=b,c!=d,e,!f,g in (h,i),j notin (k)``) into a predicate on labels."""
    requirements: list[tuple[str, str, frozenset[str]]] = []  # (key, operator, values)
    for term in _SELECTOR_SPLIT.split(selector):
        if not term.strip():
            continue
        m = _SELECTOR_TERM.fullmatch(term)
        if m is None:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {term!r}")
        if m["absent"]:
            requirements.append((m["absent"], "!", frozenset()))
        elif m["op"]:
            requirements.append((m["key"], "!=" if m["op"] == "!=" else "=", frozenset({m["value"]})))
        elif m["setop"]:
            values = frozenset(v.strip() for v in m["values"].split(",") if v.strip())
            requirements.append((m["key"], m["setop"], values))
        else:
            requirements.append((m["key"], "exists", frozenset()))

    def matches(labels: Mapping[str, str]) -> bool:
        for key, op, values in requirements:
            if op == "!":
                ok = key not in labels
            elif op == "exists":
                ok = key in labels
            elif op in ("=", "in"):
                ok = labels.get(key) in values
            else:  # "!=" and "notin" also match objects without the label, as in Kubernetes
                ok = labels.get(key) not in values
            if not ok:
                return False
        return True

    return matches


def _parse_field_selector(selector: str) -> Callable[[Mapping[str, Any]], bool]:
    checks: list[Callable[[Mapping[str, Any]], bool]] = []
    for term in selector.split(","):
        m = re.fullmatch(r"\s*([^\s!=]+)\s*(==|=|!=)\s*([^\s]*)\s*", term)
        if m is None:
            raise ApiError(400, "BadRequest", f"invalid field selector: {term!r}")
        path, op, value = m.groups()

        def check(obj: Mapping[str, Any], path: str = path, op: str = op, value: str = value) -> bool:
            actual = _get_path(obj, path)
            actual_str = (
                "" if actual is None else str(actual).lower() if isinstance(actual, bool) else str(actual)
            )
            return (actual_str == value) == (op != "!=")

        checks.append(check)
    return lambda obj: all(check(obj) for check in checks)


def _validate_metadata(meta: Mapping[str, Any]) -> None:
    problems = []
    for what, mapping, value_re in (("label", "labels", _LABEL_VALUE), ("annotation", "annotations", None)):
        for key, value in (meta.get(mapping) or {}).items():
            prefix, _, name = str(key).rpartition("/")
            if (
                not _QUALIFIED_NAME.fullmatch(name)
                or len(name) > 63
                or (prefix and (not _DNS_SUBDOMAIN.fullmatch(prefix) or len(prefix) > 253))
            ):
                problems.append(f"metadata.{mapping}: Invalid value: {key!r}: invalid {what} key")
            if not isinstance(value, str):
                problems.append(f"metadata.{mapping}.{key}: Invalid value: {value!r}: must be a string")
            elif value_re is not None and (len(value) > 63 or not value_re.fullmatch(value)):
                problems.append(f"metadata.{mapping}.{key}: Invalid value: {value!r}: invalid {what} value")
    if problems:
        raise ApiError(422, "Invalid", "; ".join(problems))


@dataclasses.dataclass(eq=False)
class _Watcher:
    kind: Kind
    namespace: str | None
    matches: Callable[[Mapping[str, Any]], bool]
    queue: asyncio.Queue[dict[str, Any] | None]


@dataclasses.dataclass
class _Fault:
    verb: str
    plural: str | None
    name: str | None
    subresource: str | None
    status: int
    count: int


@attrs.define(kw_only=True)
class _Emulator(kmock.KubernetesEmulator):
    """kmock's emulator with the object semantics re-done: see the module docstring for what is missing."""

    kinds: dict[tuple[str, str, str], Kind] = attrs.field(factory=dict)
    record_requests: bool = True
    _rv: int = attrs.field(default=0, init=False)
    _log: list[tuple[int, Kind, dict[str, Any]]] = attrs.field(factory=list, init=False)
    _watchers: list[_Watcher] = attrs.field(factory=list, init=False)
    _faults: list[_Fault] = attrs.field(factory=list, init=False)
    _stats_lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    request_log: list[tuple[str, str, str]] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.fallback[kmock.method.PUT] << self._serve_replace
        for kind in self.kinds.values():
            self.resources[kind.resource] = kmock.ResourceInfo(
                kind=kind.kind,
                singular=kind.kind.lower(),
                namespaced=kind.namespaced,
                verbs=VERBS,
                subresources=kind.subresources,
                shortnames=kind.short_names,
                categories=kind.categories,
            )

    # --- HTTP plumbing -------------------------------------------------------------------------------

    async def _serve_version(self, request: kmock.Request) -> Any:
        served = cast(dict[str, Any], await super()._serve_version(request))
        served["groupVersion"] = served["groupVersion"].lstrip("/")  # kmock says "/v1" for the core group
        return served

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock 0.8 cannot parse /api/v1/namespaces[/NAME[/status]]: build those requests here.
        m = _NAMESPACE_PATH.fullmatch(raw_request.path)
        if m is None:
            return await super().__call__(raw_request)
        body = await raw_request.read()
        text = body.decode("utf-8", errors="replace")
        try:
            data = json.loads(text) if text else None
        except ValueError:
            data = None
        method = raw_request.method.upper()
        name = m["name"]
        action: kmock.action | None
        if method == "GET" and raw_request.query.get("watch") in ("true", "1"):
            action = kmock.action.WATCH
        elif name is None:
            action = {"GET": kmock.action.LIST, "POST": kmock.action.CREATE}.get(method)
        else:
            actions = {"GET": kmock.action.FETCH, "PATCH": kmock.action.UPDATE, "DELETE": kmock.action.DELETE}
            action = actions.get(method)
        request = kmock.Request(
            id=len(self._requests),
            method=method,
            url=raw_request.url,
            params=dict(raw_request.query),
            headers=dict(raw_request.headers),
            cookies=dict(raw_request.cookies),
            body=body,
            text=text,
            data=data,
            action=action,
            resource=kmock.resource("", "v1", "namespaces"),
            namespace=None,
            name=name,
            subresource=m["sub"],
            raw_request=raw_request,
        )
        self._requests.append(request)  # kmock serves only requests it holds; _handle forgets it after
        return await self._handle(request)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        verb = "WATCH" if request.action == kmock.action.WATCH else str(request.method.value).upper()
        with self._stats_lock:
            self.request_log.append((verb, request.url.path, request.url.query_string))
        try:
            self._check_faults(verb, request)
            # Skip KubernetesEmulator._handle (it changes objects before the reactions run): the fallbacks
            # below change the state, so a test's own reactions (emulator[...] << 500) can intercept writes.
            return await kmock.RawHandler._handle(self, request)
        except ApiError as e:
            return aiohttp.web.json_response(e.status(), status=e.code)
        finally:
            if not self.record_requests:
                # kmock keeps every request (with its aiohttp request) to serve it; forget each one
                # once served, or long runs hold them all. (Clearing before serving made kmock
                # find no request to serve: every answer was a 500.)
                with contextlib.suppress(ValueError):
                    self._requests.remove(request)
                for payload in self._payloads:
                    with contextlib.suppress(ValueError, AttributeError):
                        payload._requests.remove(request)

    def _check_faults(self, verb: str, request: kmock.Request) -> None:
        for fault in self._faults:
            if (
                fault.count > 0
                and fault.verb in (verb, "*")
                and fault.plural in (None, request.resource.plural if request.resource else None)
                and fault.name in (None, request.name)
                and fault.subresource in (None, request.subresource)
            ):
                fault.count -= 1
                message = f"injected by the test: {verb} {request.url.path}"
                raise ApiError(fault.status, "InjectedFault", message)

    def _kind_of(self, request: kmock.Request) -> Kind:
        res = request.resource
        kind = self.kinds.get((res.group or "", res.version or "", res.plural or "")) if res else None
        if kind is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if request.subresource is not None and request.subresource not in kind.subresources:
            message = f"the server could not find the requested resource ({request.subresource})"
            raise ApiError(404, "NotFound", message)
        return kind

    @staticmethod
    def _content_type(request: kmock.Request) -> str:
        for key, value in request.headers.items():
            if key.lower() == "content-type":
                return value.split(";")[0].strip().lower()
        return ""

    @staticmethod
    def _body(request: kmock.Request) -> Any:
        if request.data is not None and not isinstance(request.data, Mapping | list):
            data: Any = None  # kmock's form-data fallback: not a JSON body
        else:
            data = request.data
        if data is None and request.text.strip():
            try:  # apply-patch+yaml may really be YAML, read as the API server reads it
                data = kubeyaml.load(request.text)
            except (yaml.YAMLError, kubeyaml.KubeYamlError) as e:
                raise ApiError(400, "BadRequest", f"cannot parse the body: {e}") from e
        return data

    # --- state: every change goes through these, under the lock ---------------------------------------

    def _key(self, kind: Kind, namespace: str | None, name: str) -> tuple[kmock.resource, str | None, str]:
        return (kind.resource, namespace if kind.namespaced else None, name)

    def current(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = self._key(kind, namespace, name)
        if key not in self._objects:
            return None
        obj = self._objects[key]
        return None if obj.deleted else obj.last.raw

    def current_all(self, kind: Kind, namespace: str | None = None) -> list[dict[str, Any]]:
        return [
            obj.last.raw
            for (res, ns, _), obj in self._objects.items()
            if res == kind.resource and not obj.deleted and (namespace is None or ns == namespace)
        ]

    def _store(self, kind: Kind, body: dict[str, Any] | None, namespace: str | None, name: str) -> None:
        key = self._key(kind, namespace, name)
        if key not in self._objects:
            self._objects[key] = [body]
        elif body is None:
            self._objects[key].delete()
        else:
            self._objects[key].history.append(body)

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _publish(self, kind: Kind, event_type: str, body: dict[str, Any]) -> None:
        event = {"type": event_type, "object": body}
        self._log.append((int(body["metadata"]["resourceVersion"]), kind, event))
        if len(self._log) > _EVENT_LOG_LIMIT:
            del self._log[: len(self._log) // 2]
        namespace = body["metadata"].get("namespace")
        for watcher in self._watchers:
            if watcher.kind == kind and watcher.namespace in (None, namespace) and watcher.matches(body):
                watcher.queue.put_nowait(event)

    def create_locked(
        self, kind: Kind, namespace: str | None, body: Any, *, dry_run: bool = False
    ) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise ApiError(400, "BadRequest", "the body must be a JSON object")
        obj = copy.deepcopy(dict(body))
        if (
            obj.get("apiVersion", kind.api_version) != kind.api_version
            or obj.get("kind", kind.kind) != kind.kind
        ):
            got = f"{obj.get('apiVersion')} {obj.get('kind')}"
            raise ApiError(400, "BadRequest", f"expected {kind.api_version} {kind.kind}, got {got}")
        meta = obj.get("metadata")
        if not isinstance(meta, dict):
            meta = obj["metadata"] = {}
        if kind.namespaced:
            if namespace and meta.get("namespace") and meta["namespace"] != namespace:
                raise ApiError(400, "BadRequest", "the namespace of the object does not match the URL")
            namespace = namespace or meta.get("namespace")
            if not namespace:
                raise ApiError(400, "BadRequest", f"{kind.kind} is namespaced: a namespace is required")
            ns_kind = self.kinds[("", "v1", "namespaces")]
            if self.current(ns_kind, None, namespace) is None:
                raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found')
            meta["namespace"] = namespace
        else:
            namespace = None
            meta.pop("namespace", None)
        name = meta.get("name")
        if not name and meta.get("generateName"):
            name = meta["generateName"] + "".join(random.choices("bcdfghjklmnpqrstvwxz2456789", k=5))
        if not name:
            raise ApiError(422, "Invalid", "metadata.name: Required value: name or generateName is required")
        if len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
            raise ApiError(
                422, "Invalid", f"metadata.name: Invalid value: {name!r}: not a DNS-1123 subdomain"
            )
        _validate_metadata(meta)
        if self.current(kind, namespace, name) is not None:
            raise ApiError(409, "AlreadyExists", f'{kind.plural} "{name}" already exists', {"name": name})
        for field in _SERVER_META:
            meta.pop(field, None)
        meta.update(name=name, uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        if namespace is not None:
            meta["namespace"] = namespace
        obj = {"apiVersion": kind.api_version, "kind": kind.kind, **obj}
        obj["apiVersion"], obj["kind"], obj["metadata"] = kind.api_version, kind.kind, meta
        if "status" in kind.subresources:
            obj.pop("status", None)  # the main resource ignores status when it is a subresource
        if kind.plural == "namespaces" and not kind.group:
            obj["status"] = {"phase": "Active"}
        if dry_run:
            meta["resourceVersion"] = str(self._rv)
            return obj
        meta["resourceVersion"] = self._next_rv()
        self._store(kind, obj, namespace, name)
        self._publish(kind, "ADDED", obj)
        return obj

    def update_locked(
        self,
        kind: Kind,
        namespace: str | None,
        name: str,
        transform: Callable[[dict[str, Any]], Any],
        *,
        subresource: str | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        old = self.current(kind, namespace, name)
        if old is None:
            raise _not_found(kind, name)
        proposed = transform(copy.deepcopy(old))
        if not isinstance(proposed, dict) or not isinstance(proposed.get("metadata", {}), dict):
            raise ApiError(422, "Invalid", "the patched object is not a JSON object")
        old_meta = old["metadata"]
        wanted_rv = proposed.get("metadata", {}).get("resourceVersion")
        if wanted_rv is not None and str(wanted_rv) != old_meta["resourceVersion"]:
            message = f'Operation cannot be fulfilled on {kind.plural} "{name}": the object has been modified'
            raise ApiError(409, "Conflict", message, {"name": name, "kind": kind.plural})
        if subresource == "status":
            new = copy.deepcopy(old)
            if "status" in proposed:
                new["status"] = proposed["status"]
            else:
                new.pop("status", None)
        else:
            new = proposed
            if "status" in kind.subresources:  # the main resource ignores status when it is a subresource
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
                else:
                    new.pop("status", None)
            new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
            meta = new.setdefault("metadata", {})
            for field in _SERVER_META:
                if field in old_meta:
                    meta[field] = old_meta[field]
                else:
                    meta.pop(field, None)
            _validate_metadata(meta)
            if old_meta.get("deletionTimestamp") and set(meta.get("finalizers") or ()) - set(
                old_meta.get("finalizers") or ()
            ):
                raise ApiError(
                    422, "Forbidden", "no new finalizers can be added if the object is being deleted"
                )
        if new == old:
            return old  # a no-op write: no new resourceVersion, no watch event (as the real server)

        def spec_of(obj: Mapping[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata", "status")}

        meta = new["metadata"]
        if spec_of(new) != spec_of(old):
            meta["generation"] = int(old_meta.get("generation", 1)) + 1
        if dry_run:
            return new
        meta["resourceVersion"] = self._next_rv()
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._store(kind, None, namespace, name)  # the last finalizer is gone: the object goes away
            self._publish(kind, "DELETED", new)
        else:
            self._store(kind, new, namespace, name)
            self._publish(kind, "MODIFIED", new)
        return new

    def delete_locked(
        self,
        kind: Kind,
        namespace: str | None,
        name: str,
        *,
        preconditions: Mapping[str, Any] | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        old = self.current(kind, namespace, name)
        if old is None:
            raise _not_found(kind, name)
        for field, value in (preconditions or {}).items():
            if value is not None and old["metadata"].get(field) != value:
                raise ApiError(409, "Conflict", f"Precondition failed: {field}: {value!r}", {"name": name})
        if old["metadata"].get("deletionTimestamp"):
            return old
        new = copy.deepcopy(old)
        if old["metadata"].get("finalizers"):
            new["metadata"].update(deletionTimestamp=_now(), deletionGracePeriodSeconds=0)
        if dry_run:
            return new
        new["metadata"]["resourceVersion"] = self._next_rv()
        if new["metadata"].get("finalizers"):
            self._store(kind, new, namespace, name)
            self._publish(kind, "MODIFIED", new)
        else:
            self._store(kind, None, namespace, name)
            self._publish(kind, "DELETED", new)
        return new

    def collect_garbage_locked(self) -> list[tuple[str, str, str | None, str]]:
        ns_kind = self.kinds[("", "v1", "namespaces")]
        deleted: list[tuple[str, str, str | None, str]] = []
        while True:
            alive = {
                (key[0], key[1], key[2]): obj.last.raw
                for key, obj in self._objects.items()
                if not obj.deleted
            }
            uids = {body["metadata"]["uid"] for body in alive.values()}
            namespaces = {body["metadata"]["name"] for body in self.current_all(ns_kind)}
            victims = []
            for (res, ns, name), body in alive.items():
                kind = self.kinds.get((res.group or "", res.version or "", res.plural or ""))
                if kind is None or body["metadata"].get("deletionTimestamp"):
                    continue
                owners = body["metadata"].get("ownerReferences") or []
                orphaned = bool(owners) and not any(owner.get("uid") in uids for owner in owners)
                if orphaned or (kind.namespaced and ns not in namespaces):
                    victims.append((kind, ns, name))
            if not victims:
                return deleted
            for kind, ns, name in victims:
                self.delete_locked(kind, ns, name)
                deleted.append((kind.api_version, kind.plural, ns, name))

    # --- the fallbacks that serve the requests ------------------------------------------------------

    def _selector(self, request: kmock.Request) -> Callable[[Mapping[str, Any]], bool]:
        labels = parse_label_selector(request.params.get("labelSelector", ""))
        fields_sel = request.params.get("fieldSelector", "")
        by_fields = _parse_field_selector(fields_sel) if fields_sel else (lambda obj: True)
        return lambda obj: labels(obj["metadata"].get("labels") or {}) and by_fields(obj)

    def _scale(self, kind: Kind, obj: Mapping[str, Any]) -> dict[str, Any]:
        assert kind.scale_paths is not None
        spec_path, status_path, selector_path = kind.scale_paths
        meta = obj["metadata"]
        status: dict[str, Any] = {"replicas": _get_path(obj, status_path) or 0}
        if selector_path and _get_path(obj, selector_path) is not None:
            status["selector"] = _get_path(obj, selector_path)
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                k: meta[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if k in meta
            },
            "spec": {"replicas": _get_path(obj, spec_path) or 0},
            "status": status,
        }

    async def _serve_list(self, request: kmock.Request) -> Any:
        kind = self._kind_of(request)
        matches = self._selector(request)
        async with self._lock:
            items = [obj for obj in self.current_all(kind, request.namespace) if matches(obj)]
            rv = str(self._rv)
        return {
            "apiVersion": kind.api_version,
            "kind": f"{kind.kind}List",
            "metadata": {"resourceVersion": rv, "continue": ""},
            "items": items,
        }

    async def _serve_watch(self, request: kmock.Request) -> Any:  # type: ignore[override]
        kind = self._kind_of(request)
        selected, only_name = self._selector(request), request.name  # a watch may name one object

        def matches(obj: Mapping[str, Any]) -> bool:
            return (only_name is None or obj["metadata"]["name"] == only_name) and selected(obj)

        since = request.params.get("resourceVersion", "")
        try:
            timeout = (
                float(request.params["timeoutSeconds"]) if request.params.get("timeoutSeconds") else None
            )
            since_rv = int(since) if since else 0
        except ValueError as e:
            raise ApiError(400, "BadRequest", f"invalid resourceVersion or timeoutSeconds: {e}") from e
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        async with self._lock:
            initial: list[dict[str, Any]]
            if since_rv:
                floor = self._log[0][0] if self._log else self._rv + 1
                if since_rv + 1 < floor and since_rv < self._rv:
                    gone = ApiError(410, "Expired", f"too old resource version: {since}").status()
                    initial = [{"type": "ERROR", "object": gone}]
                else:
                    initial = [
                        event
                        for rv, k, event in self._log
                        if rv > since_rv
                        and k == kind
                        and request.namespace in (None, event["object"]["metadata"].get("namespace"))
                        and matches(event["object"])
                    ]
            else:
                objs = self.current_all(kind, request.namespace)
                initial = [{"type": "ADDED", "object": obj} for obj in objs if matches(obj)]
                if request.params.get("sendInitialEvents") == "true":
                    bookmark = {
                        "apiVersion": kind.api_version,
                        "kind": kind.kind,
                        "metadata": {
                            "resourceVersion": str(self._rv),
                            "annotations": {"k8s.io/initial-events-end": "true"},
                        },
                    }
                    initial.append({"type": "BOOKMARK", "object": bookmark})
            watcher = _Watcher(kind, request.namespace, matches, queue)
            self._watchers.append(watcher)
        # A coroutine returning a Response, not kmock's async generator: the stream needs a JSON content type.
        return rendering.Response(
            headers={"Content-Type": "application/json"},
            payload=self._stream(watcher, initial, timeout),
        )

    async def _stream(
        self, watcher: _Watcher, initial: list[dict[str, Any]], timeout: float | None
    ) -> AsyncIterator[bytes]:
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        try:
            yield b""  # send the headers now, even if no event ever comes
            for event in initial:
                yield json.dumps(event).encode() + b"\n"
            while True:
                remaining = None if deadline is None else deadline - asyncio.get_running_loop().time()
                if remaining is not None and remaining <= 0:
                    return
                try:
                    live = await asyncio.wait_for(watcher.queue.get(), remaining)
                except TimeoutError:
                    return
                if live is None:  # the mock is stopping
                    return
                yield json.dumps(live).encode() + b"\n"
        finally:
            with contextlib.suppress(ValueError):
                self._watchers.remove(watcher)

    def watch_count(self, kind: Kind | None = None) -> int:
        return sum(1 for watcher in self._watchers if kind is None or watcher.kind == kind)

    def close_watches(self) -> None:
        for watcher in self._watchers:
            watcher.queue.put_nowait(None)

    async def _serve_fetch(self, request: kmock.Request) -> Any:
        kind = self._kind_of(request)
        assert request.name is not None
        async with self._lock:
            obj = self.current(kind, request.namespace, request.name)
        if obj is None:
            raise _not_found(kind, request.name)
        return self._scale(kind, obj) if request.subresource == "scale" else obj

    async def _serve_create(self, request: kmock.Request) -> Any:
        kind = self._kind_of(request)
        if request.subresource is not None:
            raise ApiError(405, "MethodNotAllowed", f"POST is not supported on {request.subresource}")
        async with self._lock:
            return self.create_locked(
                kind, request.namespace, self._body(request), dry_run="dryRun" in request.params
            )

    async def _serve_update(self, request: kmock.Request) -> Any:
        kind = self._kind_of(request)
        assert request.name is not None
        name, namespace, sub = request.name, request.namespace, request.subresource
        content_type = self._content_type(request)
        body = self._body(request)
        dry_run = "dryRun" in request.params
        transform: Callable[[dict[str, Any]], Any]
        if content_type == JSON_PATCH:
            if not isinstance(body, list):
                raise ApiError(400, "BadRequest", "a JSON patch must be a list of operations")

            def transform(obj: dict[str, Any]) -> Any:
                try:
                    return jsonpatch.apply_patch(obj, body)
                except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:
                    raise ApiError(422, "Invalid", f"the JSON patch cannot be applied: {e}") from e

        elif content_type in (MERGE_PATCH, STRATEGIC_MERGE_PATCH, APPLY_PATCH):
            if not isinstance(body, Mapping):
                raise ApiError(400, "BadRequest", "a merge patch must be a JSON object")

            def transform(obj: dict[str, Any]) -> Any:
                return merge_patch(obj, body)

        else:
            raise ApiError(
                415, "UnsupportedMediaType", f"the patch content type {content_type!r} is unsupported"
            )
        if content_type == APPLY_PATCH:
            if not request.params.get("fieldManager"):
                raise ApiError(400, "BadRequest", "fieldManager is required for apply patch")
            if sub != "scale" and (not body.get("apiVersion") or not body.get("kind")):
                raise ApiError(400, "BadRequest", "apiVersion and kind must be set in an applied object")
            if body.get("metadata", {}).get("name", name) != name:
                raise ApiError(400, "BadRequest", "the name of the object does not match the URL")

        async with self._lock:
            if sub == "scale":
                assert kind.scale_paths is not None
                old = self.current(kind, namespace, name)
                if old is None:
                    raise _not_found(kind, name)
                scale = transform(self._scale(kind, old))
                replicas = _get_path(scale, "spec.replicas")

                def set_replicas(obj: dict[str, Any]) -> Any:
                    assert kind.scale_paths is not None
                    _set_path(obj, kind.scale_paths[0], replicas)
                    return obj

                new = self.update_locked(kind, namespace, name, set_replicas, dry_run=dry_run)
                return self._scale(kind, new)
            if content_type == APPLY_PATCH and sub is None and self.current(kind, namespace, name) is None:
                applied = merge_patch({}, body)  # server-side apply creates a missing object
                applied.setdefault("metadata", {})["name"] = name
                return self.create_locked(kind, namespace, applied, dry_run=dry_run)
            return self.update_locked(kind, namespace, name, transform, subresource=sub, dry_run=dry_run)

    async def _serve_replace(self, request: kmock.Request) -> Any:
        kind = self._kind_of(request)
        if request.name is None or request.subresource == "scale":
            raise ApiError(405, "MethodNotAllowed", "PUT is supported on objects and their status only")
        body = self._body(request)
        if not isinstance(body, Mapping):
            raise ApiError(400, "BadRequest", "the body must be a JSON object")
        async with self._lock:
            return self.update_locked(
                kind,
                request.namespace,
                request.name,
                lambda _: copy.deepcopy(dict(body)),
                subresource=request.subresource,
                dry_run="dryRun" in request.params,
            )

    async def _serve_delete(self, request: kmock.Request) -> Any:
        kind = self._kind_of(request)
        assert request.name is not None
        options = self._body(request) if request.text.strip() else {}
        preconditions = options.get("preconditions") if isinstance(options, Mapping) else None
        async with self._lock:
            return self.delete_locked(
                kind,
                request.namespace,
                request.name,
                preconditions=preconditions,
                dry_run="dryRun" in request.params,
            )


class MockApi:
    """A kmock Kubernetes API emulator served on 127.0.0.1 from a background thread, with test helpers.

    Use as a context manager (or ``start()``/``stop()``). The helpers act on the store directly, the way a
    user with kubectl would (watchers see the changes), but are not counted as API requests.
    """

    def __init__(
        self,
        *,
        lws: bool = False,
        crd_dir: Path | None = CRD_DIR,
        namespaces: Collection[str] = ("default", "kube-system", "kube-public"),
        record_requests: bool = True,
    ) -> None:
        custom = load_crds(crd_dir)
        if lws:
            custom.append((LWS_KIND, _crd_for(LWS_KIND)))
        self.kinds: dict[tuple[str, str, str], Kind] = {}
        for kind in (*BUILTIN_KINDS, *(kind for kind, _ in custom)):
            self.kinds[(kind.group, kind.version, kind.plural)] = kind
        self.lws = lws
        self._crds = {crd["metadata"]["name"]: crd for _, crd in custom}
        self._namespaces = tuple(namespaces)
        self._record_requests = record_requests
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._emulator: _Emulator | None = None
        self._server: aiohttp.test_utils.RawTestServer | None = None
        self._error: BaseException | None = None

    # --- lifecycle ------------------------------------------------------------------------------------

    def __enter__(self) -> MockApi:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> MockApi:
        """Start the server thread and wait until it listens."""
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="kubeapi-mock", daemon=True)
        self._thread.start()
        started.wait(30)
        if self._error is not None:
            raise RuntimeError("the Kubernetes API mock failed to start") from self._error
        if self._server is None:
            raise RuntimeError("the Kubernetes API mock did not start in 30s")
        return self

    def stop(self) -> None:
        """Close the watch streams and the server; join the thread."""
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)

    def _run(self, started: threading.Event) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._astart())
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread by start()
            self._error = e
            started.set()
            loop.close()
            return
        started.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._astop())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _astart(self) -> None:
        emulator = _Emulator(kinds=self.kinds, record_requests=self._record_requests)
        await emulator.__aenter__()
        self._emulator = emulator
        server = aiohttp.test_utils.RawTestServer(emulator, host="127.0.0.1", port=0)
        await server.start_server()
        ns_kind = self.kind("v1", "namespaces")
        crd_kind = self.kind("apiextensions.k8s.io/v1", "customresourcedefinitions")
        async with emulator._lock:
            for name in self._namespaces:
                emulator.create_locked(ns_kind, None, {"metadata": {"name": name}})
            for crd in self._crds.values():
                emulator.create_locked(crd_kind, None, crd)
        emulator.request_log.clear()
        self._server = server

    async def _astop(self) -> None:
        assert self._emulator is not None
        self._emulator.close_watches()
        await asyncio.sleep(0)
        if self._server is not None:
            await self._server.close()
        await self._emulator.__aexit__(None, None, None)

    def _call(self, fn: Callable[[_Emulator], T]) -> T:
        """Run fn(emulator) on the server's loop under the state lock; return a deep copy of its result."""
        if self._loop is None or self._emulator is None:
            raise RuntimeError("the mock is not started")
        emulator = self._emulator

        async def locked() -> T:
            async with emulator._lock:
                return copy.deepcopy(fn(emulator))

        return asyncio.run_coroutine_threadsafe(locked(), self._loop).result(30)

    # --- addressing -------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The base URL of the API, e.g. ``http://127.0.0.1:12345`` (no auth, plain HTTP)."""
        if self._server is None:
            raise RuntimeError("the mock is not started")
        return str(self._server.make_url("")).rstrip("/")

    @property
    def emulator(self) -> kmock.KubernetesEmulator:
        """The kmock emulator, for kmock's DSL (reactions run on the server thread's loop)."""
        if self._emulator is None:
            raise RuntimeError("the mock is not started")
        return self._emulator

    def kind(self, api_version: str, plural: str) -> Kind:
        """The served Kind for an apiVersion and plural; KeyError if the mock does not serve it."""
        group, _, version = api_version.rpartition("/")
        return self.kinds[(group, version, plural)]

    def _kind_for(self, body: Mapping[str, Any]) -> Kind:
        for kind in self.kinds.values():
            if kind.api_version == body.get("apiVersion") and kind.kind == body.get("kind"):
                return kind
        raise KeyError(f"the mock serves no {body.get('apiVersion')} {body.get('kind')}")

    @staticmethod
    def _ns(kind: Kind, body: Mapping[str, Any]) -> str | None:
        if not kind.namespaced:
            return None
        return (body.get("metadata") or {}).get("namespace") or "default"

    # --- reading ---------------------------------------------------------------------------------------

    def objects(self, api_version: str, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """The stored objects of a resource (all namespaces when namespace is None), as deep copies."""
        kind = self.kind(api_version, plural)
        return self._call(lambda em: em.current_all(kind, namespace))

    def get(self, api_version: str, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """One stored object (a deep copy), or None if absent."""
        kind = self.kind(api_version, plural)
        return self._call(lambda em: em.current(kind, namespace, name))

    def fetch(self, api_version: str, plural: str, namespace: str | None, name: str) -> dict[str, Any]:
        """Like get(), but KeyError when absent (wait_for() treats that as "not yet")."""
        obj = self.get(api_version, plural, namespace, name)
        if obj is None:
            raise KeyError(f"{plural} {namespace}/{name} does not exist")
        return obj

    def history(
        self, api_version: str, plural: str, namespace: str | None, name: str
    ) -> list[dict[str, Any] | None]:
        """Every stored version of an object, oldest first; None marks a deletion."""
        kind = self.kind(api_version, plural)
        key = (kind.resource, namespace if kind.namespaced else None, name)

        def read(em: _Emulator) -> list[dict[str, Any] | None]:
            if key not in em.objects:
                return []
            return [None if v is None else v.raw for v in em.objects[key].history]

        return self._call(read)

    def events(
        self, namespace: str | None = None, *, involved_name: str | None = None
    ) -> list[dict[str, Any]]:
        """The core v1 Events (what kopf posts), optionally only those about the named object."""
        events = self.objects("v1", "events", namespace)
        if involved_name is not None:
            events = [e for e in events if e.get("involvedObject", {}).get("name") == involved_name]
        return events

    # --- writing (as a user/kubectl, or as the controllers the mock lacks) ------------------------------

    def create(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Create an object from a manifest (namespace defaults to "default"); status is dropped as usual."""
        kind = self._kind_for(body)
        return self._call(lambda em: em.create_locked(kind, self._ns(kind, body), body))

    def apply(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Create-or-merge the manifest, as the mock's server-side apply does."""
        kind = self._kind_for(body)
        namespace = self._ns(kind, body)
        name = body["metadata"]["name"]

        def apply(em: _Emulator) -> dict[str, Any]:
            if em.current(kind, namespace, name) is None:
                return em.create_locked(kind, namespace, body)
            return em.update_locked(kind, namespace, name, lambda obj: merge_patch(obj, body))

        return self._call(apply)

    def patch(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        name: str,
        patch: Any,
        *,
        patch_type: str = "merge",
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """Patch an object or its status: patch_type "merge" (also "strategic") or "json" (a list of ops)."""
        kind = self.kind(api_version, plural)
        if subresource not in (None, "status"):
            raise ValueError(f"the helper patches objects and their status, not {subresource!r}")

        def transform(obj: dict[str, Any]) -> Any:
            if patch_type == "json":
                try:
                    return jsonpatch.apply_patch(obj, patch)
                except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:
                    raise ApiError(422, "Invalid", f"the JSON patch cannot be applied: {e}") from e
            return merge_patch(obj, patch)

        return self._call(
            lambda em: em.update_locked(kind, namespace, name, transform, subresource=subresource)
        )

    def set_status(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        name: str,
        status: Mapping[str, Any],
        *,
        replace: bool = False,
    ) -> dict[str, Any]:
        """Write .status as a controller/kubelet would: merge-patch it in, or replace it whole."""
        kind = self.kind(api_version, plural)

        def transform(obj: dict[str, Any]) -> dict[str, Any]:
            obj["status"] = copy.deepcopy(dict(status)) if replace else merge_patch(obj.get("status"), status)
            return obj

        sub = "status" if "status" in kind.subresources else None
        return self._call(lambda em: em.update_locked(kind, namespace, name, transform, subresource=sub))

    def delete(self, api_version: str, plural: str, namespace: str | None, name: str) -> dict[str, Any]:
        """Delete an object: gone at once, or marked with deletionTimestamp while finalizers remain."""
        kind = self.kind(api_version, plural)
        return self._call(lambda em: em.delete_locked(kind, namespace, name))

    def collect_garbage(self) -> list[tuple[str, str, str | None, str]]:
        """Do once what the GC and namespace controllers would: delete objects whose owners are all gone,
        and objects in deleted namespaces, until nothing changes. Returns (apiVersion, plural, ns, name)s.
        The mock never does this on its own."""
        return self._call(lambda em: em.collect_garbage_locked())

    # --- request accounting and fault injection ---------------------------------------------------------

    def watch_count(self, api_version: str | None = None, plural: str | None = None) -> int:
        """How many watch streams are open now (for one resource, or all): e.g. to wait until an operator
        has started watching before counting its requests."""
        kind = self.kind(api_version, plural) if api_version is not None and plural is not None else None
        return self._call(lambda em: em.watch_count(kind))

    def request_log(self) -> list[tuple[str, str, str]]:
        """Every request since the last reset: (verb, path, query); verb is the HTTP method or WATCH."""
        emulator = self._emulator
        assert emulator is not None
        with emulator._stats_lock:
            return list(emulator.request_log)

    def request_counts(self, *, by_resource: bool = False) -> dict[str, int]:
        """Requests since the last reset per verb ("GET", "PATCH", ..., "WATCH" for watch streams), or per
        "VERB path-without-namespace-and-name" with by_resource=True."""
        counts: Counter[str] = Counter()
        for verb, path, _ in self.request_log():
            if not by_resource:
                counts[verb] += 1
                continue
            parts = re.sub(r"/namespaces/[^/]+(?=/)", "", path).strip("/").split("/")
            plural_at = 3 if parts[0] == "apis" else 2
            key = "/".join(parts[: plural_at + 1])
            if len(parts) > plural_at + 1:
                key += "/{name}"
            if len(parts) > plural_at + 2:
                key += "/" + "/".join(parts[plural_at + 2 :])
            counts[f"{verb} {key}"] += 1
        return dict(counts)

    @property
    def request_count(self) -> int:
        """The number of API requests since the last reset, watch-stream requests excluded."""
        return sum(1 for verb, _, _ in self.request_log() if verb != "WATCH")

    def reset_requests(self) -> None:
        """Forget the requests counted so far (also kmock's own request records)."""
        emulator = self._emulator
        assert emulator is not None
        with emulator._stats_lock:
            emulator.request_log.clear()

    def inject_error(
        self,
        verb: str,
        plural: str | None = None,
        *,
        name: str | None = None,
        subresource: str | None = None,
        status: int = 500,
        count: int = 1,
    ) -> None:
        """Answer the next `count` matching requests with an error Status; verb "*" matches any verb."""
        emulator = self._emulator
        assert emulator is not None
        fault = _Fault(verb.upper(), plural, name, subresource, status, count)
        self._loop_call(lambda: emulator._faults.append(fault))

    def clear_errors(self) -> None:
        """Drop every injected error that has not fired yet (the API server recovers)."""
        emulator = self._emulator
        assert emulator is not None
        self._loop_call(emulator._faults.clear)

    def _loop_call(self, fn: Callable[[], object]) -> None:
        assert self._loop is not None

        async def run() -> None:
            fn()

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(30)


# --- running a real kopf operator against the mock ----------------------------------------------------

_MOCK_URL: contextvars.ContextVar[str] = contextvars.ContextVar("kubeapi_mock_url")
_LOGGED_IN: weakref.WeakSet[kopf.OperatorRegistry] = weakref.WeakSet()


def _login_to_mock(**_: Any) -> kopf.ConnectionInfo:
    # The URL comes from the context of the operator's thread, so one registry serves many mocks in turn.
    return kopf.ConnectionInfo(server=_MOCK_URL.get(), default_namespace="default", priority=1_000)


def operator_settings() -> kopf.OperatorSettings:
    """kopf settings for tests: annotations-only bookkeeping under legorl.dev, short timeouts, no SIGKILL."""
    settings = kopf.OperatorSettings()
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="legorl.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="legorl.dev", key="last-handled-configuration"
    )
    settings.watching.server_timeout = 5
    settings.watching.client_timeout = 15
    settings.watching.connect_timeout = 2
    settings.watching.reconnect_backoff = 0.05
    settings.networking.request_timeout = 10
    settings.networking.connect_timeout = 2
    settings.networking.error_backoffs = [0.05, 0.1, 0.2]
    settings.posting.enabled = True
    settings.queueing.idle_timeout = 2.0
    settings.queueing.exit_timeout = 2.0
    settings.scanning.disabled = False
    # A stopped-by-error operator would otherwise SIGKILL the thread after 10 minutes: that kills pytest.
    settings.process.ultimate_exiting_timeout = None
    return settings


def mock_timeouts(settings: kopf.OperatorSettings, *, request_timeout: float = 10) -> kopf.OperatorSettings:
    """`settings` (e.g. an operator's production settings) with the short network timeouts and the
    no-SIGKILL exit that running against the in-process mock needs."""
    settings.watching.connect_timeout = 2
    settings.watching.reconnect_backoff = 0.05
    settings.networking.request_timeout = request_timeout
    settings.networking.connect_timeout = 2
    settings.networking.error_backoffs = [0.05, 0.1, 0.2]
    settings.queueing.idle_timeout = 0.5
    settings.queueing.exit_timeout = 0.5
    settings.process.ultimate_exiting_timeout = None
    return settings


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclasses.dataclass
class OperatorHandle:
    """The running operator: its settings, memo and registry, the kopf log records, and its health."""

    mock: MockApi
    registry: kopf.OperatorRegistry
    settings: kopf.OperatorSettings
    memo: Any
    thread: threading.Thread
    records: list[logging.LogRecord]
    error: BaseException | None = None

    @property
    def errors(self) -> list[str]:
        """kopf's ERROR-and-worse log messages so far (handler failures, failed API requests)."""
        return [r.getMessage() for r in self.records if r.levelno >= logging.ERROR]

    def messages(self, level: int = logging.INFO) -> list[str]:
        """kopf's log messages at or above `level` so far."""
        return [r.getMessage() for r in self.records if r.levelno >= level]

    def check(self) -> None:
        """Raise if the operator thread has died."""
        if self.error is not None:
            raise RuntimeError("the operator crashed") from self.error
        if not self.thread.is_alive():
            raise RuntimeError("the operator exited unexpectedly")

    def wait_for(
        self, predicate: Callable[[], T | None], *, timeout: float = 10.0, what: str | None = None
    ) -> T:
        """wait_for() that also fails fast when the operator dies."""
        return wait_for(predicate, timeout=timeout, what=what, alive=self.check)


@contextlib.contextmanager
def run_operator(
    mock: MockApi,
    target: kopf.OperatorRegistry | ModuleType | str | None = None,
    *,
    memo: Any = None,
    startup: Callable[[kopf.OperatorSettings, Any], Awaitable[None] | None] | None = None,
    settings: kopf.OperatorSettings | None = None,
    namespaces: Collection[str] = (),
    log_level: int = logging.INFO,
    timeout: float = 15.0,
    fail_on_errors: bool = True,
) -> Iterator[OperatorHandle]:
    """Run a real kopf operator in a background thread (own event loop) against the mock, standalone.

    target: a registry, or a module (or its import path) whose handlers went to kopf's default registry.
    memo: passed to kopf (default: a fresh kopf.Memo). startup(settings, memo), sync or async, runs on
    the operator's loop before kopf starts (after operator_settings() or the given settings).
    namespaces: watch only these; cluster-wide when empty. log_level: the "kopf" logger's level during
    the run; records are kept in handle.records (with settings.posting.loggers=True they also become
    Events, but only if they pass this level: the CLI sets INFO, plain Python leaves WARNING).
    On exit: stop via the stop flag, join, re-raise a crash; with fail_on_errors, raise if kopf logged
    errors (handler failures, failed requests) and the body did not fail on its own.
    """
    if isinstance(target, str):
        target = importlib.import_module(target)
    registry = target if isinstance(target, kopf.OperatorRegistry) else kopf.get_default_registry()
    if registry not in _LOGGED_IN:
        kopf.on.login(registry=registry, id="kubeapi-mock-login")(_login_to_mock)
        _LOGGED_IN.add(registry)
    own_settings = settings is None
    settings = operator_settings() if settings is None else settings
    memo = memo if memo is not None else kopf.Memo()
    stop_flag, ready_flag = threading.Event(), threading.Event()

    kopf_logger = logging.getLogger("kopf")
    saved_level = kopf_logger.level
    records = _Records()
    kopf_logger.addHandler(records)
    kopf_logger.setLevel(log_level)

    def target_fn() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        _MOCK_URL.set(mock.url)
        try:
            if startup is not None:
                result = startup(settings, memo)
                if inspect.isawaitable(result):
                    loop.run_until_complete(_awaited(result))
            loop.run_until_complete(
                kopf.operator(
                    registry=registry,
                    settings=settings,
                    memo=memo,
                    standalone=True,
                    clusterwide=not namespaces,
                    namespaces=list(namespaces),
                    stop_flag=stop_flag,
                    ready_flag=ready_flag,
                )
            )
        except BaseException as e:  # noqa: BLE001 -- re-raised in the test's thread by run_operator()
            handle.error = e
        finally:
            ready_flag.set()
            # As asyncio.run does: cancel what is still pending (a run controller's API call submitted
            # from its thread as the operator stopped) and let it unwind, so its connection is closed
            # here and not by the garbage collector in a later test (an unclosed-transport warning).
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()
            if own_settings:  # kopf never shuts down the executor of sync handlers
                settings.execution.executor.shutdown(wait=False)

    thread = threading.Thread(target=target_fn, name="kopf-operator", daemon=True)
    handle = OperatorHandle(mock, registry, settings, memo, thread, records.records)
    try:
        thread.start()
        if not ready_flag.wait(timeout):
            raise TimeoutError(f"the operator was not ready in {timeout}s; kopf said: {handle.messages()}")
        handle.check()
        try:
            yield handle
        except BaseException:
            stop_flag.set()
            thread.join(timeout)
            raise
        stop_flag.set()
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(f"the operator did not stop in {timeout}s")
        if handle.error is not None:
            raise RuntimeError("the operator crashed") from handle.error
        if fail_on_errors and handle.errors:
            raise AssertionError("kopf logged errors:\n" + "\n".join(handle.errors))
    finally:
        stop_flag.set()
        if thread.is_alive():
            thread.join(timeout)
        kopf_logger.removeHandler(records)
        kopf_logger.setLevel(saved_level)


async def _awaited(awaitable: Awaitable[None]) -> None:
    await awaitable


def wait_for(
    predicate: Callable[[], T | None],
    *,
    timeout: float = 10.0,
    interval: float = 0.05,
    what: str | None = None,
    alive: Callable[[], None] | None = None,
) -> T:
    """Poll predicate() until it returns something truthy, and return that.

    A predicate that raises KeyError/IndexError/TypeError/AttributeError/AssertionError counts as "not yet"
    (objects are often half-built). On timeout, raise AssertionError with what was awaited, the last result
    and the last error. alive() is called on every poll, to fail fast when e.g. the operator died.
    """
    deadline = time.monotonic() + timeout
    last: T | None = None
    error: BaseException | None = None
    while True:
        if alive is not None:
            alive()
        try:
            value = predicate()
        except (KeyError, IndexError, TypeError, AttributeError, AssertionError) as e:
            error = e
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            description = what or getattr(predicate, "__name__", repr(predicate))
            raise AssertionError(
                f"timed out after {timeout}s waiting for {description}; last result: {last!r}; "
                f"last error: {error!r}"
            )
        time.sleep(interval)


__all__ = [
    "BUILTIN_KINDS",
    "LWS_KIND",
    "ApiError",
    "Kind",
    "MockApi",
    "OperatorHandle",
    "load_crds",
    "merge_patch",
    "operator_settings",
    "parse_label_selector",
    "run_operator",
    "wait_for",
]
