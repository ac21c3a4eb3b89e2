"""`legorl-sandbox`: the stages as commands, for the trial pod's init containers and the verify pod.

    legorl-sandbox setup   --workspace=/testbed --into=/staged-workspace
                           --baseline=/legorl-baseline/baseline.json
                           [--task-file=/legorl-task/task.json] [--git-history=BaseCommitOnly]
    legorl-sandbox capture --workspace=/testbed --baseline=FILE --out=changes.json
    legorl-sandbox verify  --task-file=FILE --changes=changes.json --workspace=/testbed --into=DIR --out=DIR
                           [--phase all|prepare|run]
    legorl-sandbox egress-lock --allow-uid=65533 --self-test

Each prints its checks or result as JSON on stdout, writes a one-line summary to the Kubernetes
termination log when it exists, and exits 0 (done), 3 (a defense self-test failed: the trial
ends `defense_failed`), 4 (verifier error), 5 (the workspace could not be built: `sandbox_error`)
or 2 (usage). Standard library only: it runs inside task images with the interpreter the init
image ships.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from legorl.sandbox import changes as ch
from legorl.sandbox import stages
from legorl.sandbox.grade import GradeError
from legorl.sandbox.outcomes import TamperFinding
from legorl.sandbox.task import Task, TaskError
from legorl.sandbox.workspace import SetupError

EXIT_DEFENSE_FAILED = 3
EXIT_VERIFIER_ERROR = 4
EXIT_SANDBOX_ERROR = 5
TERMINATION_LOG = Path("/dev/termination-log")


TERMINATION_LOG_BYTES = 4000
"""The kubelet keeps at most 4096 bytes of a termination message."""


def termination_message(payload: dict[str, object], limit: int = TERMINATION_LOG_BYTES) -> str:
    """`payload` as JSON of at most `limit` bytes that still parses: the grade and check lists go first,
    then tamper findings from the end (details shortened); `truncated` says something was left out.
    The full payload is on stdout (the pod's log)."""
    text = json.dumps(payload)
    if len(text.encode()) <= limit:
        return text
    small: dict[str, object] = {
        k: v for k, v in payload.items() if k not in ("grade", "checks", "tamperFindings")
    }
    small["truncated"] = True
    raw = payload.get("tamperFindings")
    findings = [
        {**f, "detail": str(f.get("detail", ""))[:200]} if isinstance(f, dict) else f
        for f in (raw if isinstance(raw, list) else [])
    ]
    for keep in range(len(findings), -1, -1):
        small["tamperFindings"] = findings[:keep]
        small["tamperFindingsTotal"] = len(findings)
        text = json.dumps(small)
        if len(text.encode()) <= limit:
            return text
    fields = ("stage", "result", "reward", "error")
    return json.dumps(
        {k: str(payload[k])[:500] if k == "error" else payload[k] for k in fields if k in payload}
        | {"truncated": True}
    )


def _emit(payload: dict[str, object]) -> None:
    print(json.dumps(payload, sort_keys=True))
    with contextlib.suppress(OSError):
        if TERMINATION_LOG.parent.is_dir() and TERMINATION_LOG.exists():
            TERMINATION_LOG.write_text(termination_message(payload))


def _task(path: str | None) -> Task | None:
    if path is None:
        return None
    try:
        return Task.from_dict(json.loads(Path(path).read_text(encoding="utf-8")), where=path)
    except (OSError, json.JSONDecodeError) as exc:
        raise TaskError(f"cannot read task file {path}: {exc}") from None


def cmd_setup(args: argparse.Namespace) -> int:
    task = _task(args.task_file)
    hidden = task.hidden_test_files if task else tuple(args.hidden_test)
    from legorl.sandbox import workspace  # noqa: PLC0415

    checks = workspace.stage(
        Path(args.workspace), Path(args.into), hidden_tests=hidden, git_history=args.git_history
    )
    ch.save_baseline(ch.baseline(Path(args.into)), Path(args.baseline))
    ok = all(c.passed for c in checks)
    _emit({"stage": "setup", "result": "Passed" if ok else "Failed", "checks": [c.to_dict() for c in checks]})
    return 0 if ok else EXIT_DEFENSE_FAILED


def cmd_capture(args: argparse.Namespace) -> int:
    captured = ch.capture(Path(args.workspace), ch.load_baseline(Path(args.baseline)))
    Path(args.out).write_text(json.dumps(captured.to_dict()), encoding="utf-8")
    _emit({"stage": "capture", "files": len(captured.files), "deleted": len(captured.deleted)})
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """`--phase prepare` (one uid) builds the tree and makes it read-only; `--phase run` (another
    uid, as on Kubernetes) runs the tests on it and grades; `all` does both in one process."""
    task = _task(args.task_file)
    assert task is not None
    out, tree = Path(args.out), Path(args.into)
    prepared = out / "prepared.json"
    if args.phase in ("prepare", "all"):
        if args.changes is None:
            raise ValueError("--changes is needed to prepare the verify tree")
        changes = ch.ChangeSet.from_dict(json.loads(Path(args.changes).read_text(encoding="utf-8")))
        out.mkdir(parents=True, exist_ok=True)
        made = stages.prepare_verify(Path(args.workspace), tree, task, changes)
        stages.make_read_only(tree)
        # The run phase (another uid in the same group) writes its results here.
        out.chmod(0o2770)
        prepared.write_text(json.dumps({"findings": [f.to_dict() for f in made.findings]}), encoding="utf-8")
        if args.phase == "prepare":
            _emit(
                {"stage": "verify-prepare", "files": len(made.applied.files), "findings": len(made.findings)}
            )
            return 0
    findings = [
        TamperFinding.from_dict(f) for f in json.loads(prepared.read_text(encoding="utf-8"))["findings"]
    ]
    junit = out / "junit.xml"
    proc = subprocess.run(
        stages.test_argv(task, str(junit)),
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=task.test_timeout_seconds,
        check=False,
    )
    (out / "test.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    result, tampered = stages.grade_run(task, junit, proc.stdout)
    _emit(
        {
            "stage": "verify",
            "reward": result.reward,
            "grade": result.to_dict(),
            "tamperFindings": [f.to_dict() for f in (*findings, *tampered)],
        }
    )
    return 0


def cmd_egress(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from legorl.sandbox import egress  # noqa: PLC0415

    return egress.main(list(rest))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="legorl-sandbox", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("setup", help="stage 1: build the agent's workspace and self-test it")
    p.add_argument("--workspace", required=True, help="the task's pristine tree (the image's repo)")
    p.add_argument("--into", required=True, help="empty folder to stage the workspace into")
    p.add_argument("--baseline", required=True, help="where to record the staged files (not agent-writable)")
    p.add_argument("--task-file", help="the task's manifest row as JSON (names the hidden tests)")
    p.add_argument(
        "--hidden-test", action="append", default=[], help="a hidden test path (without --task-file)"
    )
    p.add_argument("--git-history", choices=["BaseCommitOnly", "Preserve"], default="BaseCommitOnly")
    p.add_argument(
        "--egress", choices=["ProxyOnly", "Unrestricted"], default="ProxyOnly", help="recorded only"
    )
    p.add_argument("--proxy-uid", type=int, help="recorded only (the egress-lock container applies it)")
    p.set_defaults(func=cmd_setup)
    p = sub.add_parser("capture", help="the agent's changes against the baseline, as JSON")
    p.add_argument("--workspace", required=True)
    p.add_argument("--baseline", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_capture)
    p = sub.add_parser("verify", help="stage 3: pristine tree + sanitized changes + hidden tests → reward")
    p.add_argument("--task-file", required=True)
    p.add_argument("--changes", help="the agent's change set (GET /changes); needed to prepare")
    p.add_argument("--workspace", required=True, help="the pristine tree (the verify pod's image repo)")
    p.add_argument("--into", required=True, help="folder for the verify tree (empty to prepare)")
    p.add_argument("--out", required=True, help="folder for prepared.json, junit.xml and test.log")
    p.add_argument(
        "--phase",
        choices=["all", "prepare", "run"],
        default="all",
        help="prepare the read-only tree, run the tests on it, or both (default)",
    )
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("egress-lock", help="install and self-test the iptables egress lock", add_help=False)
    p.set_defaults(func=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["egress-lock"]:
        return cmd_egress(argparse.Namespace(), argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (TaskError, ValueError, OSError, SetupError) as exc:
        print(f"legorl-sandbox {args.command}: {exc}", file=sys.stderr)
        _emit({"stage": args.command, "result": "Error", "error": str(exc)})
        return EXIT_VERIFIER_ERROR if args.command == "verify" else EXIT_SANDBOX_ERROR
    except (GradeError, subprocess.TimeoutExpired) as exc:
        print(f"legorl-sandbox {args.command}: {exc}", file=sys.stderr)
        _emit({"stage": args.command, "result": "Error", "error": str(exc)})
        return EXIT_VERIFIER_ERROR


def run() -> None:
    """The zipapp's entry point (build-tool.sh): exit with main's status. zipapp's generated `__main__`
    calls the function and drops what it returns, which made every failure, a failed defense self-test
    included, exit 0 in a real pod."""
    sys.exit(main())


if __name__ == "__main__":
    run()
