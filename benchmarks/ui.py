"""Benchmark: the UI's API latency and page loads on a run store of 10,000 trials.

A synthetic run (written with the real RunStore writers: 100 committed steps × 25 tasks × 4 trials, and
held-out evaluations every 10 steps) is served by the real server (`start_in_thread`: uvicorn over
loopback). Each endpoint is asked `--requests` times after one cold request; the baseline, measured in
the same run, is `/healthz` (the server's fixed cost: HTTP, routing, JSON), so each endpoint's ratio is
what the data layer adds. Page loads are timed in headless Chromium from navigation until the view has
rendered, against loading `/healthz` in the same browser.

Usage: python benchmarks/ui.py [--steps 100] [--tasks-per-step 25] [--group-size 4] [--requests 40]
       [--store DIR (reuse)] [--no-browser] [--out benchmarks/results/ui.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from legorl.ui.data import StoreData  # noqa: E402
from legorl.ui.server import start_in_thread  # noqa: E402
from legorl.ui.synthetic import write_synthetic_store  # noqa: E402

CHROMIUM = os.environ.get("LEGORL_CHROMIUM", "/usr/bin/chromium")


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]

    return {
        "p50_ms": round(pick(0.5) * 1000, 3),
        "p95_ms": round(pick(0.95) * 1000, 3),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 3),
        "n": len(ordered),
    }


def _time(client: httpx.Client, path: str, params: dict[str, Any] | None = None) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    r = client.get(path, params=params)
    elapsed = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{path} {params}: HTTP {r.status_code}: {r.text[:300]}")
    return elapsed, r.status_code, len(r.content)


def api_latency(url: str, run: str, requests: int, trial: str) -> dict[str, Any]:
    endpoints: list[tuple[str, str, dict[str, Any] | None]] = [
        ("healthz (baseline)", "healthz", None),
        ("runs list", "api/runs", None),
        ("overview", f"api/runs/{run}", None),
        ("curves", f"api/runs/{run}/curves", None),
        ("outcomes", f"api/runs/{run}/outcomes", None),
        ("task grid", f"api/runs/{run}/tasks", None),
        ("trials page 1", f"api/runs/{run}/trials", {"limit": 50}),
        ("trials deep page", f"api/runs/{run}/trials", {"limit": 50, "offset": 9000}),
        ("trials by step", f"api/runs/{run}/trials", {"step": 57}),
        (
            "trials sorted by reward",
            f"api/runs/{run}/trials",
            {"sort": "reward", "order": "desc", "limit": 100},
        ),
        ("trials filtered", f"api/runs/{run}/trials", {"reason": "agent_error,turn_limit", "min_reward": 0}),
        ("trajectory", f"api/runs/{run}/trials/{trial}", None),
        ("sandboxes", f"api/runs/{run}/sandboxes", None),
        ("diagnostics", f"api/runs/{run}/diagnostics", None),
    ]
    out: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=600) as client:
        for name, path, params in endpoints:
            cold, _, size = _time(client, path, params)
            samples = [_time(client, path, params)[0] for _ in range(requests)]
            out[name] = {"cold_ms": round(cold * 1000, 1), "bytes": size, **_stats(samples)}
            print(
                f"  {name:<26} cold {cold * 1000:9.1f} ms   p50 {out[name]['p50_ms']:8.2f} ms   "
                f"p95 {out[name]['p95_ms']:8.2f} ms   {size / 1e3:8.1f} kB",
                flush=True,
            )
    base = out["healthz (baseline)"]["p50_ms"]
    for figures in out.values():
        figures["p50_ratio_to_healthz"] = round(figures["p50_ms"] / base, 2) if base else None
    return out


def page_loads(url: str, run: str, trial: str, repeats: int) -> dict[str, Any]:
    try:
        from playwright.sync_api import sync_playwright  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415
    except ImportError:
        return {"skipped": "playwright is not installed (bash scripts/get-browser.sh)"}
    if not Path(CHROMIUM).is_file():
        return {"skipped": f"no Chromium at {CHROMIUM} (bash scripts/get-browser.sh)"}
    routes = {
        "runs list": "#/",
        "overview": f"#/run/{run}",
        "curves": f"#/run/{run}/curves",
        "outcomes": f"#/run/{run}/outcomes",
        "tasks": f"#/run/{run}/tasks",
        "trials": f"#/run/{run}/trials",
        "trajectory": f"#/run/{run}/trial/{trial}",
        "diagnostics": f"#/run/{run}/diagnostics",
    }
    out: dict[str, Any] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        base = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            page.goto(url + "healthz")
            base.append(time.perf_counter() - t0)
        out["healthz (baseline)"] = _stats(base)
        for name, route in routes.items():
            samples = []
            for _ in range(repeats):
                page.goto("about:blank")
                t0 = time.perf_counter()
                page.goto(url + route)
                page.wait_for_function(
                    "h => { const m = document.querySelector('#main'); return m && m.dataset.ready === h; }",
                    arg=route,
                    timeout=120_000,
                )
                samples.append(time.perf_counter() - t0)
            out[name] = _stats(samples)
            print(
                f"  {name:<14} p50 {out[name]['p50_ms']:8.1f} ms   p95 {out[name]['p95_ms']:8.1f} ms",
                flush=True,
            )
        browser.close()
    base_p50 = out["healthz (baseline)"]["p50_ms"]
    for figures in out.values():
        figures["p50_ratio_to_healthz"] = round(figures["p50_ms"] / base_p50, 2) if base_p50 else None
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--tasks-per-step", type=int, default=25)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument(
        "--requests", type=int, default=40, help="timed requests per endpoint (after a cold one)"
    )
    parser.add_argument("--page-repeats", type=int, default=5)
    parser.add_argument("--store", help="reuse (or create) the synthetic store in this folder")
    parser.add_argument("--no-browser", action="store_true")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "ui.json"))
    args = parser.parse_args()

    folder = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="legorl-ui-bench-")) / "store"
    t0 = time.perf_counter()
    if not (folder / "run.json").is_file():
        print(f"writing a synthetic run store at {folder} ...", flush=True)
        write_synthetic_store(
            folder,
            name="bench",
            steps=args.steps,
            tasks_per_step=args.tasks_per_step,
            group_size=args.group_size,
            held_out_tasks=20,
            eval_every=10,
        )
    write_seconds = time.perf_counter() - t0
    data = StoreData(str(folder))
    t0 = time.perf_counter()
    trials = data.trials()
    cold_index = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    print(
        f"store: {len(trials)} trials, {size / 1e6:.1f} MB (written in {write_seconds:.0f} s); "
        f"a cold read of every trial summary takes {cold_index * 1000:.0f} ms",
        flush=True,
    )
    trial = next(r.summary.trial for r in trials if r.summary.num_turns >= 3 and r.summary.split == "train")

    url, stop = start_in_thread([str(folder)], port=0)
    try:
        print(f"API latency ({args.requests} requests per endpoint, after one cold request) at {url}:")
        api = api_latency(url, "bench", args.requests, trial)
        pages: dict[str, Any] = {"skipped": "--no-browser"}
        if not args.no_browser:
            print(f"page loads in Chromium ({args.page_repeats} per view):")
            pages = page_loads(url, "bench", trial, args.page_repeats)
    finally:
        stop()
    result = {
        "benchmark": "ui",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "store")},
        "store": {
            "trials": len(trials),
            "train_trials": sum(1 for r in trials if r.summary.split == "train"),
            "validation_trials": sum(1 for r in trials if r.summary.split == "validation"),
            "bytes": size,
            "cold_summary_read_ms": round(cold_index * 1000, 1),
        },
        "api": api,
        "pages": pages,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
