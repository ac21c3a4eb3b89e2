"""Prometheus-style metrics of one proxy, served as text at `GET /metrics`.

A few counters and histograms are all a sidecar needs; writing the exposition format directly
keeps the proxy image free of a metrics client library.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import defaultdict

__all__ = ["PROXY_METRICS", "Metrics"]

PROXY_METRICS: tuple[tuple[str, str, str], ...] = (
    ("legorl_proxy_requests_total", "counter", "Calls served, by API format and outcome."),
    ("legorl_proxy_errors_total", "counter", "Failed calls, by error kind."),
    (
        "legorl_proxy_upstream_errors_total",
        "counter",
        "Engine answers that were not 2xx, by HTTP status (503 "
        "included, retried or not), and calls that got no answer (unreachable, timeout, transport).",
    ),
    ("legorl_proxy_tokens_in_total", "counter", "Prompt tokens sent to the engine."),
    ("legorl_proxy_tokens_out_total", "counter", "Completion tokens journaled."),
    ("legorl_proxy_engine_retries_total", "counter", "Engine calls retried (503, refused)."),
    ("legorl_proxy_unexpected_format_total", "counter", "Calls in another API than configured."),
    (
        "legorl_proxy_tool_arguments_restored_total",
        "counter",
        "Tool calls sent back re-serialised whose arguments went to the engine in its own spelling.",
    ),
    ("legorl_proxy_admission_timeouts_total", "counter", "Sessions admitted after the longest wait."),
    ("legorl_proxy_admission_wait_seconds", "histogram", "Time a new session waited for KV room."),
    ("legorl_proxy_request_seconds", "histogram", "Whole call latency, proxy to engine and back."),
    ("legorl_proxy_engine_seconds", "histogram", "The engine's part of a call (retries included)."),
    ("legorl_proxy_ttft_seconds", "histogram", "Time to the first streamed token."),
    ("legorl_proxy_journal_fsync_seconds", "histogram", "Journal fsync latency (one per batch)."),
    ("legorl_proxy_journal_batch_records", "histogram", "Records per journal fsync."),
    ("legorl_proxy_turns", "gauge", "Turns journaled in this trial."),
    ("legorl_proxy_segment_merge_ratio", "gauge", "Share of turns that extended an earlier one."),
    ("legorl_proxy_in_flight", "gauge", "Calls in flight."),
    ("legorl_proxy_journal_dropped_bytes", "gauge", "Torn-tail bytes cut off the journal at start."),
)
"""Every metric of a proxy: (name, type, help). Labels stay low-cardinality: the trial is on spans."""

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_FSYNC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1)


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    if not pairs:
        return ""
    inner = ",".join(f'{k}="{v}"'.replace("\n", " ") for k, v in pairs)
    return "{" + inner + "}"


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


class Metrics:
    """The proxy's metrics; safe to update from the journal's writer thread too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(dict)
        self._histograms: dict[str, dict[tuple[tuple[str, str], ...], _Histogram]] = defaultdict(dict)
        self._gauges: dict[str, float] = {}
        self._help: dict[str, tuple[str, str]] = {}
        for name, kind, text in PROXY_METRICS:
            self._help[name] = (kind, text)

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._counters[name]
            series[key] = series.get(key, 0.0) + value

    def observe(self, name: str, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        buckets: tuple[float, ...] = _FSYNC_BUCKETS if "journal" in name else _LATENCY_BUCKETS
        if name == "legorl_proxy_journal_batch_records":
            buckets = (1, 2, 4, 8, 16, 32, 64, 128)
        with self._lock:
            series = self._histograms[name]
            if key not in series:
                series[key] = _Histogram(buckets)
            series[key].observe(value)

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._gauges[name] = value

    def add(self, name: str, delta: float) -> None:
        with self._lock:
            self._gauges[name] = self._gauges.get(name, 0.0) + delta

    def render(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []
        with self._lock:
            for name, (kind, text) in self._help.items():
                lines.append(f"# HELP {name} {text}")
                lines.append(f"# TYPE {name} {kind}")
                if kind == "counter":
                    for key, value in sorted(self._counters.get(name, {}).items()):
                        lines.append(f"{name}{_labels(key)} {value:g}")
                elif kind == "gauge":
                    if name in self._gauges and not math.isnan(self._gauges[name]):
                        lines.append(f"{name} {self._gauges[name]:g}")
                else:
                    for key, hist in sorted(self._histograms.get(name, {}).items()):
                        cumulative = 0
                        for bound, count in zip((*hist.buckets, math.inf), hist.counts, strict=True):
                            cumulative += count
                            le = "+Inf" if bound == math.inf else f"{bound:g}"
                            lines.append(f"{name}_bucket{_labels((*key, ('le', le)))} {cumulative}")
                        lines.append(f"{name}_sum{_labels(key)} {hist.sum:g}")
                        lines.append(f"{name}_count{_labels(key)} {hist.count}")
        return "\n".join(lines) + "\n"
