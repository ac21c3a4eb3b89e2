"""The proxy's one settings object: built from the CLI (or a test), passed down, never global."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from legorl.api.run import ApiFormatName

__all__ = ["ProxySettings"]


class ProxySettings(BaseModel):
    """Everything one trial's proxy needs to know."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    upstream: str
    """Base URL of the rollout engine (vLLM's OpenAI server), e.g. `http://fleet:8000`; a
    `unix:///path/to.sock` URL reaches it through a Unix socket (the local sandbox's only way out)."""
    journal: Path
    """Directory of this trial's journal (created if missing)."""
    served_model_name: str = "policy"
    """Model name the engine answers to; any model name a harness asks for is mapped onto it."""
    run: str = "local"
    """RLRun this trial belongs to (recorded on every turn)."""
    trial: str = "trial-0"
    """Trial id (recorded on every turn)."""
    # The API's own alias: typing caches Literals that compare equal (same members, any order), so
    # a second spelling in another order would reorder the generated CRD's enum depending on
    # which module was imported first.
    api_format: ApiFormatName | None = None
    """API the harness is expected to speak; every format is served, others are counted in the
    metrics as unexpected (a misconfigured harness shows up there first)."""

    host: str = "127.0.0.1"
    """Address to listen on; loopback by default (the harness shares the pod or sandbox)."""
    port: Annotated[int, Field(ge=0, le=65535)] = 4000
    """Port to listen on (0: any free port)."""
    workspace: str | None = None
    """The agent's workspace, mounted read-only, for `GET /changes` (with `baseline`)."""
    baseline: str | None = None
    """Setup's record of the staged workspace (`legorl-sandbox setup --baseline`)."""
    unix_socket: Annotated[str, Field(min_length=1, max_length=107)] | None = None
    """Listen on this Unix socket instead of host:port (mode 0666: the local sandbox backend binds it
    into a trial's network namespace, where it is the only way out)."""

    # Sampling the proxy enforces over what the harness asks (RLRun spec.sampling).
    temperature: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    """Overrides the harness's temperature when set."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    """Overrides the harness's top_p when set."""
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    """Caps completion tokens per call (the smaller of this and the harness's ask wins)."""

    capture_routed_experts: bool = False
    """The fleet captures routed experts (its `--enable-return-routed-experts`). vLLM returns them
    only on whole responses, so every call then goes upstream unstreamed (a streaming harness still
    gets a stream, replayed from the whole answer), and a turn without routing is refused as an
    engine error instead of being journaled without it."""
    policy_version: str = "v0"
    """Version recorded when the engine cannot report one (no `/weight_info`)."""
    policy_version_source: Literal["engine", "fixed"] = "engine"
    """`engine`: record the versions the engine names with each answer (legorl's middleware in the
    fleet's vLLM, `legorl.api.weight_versions`), or where it names none, read `GET /weight_info`
    before and after each call and record both; `fixed`: record `policy_version`."""

    connect_timeout_seconds: Annotated[float, Field(gt=0)] = 5.0
    """Limit for opening a connection to the engine."""
    read_timeout_seconds: Annotated[float, Field(gt=0)] = 600.0
    """Longest silence from the engine within one call (a stream's gap between chunks)."""
    max_connections: Annotated[int, Field(ge=1)] = 256
    """Connections to the engine kept at most (and kept alive)."""
    retry_budget_seconds: Annotated[float, Field(ge=0)] = 120.0
    """How long a call retries a 503 or a refused connection (a weight swap, an engine restart)
    with backoff and jitter before the trial ends as `engine_error`."""
    retry_initial_seconds: Annotated[float, Field(gt=0)] = 0.25
    """First backoff ceiling; it doubles per retry (full jitter below it)."""
    retry_max_seconds: Annotated[float, Field(gt=0)] = 5.0
    """Largest backoff ceiling."""

    max_body_bytes: Annotated[int, Field(ge=1024)] = 32 * 1024 * 1024
    """Largest request body accepted (413 beyond)."""
    record_bodies: bool = True
    """Keep each call's request and response JSON on the turn (for the trajectory viewer)."""
    fsync: bool = True
    """fsync every journal write; off only for benchmarks that measure the proxy without a disk."""

    max_turns: Annotated[int, Field(ge=1)] | None = None
    """Turn budget of the trial: the call after the last one is refused and the trial ends as
    `turn_limit` (the harness's own limit, enforced where the harness cannot skip it)."""
    otlp_endpoint: str | None = None
    """OTLP/HTTP endpoint for traces, used as it is (e.g. `http://collector:4318/v1/traces`); unset:
    the standard `OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT` variables, and without those no export."""

    drain_seconds: Annotated[float, Field(ge=0, le=3600)] = 0.0
    """After SIGTERM, go on serving until the trial's trajectory has been read since it ended (`POST
    /finish`, then `GET /trajectory`), or this many seconds have passed. A trial pod someone deletes
    keeps its journal that long (within the pod's grace period), so the controller still records the
    acknowledged turns. 0: stop at once."""

    claim_fifo: str | None = None
    """A trial pod made ready ahead: the FIFO its agent waits at (made at start, 0644); `POST /claim`
    writes the agent its `go` (`legorl.proxy.gate`). Unset: no gate, `/claim` is 404."""

    admission_kv_usage: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    """Session admission under KV pressure: the trial's first call waits while the engine's KV
    cache usage (vLLM's `vllm:kv_cache_usage_perc` at `/metrics`) is at or above this share, so
    a full replica finishes the sessions it has before taking new ones. Unset: off."""
    admission_max_wait_seconds: Annotated[float, Field(ge=0)] = 300.0
    """Longest a new session waits for admission; then it goes ahead (and is counted)."""
    admission_poll_seconds: Annotated[float, Field(gt=0)] = 1.0
    """How often a waiting session re-reads the engine's KV usage."""
    admission_max_sessions: Annotated[int, Field(ge=1)] | None = None
    """At most this many calls of this trial in the engine at once (a harness running parallel
    sub-agents); more wait their turn. Unset: no limit."""

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, value: str) -> str:
        if not value.startswith(("http://", "https://", "unix://")):
            raise ValueError("upstream must be an http://, https:// or unix:// URL")
        return value.rstrip("/")
