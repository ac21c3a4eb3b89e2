"""Real harness CLIs through the real launcher and the proxy, against vLLM's CPU build: Codex CLI, Claude
Code and OpenCode, at the versions the harness images pin, installed from npm by scripts/get-harnesses.sh
(scripts/test.sh runs it through scripts/get-engine.sh).

Each test lays out a harness runtime the way a trial pod has it (`bin/legorl-harness`, the working tree's
launcher, with `libexec/` and `share/` from the npm cache), runs `legorl-harness KIND` on a one-line task
in a small workspace, with the launcher pointing the CLI at a `legorl proxy` in front of the shared vLLM
server (`vllm_engine`: the tiny random Qwen3-MoE, `tests/support/vllm_proxy.py`), and checks:

- the CLI exits 0, and the product maps that exit to the trial's termination reason `completed`
  (`agent_end`, which reads the agent container's exit code; the proxy's `/finish`; `reconcile`);
- a tool call round trip happened: vLLM sampled a call to the CLI's shell tool, the CLI ran it, and the
  next request the proxy made carried that call (the engine's own arguments) and the command's output;
- every journaled turn is exactly what vLLM sent (token ids, log-probs, finish reason: `check_journal`).

A random model never calls a tool by itself, and rarely ends a turn, so the tap between the proxy and
vLLM (test code, never the product; `Forcer`) rewrites vLLM's requests for the agent's first model calls,
those that offer the CLI's shell tool, in order:

1. the first (for Codex, also the second, for apply_patch): the tool is named in `tool_choice` and its
   schema, in the request to vLLM only, replaced by one that admits exactly one harmless value per
   argument (`strict`), so vLLM's structured output samples exactly that call; `max_tokens` gives the
   call room to close its JSON, which the random model pads with whitespace;
2. the next: the answer is held to the text "Done." by a regex (`structured_outputs`), after which
   only the end-of-turn token can follow, so the CLI gets a whole text answer and ends its run. A
   random answer cut by `max_tokens` would do for Codex and OpenCode, but Claude Code takes a cut
   answer for an error, asks the model to continue four times and exits 1 (measured).

Every other call passes unchanged (OpenCode's title call, any later one), under the proxy's own
`max_tokens` cap, which keeps random text short. The journal is held to vLLM's answers to the requests
as rewritten: the tap records what vLLM was sent and what it answered.

Measured on 2 shared CPUs (first prompts with the tiny byte-level tokenizer): Codex 17.3k tokens, three
calls, ~28 s; Claude Code with `--tools Bash,Read` 6.0k tokens, ~5 s; OpenCode 13.4k tokens, ~20 s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from legorl.api.summary import TrajectorySummary
from legorl.api.termination import TerminationReason
from legorl.api.trajectory import ApiFormat, Turn
from legorl.controller.records import reconcile
from legorl.operator.status.trial import agent_end
from tests.support.vllm_proxy import Answer, Engine, Exchange, Proxy, check_journal, open_proxy

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "sandbox-images/harness"
TEXT_MAX_TOKENS = 24
"""The proxy's cap on every answer (the run's `max_tokens`): the random text that ends a run stays short."""
FORCED_MAX_TOKENS = 1024
"""Room for a forced call: the random model pads the JSON with whitespace (54-138 tokens measured)."""
FINAL = "Done."
"""The text answer that ends each run."""
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello from the policy\n*** End Patch\n"


def pinned(kind: str, arg: str) -> str:
    """The version a harness image pins (its Dockerfile's ARG default), the one the tests must run."""
    text = (HARNESS / kind / "Dockerfile").read_text(encoding="utf-8")
    match = re.search(rf"^ARG {arg}=(\S+)$", text, re.MULTILINE)
    assert match, f"{kind}/Dockerfile has no ARG {arg}"
    return match.group(1)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A harness runtime folder as the trial pod mounts it: the working tree's launcher in bin/, the CLIs
    (and Codex's model catalog) that scripts/get-harnesses.sh installed, linked in."""
    cache = Path(os.environ.get("LEGORL_CACHE", Path.home() / ".cache/legorl")) / "npm/runtime"
    binaries = {
        "Codex": (cache / "libexec/codex/bin/codex", pinned("codex", "CODEX_VERSION")),
        "ClaudeCode": (cache / "libexec/claude", pinned("claude-code", "CLAUDE_CODE_VERSION")),
        "OpenCode": (cache / "libexec/opencode", pinned("opencode", "OPENCODE_VERSION")),
    }
    for kind, (binary, version) in binaries.items():
        if not os.access(binary, os.X_OK):
            pytest.fail(f"{kind} is not installed ({binary}): run `bash scripts/get-harnesses.sh`")
        home = tmp_path_factory.mktemp("version-home")
        shown = subprocess.run(
            [str(binary), "--version"],
            env={"PATH": "/usr/bin:/bin", "HOME": str(home)},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert version in shown.stdout.split(), (
            f"{kind}: {binary} is {shown.stdout.strip()!r}, the image pins {version}: "
            "run `bash scripts/get-harnesses.sh`"
        )
    root = tmp_path_factory.mktemp("harness-runtime")
    (root / "bin").mkdir()
    shutil.copy2(HARNESS / "legorl-harness", root / "bin/legorl-harness")
    (root / "libexec").symlink_to(cache / "libexec")
    (root / "share").symlink_to(cache / "share")
    return root


# -- forcing the random model's tool calls (in the tap, test code only) ---------------------------------


@dataclass
class Force:
    """One forced call: the next request that offers `tool` gets it named in `tool_choice`, with
    `schema` (in vLLM's request only) admitting exactly the arguments to sample. Without a schema, the
    answer is forced to be the text `FINAL` instead, ended by the model's end-of-turn token."""

    tool: str
    schema: dict[str, Any] | None = None
    rewritten: dict[str, Any] | None = None
    """vLLM's request, once this call was forced."""


def only(**values: str) -> dict[str, Any]:
    """A JSON schema admitting exactly one object: these string values."""
    return {
        "type": "object",
        "properties": {k: {"type": "string", "enum": [v]} for k, v in values.items()},
        "required": list(values),
        "additionalProperties": False,
    }


@dataclass
class Forcer:
    """The tap's `rewrite`: forces `plan`'s calls, in order, on the requests that offer their tools."""

    plan: list[Force]
    done: list[Force] = field(default_factory=list)

    def __call__(self, body: dict[str, Any]) -> dict[str, Any] | None:
        if not self.plan:
            return None
        step = self.plan[0]
        tools = body.get("tools") or []
        if not any(t["function"]["name"] == step.tool for t in tools):
            return None  # a side call (OpenCode's title, Claude Code's own): unchanged
        self.plan.pop(0)
        step.rewritten = body
        self.done.append(step)
        if step.schema is None:
            # Once the regex is matched only the end-of-turn token may follow: a whole answer, never
            # cut by max_tokens (Claude Code takes a cut answer for an error and asks to continue).
            body["structured_outputs"] = {"regex": re.escape(FINAL)}
            return body
        body["tools"] = [
            {
                "type": "function",
                "function": {**t["function"], "parameters": step.schema, "strict": True},
            }
            if t["function"]["name"] == step.tool
            else t
            for t in tools
        ]
        body["tool_choice"] = {"type": "function", "function": {"name": step.tool}}
        body["max_tokens"] = FORCED_MAX_TOKENS
        return body


# -- one run of a harness through the launcher --------------------------------------------------------


@dataclass
class Run:
    kind: str
    result: subprocess.CompletedProcess[str]
    seconds: float
    workspace: Path
    proxy: Proxy
    forcer: Forcer

    @property
    def log(self) -> str:
        return (
            f"{self.kind}: exit {self.result.returncode} after {self.seconds:.1f}s\n"
            f"stdout:\n{self.result.stdout[-6000:]}\nstderr:\n{self.result.stderr[-6000:]}"
        )


@pytest.fixture
def proxy(vllm_engine: Engine, tmp_path: Path) -> Iterator[Proxy]:
    with open_proxy(vllm_engine, tmp_path, max_tokens=TEXT_MAX_TOKENS) as handle:
        yield handle


def run_harness(
    proxy: Proxy,
    runtime: Path,
    folder: Path,
    kind: str,
    plan: list[Force],
    *,
    task: str = "List the files in the current directory.",
    args: tuple[str, ...] = (),
    config: dict[str, str] | None = None,
    timeout: float = 240,
) -> Run:
    """`legorl-harness KIND ARGS...` as the trial pod runs it: a workspace, a task file, a HOME and a
    TMPDIR of its own, the proxy's URLs; `config` files go to LEGORL_HARNESS_CONFIG_DIR."""
    workspace = folder / "workspace"
    workspace.mkdir()
    (workspace / "README.md").write_text("A small repository.\n", encoding="utf-8")
    (folder / "task.md").write_text(task + "\n", encoding="utf-8")
    config_dir = folder / "harness-config"
    config_dir.mkdir()
    for name, text in (config or {}).items():
        (config_dir / name).write_text(text, encoding="utf-8")
    for name in ("home", "tmp"):
        (folder / name).mkdir()
    forcer = Forcer(list(plan))
    proxy.tap.rewrite = forcer
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": str(folder / "home"),
        "TMPDIR": str(folder / "tmp"),
        "OPENAI_BASE_URL": f"{proxy.url}/v1",
        "ANTHROPIC_BASE_URL": proxy.url,
        "LEGORL_MAX_TURNS": "10",
        "LEGORL_WORKSPACE": str(workspace),
        "LEGORL_TASK_FILE": str(folder / "task.md"),
        "LEGORL_HARNESS_CONFIG_DIR": str(config_dir),
    }
    started = time.monotonic()
    result = subprocess.run(
        [str(runtime / "bin/legorl-harness"), kind, *args],
        env=env,
        cwd=folder,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    run = Run(kind, result, time.monotonic() - started, workspace, proxy, forcer)
    print(f"\n{kind}: exit {result.returncode} in {run.seconds:.1f}s, {len(proxy.tap.chat())} model calls")
    return run


def termination(run: Run) -> TerminationReason:
    """The trial's termination reason as the product decides it: the agent container's exit code read by
    the operator (`agent_end`), told to the proxy (`POST /finish`), reconciled with its end state."""
    now = datetime.now(UTC)
    stamp = now.isoformat().replace("+00:00", "Z")
    pod = {
        "metadata": {"name": "trial-0"},
        "status": {
            "startTime": stamp,
            "containerStatuses": [
                {
                    "name": "agent",
                    "state": {
                        "terminated": {
                            "exitCode": run.result.returncode,
                            "startedAt": stamp,
                            "finishedAt": stamp,
                        }
                    },
                }
            ],
        },
    }
    end = agent_end(pod, now=now, setup_seconds=600, agent_seconds=3600, launched=now)
    assert end is not None
    finished = run.proxy.http.post("/finish", json={"reason": end.reason, "exitCode": end.exit_code})
    assert finished.status_code == 200, finished.text
    return reconcile(end.reason, TrajectorySummary.from_json(run.proxy.trajectory()))


def exchange_after(exchanges: list[Exchange], forced: Force) -> tuple[Exchange, Exchange]:
    """The forced exchange, and the next one that offered the same tools (the agent's next step)."""
    [at] = [i for i, e in enumerate(exchanges) if e.request is forced.rewritten]
    names = [t["function"]["name"] for t in exchanges[at].sent_by_proxy.get("tools") or []]
    for later in exchanges[at + 1 :]:
        if [t["function"]["name"] for t in later.sent_by_proxy.get("tools") or []] == names:
            return exchanges[at], later
    raise AssertionError(f"no request after the forced call to {forced.tool} offered the same tools")


def assert_round_trip(run: Run, forced: Force, arguments: dict[str, str], output: str) -> tuple[Answer, Any]:
    """vLLM sampled exactly the forced call; the CLI ran it; its next request carried the call, in the
    engine's own spelling, and a tool result holding `output`. Returns vLLM's answer and that result."""
    call_exchange, follow_up = exchange_after(run.proxy.tap.chat(), forced)
    answer = call_exchange.answer()
    # (A named tool_choice ends with finish_reason "stop" in vLLM, not "tool_calls".)
    [call] = answer.tool_calls
    assert (call["name"], json.loads(call["arguments"])) == (forced.tool, arguments), run.log
    messages = follow_up.sent_by_proxy["messages"]
    sent_calls = [c for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    assert {"id": call["id"], "name": forced.tool, "arguments": call["arguments"]} in [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in sent_calls
    ], "the CLI's next request must carry the call as the engine made it"
    [result] = [m for m in messages if m["role"] == "tool" and m.get("tool_call_id") == call["id"]]
    text = result["content"] if isinstance(result["content"], str) else json.dumps(result["content"])
    assert output in text, (text, run.log)
    return answer, result


def assert_journal(run: Run, api_format: ApiFormat, *, ordered: bool = True) -> list[Turn]:
    """Every journaled turn is vLLM's answer, byte for byte; the forced end is a whole text answer."""
    pairs = check_journal(run.proxy, ordered=ordered)
    assert pairs, run.log
    [end] = [e for e in run.proxy.tap.chat() if e.request is run.forcer.done[-1].rewritten]
    answer = end.answer()
    assert (answer.content, answer.finish_reason, answer.tool_calls) == (FINAL, "stop", []), run.log
    assert all(turn.api_format == api_format for turn, _ in pairs)
    trajectory = run.proxy.trajectory()
    assert trajectory["errors"] == {}, trajectory["errors"]
    assert trajectory["turns"] == len(pairs)
    return [turn for turn, _ in pairs]


# -- the tests ----------------------------------------------------------------------------------------------


def test_codex_runs_a_command_and_applies_a_patch(proxy: Proxy, runtime: Path, tmp_path: Path) -> None:
    """Codex CLI: `exec_command` (`cmd: ls`), then its custom (freeform) `apply_patch` tool, which the proxy
    offers the engine as a function taking `input`: the patch adds hello.txt, Codex applies it, and the
    result goes back to the engine as the call's tool result. Then a text answer ends the run; the
    launcher's model catalog means no fallback-metadata warning."""
    shell = Force("exec_command", only(cmd="ls"))
    patch = Force("apply_patch", only(input=PATCH))
    run = run_harness(proxy, runtime, tmp_path, "Codex", [shell, patch, Force("exec_command")])
    assert run.result.returncode == 0, run.log
    assert termination(run) == TerminationReason.COMPLETED
    assert not run.forcer.plan, f"calls not forced: {run.forcer.plan}\n{run.log}"
    assert "Model metadata for" not in run.result.stdout + run.result.stderr, run.log
    assert FINAL in run.result.stdout, run.log

    assert_round_trip(run, shell, {"cmd": "ls"}, "README.md")
    assert (run.workspace / "hello.txt").read_text(encoding="utf-8") == "hello from the policy\n", run.log
    assert_round_trip(run, patch, {"input": PATCH}, "hello.txt")
    first = run.proxy.tap.chat()[0].sent_by_proxy
    # Codex's apply_patch reached the engine as a function with one string argument.
    [apply_patch] = [t["function"] for t in first["tools"] if t["function"]["name"] == "apply_patch"]
    assert apply_patch["parameters"]["required"] == ["input"]
    assert "lark" in apply_patch["parameters"]["properties"]["input"]["description"]
    assert len(assert_journal(run, ApiFormat.OPENAI_RESPONSES)) == len(run.proxy.tap.chat()) >= 3


def test_claude_code_runs_a_command(proxy: Proxy, runtime: Path, tmp_path: Path) -> None:
    """Claude Code: `Bash` (`command: ls`), then a text answer ends the run (`-p`, JSON output). It runs as
    the launcher starts it, `--dangerously-skip-permissions` included (as root it needs the launcher's
    IS_SANDBOX=1). Its tools are narrowed to Bash and Read (`--tools`, passed on by the launcher): with
    its whole set (12 tools) the first prompt is 22.3k tokens and the run takes ~36 s instead of ~5 s
    (6.0k tokens); the engine's 32k context holds either."""
    shell = Force("Bash", only(command="ls"))
    run = run_harness(
        proxy, runtime, tmp_path, "ClaudeCode", [shell, Force("Bash")], args=("--tools", "Bash,Read")
    )
    assert run.result.returncode == 0, run.log
    assert termination(run) == TerminationReason.COMPLETED
    assert not run.forcer.plan, run.log
    report = json.loads(run.result.stdout)
    assert (report["type"], report["subtype"], report["is_error"]) == ("result", "success", False), run.log
    assert report["result"] == FINAL
    assert_round_trip(run, shell, {"command": "ls"}, "README.md")
    turns = assert_journal(run, ApiFormat.ANTHROPIC_MESSAGES, ordered=False)
    assert len(turns) >= 2


def test_opencode_runs_a_command(proxy: Proxy, runtime: Path, tmp_path: Path) -> None:
    """OpenCode (Chat Completions through @ai-sdk/openai-compatible): `bash` (`command: ls` and its
    `description`), then a text answer ends the run. OpenCode also makes a title-generation call of its own,
    concurrently, so turns are matched to vLLM's answers by prompt."""
    shell = Force("bash", only(command="ls", description="List the files"))
    run = run_harness(proxy, runtime, tmp_path, "OpenCode", [shell, Force("bash")])
    assert run.result.returncode == 0, run.log
    assert termination(run) == TerminationReason.COMPLETED
    assert not run.forcer.plan, run.log
    assert_round_trip(run, shell, {"command": "ls", "description": "List the files"}, "README.md")
    assert FINAL in run.result.stdout, run.log
    turns = assert_journal(run, ApiFormat.OPENAI_CHAT, ordered=False)
    assert len(turns) >= 2
