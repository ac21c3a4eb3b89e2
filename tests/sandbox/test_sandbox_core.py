"""The sandbox stages' file logic: task format, history reduction, change capture, grading, CLI.

Real git and real pytest throughout; the local bubblewrap backend has its own test module.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import swebench
from swebench.types import SWEbenchInstance  # the real package's instance schema

from legorl.sandbox import changes as ch
from legorl.sandbox import cli, stages, workspace
from legorl.sandbox import task as task_mod
from legorl.sandbox.grade import grade, parse_junit, parse_pytest_log
from legorl.sandbox.local import LocalBackend
from legorl.sandbox.outcomes import TamperFinding
from legorl.sandbox.paths import hook_reason, is_test_path
from legorl.sandbox.task import DEFAULT_TEST_COMMAND, Task, TaskError, TaskSet, load_jsonl

GIT_ENV = {**workspace.git_env(), "GIT_AUTHOR_DATE": "2020-01-01T00:00:00Z"}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, env=GIT_ENV, check=True, capture_output=True, text=True
    ).stdout.strip()


HIDDEN = "tests/test_hidden.py"
HIDDEN_TEST = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


@pytest.fixture
def hostile_repo(tmp_path: Path) -> tuple[Path, str, str]:
    """A source repository whose history leaks the fix every way git allows: a later commit, a tag,
    a branch, a stash, a remote, packed refs, reflog entries and an unreachable commit."""
    repo = tmp_path / "src"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "calc").mkdir()
    (repo / "tests").mkdir()
    (repo / "calc" / "__init__.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "tests" / "test_calc.py").write_text(
        "from calc import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n"
    )
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    base = git(repo, "rev-parse", "HEAD")
    (repo / HIDDEN).write_text(HIDDEN_TEST)
    git(repo, "add", HIDDEN)
    test_patch = git(repo, "diff", "--cached") + "\n"
    (repo / "calc" / "__init__.py").write_text("def add(a, b):\n    return a + b\n")
    git(repo, "commit", "-qam", "fix: add really adds")
    git(repo, "tag", "v1.0.1")
    git(repo, "branch", "fix")
    (repo / "calc" / "__init__.py").write_text("def add(a, b):\n    return b + a  # stashed\n")
    git(repo, "stash")
    git(repo, "commit", "-q", "--allow-empty", "-m", "dangling")
    git(repo, "reset", "-q", "--hard", "HEAD~1")  # leaves an unreachable commit behind in the reflog
    git(repo, "remote", "add", "origin", "https://example.invalid/calc.git")
    git(repo, "gc", "-q")  # packs objects and refs
    git(repo, "checkout", "-q", base)
    return repo, base, test_patch


def make_task(base: str, test_patch: str, **extra: Any) -> Task:
    row = {
        "instance_id": "calc-1",
        "repo": "legorl-tests/calc",
        "base_commit": base,
        "problem_statement": "add(2, 3) returns -1; it should return 5.",
        "test_patch": test_patch,
        "FAIL_TO_PASS": [f"{HIDDEN}::test_add"],
        "PASS_TO_PASS": ["tests/test_calc.py::test_zero"],
        **extra,
    }
    return Task.from_dict(row)


# -- task format -----------------------------------------------------------------------------


def test_swebench_rows_load_unchanged() -> None:
    """A SWE-bench row (list fields as JSON text) loads; every SWE-bench field is a known field."""
    row = {
        "repo": "astropy/astropy",
        "instance_id": "astropy__astropy-12907",
        "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
        "patch": "diff --git a/x.py b/x.py\n",
        "test_patch": (
            "diff --git a/astropy/tests/test_x.py b/astropy/tests/test_x.py\n"
            "--- a/astropy/tests/test_x.py\n+++ b/astropy/tests/test_x.py\n@@ -1 +1,2 @@\n x\n+y\n"
        ),
        "problem_statement": "separability_matrix is wrong for nested models",
        "hints_text": "",
        "created_at": "2022-03-03T15:14:54Z",
        "version": "4.3",
        "FAIL_TO_PASS": '["astropy/tests/test_x.py::test_nested"]',
        "PASS_TO_PASS": "[]",
        "environment_setup_commit": "298ccb478e6bf092953bca67a3d29dc6c35f6752",
    }
    assert set(row) == set(SWEbenchInstance.__annotations__)
    task = Task.from_dict(row)
    assert task.fail_to_pass == ("astropy/tests/test_x.py::test_nested",)
    assert task.pass_to_pass == ()
    # The patch changes an existing test file: it stays visible at its base version (SWE-bench's
    # way); only files the patch creates are hidden. Agent edits to either are discarded.
    assert task.hidden_test_files == ()
    assert task.test_patch_paths == ("astropy/tests/test_x.py",)
    assert task.extra["environment_setup_commit"] == row["environment_setup_commit"]
    assert task.test_command == DEFAULT_TEST_COMMAND
    again = Task.from_dict(task.to_dict())
    assert again == task


@pytest.mark.parametrize(("label", "split"), [("train", "train"), ("test", "test"), (None, None), (3, None)])
def test_the_task_sets_split_label_is_read_and_kept(label: object, split: str | None) -> None:
    row: dict[str, Any] = {
        "instance_id": "t-1",
        "repo": "r",
        "base_commit": "a" * 40,
        "problem_statement": "p",
        "test_patch": "diff --git a/tests/test_a.py b/tests/test_a.py\n",
        "FAIL_TO_PASS": ["tests/test_a.py::test_a"],
    }
    if label is not None:
        row[task_mod.SPLIT_KEY] = label
    task = Task.from_dict(row)
    assert task.split == split
    assert Task.from_dict(task.to_dict()) == task
    assert task.to_dict().get("legorl_split") == label


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"instance_id": None}, "missing required field 'instance_id'"),
        ({"instance_id": "a b"}, "instance_id 'a b' must be"),
        ({"base_commit": "abc"}, "full 40-character hex commit"),
        ({"FAIL_TO_PASS": []}, "FAIL_TO_PASS is empty"),
        ({"FAIL_TO_PASS": "not json"}, "FAIL_TO_PASS is a string but not a JSON list"),
        ({"PASS_TO_PASS": [1]}, "PASS_TO_PASS must be a list of test ids"),
        ({"test_patch": "no diff here"}, "test_patch adds no files"),
        ({"test_patch": "diff --git a/../x.py b/../x.py\n"}, "must be a relative path inside the repository"),
        ({"test_command": "pytest"}, "must write JUnit XML to the `{junit}` placeholder"),
        ({"workspace_dir": "testbed"}, "workspace_dir must be an absolute path"),
        ({"test_timeout_seconds": 0}, "test_timeout_seconds must be an integer"),
        ({"problem_statement": 5}, "problem_statement must be a string"),
        ({"FAIL_TO_PASS": ["../../etc/passwd::x"]}, "names the file '../../etc/passwd'"),
    ],
)
def test_invalid_task_rows_say_what_to_fix(change: dict[str, Any], message: str) -> None:
    row: dict[str, Any] = {
        "instance_id": "t-1",
        "repo": "r",
        "base_commit": "a" * 40,
        "problem_statement": "p",
        "test_patch": "diff --git a/tests/test_a.py b/tests/test_a.py\n",
        "FAIL_TO_PASS": ["tests/test_a.py::test_a"],
    }
    for key, value in change.items():
        if value is None:
            row.pop(key)
        else:
            row[key] = value
    with pytest.raises(TaskError, match=message.replace("(", r"\(").replace("[", r"\[").replace("{", r"\{")):
        Task.from_dict(row)


def test_manifest_errors_name_the_line(tmp_path: Path) -> None:
    manifest = tmp_path / "tasks.jsonl"
    manifest.write_text('{"instance_id": "x"}\n')
    with pytest.raises(TaskError, match=r"tasks.jsonl:1 x: missing required field 'base_commit'"):
        load_jsonl(manifest)
    manifest.write_text("\n{not json\n")
    with pytest.raises(TaskError, match=r"tasks.jsonl:2: not valid JSON"):
        load_jsonl(manifest)
    task = make_task(
        "b" * 40, "diff --git a/tests/test_a.py b/tests/test_a.py\n", image="img:1", source="repos/x"
    )
    dup = json.dumps(task.to_dict())
    manifest.write_text(f"{dup}\n{dup}\n")
    with pytest.raises(TaskError, match="duplicate instance_id 'calc-1'"):
        load_jsonl(manifest)
    manifest.write_text(f"{dup}\n")
    loaded = load_jsonl(manifest)
    assert loaded.images == ["img:1"]
    assert loaded.source_path(loaded.tasks[0]) == tmp_path / "repos" / "x"
    assert isinstance(loaded, TaskSet)


def test_patch_paths_with_spaces_quotes_deletions_and_binaries() -> None:
    patch = (
        "diff --git a/tests/new test.py b/tests/new test.py\nnew file mode 100644\n--- /dev/null\n"
        "+++ b/tests/new test.py\n@@ -0,0 +1 @@\n+z\n"
        'diff --git "a/tests/t\\303\\251st.py" "b/tests/t\\303\\251st.py"\nnew file mode 100644\n'
        '--- /dev/null\n+++ "b/tests/t\\303\\251st.py"\n@@ -0,0 +1 @@\n+z\n'
        "diff --git a/tests/gone.py b/tests/gone.py\ndeleted file mode 100644\n--- a/tests/gone.py\n"
        "+++ /dev/null\n@@ -1 +0,0 @@\n-z\n"
        "diff --git a/tests/data.bin b/tests/data.bin\nnew file mode 100644\n"
        "Binary files /dev/null and b/tests/data.bin differ\n"
    )
    assert task_mod.patch_files(patch) == (
        task_mod.PatchFile("tests/new test.py", created=True),
        task_mod.PatchFile("tests/tést.py", created=True),
        task_mod.PatchFile("tests/gone.py", created=False),
        task_mod.PatchFile("tests/data.bin", created=True),
    )


def test_other_runners_ids_name_no_file() -> None:
    task = make_task(
        "d" * 40,
        "diff --git a/tests/test_a.py b/tests/test_a.py\nnew file mode 100644\n",
        FAIL_TO_PASS=["test_add (calc.tests.AddTests)"],
    )
    assert task.test_files == ("tests/test_a.py", "tests/test_calc.py")


def test_patch_files_and_test_files() -> None:
    patch = (
        "diff --git a/tests/test_a.py b/tests/test_a.py\n--- a/tests/test_a.py\n+++ b/tests/test_a.py\n"
        "diff --git a/tests/test_b.py b/tests/test_b.py\nnew file mode 100644\n"
    )
    assert make_task("c" * 40, patch).hidden_test_files == ("tests/test_b.py",)
    assert task_mod.patch_files(patch) == (
        task_mod.PatchFile("tests/test_a.py", created=False),
        task_mod.PatchFile("tests/test_b.py", created=True),
    )
    task = make_task("c" * 40, patch)
    assert task.test_files == ("tests/test_a.py", "tests/test_b.py", "tests/test_calc.py", HIDDEN)


# -- paths ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "is_test"),
    [
        ("tests/test_a.py", True),
        ("pkg/tests/helpers.py", True),
        ("test_top.py", True),
        ("pkg/thing_test.py", True),
        ("pkg/testing/util.py", True),
        ("pkg/contest.py", False),
        ("pkg/module.py", False),
    ],
)
def test_test_paths(path: str, is_test: bool) -> None:
    assert is_test_path(path) is is_test


@pytest.mark.parametrize(
    "path",
    [
        "conftest.py",
        "pkg/conftest.py",
        "sitecustomize.py",
        "usercustomize.py",
        "evil.pth",
        "pytest.ini",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "pkg.egg-info/entry_points.txt",
        ".github/workflows/ci.yml",
        "pytest_evil.py",
        "pytest.py",
        "_pytest/runner.py",
        "unittest/__init__.py",
        "pkg/__pycache__/mod.cpython-311.pyc",
    ],
)
def test_hook_paths_are_recognised(path: str) -> None:
    assert hook_reason(path) is not None


def test_existing_packages_are_not_flagged_as_shadowing() -> None:
    assert hook_reason("calendar/core.py") is not None
    assert hook_reason("calendar/core.py", frozenset({"calendar"})) is None
    assert hook_reason("calc/__init__.py") is None


# -- setup: history reduction and its self-tests ------------------------------------------------


def test_setup_leaves_one_commit_and_nothing_else(
    hostile_repo: tuple[Path, str, str], tmp_path: Path
) -> None:
    source, base, test_patch = hostile_repo
    # The control: the source really does leak the fix in every way the self-tests look for.
    leaky = workspace.check_history(source)
    assert {c.name for c in leaky if not c.passed} >= {
        "history.single_commit",
        "history.single_ref",
        "history.no_leftovers",
        "history.no_remotes",
    }
    pristine = tmp_path / "pristine"
    workspace.checkout_source(source, base, pristine)
    task = make_task(base, test_patch)
    staged = stages.setup(pristine, tmp_path / "ws", task)
    assert all(c.passed for c in staged.checks), staged.checks
    ws = tmp_path / "ws"
    assert git(ws, "rev-list", "--all").count("\n") == 0
    assert git(ws, "tag") == ""
    assert git(ws, "stash", "list") == ""
    assert git(ws, "reflog") == ""
    objects = git(ws, "cat-file", "--batch-all-objects", "--batch-check")
    every_object = subprocess.run(
        ["git", "cat-file", "--batch-all-objects", "--batch"],
        cwd=ws,
        env=GIT_ENV,
        capture_output=True,
        check=True,
    ).stdout
    assert b"a - b" in every_object  # the control: object contents are searchable here
    assert b"a + b" not in every_object
    assert b"test_add" not in every_object
    assert len(objects.splitlines()) == len(git(ws, "rev-list", "--objects", "--all").splitlines())
    assert not (ws / HIDDEN).exists()
    assert (ws / "calc" / "__init__.py").read_text().endswith("a - b\n")
    assert set(staged.baseline) == {"calc/__init__.py", "tests/test_calc.py"}


def test_self_tests_catch_what_reduction_missed(hostile_repo: tuple[Path, str, str], tmp_path: Path) -> None:
    """Each self-test fails on a workspace that still holds the thing it looks for."""
    source, base, test_patch = hostile_repo
    pristine = tmp_path / "pristine"
    workspace.checkout_source(source, base, pristine)
    ws = tmp_path / "ws"
    stages.setup(pristine, ws, make_task(base, test_patch))
    (ws / ".git" / "objects" / "info" / "alternates").write_text(str(source / ".git" / "objects") + "\n")
    (ws / ".git" / "ORIG_HEAD").write_text(base + "\n")
    (ws / HIDDEN).write_text(HIDDEN_TEST)
    # A stray object that no commit reaches (content the alternate store does not hold).
    blob = subprocess.run(
        ["git", "hash-object", "-w", "--stdin"],
        cwd=ws,
        input="def add(a, b):\n    return sum((a, b))\n",
        env=GIT_ENV,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert blob
    failed = {c.name for c in workspace.check_history(ws) if not c.passed}
    assert {"history.no_leftovers", "history.no_unreachable_objects"} <= failed
    assert not workspace.check_tests_absent(ws, [HIDDEN])[0].passed


def test_preserve_keeps_history_on_purpose(hostile_repo: tuple[Path, str, str], tmp_path: Path) -> None:
    source, _, _ = hostile_repo
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(source), str(clone))
    checks = workspace.stage(clone, tmp_path / "ws", hidden_tests=[HIDDEN], git_history="Preserve")
    assert [c.name for c in checks] == ["history.preserved", "tests.hidden_absent"]
    assert "v1.0.1" in git(tmp_path / "ws", "tag")


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder owned by another uid needs root")
def test_a_workspace_on_a_mount_point_owned_by_another_uid_is_staged_and_checked(
    hostile_repo: tuple[Path, str, str], tmp_path: Path
) -> None:
    """In a trial pod the staged workspace is an emptyDir's mount point, owned by root, and the stage runs
    as the agent (65532): git's ownership check then hides the repository from every git call."""
    source, base, _ = hostile_repo
    pristine = tmp_path / "pristine"
    workspace.checkout_source(source, base, pristine)
    into = tmp_path / "ws"
    into.mkdir()
    os.chown(into, 65532, 65532)  # not the uid that runs git here (root)
    checks = workspace.stage(pristine, into, hidden_tests=[HIDDEN])
    assert checks and all(c.passed for c in checks), [c.to_dict() for c in checks]
    assert len(workspace.git(["rev-list", "--all"], into).stdout.split()) == 1


def test_setup_refuses_a_missing_base_commit(hostile_repo: tuple[Path, str, str], tmp_path: Path) -> None:
    source, _, _ = hostile_repo
    with pytest.raises(workspace.SetupError, match=r"base commit 0{40} is not in"):
        workspace.checkout_source(source, "0" * 40, tmp_path / "x")


# -- capture and sanitize ---------------------------------------------------------------------


def test_capture_sees_edits_additions_deletions_and_refuses_links(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "pkg").mkdir(parents=True)
    (ws / "pkg" / "a.py").write_text("a = 1\n")
    (ws / "pkg" / "gone.py").write_text("x = 1\n")
    (ws / "run.sh").write_text("#!/bin/sh\n")
    base = ch.baseline(ws)
    (ws / "pkg" / "a.py").write_text("a = 2\n")
    (ws / "pkg" / "gone.py").unlink()
    (ws / "pkg" / "new.py").write_text("b = 3\n")
    (ws / "run.sh").chmod(0o755)
    (ws / "link.py").symlink_to("/etc/passwd")
    (ws / "blob.bin").write_bytes(b"\x00\x01binary")
    (ws / ".git").mkdir()
    (ws / ".git" / "config").write_text("[core]\n\tfsmonitor = touch /tmp/pwned\n")
    os.mkfifo(ws / "pipe")
    changes = ch.capture(ws, base)
    assert changes.files == {"pkg/a.py": "a = 2\n", "pkg/new.py": "b = 3\n", "run.sh": "#!/bin/sh\n"}
    assert changes.executable == {"run.sh"}
    assert changes.deleted == {"pkg/gone.py"}
    kinds = {(f.kind, f.path) for f in changes.findings}
    assert kinds == {("symlink", "link.py"), ("binary_patch", "blob.bin"), ("symlink", "pipe")}


def test_sanitize_strips_tests_and_hooks_and_reports_them() -> None:
    changes = ch.ChangeSet(
        files={
            "calc/__init__.py": "fix\n",
            "tests/test_calc.py": "def test_zero(): pass\n",
            "conftest.py": "evil\n",
            "calc/evil.pth": "import os\n",
            "pytest.py": "fake\n",
            "../outside.py": "x\n",
        },
        deleted={"tests/test_other.py"},
    )
    clean = ch.sanitize(changes, hidden_tests=[HIDDEN], existing_tops=frozenset({"calc", "tests"}))
    assert clean.files == {"calc/__init__.py": "fix\n"}
    assert clean.deleted == set()
    found = {(f.kind, f.path) for f in clean.findings}
    assert found == {
        ("test_file_modified", "tests/test_calc.py"),
        ("test_file_modified", "tests/test_other.py"),
        ("test_hook_added", "conftest.py"),
        ("test_hook_added", "calc/evil.pth"),
        ("test_hook_added", "pytest.py"),
        ("outside_repo", "../outside.py"),
    }


def test_apply_never_writes_through_a_link(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "pkg").symlink_to(tmp_path)
    with pytest.raises(ValueError, match="refusing to write through the link"):
        ch.apply(ch.ChangeSet(files={"pkg/x.py": "x\n"}), tree)
    with pytest.raises(ValueError, match="refusing to write"):
        ch.apply(ch.ChangeSet(files={"/etc/x": "x\n"}), tree)
    assert not (tmp_path / "x.py").exists()


def test_change_sets_round_trip_as_json() -> None:
    changes = ch.ChangeSet(files={"a.py": "x\n"}, executable={"a.py"}, deleted={"b.py"})
    changes.findings.append(TamperFinding(kind="symlink", path="c", detail="why"))
    again = ch.ChangeSet.from_dict(json.loads(json.dumps(changes.to_dict())))
    assert again.to_dict() == changes.to_dict()
    with pytest.raises(ValueError, match="not a legorl change set"):
        ch.ChangeSet.from_dict({"files": {}})


# -- grading ----------------------------------------------------------------------------------

SAMPLE_TESTS = """
import pytest

def test_ok():
    pass

def test_bad():
    assert 0

@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    assert n == 1

class TestGroup:
    def test_method(self):
        pass

@pytest.mark.skip(reason="no")
def test_skip():
    pass

@pytest.mark.xfail(reason="known", strict=False)
def test_xfail():
    assert 0
"""


def test_junit_and_log_parsers_agree_on_a_real_pytest_run(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_sample.py").write_text(SAMPLE_TESTS)
    junit = tmp_path / "junit.xml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-rA",
            "-p",
            "no:cacheprovider",
            "-o",
            "junit_family=xunit1",
            f"--junitxml={junit}",
            "tests/test_sample.py",
            "-W",
            "ignore",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTEST_ADDOPTS": ""},
    )
    from_xml = parse_junit(junit)
    from_log = parse_pytest_log(proc.stdout)
    expected = {
        "tests/test_sample.py::test_ok": "PASSED",
        "tests/test_sample.py::test_bad": "FAILED",
        "tests/test_sample.py::test_param[1]": "PASSED",
        "tests/test_sample.py::test_param[2]": "FAILED",
        "tests/test_sample.py::TestGroup::test_method": "PASSED",
        "tests/test_sample.py::test_skip": "SKIPPED",
        "tests/test_sample.py::test_xfail": "XFAIL",
    }
    assert from_xml == expected
    # pytest's -rA summary names no test for a skip ("SKIPPED [1] file:line: reason").
    assert from_log == {k: v for k, v in expected.items() if v != "SKIPPED"}


def _swebench_log_parser(monkeypatch: pytest.MonkeyPatch) -> Any:
    """SWE-bench's own `parse_log_pytest`, loaded from the installed package without its
    `swebench.harness` package init (which imports docker, absent here on purpose)."""
    root = Path(swebench.__file__).parent / "harness"
    harness = types.ModuleType("swebench.harness")
    harness.__path__ = [str(root)]
    monkeypatch.setitem(sys.modules, "swebench.harness", harness)
    loaded: Any = None
    for name, path in (
        ("swebench.harness.constants", root / "constants" / "__init__.py"),
        ("swebench.harness.log_parsers.python", root / "log_parsers" / "python.py"),
    ):
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        loaded = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, loaded)
        spec.loader.exec_module(loaded)
    return loaded.parse_log_pytest


def test_log_parser_agrees_with_swebench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Our `-rA` parser and SWE-bench's `parse_log_pytest` read the same real pytest log alike."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_sample.py").write_text(SAMPLE_TESTS)
    log = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-rA",
            "-p",
            "no:cacheprovider",
            "tests/test_sample.py",
            "-W",
            "ignore",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTEST_ADDOPTS": ""},
    ).stdout
    theirs = _swebench_log_parser(monkeypatch)(log, None)
    ours = parse_pytest_log(log)
    assert len(ours) == 6
    assert ours == theirs


def test_reward_needs_every_listed_test_to_pass() -> None:
    results = {"a::x": "PASSED", "a::y": "PASSED", "a::z": "FAILED"}
    assert grade(results, ["a::x"], ["a::y"]).reward == 1.0  # type: ignore[arg-type]
    assert grade(results, ["a::x"], ["a::z"]).reward == 0.0  # type: ignore[arg-type]
    missing = grade(results, ["a::x", "a::deleted"], [])  # type: ignore[arg-type]
    assert missing.reward == 0.0
    assert missing.fail_to_pass["a::deleted"] is None


# -- the CLI the trial and verify pods run ------------------------------------------------------


def test_cli_setup_capture_verify_round_trip(
    hostile_repo: tuple[Path, str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Kubernetes path without Kubernetes: the pod commands on plain folders."""
    source, base, test_patch = hostile_repo
    image_repo = tmp_path / "image-testbed"
    git(tmp_path, "clone", "-q", str(source), str(image_repo))
    git(image_repo, "checkout", "-q", base)
    task_file = tmp_path / "task.json"
    task_file.write_text(json.dumps(make_task(base, test_patch).to_dict()))
    staged, baseline = tmp_path / "staged", tmp_path / "baseline.json"
    args = ["setup", f"--workspace={image_repo}", f"--into={staged}", f"--baseline={baseline}"]
    assert cli.main([*args, f"--task-file={task_file}"]) == 0
    setup_out = json.loads(capsys.readouterr().out)
    assert setup_out["result"] == "Passed"
    # The agent fixes the bug and also rewrites a visible test.
    (staged / "calc" / "__init__.py").write_text("def add(a, b):\n    return a + b\n")
    (staged / "tests" / "test_calc.py").write_text("def test_zero():\n    pass\n")
    changes = tmp_path / "changes.json"
    assert cli.main(["capture", f"--workspace={staged}", f"--baseline={baseline}", f"--out={changes}"]) == 0
    capsys.readouterr()
    verify = ["verify", f"--task-file={task_file}", f"--changes={changes}", f"--workspace={image_repo}"]
    assert cli.main([*verify, f"--into={tmp_path / 'verify'}", f"--out={tmp_path / 'out'}"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["reward"] == 1.0
    assert [f["kind"] for f in result["tamperFindings"]] == ["test_file_modified"]
    assert (tmp_path / "verify" / "tests" / "test_calc.py").read_text().endswith("add(0, 0) == 0\n")


def test_cli_setup_fails_closed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("x = 1\n")
    (tmp_path / "into").mkdir()
    (tmp_path / "into" / "stale").write_text("")
    rc = cli.main(["setup", f"--workspace={src}", f"--into={tmp_path / 'into'}", "--baseline=/dev/null"])
    assert rc == cli.EXIT_SANDBOX_ERROR
    assert "is not empty" in capsys.readouterr().err


REWRITES_TESTS = """import os


def add(a, b):
    return a - b


# Imported by the visible tests, collected before the hidden ones: rewrite those while it can.
_hidden = os.path.join(os.path.dirname(__file__), "..", "tests", "test_hidden.py")
try:
    os.chmod(os.path.dirname(_hidden), 0o755)  # undo a read-only tree, where this uid owns it
    os.chmod(_hidden, 0o644)
    with open(_hidden, "w") as fh:
        fh.write("def test_add():\\n    pass\\n")
except OSError:
    pass
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None, reason="runs the phases as sandbox uids (root, bwrap)"
)
def test_verify_pod_phases_keep_the_tree_out_of_the_tests_reach(
    hostile_repo: tuple[Path, str, str], tmp_path: Path
) -> None:
    """The verify pod's two containers: `prepare` builds the tree as one uid and leaves it
    read-only, `run` tests it as another. Code under test that rewrites the hidden tests at import
    wins when its own uid prepared the tree (the control), and cannot when another uid did."""
    source, base, test_patch = hostile_repo
    work = tmp_path / "pod"
    image_repo = work / "testbed"
    git(tmp_path, "clone", "-q", str(source), str(image_repo))
    git(image_repo, "checkout", "-q", base)
    (work / "task.json").write_text(json.dumps(make_task(base, test_patch).to_dict()))
    (work / "changes.json").write_text(
        json.dumps(ch.ChangeSet(files={"calc/__init__.py": REWRITES_TESTS}).to_dict())
    )
    backend = LocalBackend(tmp_path / "backend")
    package = Path(cli.__file__).parent

    def phase(name: str, into: str, out: str, uid: int | None = None) -> dict[str, Any]:
        argv = [
            "python", "-m", "legorl.sandbox.cli", "verify", f"--phase={name}",
            f"--task-file={work / 'task.json'}", f"--changes={work / 'changes.json'}",
            f"--workspace={image_repo}", f"--into={work / into}", f"--out={work / out}",
        ]  # fmt: skip
        if uid is None:  # as root, in this process: the other uid of the pod
            with contextlib.redirect_stdout(io.StringIO()) as printed:
                assert cli.main(argv[3:]) == 0
            return dict(json.loads(printed.getvalue().strip().splitlines()[-1]))
        env = {"PATH": f"{backend.task_env}/bin:/usr/bin:/bin", "PYTHONPATH": "/opt/t", "HOME": "/tmp"}
        binds = [(str(work), str(work), True), (str(package), "/opt/t/legorl/sandbox", False)]
        run = backend.run(argv, uid=uid, binds=binds, cwd=str(work), env=env, timeout=120)
        assert run.returncode == 0, run.output
        return dict(json.loads(run.output.strip().splitlines()[-1]))

    with backend.identity() as uid:
        subprocess.run(["chown", "-R", f"{uid}:{uid}", str(work)], check=True)
        # Control: the tests' own uid prepares and runs; the rewrite lands and the "fix" earns 1.
        assert phase("all", "one/repo", "one/out", uid)["reward"] == 1.0
        # Another uid prepares: the tree is read-only to the tests, which run as written.
        phase("prepare", "two/repo", "two/out")
        (work / "two" / "out").chmod(0o777)  # what the pod's fsGroup does for the shared group
        result = phase("run", "two/repo", "two/out", uid)
    assert result["reward"] == 0.0
    assert result["grade"]["FAIL_TO_PASS"] == {f"{HIDDEN}::test_add": "FAILED"}
    assert (work / "two" / "repo" / HIDDEN).read_text() == HIDDEN_TEST


def test_verify_tree_inside_a_git_checkout_still_gets_its_hidden_tests(
    hostile_repo: tuple[Path, str, str], tmp_path: Path
) -> None:
    """A run folder inside a checkout (`legorl sandbox trial --root .legorl/...`): git must not
    resolve the test patch against the outer repository and skip it."""
    source, base, test_patch = hostile_repo
    pristine = tmp_path / "pristine"
    workspace.checkout_source(source, base, pristine)
    outer = tmp_path / "checkout"
    git(tmp_path, "init", "-q", str(outer))
    tree = stages.prepare_verify(
        pristine, outer / "run" / "repo", make_task(base, test_patch), ch.ChangeSet()
    )
    assert (tree.path / HIDDEN).read_text() == HIDDEN_TEST


def test_termination_message_stays_parseable_when_long() -> None:
    findings = [
        {"kind": "test_file_modified", "path": f"tests/t{i}.py", "detail": "x" * 500} for i in range(40)
    ]
    payload = {"stage": "verify", "reward": 1.0, "grade": {"passed": ["a"] * 500}, "tamperFindings": findings}
    text = cli.termination_message(payload)
    assert len(text.encode()) <= 4000
    parsed = json.loads(text)
    assert parsed["reward"] == 1.0 and parsed["truncated"] is True
    assert parsed["tamperFindingsTotal"] == 40 and 0 < len(parsed["tamperFindings"]) < 40
    short = {"stage": "verify", "reward": 0.0, "tamperFindings": []}
    assert json.loads(cli.termination_message(short)) == short
