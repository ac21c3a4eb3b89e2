"""Trial traces: one OpenTelemetry trace per trial, joined across processes by ids derived from the trial.

A trial's work is spread over processes that never talk about tracing: its proxy (one span per model
call, and the engine's own spans under it through `traceparent`), and the process that collects the
trial (the run controller), which learns the sandbox's stage timings only at the end. All of them
derive the same ids from (run, trial):

- the trace id, `trial_trace_id(run, trial)`;
- the span id of the trial's root span, `trial_span_id(run, trial)`.

The proxy parents its spans on `trial_context(run, trial)`; the collector emits the root span with
exactly those ids after the fact (`emit_trial_spans`), with one child span per sandbox stage rebuilt
from `TrialRecord.stage_seconds`. The sandbox itself stays standard-library only.

Export is configured by the standard `OTEL_*` variables (`tracer_provider_from_env`); without an
endpoint there is no provider, and every function here returns at once.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import os
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from legorl.api.termination import INFRA_REASONS
from legorl.api.trajectory import TrialRecord

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.trace import TracerProvider

__all__ = [
    "STAGE_ORDER",
    "TRACER_NAME",
    "emit_trial_spans",
    "stage_layout",
    "trace_headers",
    "tracer_provider_from_env",
    "trial_context",
    "trial_id_generator",
    "trial_span_id",
    "trial_trace_id",
]

log = logging.getLogger(__name__)

TRACER_NAME = "legorl"
"""Instrumentation scope of the spans legorl emits after the fact."""
STAGE_ORDER = ("proxy_start", "setup", "agent", "verify")
"""Stages in the order a trial runs them; other recorded stages follow, in the record's order."""
SUBSTAGES = {"agent_start": "agent"}
"""Stages measured inside another from its start (the sandbox's start-up, inside the agent stage)."""

_FIXED_IDS: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "legorl_fixed_span_ids", default=None
)


def _digest(*parts: str) -> bytes:
    return hashlib.sha256("\x00".join(parts).encode()).digest()


def trial_trace_id(run: str, trial: str) -> int:
    """The trace id of a trial (128 bits, never 0): the same in every process that knows the trial."""
    return int.from_bytes(_digest("legorl.trace", run, trial)[:16], "big") or 1


def trial_span_id(run: str, trial: str) -> int:
    """The span id of a trial's root span (64 bits, never 0)."""
    return int.from_bytes(_digest("legorl.span", run, trial)[:8], "big") or 1


def trial_context(run: str, trial: str) -> Context:
    """A context whose current span is the trial's root span (remote, sampled): the parent of the
    proxy's per-call spans, so they land in the trial's trace under its root span."""
    from opentelemetry import trace  # noqa: PLC0415

    span_context = trace.SpanContext(
        trial_trace_id(run, trial),
        trial_span_id(run, trial),
        is_remote=True,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context))


def trace_headers(context: Context | None = None) -> dict[str, str]:
    """W3C `traceparent` (and `tracestate`) of the current span, for a call to another service (vLLM
    started with `--otlp-traces-endpoint` continues the trace); empty when no span is recording."""
    from opentelemetry import trace  # noqa: PLC0415
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # noqa: PLC0415

    if not trace.get_current_span(context).get_span_context().is_valid:
        return {}
    headers: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(headers, context)
    return headers


@contextlib.contextmanager
def _fixed_ids(trace_id: int, span_id: int) -> Iterator[None]:
    token = _FIXED_IDS.set((trace_id, span_id))
    try:
        yield
    finally:
        _FIXED_IDS.reset(token)


def trial_id_generator() -> Any:
    """The SDK's random id generator, except for a trial's root span (`emit_trial_spans`), which gets the
    trial's own ids. `tracer_provider_from_env` uses it; give it to a provider of your own likewise."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator  # noqa: PLC0415

    class TrialIdGenerator(RandomIdGenerator):
        def generate_trace_id(self) -> int:
            fixed = _FIXED_IDS.get()
            return fixed[0] if fixed is not None else super().generate_trace_id()

        def generate_span_id(self) -> int:
            fixed = _FIXED_IDS.get()
            return fixed[1] if fixed is not None else super().generate_span_id()

        def is_trace_id_random(self) -> bool:
            return _FIXED_IDS.get() is None

    return TrialIdGenerator()


def _traces_endpoint(env: Mapping[str, str]) -> str | None:
    return env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None


def tracer_provider_from_env(
    service_name: str,
    *,
    attributes: Mapping[str, str] | None = None,
    endpoint: str | None = None,
    env: Mapping[str, str] | None = None,
) -> SdkTracerProvider | None:
    """An SDK tracer provider exporting as the `OTEL_*` variables say, or None: no export, no cost.

    Exports when `endpoint` is given (sent to as it is) or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` /
    `OTEL_EXPORTER_OTLP_ENDPOINT` is set (the exporter reads them, and the protocol, headers, timeout
    and TLS variables, itself), or when `OTEL_TRACES_EXPORTER=console` (spans printed to stdout, for a
    look at them). `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn it off. The resource is
    `service.name` (`OTEL_SERVICE_NAME` when set), `attributes` and `OTEL_RESOURCE_ATTRIBUTES`;
    spans are batched (`OTEL_BSP_*`) and sampled as `OTEL_TRACES_SAMPLER` says (default: always, or as
    the parent was).
    """
    env = os.environ if env is None else env
    exporter_name = (env.get("OTEL_TRACES_EXPORTER") or "otlp").strip().lower()
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or exporter_name == "none":
        return None
    if exporter_name == "otlp" and endpoint is None and _traces_endpoint(env) is None:
        return None
    if exporter_name not in ("otlp", "console"):
        log.warning(
            "OTEL_TRACES_EXPORTER=%s is not supported (otlp, console, none); no traces", exporter_name
        )
        return None
    try:
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace import TracerProvider as SdkProvider  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import (  # noqa: PLC0415
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SpanExporter,
        )
    except ImportError:
        log.warning("tracing is configured but opentelemetry-sdk is not installed; no traces exported")
        return None
    exporter: SpanExporter
    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    else:
        try:
            exporter = _otlp_exporter(endpoint, env)
        except ImportError:
            log.warning(
                "an OTLP endpoint is set but opentelemetry-exporter-otlp-proto-http is not installed; "
                "no traces exported"
            )
            return None
    resource_attributes: dict[str, str] = {
        **(attributes or {}),
        "service.name": env.get("OTEL_SERVICE_NAME") or service_name,
    }
    provider = SdkProvider(resource=Resource.create(resource_attributes), id_generator=trial_id_generator())
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _otlp_exporter(endpoint: str | None, env: Mapping[str, str]) -> Any:
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol.strip().lower() == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # noqa: PLC0415
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError:
            log.warning(
                "OTLP protocol grpc needs opentelemetry-exporter-otlp-proto-grpc; using http/protobuf"
            )
        else:
            return GrpcExporter(endpoint=endpoint) if endpoint else GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415

    return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()


# --- a trial's spans, after the fact ---------------------------------------------------------------


def _ns(when: datetime) -> int:
    return int(when.timestamp() * 1e9)


def stage_layout(
    stage_seconds: Mapping[str, float], started_at: datetime, ended_at: datetime
) -> list[tuple[str, int, int, str | None]]:
    """(stage, start ns, end ns, parent stage or None) of each recorded stage. Pure.

    Only durations are recorded, so stages are laid back to back from the trial's start in the order
    they run (`STAGE_ORDER`, then any others); a sub-stage (`agent_start`) starts with its parent.
    Ends are clamped to the trial's end (clocks of different machines may disagree a little): the
    durations are exact, the offsets approximate.
    """
    start, limit = _ns(started_at), max(_ns(ended_at), _ns(started_at))
    known = [s for s in STAGE_ORDER if s in stage_seconds]
    others = [s for s in stage_seconds if s not in STAGE_ORDER and s not in SUBSTAGES]
    out: list[tuple[str, int, int, str | None]] = []
    starts: dict[str, int] = {}
    cursor = start
    for stage in (*known, *others):
        seconds = max(0.0, float(stage_seconds[stage]))
        end = min(cursor + int(seconds * 1e9), limit)
        out.append((stage, cursor, end, None))
        starts[stage] = cursor
        cursor = end
    for stage, parent in SUBSTAGES.items():
        if stage not in stage_seconds:
            continue
        begin = starts.get(parent, start)
        seconds = max(0.0, float(stage_seconds[stage]))
        out.append(
            (stage, begin, min(begin + int(seconds * 1e9), limit), parent if parent in starts else None)
        )
    return out


def _trial_attributes(record: TrialRecord) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "legorl.run": record.run,
        "legorl.trial": record.trial,
        "legorl.task_id": record.task_id,
        "legorl.group_id": record.group_id,
        "legorl.split": record.split,
        "legorl.step": record.step,
        "legorl.harness": record.harness,
        "legorl.termination_reason": record.termination_reason.value,
        "legorl.num_turns": record.num_turns,
        "legorl.tamper_findings": len(record.tamper_findings),
    }
    if record.policy_versions:
        attributes["legorl.policy_versions"] = list(record.policy_versions)
        attributes["legorl.policy_version"] = record.policy_versions[-1]
    if record.reward is not None:
        attributes["legorl.reward"] = float(record.reward)
    if record.merged_turn_share is not None:
        attributes["legorl.merged_turn_share"] = float(record.merged_turn_share)
    if record.tamper_findings:
        attributes["legorl.tamper_kinds"] = sorted({f.kind for f in record.tamper_findings})
    return attributes


def emit_trial_spans(
    tracer_provider: TracerProvider | None,
    record: TrialRecord,
    *,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """Emit a finished trial's root span and one child span per recorded stage (explicit start and end
    times, from the record). No-op without a provider.

    The root span (`trial`) gets the ids of `trial_trace_id` / `trial_span_id` when the provider came
    from `tracer_provider_from_env`, so the proxy's spans of the same trial hang under it; with another
    provider it gets ids of its own and the proxy's spans stay findable by their `legorl.trial`
    attribute. `attributes` are added to the root span (e.g. `k8s.namespace.name`).
    """
    if tracer_provider is None:
        return
    from opentelemetry import trace  # noqa: PLC0415
    from opentelemetry.trace import Status, StatusCode  # noqa: PLC0415

    tracer = tracer_provider.get_tracer(TRACER_NAME)
    root_attributes = {**_trial_attributes(record), **(attributes or {})}
    with _fixed_ids(trial_trace_id(record.run, record.trial), trial_span_id(record.run, record.trial)):
        root = tracer.start_span(
            "trial",
            # An empty context: the trial's root span never inherits whatever span is current here.
            context=trace.set_span_in_context(trace.INVALID_SPAN),
            attributes=root_attributes,
            start_time=_ns(record.started_at),
        )
    if record.termination_reason in INFRA_REASONS:
        root.set_status(Status(StatusCode.ERROR, record.error or record.termination_reason.value))
    elif record.error:
        root.set_attribute("legorl.error", record.error[:2000])
    root_context = trace.set_span_in_context(root)
    spans: dict[str, Any] = {}
    layout = stage_layout(record.stage_seconds, record.started_at, record.ended_at)
    for stage, start, _end, parent in layout:
        context = trace.set_span_in_context(spans[parent]) if parent in spans else root_context
        span = tracer.start_span(
            f"stage {stage}",
            context=context,
            attributes={
                "legorl.run": record.run,
                "legorl.trial": record.trial,
                "legorl.stage": stage,
                "legorl.stage_seconds": float(record.stage_seconds[stage]),
            },
            start_time=start,
        )
        spans[stage] = span
    # Children end before their parents (exporters show them in that order).
    for stage, _start, end, _parent in reversed(layout):
        spans[stage].end(end_time=end)
    root.end(end_time=max(_ns(record.ended_at), _ns(record.started_at)))
