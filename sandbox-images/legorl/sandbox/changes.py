"""The agent's changes: captured from its workspace without trusting it, sanitized, applied to verify.

The agent controls everything in its workspace, `.git` included, so nothing here runs git (or any
program) on it: a repository's config can name hooks, filters, pagers and fsmonitors that would run
with the caller's rights. Instead the workspace is walked with `lstat` and compared with the
baseline the setup stage recorded (path → mode, size, SHA-256). What changed becomes a `ChangeSet`:
regular text files with their new content, and deletions. Symlinks, special files, binary content,
paths outside the repository, test files and test-runner hooks are findings; `sanitize` drops them
and reports each one.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from legorl.sandbox.outcomes import TamperFinding
from legorl.sandbox.paths import hook_reason, is_test_path

MAX_FILE_BYTES = 2 * 1024 * 1024
MAX_TOTAL_BYTES = 32 * 1024 * 1024
MAX_FILES = 5000
MAX_ENTRIES = 500_000
MAX_DEPTH = 64
MAX_PATH = 1024
EXCLUDED_DIRS = frozenset({".git"})


@dataclass(frozen=True)
class Entry:
    """A baseline entry: what a path was when the agent started."""

    mode: int
    size: int
    sha256: str


@dataclass(frozen=True)
class _Item:
    """One entry of a walk: its relative path, its lstat, and how to open it without following
    anything (the folder's fd and the entry's name)."""

    rel: str
    st: os.stat_result
    dir_fd: int
    name: str

    def open(self) -> BinaryIO:
        fd = os.open(self.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dir_fd)
        return os.fdopen(fd, "rb")

    def read(self, limit: int = -1) -> bytes:
        with self.open() as fh:
            return fh.read(limit)

    def sha256(self) -> str:
        digest = hashlib.sha256()
        with self.open() as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        return digest.hexdigest()


def _walk(root: Path, problems: list[TamperFinding] | None = None) -> Iterator[_Item]:
    """Every entry below root except `.git`, never following links.

    Folders are opened relative to their parent's fd (`O_NOFOLLOW`), so a tree deeper than
    PATH_MAX is walked, not crashed on; past MAX_DEPTH or MAX_PATH a folder is reported in
    `problems` and not entered, and the walk stops after MAX_ENTRIES entries."""
    seen = 0
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    stack: list[tuple[int, str, int]] = [(os.open(root, flags), "", 0)]
    try:
        while stack:
            fd, prefix, depth = stack.pop()
            try:
                with os.scandir(fd) as it:
                    entries = sorted(it, key=lambda e: e.name)
                for entry in entries:
                    seen += 1
                    rel = f"{prefix}{entry.name}"
                    if seen > MAX_ENTRIES:
                        if problems is not None:
                            problems.append(
                                TamperFinding(
                                    kind="binary_patch", path=None, detail=f"more than {MAX_ENTRIES} entries"
                                )
                            )
                        return
                    st = os.stat(entry.name, dir_fd=fd, follow_symlinks=False)
                    if not stat.S_ISDIR(st.st_mode):
                        yield _Item(rel, st, fd, entry.name)
                        continue
                    if entry.name in EXCLUDED_DIRS:
                        continue
                    if depth + 1 > MAX_DEPTH or len(rel) > MAX_PATH:
                        if problems is not None:
                            problems.append(
                                TamperFinding(
                                    kind="outside_repo", path=rel[:200], detail="folder too deep; not read"
                                )
                            )
                        continue
                    stack.append((os.open(entry.name, flags, dir_fd=fd), rel + "/", depth + 1))
            finally:
                # A folder's fd is closed once its entries are handed out (files read meanwhile).
                os.close(fd)
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def baseline(root: Path) -> dict[str, Entry]:
    """Record the workspace as the agent receives it (regular files and links; `.git` excluded)."""
    entries: dict[str, Entry] = {}
    for item in _walk(root):
        if stat.S_ISREG(item.st.st_mode):
            entries[item.rel] = Entry(stat.S_IMODE(item.st.st_mode), item.st.st_size, item.sha256())
        else:
            entries[item.rel] = Entry(stat.S_IFMT(item.st.st_mode), item.st.st_size, "")
    return entries


def save_baseline(entries: dict[str, Entry], path: Path) -> None:
    data = {k: [e.mode, e.size, e.sha256] for k, e in sorted(entries.items())}
    path.write_text(json.dumps({"version": 1, "files": data}), encoding="utf-8")


def load_baseline(path: Path) -> dict[str, Entry]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return {k: Entry(int(v[0]), int(v[1]), str(v[2])) for k, v in data["files"].items()}


@dataclass
class ChangeSet:
    """Changed and added text files (new content) and deleted paths, plus what was refused."""

    files: dict[str, str] = field(default_factory=dict)
    executable: set[str] = field(default_factory=set)
    deleted: set[str] = field(default_factory=set)
    findings: list[TamperFinding] = field(default_factory=list)

    @property
    def paths(self) -> list[str]:
        return sorted(set(self.files) | self.deleted)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "files": {k: self.files[k] for k in sorted(self.files)},
            "executable": sorted(self.executable),
            "deleted": sorted(self.deleted),
            "findings": [f.to_dict() for f in self.findings],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ChangeSet:
        """Load a change set from JSON; every path is checked again (it crossed a trust boundary)."""
        if not isinstance(data, dict) or data.get("version") != 1:
            raise ValueError("not a legorl change set (version 1)")
        out = cls()
        files = data.get("files", {})
        if not isinstance(files, dict):
            raise ValueError("change set 'files' must be an object")
        for path, content in files.items():
            if not isinstance(path, str) or not isinstance(content, str):
                raise ValueError("change set 'files' maps paths to text")
            out.files[path] = content
        out.executable = {str(p) for p in data.get("executable", [])}
        out.deleted = {str(p) for p in data.get("deleted", [])}
        for item in data.get("findings", []):
            out.findings.append(TamperFinding.from_dict(item))
        return out


def path_problem(path: str) -> str | None:
    """Why `path` cannot be written inside the repository (None when it is a plain relative path)."""
    if not path or "\x00" in path or "\\" in path or "\n" in path:
        return "path contains NUL, backslash or newline"
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "path is not valid UTF-8"
    if len(path) > MAX_PATH:
        return f"path longer than {MAX_PATH} characters"
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or "." in p.parts or p.as_posix() != path:
        return "path is absolute or leaves the repository"
    if any(part in EXCLUDED_DIRS for part in p.parts):
        return "path is inside .git"
    return None


def capture(root: Path, base: dict[str, Entry]) -> ChangeSet:
    """Compare the workspace with its baseline; never follows a link, never runs a program."""
    changes = ChangeSet()
    seen: set[str] = set()
    total = 0
    for item in _walk(root, changes.findings):
        rel, st = item.rel, item.st
        seen.add(rel)
        before = base.get(rel)
        if stat.S_ISLNK(st.st_mode):
            if before is None or before.sha256 or before.mode != stat.S_IFLNK:
                target = os.readlink(item.name, dir_fd=item.dir_fd)
                changes.findings.append(
                    TamperFinding(kind="symlink", path=rel, detail=f"symbolic link to {target!r} refused")
                )
            continue
        if not stat.S_ISREG(st.st_mode):
            changes.findings.append(
                TamperFinding(
                    kind="symlink", path=rel, detail="not a regular file (fifo, socket or device) refused"
                )
            )
            continue
        if (
            before is not None
            and before.size == st.st_size
            and before.sha256
            and item.sha256() == before.sha256
        ):
            if stat.S_IMODE(st.st_mode) & 0o111 != before.mode & 0o111:
                changes.files[rel] = item.read().decode("utf-8", errors="replace")
                if st.st_mode & 0o100:
                    changes.executable.add(rel)
            continue
        problem = path_problem(rel)
        if problem:
            changes.findings.append(TamperFinding(kind="outside_repo", path=rel, detail=problem))
            continue
        if len(changes.files) >= MAX_FILES:
            changes.findings.append(
                TamperFinding(kind="binary_patch", path=rel, detail=f"more than {MAX_FILES} changed files")
            )
            continue
        if st.st_size > MAX_FILE_BYTES or total + st.st_size > MAX_TOTAL_BYTES:
            changes.findings.append(
                TamperFinding(
                    kind="binary_patch",
                    path=rel,
                    detail=f"file of {st.st_size} bytes exceeds the change-set size limits",
                )
            )
            continue
        raw = item.read(MAX_FILE_BYTES + 1)
        try:
            if b"\x00" in raw:
                raise UnicodeDecodeError("utf-8", raw, 0, 1, "NUL byte")
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            changes.findings.append(
                TamperFinding(
                    kind="binary_patch", path=rel, detail="binary content refused (only UTF-8 text)"
                )
            )
            continue
        total += len(raw)
        changes.files[rel] = text
        if st.st_mode & 0o100:
            changes.executable.add(rel)
    for rel in base:
        if rel not in seen:
            changes.deleted.add(rel)
    return changes


def sanitize(
    changes: ChangeSet,
    *,
    hidden_tests: Iterable[str] = (),
    existing_tops: frozenset[str] = frozenset(),
    runner_modules: frozenset[str] = frozenset(),
    pristine: Path | None = None,
) -> ChangeSet:
    """Drop what the agent may not change (tests, test-runner hooks, bad paths) and report it."""
    hidden = frozenset(hidden_tests)
    out = ChangeSet(findings=list(changes.findings))
    for rel in changes.paths:
        problem = path_problem(rel)
        if problem:
            out.findings.append(TamperFinding(kind="outside_repo", path=rel, detail=problem))
            continue
        action = "deleted" if rel in changes.deleted else "changed"
        reason = hook_reason(rel, existing_tops, runner_modules)
        if reason:
            out.findings.append(
                TamperFinding(kind="test_hook_added", path=rel, detail=f"{reason}; {action} file ignored")
            )
            continue
        if is_test_path(rel, hidden):
            out.findings.append(
                TamperFinding(
                    kind="test_file_modified", path=rel, detail=f"test file {action}; restored for verify"
                )
            )
            continue
        introduced = (
            runner_reference(changes.files[rel], _pristine_text(pristine, rel))
            if rel in changes.files
            else None
        )
        if introduced and rel.endswith(".py"):
            out.findings.append(
                TamperFinding(
                    kind="test_hook_added",
                    path=rel,
                    detail=f"source adds {introduced!r}, which reaches into the test runner; ignored",
                )
            )
            continue
        if rel in changes.deleted:
            out.deleted.add(rel)
        else:
            out.files[rel] = changes.files[rel]
            if rel in changes.executable:
                out.executable.add(rel)
    return out


# What code under test has no business adding to a fix: the test runner's internals, the process's
# exit and arguments (where the results file is named), dynamic code. Counted against the pristine
# file, so a project that already uses one of these can still be fixed.
RUNNER_REFERENCE = re.compile(
    r"\b(?:_pytest|pluggy|pytest|TestReport|CallInfo|hookimpl|hookwrapper|junitxml|junit|atexit|"
    r"sys\.argv|sys\.modules|sys\._getframe|settrace|setprofile|gc\.get_objects|os\._exit|"
    r"__import__|importlib|builtins|LEGORL_\w+)\b|(?<![\w.])(?:exec|eval|compile)\s*\(|legorl-out"
)


def runner_reference(new: str, old: str) -> str | None:
    """The first runner-reaching token that `new` uses more often than `old` (None if none)."""
    before: dict[str, int] = {}
    for match in RUNNER_REFERENCE.finditer(old):
        before[match.group(0)] = before.get(match.group(0), 0) + 1
    counts: dict[str, int] = {}
    for match in RUNNER_REFERENCE.finditer(new):
        token = match.group(0)
        counts[token] = counts.get(token, 0) + 1
        if counts[token] > before.get(token, 0):
            return token
    return None


def _pristine_text(pristine: Path | None, rel: str) -> str:
    if pristine is None:
        return ""
    path = pristine / rel
    try:
        return (
            path.read_text(encoding="utf-8", errors="replace")
            if path.is_file() and not path.is_symlink()
            else ""
        )
    except OSError:
        return ""


def apply(changes: ChangeSet, root: Path) -> None:
    """Write a sanitized change set into a fresh tree; refuses to follow any link on the way."""
    for rel in sorted(changes.deleted):
        if path_problem(rel):
            raise ValueError(f"refusing to delete {rel!r}")
        target = root / rel
        _check_no_links(root, rel)
        if target.is_symlink() or target.is_file():
            target.unlink()
    for rel, text in sorted(changes.files.items()):
        if path_problem(rel):
            raise ValueError(f"refusing to write {rel!r}")
        _check_no_links(root, rel)
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        fd = os.open(target, flags, 0o755 if rel in changes.executable else 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(text.encode("utf-8"))
        target.chmod(0o755 if rel in changes.executable else 0o644)


def _check_no_links(root: Path, rel: str) -> None:
    current = root
    for part in PurePosixPath(rel).parts[:-1]:
        current = current / part
        if current.is_symlink():
            raise ValueError(f"refusing to write through the link {current}")


def unified_diff(changes: ChangeSet, pristine: Path) -> str:
    """A readable `git diff`-style rendering of the change set against the pristine tree."""
    chunks: list[str] = []
    for rel in changes.paths:
        old_path = pristine / rel
        old = old_path.read_text(encoding="utf-8", errors="replace") if old_path.is_file() else ""
        new = "" if rel in changes.deleted else changes.files[rel]
        a = f"a/{rel}" if old_path.is_file() else "/dev/null"
        b = "/dev/null" if rel in changes.deleted else f"b/{rel}"
        chunks.append(f"diff --git a/{rel} b/{rel}\n")
        chunks.extend(difflib.unified_diff(old.splitlines(True), new.splitlines(True), a, b))
    return "".join(c if c.endswith("\n") else c + "\n\\ No newline at end of file\n" for c in chunks)
