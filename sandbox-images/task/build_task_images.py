"""Build (and optionally push) one task image per row of a task-set manifest.

    python sandbox-images/task/build_task_images.py TASK_SET/tasks.jsonl [--only ID ...]
        [--push] [--dry-run] [--docker docker] [--build-arg NAME=VALUE ...]
        [--dockerfile PATH] [--network NAME]

Each row that names a `source` (a git bundle or repository folder, relative to the manifest's
folder) is built with sandbox-images/task/Dockerfile, the manifest's folder as build context,
and tagged with the row's `image`. Rows without a `source` (SWE-bench rows that come with
prebuilt images) are skipped. `--dry-run` prints the commands instead of running them (one per
line, shell-quoted). Standard library only; needs a Docker engine (or a compatible CLI such as
podman) unless --dry-run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parent / "Dockerfile"


class ManifestError(ValueError):
    """The manifest cannot be turned into builds; the message says which row and why."""


def rows(manifest: Path) -> Iterator[tuple[int, dict[str, object]]]:
    """(line number, row) of every non-blank line of a JSONL manifest."""
    for number, line in enumerate(manifest.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{manifest}:{number}: not JSON ({exc})") from None
        if not isinstance(row, dict):
            raise ManifestError(f"{manifest}:{number}: a row must be a JSON object")
        yield number, row


def build_commands(
    manifest: Path,
    *,
    only: Sequence[str] = (),
    push: bool = False,
    docker: str = "docker",
    build_args: Sequence[str] = (),
    dockerfile: Path = DOCKERFILE,
    network: str | None = None,
) -> list[list[str]]:
    """The commands that build (and push) the manifest's task images, in manifest order."""
    context = manifest.resolve().parent
    commands: list[list[str]] = []
    seen: set[str] = set()
    for number, row in rows(manifest):
        where = f"{manifest}:{number}"
        instance_id = row.get("instance_id")
        if not isinstance(instance_id, str) or not instance_id:
            raise ManifestError(f"{where}: instance_id is missing")
        seen.add(instance_id)
        if only and instance_id not in only:
            continue
        source = row.get("source")
        if source is None:
            continue  # a prebuilt image (SWE-bench): nothing to build
        image, commit = row.get("image"), row.get("base_commit")
        if not isinstance(source, str) or not source:
            raise ManifestError(f"{where}: source must be a path relative to {context}")
        if not isinstance(image, str) or not image:
            raise ManifestError(f"{where} ({instance_id}): image is missing; name the tag to build")
        if not isinstance(commit, str) or len(commit) != 40:
            raise ManifestError(f"{where} ({instance_id}): base_commit must be a full 40-digit commit id")
        path = (context / source).resolve()
        if not path.is_relative_to(context):
            raise ManifestError(f"{where} ({instance_id}): source {source} lies outside {context}")
        if not path.exists():
            raise ManifestError(f"{where} ({instance_id}): source {path} does not exist")
        command = [docker, "build", "-f", str(dockerfile)]
        if network is not None:
            command += ["--network", network]
        for arg in (
            f"SOURCE={path.relative_to(context).as_posix()}",
            f"BASE_COMMIT={commit}",
            f"INSTANCE_ID={instance_id}",
            *build_args,
        ):
            command += ["--build-arg", arg]
        command += ["-t", image, str(context)]
        commands.append(command)
        if push:
            commands.append([docker, "push", image])
    missing = sorted(set(only) - seen)
    if missing:
        raise ManifestError(f"{manifest}: no rows for {', '.join(missing)}")
    return commands


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("manifest", type=Path, help="the task set's tasks.jsonl")
    parser.add_argument("--only", action="append", default=[], metavar="ID", help="build only this task")
    parser.add_argument("--push", action="store_true", help="push each image after building it")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--docker", default="docker", help="the container CLI (docker, podman, ...)")
    parser.add_argument(
        "--build-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="passed to every build, e.g. PYTHON_IMAGE=python:3.11.13-slim-bookworm@sha256:...",
    )
    parser.add_argument(
        "--dockerfile", type=Path, default=DOCKERFILE, help="the task recipe (default: %(default)s)"
    )
    parser.add_argument("--network", help="the builds' network, e.g. host (docker build --network)")
    args = parser.parse_args(argv)
    try:
        commands = build_commands(
            args.manifest,
            only=args.only,
            push=args.push,
            docker=args.docker,
            build_args=args.build_arg,
            dockerfile=args.dockerfile,
            network=args.network,
        )
    except (OSError, ManifestError) as exc:
        sys.stderr.write(f"build_task_images: {exc}\n")
        return 2
    for command in commands:
        if args.dry_run:
            sys.stdout.write(shlex.join(command) + "\n")
            continue
        sys.stderr.write(f"+ {shlex.join(command)}\n")
        result = subprocess.run(command, check=False)
        if result.returncode != 0:
            return result.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
