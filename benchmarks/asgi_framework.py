"""Benchmark: what an ASGI framework (Starlette) costs per call against a hand-written ASGI app.

The question (issue 20): the proxy keeps its own minimal ASGI app only if a framework costs more than
0.3 ms of server CPU per call. Both servers answer the same trivial endpoint, `POST /v1/chat/completions`:
read a ~30 KB JSON body, parse it, answer a ~2 KB JSON. One is a raw ASGI callable in the style of the
proxy's app before it moved onto Starlette (read `http.request` messages, send `http.response.start` and
one body);
the other is a Starlette application (a `Route`, `await request.body()`, a `Response`). Both parse and
encode with orjson, as the proxy does, so only the framework differs.

Each runs in a process of its own under uvicorn configured as `legorl proxy` runs it (httptools,
uvloop, no access log, no date or server header). One client (httpx, one keep-alive connection per
server) sends the calls one at a time, in rounds that alternate between the servers, so machine noise
falls on both alike. Per round: the server's CPU time per call (user + system, /proc/PID/stat) and the
p50 latency. Reported: the median over rounds, its spread (min, max), and the paired difference
Starlette - raw per round.

Usage: python benchmarks/asgi_framework.py [--calls 1000] [--repeats 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from provenance import git_commit  # noqa: E402

from tests.support.asgi_server import free_port  # noqa: E402

PATH = "/v1/chat/completions"
THRESHOLD_MS = 0.3
"""Above this much server CPU per call, the proxy keeps its hand-written ASGI app (issue 20)."""

# Both apps, under uvicorn as `legorl proxy` configures it (argv: "raw" or "starlette", port, path).
SERVER_CODE = """
import sys
import orjson
import uvicorn

PATH = sys.argv[3]
ANSWER = {
    "id": "chatcmpl-bench",
    "object": "chat.completion",
    "model": "bench",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "x" * 1700}}],
    "usage": {"prompt_tokens": 7000, "completion_tokens": 400, "total_tokens": 7400},
}


def answer(body):
    request = orjson.loads(body)
    return orjson.dumps({**ANSWER, "model": request["model"], "messages_seen": len(request["messages"])})


async def raw(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    if scope["method"] != "POST" or scope["path"] != PATH:
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    out = answer(b"".join(chunks))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": out, "more_body": False})


def starlette_app():
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    async def completions(request):
        return Response(answer(await request.body()), media_type="application/json")

    return Starlette(routes=[Route(PATH, completions, methods=["POST"])])


app = raw if sys.argv[1] == "raw" else starlette_app()
# The settings of legorl/proxy/main.py (uvicorn[standard]: httptools and uvloop).
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), http="httptools", loop="uvloop", lifespan="on",
            log_level="warning", access_log=False, timeout_keep_alive=600, proxy_headers=False,
            server_header=False, date_header=False)
"""

TARGETS = ("raw", "starlette")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def request_body() -> bytes:
    """A ~30 KB chat request: a system prompt and a history of turns, as a coding harness sends."""
    messages = [{"role": "system", "content": "You are a coding agent. " * 40}]
    for turn in range(24):
        messages.append({"role": "user", "content": f"turn {turn}: " + "def f(x): return x + 1\n" * 40})
        messages.append({"role": "assistant", "content": "ok " * 40})
    return json.dumps({"model": "bench", "messages": messages, "max_tokens": 512}).encode()


def start(target: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", SERVER_CODE, target, str(port), PATH])  # noqa: S603
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.post(url + PATH, content=request_body(), timeout=1).raise_for_status()
            return process, url
        except httpx.TransportError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {target} server did not start") from None
            time.sleep(0.1)


def one_round(client: httpx.Client, url: str, pid: int, body: bytes, calls: int) -> dict[str, float]:
    latencies = []
    cpu0 = cpu_seconds(pid)
    for _ in range(calls):
        t0 = time.perf_counter()
        response = client.post(url + PATH, content=body, headers={"content-type": "application/json"})
        response.read()
        latencies.append(time.perf_counter() - t0)
        assert response.status_code == 200, response.text
    cpu = cpu_seconds(pid) - cpu0
    return {"cpu_ms_per_call": cpu / calls * 1e3, "p50_ms": statistics.median(latencies) * 1e3}


def spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="calls per server per round")
    parser.add_argument("--repeats", type=int, default=7, help="rounds (each server once per round)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "asgi_framework.json"))
    args = parser.parse_args()
    body = request_body()
    servers = {target: start(target) for target in TARGETS}
    response_bytes = len(httpx.post(servers["raw"][1] + PATH, content=body).content)
    rounds: dict[str, list[dict[str, float]]] = {target: [] for target in TARGETS}
    try:
        with httpx.Client(timeout=30) as client:
            for _, url in servers.values():  # warm-up: connections, imports, caches
                for _ in range(200):
                    client.post(url + PATH, content=body).read()
            for repeat in range(args.repeats):
                order = TARGETS if repeat % 2 == 0 else TARGETS[::-1]
                for target in order:
                    process, url = servers[target]
                    rounds[target].append(one_round(client, url, process.pid, body, args.calls))
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=30)
    added_cpu = [
        s["cpu_ms_per_call"] - r["cpu_ms_per_call"]
        for r, s in zip(rounds["raw"], rounds["starlette"], strict=True)
    ]
    added_p50 = [s["p50_ms"] - r["p50_ms"] for r, s in zip(rounds["raw"], rounds["starlette"], strict=True)]
    import starlette  # noqa: PLC0415
    import uvicorn  # noqa: PLC0415

    result: dict[str, Any] = {
        "benchmark": "asgi_framework",
        "commit": git_commit(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {"starlette": starlette.__version__, "uvicorn": uvicorn.__version__},
        "request_bytes": len(body),
        "response_bytes": response_bytes,
        "calls_per_round": args.calls,
        "repeats": args.repeats,
        "threshold_cpu_ms": THRESHOLD_MS,
        "servers": {
            target: {
                "cpu_ms_per_call": spread([r["cpu_ms_per_call"] for r in rounds[target]]),
                "p50_ms": spread([r["p50_ms"] for r in rounds[target]]),
            }
            for target in TARGETS
        },
        "starlette_added": {"cpu_ms_per_call": spread(added_cpu), "p50_ms": spread(added_p50)},
    }
    result["framework_within_threshold"] = (
        result["starlette_added"]["cpu_ms_per_call"]["median"] <= THRESHOLD_MS
    )
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
