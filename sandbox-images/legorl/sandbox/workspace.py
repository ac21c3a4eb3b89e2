"""Stage 1 (setup): the agent's workspace — base commit only, hidden tests removed — and its self-tests.

The staged workspace is built, never edited in place: the files of the task's base commit are
copied into a new folder (`.git` left behind), the hidden test files are deleted, and a brand-new
repository with a single root commit is created over them. Nothing of the original object store
survives — no other commits, refs, tags, reflog, stash, remotes, alternates, hooks or packed
objects — so there is nothing to find and nothing to forget to delete. Each property is then
checked on the result (`history.*` and `tests.*` checks); a failed check fails the trial closed.

Git only ever runs here on repositories this module created or on the trusted task source, with
system and global config ignored and hooks disabled.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from legorl.sandbox.checks import Check

BASE_BRANCH = "main"
IDENTITY = {
    "GIT_AUTHOR_NAME": "legorl",
    "GIT_AUTHOR_EMAIL": "sandbox@legorl.dev",
    "GIT_COMMITTER_NAME": "legorl",
    "GIT_COMMITTER_EMAIL": "sandbox@legorl.dev",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}


class SetupError(RuntimeError):
    """The workspace could not be built (missing source, bad base commit, git failure)."""


def git_env(home: Path | None = None) -> dict[str, str]:
    """A git environment that reads no system or user config and prompts for nothing."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home or Path(tempfile.gettempdir())),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_OPTIONAL_LOCKS": "0",
        "LC_ALL": "C",
    }
    env.update(IDENTITY)
    return env


def git(args: Sequence[str], cwd: Path, *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run git with hooks off and no config beyond the repository's own.

    The repository at `cwd` is trusted by name (`safe.directory`, which git honours on its command line): in
    a pod the workspace is a volume's mount point, owned by root while the stage runs as the agent's uid,
    and git then treats the repository as absent ("fatal: not in a git directory", seen on a real node),
    which made the history self-tests fail open. Hooks and fsmonitor stay off whatever the repository says."""
    cmd = [
        "git", "-c", f"safe.directory={Path(cwd).absolute()}",
        "-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false", *args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=cwd, env=git_env(), capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise SetupError(
            f"git {' '.join(args)} failed in {cwd}: {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def checkout_source(source: Path, base_commit: str, into: Path) -> None:
    """Clone a trusted git repository or bundle into `into`, checked out at `base_commit`.

    The clone keeps the source's whole history, as a task image's repository does: setup leaves it
    behind (BaseCommitOnly) or copies it on purpose (Preserve); verify never uses it."""
    if not source.exists():
        raise SetupError(f"task source {source} does not exist")
    into.parent.mkdir(parents=True, exist_ok=True)
    git(["clone", "--quiet", "--no-checkout", str(source), str(into)], into.parent)
    if git(["cat-file", "-e", f"{base_commit}^{{commit}}"], into, check=False).returncode != 0:
        shutil.rmtree(into, ignore_errors=True)
        raise SetupError(f"base commit {base_commit} is not in {source}")
    git(["checkout", "--quiet", "--detach", base_commit], into)


def copy_tree(src: Path, dst: Path) -> None:
    """Copy a working tree without its `.git`; links are copied as links, never followed."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in sorted(src.iterdir()):
        if item.name == ".git":
            continue
        target = dst / item.name
        if item.is_symlink():
            target.symlink_to(item.readlink())
        elif item.is_dir():
            shutil.copytree(item, target, symlinks=True)
        else:
            shutil.copy2(item, target, follow_symlinks=False)


def remove_hidden(root: Path, hidden: Iterable[str]) -> list[str]:
    """Delete the hidden test files from the tree; returns those that were present."""
    removed = []
    for rel in hidden:
        path = root / rel
        if path.is_symlink() or path.exists():
            path.unlink()
            removed.append(rel)
    return removed


def init_single_commit(root: Path) -> str:
    """Create a fresh repository over `root` with one root commit and no reflog; returns its id."""
    git(["init", "--quiet", f"--initial-branch={BASE_BRANCH}", str(root)], root)
    git(["config", "core.logAllRefUpdates", "false"], root)
    git(["config", "gc.auto", "0"], root)
    shutil.rmtree(root / ".git" / "hooks", ignore_errors=True)
    git(["add", "--all", "--force", "."], root)
    git(["commit", "--quiet", "--no-verify", "--allow-empty", "-m", "base"], root)
    shutil.rmtree(root / ".git" / "logs", ignore_errors=True)
    return git(["rev-parse", "HEAD"], root).stdout.strip()


def stage(
    pristine: Path,
    into: Path,
    *,
    hidden_tests: Sequence[str],
    git_history: str = "BaseCommitOnly",
) -> list[Check]:
    """Build the agent's workspace from a pristine tree; returns the self-test results.

    `pristine` is the task's tree at its base commit (a checkout, or the image's workspace with its
    build artifacts). With `git_history="Preserve"` the original `.git` is copied unchanged (an
    explicit opt-out that the checks report)."""
    if into.exists() and any(into.iterdir()):
        raise SetupError(f"{into} is not empty; the workspace is staged into an empty folder")
    copy_tree(pristine, into)
    remove_hidden(into, hidden_tests)
    checks: list[Check] = []
    if git_history == "Preserve":
        if (pristine / ".git").is_dir():
            shutil.copytree(pristine / ".git", into / ".git", symlinks=True)
        checks.append(Check("history.preserved", True, "git history kept on purpose (gitHistory: Preserve)"))
    else:
        init_single_commit(into)
        checks.extend(check_history(into))
    checks.extend(check_tests_absent(into, hidden_tests))
    return checks


def check_history(root: Path) -> list[Check]:
    """Self-test of history reduction: exactly one commit, one branch, nothing unreachable."""
    checks: list[Check] = []
    dot_git = root / ".git"
    commits = git(["rev-list", "--all", "--reflog"], root, check=False).stdout.split()
    checks.append(Check("history.single_commit", len(commits) == 1, f"{len(commits)} commit(s) reachable"))
    refs = git(["for-each-ref", "--format=%(refname)"], root, check=False).stdout.split()
    checks.append(
        Check(
            "history.single_ref", refs == [f"refs/heads/{BASE_BRANCH}"], f"refs: {', '.join(refs) or 'none'}"
        )
    )
    leftovers = [
        name
        for name in ("ORIG_HEAD", "FETCH_HEAD", "MERGE_HEAD", "packed-refs", "logs", "refs/stash", "shallow")
        if (dot_git / name).exists()
    ]
    alternates = dot_git / "objects" / "info" / "alternates"
    if alternates.exists():
        leftovers.append("objects/info/alternates")
    checks.append(Check("history.no_leftovers", not leftovers, ", ".join(leftovers) or "none"))
    remotes = git(["remote"], root, check=False).stdout.split()
    checks.append(Check("history.no_remotes", not remotes, ", ".join(remotes) or "none"))
    listing = git(["rev-list", "--objects", "--all"], root, check=False).stdout
    reachable_ids = {line.split()[0] for line in listing.splitlines() if line.strip()}
    stored = _stored_objects(dot_git)
    extra = stored - reachable_ids
    checks.append(
        Check(
            "history.no_unreachable_objects",
            not extra and bool(stored),
            f"{len(stored)} object(s) stored, {len(extra)} unreachable",
        )
    )
    return checks


def _stored_objects(dot_git: Path) -> set[str]:
    """Every object id in the store: loose files and pack indexes (read with git show-index)."""
    objects = dot_git / "objects"
    ids: set[str] = set()
    for sub in objects.iterdir():
        if len(sub.name) == 2 and sub.is_dir():
            ids.update(sub.name + f.name for f in sub.iterdir())
    pack_dir = objects / "pack"
    if pack_dir.is_dir():
        for idx in pack_dir.glob("*.idx"):
            with idx.open("rb") as fh:
                proc = subprocess.run(
                    ["git", "show-index"],
                    stdin=fh,
                    capture_output=True,
                    text=True,
                    check=False,
                    env=git_env(),
                )
            ids.update(line.split()[1] for line in proc.stdout.splitlines() if len(line.split()) >= 2)
    return ids


def check_tests_absent(root: Path, hidden_tests: Sequence[str]) -> list[Check]:
    """Self-test: no hidden test file in the tree or in the committed snapshot."""
    present = [rel for rel in hidden_tests if (root / rel).exists() or (root / rel).is_symlink()]
    committed: list[str] = []
    if (root / ".git").is_dir():
        listed = set(git(["ls-tree", "-r", "--name-only", "HEAD"], root, check=False).stdout.splitlines())
        committed = [rel for rel in hidden_tests if rel in listed]
    ok = not present and not committed
    detail = "hidden tests absent" if ok else f"present: {sorted(set(present + committed))}"
    return [Check("tests.hidden_absent", ok, detail)]


def make_agent_owned(root: Path, uid: int, gid: int) -> None:
    """Hand the workspace to the agent's uid (the local backend runs each trial as its own uid)."""
    for dirpath, dirnames, filenames in os.walk(root):
        os.chown(dirpath, uid, gid, follow_symlinks=False)
        for name in dirnames + filenames:
            os.chown(Path(dirpath) / name, uid, gid, follow_symlinks=False)
