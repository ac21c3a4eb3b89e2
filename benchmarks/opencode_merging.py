"""Benchmark: how the real OpenCode CLI's turns merge into segments through the proxy, vs a baseline commit.

OpenCode (npm `opencode-ai`, pinned; installed under ~/.cache/legorl/npm on first use) runs one task,
`opencode run "CALL_TOOL list the files"`, through `legorl proxy` to the fake engine of
`legorl.proxy.testing` (it answers a `CALL_TOOL` prompt with a tool call, then a text answer), once with
the proxy of this checkout and once with the proxy of `--baseline` (a git worktree of that commit), in
the same run. Each prints the trial's turns, segments and merged share (`GET /trajectory`): OpenCode
makes a title-generation side call (its own segment), then the agent's turns, which merge only if the
second extends the first exactly. OpenCode sends the tool call's arguments back re-serialised
(`{"command":"ls -la"}` for the engine's `{"command": "ls -la"}`).

Usage: python benchmarks/opencode_merging.py --baseline COMMIT
       [--out benchmarks/results/opencode_merging.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from provenance import git_commit  # noqa: E402

from tests.support.asgi_server import free_port  # noqa: E402

OPENCODE_VERSION = "1.18.33"
NPM_HOME = Path.home() / ".cache" / "legorl" / "npm" / f"opencode-{OPENCODE_VERSION}"
PARTS = ("", "proxy", "operator", "trainer", "sandbox-images")
"""The folders whose `legorl` trees make up the namespace (pyproject's dev-mode dirs)."""
ENGINE = """
import sys, uvicorn
from legorl.proxy.testing import FakeEngine
uvicorn.run(FakeEngine(), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def opencode() -> Path:
    binary = NPM_HOME / "node_modules" / ".bin" / "opencode"
    if not binary.exists():
        NPM_HOME.mkdir(parents=True, exist_ok=True)
        subprocess.run(  # noqa: S603 - npm, a pinned package
            ["npm", "install", "--no-audit", "--no-fund", f"opencode-ai@{OPENCODE_VERSION}"],  # noqa: S607
            cwd=NPM_HOME,
            check=True,
        )
    return binary


def _wait(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not come up")


def measure(tree: Path, binary: Path) -> dict[str, Any]:
    """One OpenCode run through the proxy of `tree`; the trial's merge figures."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(tree / p) for p in PARTS)}
    engine_port, proxy_port = free_port(), free_port()
    work = Path(tempfile.mkdtemp(prefix="opencode-merging-"))
    started = [subprocess.Popen([sys.executable, "-c", ENGINE, str(engine_port)], env=env)]  # noqa: S603
    started.append(
        subprocess.Popen(  # noqa: S603 - this interpreter, our arguments
            [
                sys.executable,
                "-m",
                "legorl.cli",
                "proxy",
                "--upstream",
                f"http://127.0.0.1:{engine_port}",
                "--journal",
                str(work / "journal"),
                "--port",
                str(proxy_port),
                "--log-level",
                "WARNING",
            ],
            env=env,
        )
    )
    proxy = f"http://127.0.0.1:{proxy_port}"
    try:
        _wait(f"http://127.0.0.1:{engine_port}/weight_info")
        _wait(f"{proxy}/ready")
        config = {
            "autoupdate": False,
            "share": "disabled",
            "model": "legorl/policy",
            "provider": {
                "legorl": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "legorl",
                    "options": {"baseURL": f"{proxy}/v1", "apiKey": "dummy"},
                    "models": {"policy": {"name": "policy"}},
                }
            },
        }
        (work / "opencode.json").write_text(json.dumps(config))
        run_env = {
            **os.environ,
            "HOME": str(work),
            "OPENCODE_CONFIG": str(work / "opencode.json"),
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
        }
        done = subprocess.run(  # noqa: S603 - the pinned CLI
            [str(binary), "run", "CALL_TOOL list the files"],
            cwd=work,
            env=run_env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        trajectory = httpx.get(f"{proxy}/trajectory", params={"tokens": "false"}).json()
        restored = [
            line.split()[-1]
            for line in httpx.get(f"{proxy}/metrics").text.splitlines()
            if line.startswith("legorl_proxy_tool_arguments_restored_total")
        ]
    finally:
        for process in reversed(started):
            process.terminate()
            process.wait(timeout=30)
    return {
        "opencode_exit_code": done.returncode,
        "turns": trajectory["turns"],
        "segments": trajectory["segments"],
        "merged_turn_share": trajectory["mergedTurnShare"],
        "tool_arguments_restored": float(restored[0]) if restored else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the commit whose proxy is the baseline")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here (under benchmarks/results/)")
    args = parser.parse_args(argv)
    binary = opencode()
    baseline_tree = Path(tempfile.mkdtemp(prefix="opencode-merging-baseline-")) / "tree"
    git = ["git", "-C", str(REPO), "worktree"]
    subprocess.run([*git, "add", "--detach", str(baseline_tree), args.baseline], check=True)  # noqa: S603
    try:
        baseline = measure(baseline_tree, binary)
        current = measure(REPO, binary)
    finally:
        subprocess.run([*git, "remove", "--force", str(baseline_tree)], check=False)  # noqa: S603
    document = {
        "git_commit": git_commit(),
        "baseline_commit": args.baseline,
        "opencode": OPENCODE_VERSION,
        "what": "opencode run 'CALL_TOOL list the files' through legorl proxy to the fake engine; "
        "the trial's turns, segments and merged share",
        "baseline": baseline,
        "this_tree": current,
    }
    for name in ("baseline", "this_tree"):
        r = document[name]
        print(
            f"{name:9}: opencode exit {r['opencode_exit_code']}, {r['turns']} turns, "
            f"{r['segments']} segments, merged share {r['merged_turn_share']}, "
            f"tool arguments restored {r['tool_arguments_restored']}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
