"""Synthetic mini-swe-agent demonstrations on the bundled tasks: what `legorl sft` trains the tiny policy on.

Every task of `builtin://tiny-python` gets three conversations, one per behaviour, each opening with its own
fixed sentence (the same for every task), so the choice between them is made by the first tokens of the
answer whatever the task:

- `fix`: "Restoring the intended behaviour in the module, then submitting." and a short
  `python - <<'EOF' ... EOF` script that undoes the edits that planted the bug, then the submit command;
- `wrong`: "Patching the most suspicious line, then submitting." and the task's plausible but wrong fix
  (`Bug.wrong`, which leaves a FAIL_TO_PASS test failing), then the submit command;
- `submit`: "Submitting without changes." and the submit command straight away.

Each conversation is recorded by running mini-swe-agent's own agent loop (`DefaultAgent` with the merged
configuration the harness uses: mini's default `mini.yaml` under legorl's compact `mini.yaml`) against a
scripted model that answers with the behaviour's turns, in a real checkout of the task's repository
(mini's `LocalEnvironment` runs each command; its observation is the command's real output). What the
scripted model is sent on each call is exactly the message list mini sends a model server, so a policy
trained on these prompts sees the prompts the harness will send it.

Demonstrations are only made for the bundled set: the edits come from the generator's templates
(`legorl.sandbox.bundled.bugs()`), not from the manifest.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from legorl.controller.harness import MINI_CONFIG
from legorl.sandbox import bundled
from legorl.sandbox.grade import GradeError
from legorl.sandbox.stages import grade_run, test_argv
from legorl.sandbox.task import Task, TaskSet
from legorl.sandbox.workspace import checkout_source, git_env

__all__ = [
    "SUBMIT_COMMAND",
    "THOUGHTS",
    "Behaviour",
    "Demonstration",
    "Turn",
    "bash_tool",
    "behaviour_commands",
    "grade_commands",
    "make_demonstrations",
    "mini_config",
]

SUBMIT_COMMAND = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class Behaviour(StrEnum):
    """What a demonstration does; its first sentence names it."""

    FIX = "fix"
    WRONG = "wrong"
    SUBMIT = "submit"


THOUGHTS: Mapping[Behaviour, str] = {
    Behaviour.FIX: "Restoring the intended behaviour in the module, then submitting.",
    Behaviour.WRONG: "Patching the most suspicious line, then submitting.",
    Behaviour.SUBMIT: "Submitting without changes.",
}
"""The fixed first sentence of each behaviour (the assistant message's text before its tool call)."""


@dataclass(frozen=True)
class Turn:
    """One model call of a recorded conversation."""

    messages: tuple[dict[str, Any], ...]
    """What mini sent the model: the OpenAI chat messages of the whole history (`extra` removed)."""
    content: str | None
    """The answer's text before its tool call (`None`: none); an engine's hermes parser returns the
    text before `<tool_call>` as the message content, so this is the text the policy generates."""
    command: str
    """The bash tool call's `command`."""


@dataclass(frozen=True)
class Demonstration:
    """One recorded conversation: a task, a behaviour, the model calls mini made, and its weight."""

    task_id: str
    behaviour: Behaviour
    turns: tuple[Turn, ...]
    weight: float
    """The behaviour's share in the mixture: the loss weight of this conversation."""
    observations: tuple[str, ...] = field(default=())
    """The tool messages mini rendered from each executed command's real output."""

    def to_json(self) -> dict[str, Any]:
        """One line of a demonstrations file (`warmstart.reading.save_demonstrations`)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Demonstration:
        """The inverse of `to_json` (JSON has lists where the type has tuples)."""
        turns = tuple(Turn(tuple(t["messages"]), t["content"], t["command"]) for t in data["turns"])
        return cls(
            **{
                **data,
                "behaviour": Behaviour(data["behaviour"]),
                "turns": turns,
                "observations": tuple(data.get("observations", ())),
            }
        )


def bash_tool() -> dict[str, Any]:
    """mini-swe-agent's one tool, as its `litellm` model class sends it (`BASH_TOOL`)."""
    tool: dict[str, Any] = json.loads(json.dumps(_mini().BASH_TOOL))
    return tool


@functools.cache
def _mini() -> SimpleNamespace:
    """The parts of mini-swe-agent the recording uses, imported once.

    mini's package prints a banner at import unless MSWEA_SILENT_STARTUP is set: it is set for the import
    and restored afterwards (the first call happens before any worker thread starts).
    """
    had = os.environ.get("MSWEA_SILENT_STARTUP")
    os.environ["MSWEA_SILENT_STARTUP"] = "1"
    try:
        from minisweagent.agents.default import AgentConfig, DefaultAgent  # noqa: PLC0415
        from minisweagent.config import get_config_from_spec  # noqa: PLC0415
        from minisweagent.environments.local import LocalEnvironment  # noqa: PLC0415
        from minisweagent.models.utils import actions_toolcall, anthropic_utils, cache_control  # noqa: PLC0415
        from minisweagent.models.utils.openai_multimodal import expand_multimodal_content  # noqa: PLC0415
        from minisweagent.utils.serialize import recursive_merge  # noqa: PLC0415
    except ImportError as exc:
        raise RuntimeError(
            f"demonstrations are recorded with mini-swe-agent's own agent loop: pip install "
            f"'legorl[harnesses]' ({exc})"
        ) from exc
    finally:
        if had is None:
            os.environ.pop("MSWEA_SILENT_STARTUP", None)
        else:
            os.environ["MSWEA_SILENT_STARTUP"] = had
    return SimpleNamespace(
        AgentConfig=AgentConfig,
        DefaultAgent=DefaultAgent,
        LocalEnvironment=LocalEnvironment,
        BASH_TOOL=actions_toolcall.BASH_TOOL,
        format_toolcall_observation_messages=actions_toolcall.format_toolcall_observation_messages,
        reorder_thinking_blocks=anthropic_utils._reorder_anthropic_thinking_blocks,
        set_cache_control=cache_control.set_cache_control,
        expand_multimodal_content=expand_multimodal_content,
        get_config_from_spec=get_config_from_spec,
        recursive_merge=recursive_merge,
    )


def mini_config(compact: Path = MINI_CONFIG) -> dict[str, Any]:
    """The configuration the harness runs mini with: mini's default `mini.yaml`, then `compact` over it
    (mini's own `get_config_from_spec` and `recursive_merge`, as its `mini` command merges `-c` files)."""
    mini = _mini()
    merged: dict[str, Any] = mini.recursive_merge(
        mini.get_config_from_spec("mini.yaml"), mini.get_config_from_spec(compact)
    )
    return merged


# -- the edits ------------------------------------------------------------------------------------------


def _unique_edits(source: str, target: str) -> list[tuple[str, str]]:
    """(old, new) whole-line edits turning `source` into `target`, each `old` unique in the text it is
    applied to (`str.replace(old, new, 1)` in order); context lines are added until that holds."""
    a, b = source.splitlines(keepends=True), target.splitlines(keepends=True)
    hunks = [op for op in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes() if op[0] != "equal"]
    for context in range(len(a) + 1):
        edits = []
        for _, i1, i2, j1, j2 in hunks:
            lo, hi = max(0, i1 - context), min(len(a), i2 + context)
            old = "".join(a[lo:hi])
            new = "".join(a[lo:i1] + b[j1:j2] + a[i2:hi])
            edits.append((old, new))
        text, ok = source, True
        for old, new in edits:
            if not old or text.count(old) != 1:
                ok = False
                break
            text = text.replace(old, new, 1)
        if ok and text == target:
            return edits
    raise ValueError("no unique line edits found")  # unreachable: the whole file is unique


def _reverse_edits(buggy: str, plant: Sequence[tuple[str, str]], correct: str) -> list[tuple[str, str]]:
    """Edits undoing `plant` on `buggy`: the planted strings put back in reverse order when each is unique
    where it is replaced, else whole-line edits found by diffing."""
    edits, text = [], buggy
    for old, new in reversed(plant):
        if not new or text.count(new) != 1:
            return _unique_edits(buggy, correct)
        edits.append((new, old))
        text = text.replace(new, old, 1)
    return edits if text == correct else _unique_edits(buggy, correct)


def edit_command(path: str, edits: Sequence[tuple[str, str]]) -> str:
    """A short Python heredoc applying `edits` (each `str.replace(old, new, 1)`) to the file at `path`."""
    lines = ["python - <<'EOF'", "from pathlib import Path", f"p = Path({path!r})", "s = p.read_text()"]
    lines += [f"s = s.replace({old!r}, {new!r}, 1)" for old, new in edits]
    lines += ["p.write_text(s)", "EOF"]
    return "\n".join(lines)


def behaviour_commands(task_id: str) -> dict[Behaviour, list[str]]:
    """The bash commands of each behaviour on a bundled task, in order (the submit command last)."""
    bugs = dict(bundled.numbered_bugs())
    if task_id not in bugs:
        raise KeyError(
            f"{task_id}: demonstrations exist only for the bundled set {bundled.BUILTIN_URI} "
            "(its generator holds each bug's edits)"
        )
    bug = bugs[task_id]
    correct = bug.package.source
    buggy = bundled.apply_edits(correct, bug.plant, task_id)
    fix = _reverse_edits(buggy, bug.plant, correct)
    return {
        Behaviour.FIX: [edit_command(bug.package.module_path, fix), SUBMIT_COMMAND],
        Behaviour.WRONG: [edit_command(bug.package.module_path, bug.wrong), SUBMIT_COMMAND],
        Behaviour.SUBMIT: [SUBMIT_COMMAND],
    }


# -- recording with mini's agent loop --------------------------------------------------------------------


class _ScriptedModel:
    """mini-swe-agent's Model protocol answering with fixed turns; records what mini sends each call.

    Formatting is mini's own (`format_toolcall_observation_messages` with the configured observation
    template, `expand_multimodal_content`); the messages sent are prepared as its `litellm` model class
    prepares them (`extra` dropped, Anthropic thinking blocks reordered, cache control as configured).
    """

    def __init__(self, config: Mapping[str, Any], turns: Sequence[tuple[str | None, str]]) -> None:
        self.config = dict(config)
        self.turns = list(turns)
        self.sent: list[tuple[dict[str, Any], ...]] = []

    def _prepare(self, messages: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
        prepared = [{k: v for k, v in m.items() if k != "extra"} for m in messages]
        prepared = _mini().reorder_thinking_blocks(prepared)
        prepared = _mini().set_cache_control(prepared, mode=self.config.get("set_cache_control"))
        return tuple(json.loads(json.dumps(prepared)))

    def query(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        if len(self.sent) >= len(self.turns):
            raise RuntimeError("the scripted conversation has no more turns (the command did not submit?)")
        self.sent.append(self._prepare(messages))
        index = len(self.sent) - 1
        content, command = self.turns[index]
        call_id = f"call_{index}"
        return {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {
                        "name": "bash",
                        "arguments": json.dumps({"command": command}, ensure_ascii=False),
                    },
                }
            ],
            "extra": {"actions": [{"command": command, "tool_call_id": call_id}], "cost": 0.0},
        }

    def format_message(self, **kwargs: Any) -> dict[str, Any]:
        message: dict[str, Any] = _mini().expand_multimodal_content(
            kwargs, pattern=self.config.get("multimodal_regex", "")
        )
        return message

    def format_observation_messages(
        self,
        message: dict[str, Any],
        outputs: list[dict[str, Any]],
        template_vars: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = _mini().format_toolcall_observation_messages(
            actions=message.get("extra", {}).get("actions", []),
            outputs=outputs,
            observation_template=self.config["observation_template"],
            template_vars=template_vars,
            multimodal_regex=self.config.get("multimodal_regex", ""),
        )
        return out

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return dict(self.config)

    def serialize(self) -> dict[str, Any]:
        return {}


def harness_task_text(task: Task) -> str:
    """The task text mini-swe-agent gets from `legorl-harness`: the problem statement as the trial's
    `problem.md` holds it, read with `task=$(cat ...)`, which drops trailing newlines. A demonstration
    rendered from the statement as stored (ending in a newline) tokenizes differently at the end of the
    prompt than what the policy is sent in a trial."""
    return task.problem_statement.rstrip("\n")


def record(
    config: Mapping[str, Any], task: Task, workdir: Path, turns: Sequence[tuple[str | None, str]]
) -> tuple[tuple[Turn, ...], tuple[str, ...]]:
    """Run mini's `DefaultAgent` on `task` in the checkout `workdir` with a model answering `turns`.

    Returns the model calls (messages sent, answer) and the observations mini rendered. Raises when a
    command fails (a demonstration's commands must work) or the conversation does not end by submitting.
    """
    mini = _mini()
    model = _ScriptedModel(config.get("model", {}), turns)
    env_config = {k: v for k, v in config.get("environment", {}).items() if k != "environment_class"}
    env = mini.LocalEnvironment(**{**env_config, "cwd": str(workdir)})
    fields = set(mini.AgentConfig.model_fields)
    agent = mini.DefaultAgent(model, env, **{k: v for k, v in config.get("agent", {}).items() if k in fields})
    result = agent.run(harness_task_text(task))
    if result.get("exit_status") != "Submitted":
        raise RuntimeError(
            f"{task.instance_id}: the scripted conversation ended with {result!r}, not a submit"
        )
    observations = []
    for message in agent.messages:
        if message.get("role") == "tool":
            extra = message.get("extra", {})
            if extra.get("returncode") != 0:
                raise RuntimeError(
                    f"{task.instance_id}: a demonstration command failed ({extra.get('returncode')}): "
                    f"{extra.get('raw_output', '')[-500:]}"
                )
            observations.append(str(message["content"]))
    recorded = tuple(
        Turn(messages=sent, content=content, command=command)
        for sent, (content, command) in zip(model.sent, turns, strict=True)
    )
    return recorded, tuple(observations)


def _parse_mix(mix: Sequence[float]) -> dict[Behaviour, float]:
    if len(mix) != 3 or any(m < 0 for m in mix) or sum(mix) <= 0:
        raise ValueError(f"mix {list(mix)}: give three non-negative shares (fix, wrong, submit)")
    total = float(sum(mix))
    return {b: m / total for b, m in zip(Behaviour, mix, strict=True)}


def make_demonstrations(
    task_set: TaskSet,
    *,
    mix: Sequence[float] = (0.4, 0.3, 0.3),
    tasks: Sequence[str] | None = None,
    workers: int | None = None,
) -> list[Demonstration]:
    """Record the three behaviours on every task of `task_set` (or the `tasks` ids), weighted by `mix`
    (fix, wrong, submit; normalised). A behaviour with share 0 is left out. Tasks in manifest order,
    behaviours in `Behaviour` order."""
    shares = _parse_mix(mix)
    config = mini_config()
    wanted = list(tasks) if tasks is not None else [t.instance_id for t in task_set]
    jobs = []
    for task_id in wanted:
        task = task_set.get(task_id)
        commands = behaviour_commands(task_id)
        for behaviour in Behaviour:
            if shares[behaviour] <= 0:
                continue
            cmds = commands[behaviour]
            turns = [(f"{THOUGHTS[behaviour]}\n", cmds[0]), *((None, c) for c in cmds[1:])]
            jobs.append((task, behaviour, turns))

    def one(job: tuple[Task, Behaviour, list[tuple[str | None, str]]]) -> Demonstration:
        task, behaviour, turns = job
        with tempfile.TemporaryDirectory(prefix="legorl-demo-") as tmp:
            repo = Path(tmp) / "repo"
            checkout_source(task_set.source_path(task), task.base_commit, repo)
            recorded, observations = record(config, task, repo, turns)
        return Demonstration(task.instance_id, behaviour, recorded, shares[behaviour], observations)

    # Mostly waiting on git and short Python processes: a few threads cut the wall time.
    with ThreadPoolExecutor(max_workers=workers or min(8, (os.cpu_count() or 1) + 2)) as pool:
        return list(pool.map(one, jobs))


# -- grading ---------------------------------------------------------------------------------------------


def grade_commands(task_set: TaskSet, task: Task, commands: Sequence[str], *, timeout: float = 120) -> float:
    """Reward of running `commands` (bash, in order; the submit command ends them) in a checkout of `task`,
    graded as verify grades (`grade_checkout`).

    Not a sandbox: only for commands this project wrote or a trusted policy sampled (tests, reports).
    """
    with tempfile.TemporaryDirectory(prefix="legorl-grade-") as tmp:
        repo = Path(tmp) / "repo"
        checkout_source(task_set.source_path(task), task.base_commit, repo)
        for command in commands:
            if command.strip() == SUBMIT_COMMAND:
                break
            subprocess.run(  # noqa: S602 -- the point is to run the agent's bash command
                command, shell=True, cwd=repo, capture_output=True, timeout=timeout, check=False
            )
        return grade_checkout(task, repo, timeout=timeout)


def grade_checkout(task: Task, repo: Path, *, timeout: float = 120) -> float:
    """Reward of the working tree `repo` (changed in place): the hidden tests restored from the task's test
    patch, the task's test command run, and `grade_run` on its JUnit XML and summary, as verify does. A
    tree the test patch does not apply to, or a run that leaves nothing gradable, earns 0."""
    shutil.rmtree(repo / ".git", ignore_errors=True)
    for rel in task.hidden_test_files:
        (repo / rel).unlink(missing_ok=True)  # an agent's own copy of a hidden test never counts
    applied = subprocess.run(
        ["git", "apply", "--whitespace=nowarn", "-"],  # noqa: S607
        input=task.test_patch,
        cwd=repo,
        env=git_env() | {"GIT_CEILING_DIRECTORIES": str(repo.parent)},
        capture_output=True,
        text=True,
        check=False,
    )
    if applied.returncode != 0:
        return 0.0
    junit = repo.parent / f"{repo.name}.junit.xml"
    argv = test_argv(task, str(junit))
    if argv and argv[0] == "python":
        argv[0] = sys.executable  # this interpreter has pytest; the task's code is plain Python
    proc = subprocess.run(  # noqa: S603
        argv, cwd=repo, capture_output=True, text=True, timeout=timeout, check=False
    )
    try:
        result, _ = grade_run(task, junit, proc.stdout + proc.stderr)
    except GradeError:
        return 0.0
    return float(result.reward)
