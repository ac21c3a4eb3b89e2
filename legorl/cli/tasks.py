"""`legorl tasks ...` and `legorl sandbox trial`: task sets and one local trial, from the shell."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from legorl.sandbox.task import Task, TaskError, load_task_set, write_jsonl

SWEBENCH_IMAGE = "swebench/sweb.eval.x86_64.{instance_id_docker}:latest"
"""SWE-bench's own evaluation image names (its docker builder lowercases the id and spells `__` as
`_1776_`)."""


def cmd_generate(args: argparse.Namespace) -> int:
    from legorl.sandbox.bundled import builtin_task_set, generate  # noqa: PLC0415

    manifest = generate(Path(args.out)) if args.out else builtin_task_set()
    task_set = load_task_set(manifest)
    print(f"{manifest}: {len(task_set)} tasks, {len(task_set.images)} images")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    failed = 0
    for name in args.files:
        try:
            task_set = load_task_set(Path(name))
        except (TaskError, OSError) as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            failed += 1
            continue
        missing = [t.instance_id for t in task_set if t.image is None]
        print(f"{name}: {len(task_set)} tasks valid, {len(task_set.images)} distinct images")
        if missing:
            print(
                f"{name}: warning: {len(missing)} task(s) name no image (local backend only): {missing[:5]}"
            )
    return 1 if failed else 0


def cmd_import_swebench(args: argparse.Namespace) -> int:
    """SWE-bench rows (JSONL or Parquet, e.g. a dataset export) → a legorl manifest with images."""
    try:
        source = load_task_set(Path(args.source))
    except TaskError as exc:
        print(f"{args.source}: {exc}", file=sys.stderr)
        return 1
    tasks: list[Task] = []
    for task in source:
        docker_id = task.instance_id.lower().replace("__", "_1776_")
        image = args.image_template.format(instance_id=task.instance_id, instance_id_docker=docker_id)
        row = task.to_dict() | {"image": image}
        tasks.append(Task.from_dict(row))
    write_jsonl(tasks, Path(args.out))
    print(f"wrote {args.out}: {len(tasks)} tasks")
    return 0


def cmd_trial(args: argparse.Namespace) -> int:
    """One trial on the local backend with any command as the agent; prints its outcome as JSON."""
    from legorl.sandbox.local import LocalBackend, SandboxError  # noqa: PLC0415
    from legorl.sandbox.trial import run_local_trial  # noqa: PLC0415

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("legorl sandbox trial: give the agent's command after --", file=sys.stderr)
        return 2
    task_set = load_task_set(Path(args.tasks))
    try:
        task = task_set.get(args.task)
    except KeyError:
        print(f"no task {args.task!r} in {args.tasks}", file=sys.stderr)
        return 2
    try:
        backend = LocalBackend(Path(args.root))
    except SandboxError as exc:
        print(f"legorl sandbox trial: {exc}", file=sys.stderr)
        return 2
    trial_id = args.trial or f"{task.instance_id}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = run_local_trial(
        backend,
        task_set,
        task,
        trial_id,
        command,
        agent_seconds=args.agent_seconds,
        verify_seconds=args.verify_seconds,
        keep=args.keep,
    )
    record = out.to_dict()
    if args.output == "json":
        print(json.dumps(record, indent=2))
    else:
        print(f"trial {out.trial} on {out.task_id}: {out.termination_reason}, reward {out.reward}")
        for finding in out.findings:
            print(f"  tamper: {finding.kind} {finding.path}: {finding.detail}")
        for check in out.checks:
            if not check.passed:
                print(f"  FAILED check {check.name}: {check.message}")
        print("  stages: " + ", ".join(f"{k} {v:.2f}s" for k, v in out.stage_seconds.items()))
        if out.error:
            print(f"  error: {out.error}")
        print(f"  outcome: {backend.root / 'outcomes' / (out.trial + '.json')}")
    return 0 if out.termination_reason in ("completed", "agent_error", "agent_timeout") else 1


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tasks = sub.add_parser("tasks", help="task sets: generate the bundled one, validate, import SWE-bench")
    tsub = tasks.add_subparsers(dest="tasks_command", required=True, metavar="SUBCOMMAND")
    p = tsub.add_parser("generate", help="write the bundled tiny-python task set (builtin://tiny-python)")
    p.add_argument("out", nargs="?", help="folder (default: the cache folder builtin://tiny-python uses)")
    p.set_defaults(func=cmd_generate)
    p = tsub.add_parser("validate", help="check task-set manifests (JSONL or Parquet)")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.set_defaults(func=cmd_validate)
    p = tsub.add_parser(
        "import-swebench", help="turn SWE-bench rows into a manifest naming each task's image"
    )
    p.add_argument("source", help="SWE-bench rows as JSONL or Parquet")
    p.add_argument("out", help="manifest to write (JSONL)")
    p.add_argument(
        "--image-template",
        default=SWEBENCH_IMAGE,
        help="image name; {instance_id} and {instance_id_docker} are filled in (default: %(default)s)",
    )
    p.set_defaults(func=cmd_import_swebench)

    sandbox = sub.add_parser("sandbox", help="run trials in local sandboxes (the embedded backend)")
    ssub = sandbox.add_subparsers(dest="sandbox_command", required=True, metavar="SUBCOMMAND")
    p = ssub.add_parser(
        "trial",
        help="one trial: setup, your command as the agent, verify; prints the reward",
        description="Run the four stages of one trial on this machine with COMMAND as the agent "
        "(it runs in the workspace, as its own uid, with only loopback networking). Needs bubblewrap.",
    )
    p.add_argument("--tasks", required=True, help="task-set manifest")
    p.add_argument("--task", required=True, help="instance_id")
    p.add_argument("--root", default=".legorl/sandbox", help="folder for trials (default: %(default)s)")
    p.add_argument("--trial", help="trial id (default: task id and time)")
    p.add_argument("--agent-seconds", type=float, default=600.0)
    p.add_argument("--verify-seconds", type=float, default=600.0)
    p.add_argument("--keep", action="store_true", help="keep the trial folder (when not on tmpfs)")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the agent's command")
    p.set_defaults(func=cmd_trial)
