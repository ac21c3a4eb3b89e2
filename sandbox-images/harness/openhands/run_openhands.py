"""Run the OpenHands software-agent SDK on one task against the trial's proxy.

`legorl-harness OpenHands` starts this with the harness runtime's own Python, into which
openhands-sdk and openhands-tools were installed when the image was built:

    python3 -I run_openhands.py --task-file FILE --workspace DIR --model openai/NAME \\
        --base-url URL --api-mode chat|responses --max-turns N --state-dir DIR [--config FILE]

The agent is the SDK's default agent in CLI mode (terminal, file editor and task tracker; no
browser), working directly in the workspace. The API key comes from OPENAI_API_KEY (the proxy
ignores it). `--config` names a JSON file with extra keyword arguments:
`{"llm": {...}, "agent": {...}, "conversation": {...}}` for `LLM`, `get_default_agent` and
`Conversation`; the proxy settings given on the command line always win.

Exit status: 0 when the agent finished, 1 when the conversation ended otherwise (an error, stuck,
the turn limit), 2 for bad arguments or configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONFIG_SECTIONS = ("llm", "agent", "conversation")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="run_openhands.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task-file", required=True, type=Path, help="the problem statement")
    parser.add_argument("--workspace", required=True, type=Path, help="the repository to work in")
    parser.add_argument("--model", required=True, help="LiteLLM model name, e.g. openai/policy")
    parser.add_argument("--base-url", required=True, help="the proxy's OpenAI base URL (…/v1)")
    parser.add_argument("--api-mode", choices=["chat", "responses"], default="chat")
    parser.add_argument("--max-turns", type=int, default=100, help="agent iterations allowed")
    parser.add_argument("--state-dir", type=Path, required=True, help="where the conversation is kept")
    parser.add_argument("--config", type=Path, help="JSON with extra llm/agent/conversation arguments")
    args = parser.parse_args(argv)
    if args.max_turns < 1:
        parser.error("--max-turns must be at least 1")
    return args


def load_config(path: Path | None) -> dict[str, dict[str, Any]]:
    """The `--config` file's sections (each a JSON object), empty ones for those it leaves out."""
    sections: dict[str, dict[str, Any]] = {name: {} for name in CONFIG_SECTIONS}
    if path is None:
        return sections
    raw = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object with keys {', '.join(CONFIG_SECTIONS)}")
    for key, value in raw.items():
        if key not in sections or not isinstance(value, dict):
            raise ValueError(f"{path}: {key!r} is not one of {', '.join(CONFIG_SECTIONS)} (each an object)")
        sections[key] = value
    return sections


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config)
        task = args.task_file.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"run_openhands: {exc}\n")
        return 2
    os.environ.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")

    # Imported here so --help and argument errors need no SDK.
    from openhands.sdk import LLM, Conversation  # noqa: PLC0415
    from openhands.tools.preset.default import get_default_agent  # noqa: PLC0415
    from pydantic import SecretStr  # noqa: PLC0415

    llm = LLM(
        **{
            **config["llm"],
            "model": args.model,
            "base_url": args.base_url,
            "api_key": SecretStr(os.environ.get("OPENAI_API_KEY") or "legorl-proxy"),
            "api_mode": args.api_mode,
            "usage_id": "agent",
        }
    )
    agent = get_default_agent(**{"cli_mode": True, **config["agent"], "llm": llm})
    args.state_dir.mkdir(parents=True, exist_ok=True)
    conversation = Conversation(
        **{
            **config["conversation"],
            "agent": agent,
            "workspace": str(args.workspace),
            "persistence_dir": str(args.state_dir),
            "max_iteration_per_run": args.max_turns,
        }
    )
    conversation.send_message(task)
    conversation.run()
    status = str(getattr(conversation.state.execution_status, "value", conversation.state.execution_status))
    sys.stdout.write(f"run_openhands: conversation {status}\n")
    return 0 if status == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
