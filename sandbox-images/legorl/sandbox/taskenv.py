"""The local backend's stand-in for a task image's Python: a venv that sees only pytest.

On Kubernetes the task image brings the interpreter and packages its tests need. Locally the
sandbox would otherwise see whatever the calling environment has installed (legorl's own
development tools, pytest plugins that load themselves through entry points), which makes tests
slow and behave unlike the image. This venv is made offline, in milliseconds: no pip, just a
`.pth` file pointing at a folder of links to the host's pytest and its dependencies. Without
their `dist-info`, no entry-point plugin loads. Tasks that need more packages point
`LocalBackend(task_env=...)` at an environment of their own.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

PACKAGES = ("pytest", "_pytest", "py", "pluggy", "iniconfig", "packaging", "pygments")
"""pytest and what it imports (its `Requires-Dist`, which pytest 8 and 9 share)."""
DISTRIBUTIONS = ("pytest", "pluggy", "iniconfig", "packaging", "pygments")
"""Their metadata (pluggy reads its own version from it); none registers a `pytest11` plugin."""
STAMP = "legorl-task-env-2"


class TaskEnvError(RuntimeError):
    """The stand-in task environment cannot be made (pytest is missing from this interpreter)."""


def ensure_task_env(path: Path) -> Path:
    """Create (once) a venv at `path` whose site-packages links only pytest and its dependencies."""
    if importlib.util.find_spec("pytest") is None:
        raise TaskEnvError(
            f"pytest is not installed in legorl's Python ({sys.executable}): local sandboxes run each "
            "task's tests with it; install it with pip install 'legorl[local]' (scripts/get-engine.sh does)"
        )
    stamp = path / STAMP
    if stamp.exists() and (path / "links" / "pytest").exists():
        return path
    if stamp.exists():  # made by an interpreter without pytest: made again
        subprocess.run(["rm", "-rf", str(path)], check=False)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(tmp)], check=True, capture_output=True, text=True
    )
    links = tmp / "links"
    links.mkdir()
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        origin = Path(spec.origin)
        target = origin.parent if origin.name == "__init__.py" else origin
        (links / target.name).symlink_to(target)
        for dist in DISTRIBUTIONS:
            for info in target.parent.glob(f"{dist}-*.dist-info"):
                if not (links / info.name).exists():
                    (links / info.name).symlink_to(info)
    purelib = subprocess.run(
        [str(tmp / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # The venv's own paths, so the .pth resolves where the venv ends up after the rename.
    rel = Path(purelib).relative_to(tmp)
    (tmp / rel / "legorl-task-env.pth").write_text(f"{path / 'links'}\n")
    (tmp / STAMP).write_text("")
    try:
        tmp.rename(path)
    except OSError:  # made concurrently by another backend
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return path


def link_targets(path: Path) -> list[Path]:
    """Host folders the links point into (bound read-only into sandboxes)."""
    targets = {p.resolve().parent for p in (path / "links").iterdir()}
    return sorted(targets)
