"""Tasks: SWE-bench-compatible instances and the task-set manifest (JSONL), standard library only.

A task is a SWE-bench instance (``instance_id``, ``repo``, ``base_commit``, ``problem_statement``,
``patch``, ``test_patch``, ``FAIL_TO_PASS``, ``PASS_TO_PASS``, ``version``, ...) plus what legorl
needs to run it: the ``image`` that holds the repository at its base commit (Kubernetes), a
``source`` git repository or bundle for the local backend, the ``workspace_dir`` inside the image
and the ``test_command``. SWE-bench rows load unchanged (their list fields arrive as JSON strings).

This module runs inside task images (the setup and verify stages), so it imports nothing beyond
the standard library.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

INSTANCE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
DIFF_FILE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)

DEFAULT_TEST_COMMAND = (
    "python -m pytest -rA -p no:cacheprovider -o junit_family=xunit1 --junitxml={junit} {tests}"
)
"""Runs the task's test files; `{junit}` is where the verifier reads results, `{tests}` the test
files (FAIL_TO_PASS and PASS_TO_PASS files, hidden tests included)."""

SPLIT_KEY = "legorl_split"
"""Manifest field holding the task set's own split label of a task: `train`, `validation` or `test`
(an RLRun's `tasks.split.taskSetSplit` holds out the tasks of one label and trains on `train`)."""
SPLIT_LABELS = ("train", "validation", "test")
"""The values of `SPLIT_KEY`."""

KNOWN_FIELDS = frozenset(
    {
        "instance_id",
        "repo",
        "base_commit",
        "problem_statement",
        "patch",
        "test_patch",
        "FAIL_TO_PASS",
        "PASS_TO_PASS",
        "version",
        "hints_text",
        "created_at",
        "environment_setup_commit",
        "image",
        "source",
        "workspace_dir",
        "test_command",
        "test_timeout_seconds",
    }
)


class TaskError(ValueError):
    """A task or task-set manifest is invalid; the message says which field and how to fix it."""


@dataclass(frozen=True)
class Task:
    """One task: a repository at a base commit, a problem statement and its hidden tests."""

    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    patch: str = ""
    """The reference fix (SWE-bench's gold patch); never shown to the agent."""
    version: str = ""
    image: str | None = None
    """Image with the repository at `base_commit` in `workspace_dir` (Kubernetes backend)."""
    source: str | None = None
    """Git repository or bundle holding `base_commit` (local backend); relative paths are resolved
    against the manifest's folder."""
    workspace_dir: str = "/testbed"
    test_command: str = DEFAULT_TEST_COMMAND
    test_timeout_seconds: int = 600
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def split(self) -> str | None:
        """The task set's split label (`SPLIT_KEY`: train, validation or test); None when unlabelled."""
        label = self.extra.get(SPLIT_KEY)
        return label if isinstance(label, str) else None

    @property
    def hidden_test_files(self) -> tuple[str, ...]:
        """Files the test patch creates: absent while the agent works, restored to verify. A test
        file the patch only changes stays visible at its base version, as in SWE-bench."""
        return tuple(f.path for f in patch_files(self.test_patch) if f.created)

    @property
    def test_patch_paths(self) -> tuple[str, ...]:
        """Every file the test patch touches; the agent's changes to any of them are discarded."""
        return tuple(f.path for f in patch_files(self.test_patch))

    @property
    def test_files(self) -> tuple[str, ...]:
        """Test files the verifier runs (`{tests}`): the files of pytest-style FAIL_TO_PASS /
        PASS_TO_PASS ids and those the test patch touches, sorted."""
        files = {_test_file(t) for t in (*self.fail_to_pass, *self.pass_to_pass)} - {None}
        files.update(self.test_patch_paths)
        return tuple(sorted(f for f in files if f))

    def to_dict(self) -> dict[str, Any]:
        """The manifest row (SWE-bench field names; lists stay lists)."""
        row: dict[str, Any] = dict(self.extra)
        row.update(
            {
                "instance_id": self.instance_id,
                "repo": self.repo,
                "base_commit": self.base_commit,
                "problem_statement": self.problem_statement,
                "patch": self.patch,
                "test_patch": self.test_patch,
                "FAIL_TO_PASS": list(self.fail_to_pass),
                "PASS_TO_PASS": list(self.pass_to_pass),
                "version": self.version,
                "workspace_dir": self.workspace_dir,
                "test_command": self.test_command,
                "test_timeout_seconds": self.test_timeout_seconds,
            }
        )
        if self.image is not None:
            row["image"] = self.image
        if self.source is not None:
            row["source"] = self.source
        return row

    @classmethod
    def from_dict(cls, row: Mapping[str, Any], *, where: str = "task") -> Task:
        """Validate one manifest row; SWE-bench rows (list fields as JSON strings) are accepted."""
        if not isinstance(row, Mapping):
            raise TaskError(f"{where}: expected a JSON object, got {type(row).__name__}")
        iid = _text(row, "instance_id", where, required=True)
        if not INSTANCE_ID.match(iid):
            raise TaskError(
                f"{where}: instance_id {iid!r} must be 1-200 characters of letters, digits, '.', '_' "
                "or '-', starting with a letter or digit"
            )
        where = f"{where} {iid}"
        commit = _text(row, "base_commit", where, required=True)
        if not COMMIT.match(commit):
            raise TaskError(f"{where}: base_commit must be a full 40-character hex commit id, got {commit!r}")
        test_patch = _text(row, "test_patch", where, required=True)
        touched = patch_files(test_patch)
        if not touched:
            raise TaskError(f"{where}: test_patch adds no files (expected `diff --git a/... b/...` headers)")
        for item in touched:
            check_relative_path(item.path, f"{where}: test_patch file")
        f2p = _test_list(row, "FAIL_TO_PASS", where)
        if not f2p:
            raise TaskError(
                f"{where}: FAIL_TO_PASS is empty; a task needs at least one test the fix makes pass"
            )
        p2p = _test_list(row, "PASS_TO_PASS", where)
        for test_id in (*f2p, *p2p):
            file = _test_file(test_id)
            if file is not None:
                check_relative_path(file, f"{where}: test id {test_id!r} names the file")
        image = _text(row, "image", where) or None
        source = _text(row, "source", where) or None
        workspace_dir = _text(row, "workspace_dir", where) or "/testbed"
        if not workspace_dir.startswith("/") or ".." in PurePosixPath(workspace_dir).parts:
            raise TaskError(
                f"{where}: workspace_dir must be an absolute path without '..', got {workspace_dir!r}"
            )
        command = _text(row, "test_command", where) or DEFAULT_TEST_COMMAND
        if "{junit}" not in command:
            raise TaskError(
                f"{where}: test_command must write JUnit XML to the `{{junit}}` placeholder "
                "(pytest: --junitxml={junit})"
            )
        timeout = row.get("test_timeout_seconds", 600)
        if not isinstance(timeout, int) or isinstance(timeout, bool) or not 1 <= timeout <= 86_400:
            raise TaskError(f"{where}: test_timeout_seconds must be an integer in 1..86400, got {timeout!r}")
        extra = {k: v for k, v in row.items() if k not in KNOWN_FIELDS}
        return cls(
            instance_id=iid,
            repo=_text(row, "repo", where, required=True),
            base_commit=commit,
            problem_statement=_text(row, "problem_statement", where, required=True),
            test_patch=test_patch,
            fail_to_pass=f2p,
            pass_to_pass=p2p,
            patch=_text(row, "patch", where),
            version=str(row.get("version") or ""),
            image=image,
            source=source,
            workspace_dir=workspace_dir,
            test_command=command,
            test_timeout_seconds=timeout,
            extra={k: row[k] for k in ("hints_text", "created_at", "environment_setup_commit") if k in row}
            | extra,
        )


def _text(row: Mapping[str, Any], key: str, where: str, *, required: bool = False) -> str:
    value = row.get(key)
    if value is None:
        if required:
            raise TaskError(f"{where}: missing required field {key!r}")
        return ""
    if not isinstance(value, str):
        raise TaskError(f"{where}: {key} must be a string, got {type(value).__name__}")
    if required and not value.strip():
        raise TaskError(f"{where}: {key} is empty")
    return value


def _test_list(row: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = row.get(key, [])
    if isinstance(value, str):  # SWE-bench stores these lists as JSON text
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as exc:
            raise TaskError(f"{where}: {key} is a string but not a JSON list: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise TaskError(f"{where}: {key} must be a list of test ids like 'tests/test_x.py::test_y'")
    return tuple(value)


@dataclass(frozen=True)
class PatchFile:
    """One file a git diff touches: its path after the patch, and whether the patch creates it."""

    path: str
    created: bool


def _unquote(path: str) -> str:
    """git writes unusual names C-quoted (`"tests/t\303\251st.py"`): undo it."""
    if not (path.startswith('"') and path.endswith('"')):
        return path
    raw = path[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape").encode("latin-1")
    return raw.decode("utf-8", "surrogateescape")


def patch_files(patch: str) -> tuple[PatchFile, ...]:
    """Files a unified git diff touches, in order. Paths come from the `--- a/` / `+++ b/` lines
    (unambiguous with spaces, unquoted when git quoted them); a binary or mode-only change falls
    back to its `diff --git` header."""
    files: dict[str, bool] = {}
    header: str | None = None
    old: str | None = None
    created = False
    for line in patch.splitlines():
        if line.startswith("diff --git "):
            match = DIFF_FILE.match(line)
            if header is not None and header not in files:
                files[header] = created
            header, old, created = (match.group(2) if match else None), None, False
        elif line.startswith("new file mode") and header is not None:
            created = True
        elif line.startswith("--- "):
            old = line[4:].split("\t", 1)[0]
        elif line.startswith("+++ ") and old is not None:
            new = _unquote(line[4:].split("\t", 1)[0])
            path = _unquote(old) if new == "/dev/null" else new
            path = path[2:] if path.startswith(("a/", "b/")) else path
            files[path] = created or old == "/dev/null"
            header, old = None, None
    if header is not None and header not in files:
        files[header] = created
    return tuple(PatchFile(path, made) for path, made in files.items())


def _test_file(test_id: str) -> str | None:
    """The file of a pytest node id (`tests/test_x.py::test_y` → `tests/test_x.py`); None for other
    runners' ids (Django's `test_x (module.Class)`), whose files the test command must name."""
    file, sep, _ = test_id.partition("::")
    return file if sep and file else None


def check_relative_path(path: str, what: str) -> None:
    """Reject absolute paths, '..' and the git directory: every task path stays inside the repo."""
    parts = PurePosixPath(path).parts
    if not parts or path.startswith("/") or ".." in parts or parts[0] == ".git" or "\\" in path:
        raise TaskError(f"{what} {path!r} must be a relative path inside the repository")


@dataclass(frozen=True)
class TaskSet:
    """A task-set manifest: tasks in order, and the images they need (for pre-pull)."""

    tasks: tuple[Task, ...]
    root: Path | None = None
    """Folder the manifest was read from: relative `source` paths resolve against it."""

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def __len__(self) -> int:
        return len(self.tasks)

    def get(self, instance_id: str) -> Task:
        for task in self.tasks:
            if task.instance_id == instance_id:
                return task
        raise KeyError(instance_id)

    @property
    def images(self) -> list[str]:
        """Distinct images in manifest order: what a SandboxPool pre-pulls."""
        return list(dict.fromkeys(t.image for t in self.tasks if t.image))

    def source_path(self, task: Task) -> Path:
        """Where the local backend finds `task`'s repository."""
        if task.source is None:
            raise TaskError(f"task {task.instance_id}: no `source` (needed by the local backend)")
        path = Path(task.source.removeprefix("file://"))
        if not path.is_absolute() and self.root is not None:
            path = self.root / path
        return path

    @classmethod
    def from_rows(cls, rows: Iterable[tuple[str, Any]], root: Path | None = None) -> TaskSet:
        tasks: list[Task] = []
        seen: set[str] = set()
        for where, row in rows:
            task = Task.from_dict(row, where=where)
            if task.instance_id in seen:
                raise TaskError(f"{where}: duplicate instance_id {task.instance_id!r}")
            seen.add(task.instance_id)
            tasks.append(task)
        if not tasks:
            raise TaskError("task set is empty")
        return cls(tuple(tasks), root)


def load_jsonl(path: Path) -> TaskSet:
    """Read a JSONL task-set manifest (one SWE-bench-style object per line; blank lines skipped)."""

    def rows() -> Iterator[tuple[str, Any]]:
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path.name}:{lineno}", json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TaskError(f"{path.name}:{lineno}: not valid JSON: {exc.msg}") from None

    return TaskSet.from_rows(rows(), root=path.resolve().parent)


def load_parquet(path: Path) -> TaskSet:
    """Read a Parquet task-set manifest (one row per task, SWE-bench columns).

    pyarrow is imported by name at call time: the in-pod tool never reads Parquet and stays
    standard-library only (the import-linter contract), the controller and CLI have pyarrow."""
    parquet = importlib.import_module("pyarrow.parquet")
    rows = parquet.read_table(path).to_pylist()
    return TaskSet.from_rows(
        ((f"{path.name}:row {i}", row) for i, row in enumerate(rows, 1)), root=path.parent
    )


def load_task_set(path: Path, format: str = "Auto") -> TaskSet:
    """A JSONL or Parquet manifest; `Auto` goes by the file extension (TaskSetSource.format)."""
    if format == "Parquet" or (format == "Auto" and path.suffix == ".parquet"):
        return load_parquet(path)
    return load_jsonl(path)


def write_jsonl(tasks: Iterable[Task], path: Path) -> None:
    """Write a JSONL manifest, one task per line, keys sorted (byte-reproducible)."""
    lines = [json.dumps(t.to_dict(), sort_keys=True, ensure_ascii=False) for t in tasks]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
