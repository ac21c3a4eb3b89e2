"""The exact-fix reward of the GRPO cross-check: one function, standard library only, for both trainers.

`benchmarks/learning_vs_trl.py` (legorl's side and the evaluator) and `benchmarks/_trl_grpo.py` (TRL's
side, in TRL's own virtualenv) import this file, so the two trainers are rewarded by the same code.

An answer to a decision turn of `builtin://tiny-read` is the text the policy generated after the prompt,
decoded with the checkpoint's tokenizer (special tokens kept). It is **well formed** when it ended with
the turn's stop token and is one hermes tool call, as vLLM's hermes parser reads one: optional text, then
`<tool_call>` JSON `</tool_call>`, nothing after it, the JSON an object naming the `bash` function with a
string `command` argument. Its **reward** is 1.0 when it is well formed and the command is exactly the
demonstration's fix-and-submit command for that task (`sed -i '<line>s/<found>/<expected>/' <file> && echo
COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`), else 0.0.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

STOP = "<|im_end|>"
"""The chat template's end of turn: the stop token of both samplers."""
_CALL = re.compile(r"<tool_call>\s*(?P<body>.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class Scored:
    """One answer, scored."""

    reward: float
    """1.0: the exact fix-and-submit command in a well-formed tool call; else 0.0."""
    malformed: bool
    """Not one well-formed `bash` tool call ended by the stop token."""
    command: str | None
    """The tool call's command when well formed."""


def tool_command(text: str) -> str | None:
    """The `bash` command of `text` when it is one well-formed tool call ended by `STOP`, else None."""
    if not text.endswith(STOP):
        return None  # cut off at the token limit, or stopped another way: the harness gets no action
    body = text[: -len(STOP)]
    calls = list(_CALL.finditer(body))
    if len(calls) != 1 or body[calls[0].end() :].strip():
        return None
    try:
        call = json.loads(calls[0].group("body"))
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") != "bash":
        return None
    arguments = call.get("arguments")
    if not isinstance(arguments, dict) or not isinstance(arguments.get("command"), str):
        return None
    command: str = arguments["command"]
    return command


def score(text: str, expected_command: str) -> Scored:
    """`text` (an answer, decoded with special tokens) against the task's fix-and-submit command."""
    command = tool_command(text)
    if command is None:
        return Scored(0.0, True, None)
    return Scored(1.0 if command.strip() == expected_command.strip() else 0.0, False, command)
