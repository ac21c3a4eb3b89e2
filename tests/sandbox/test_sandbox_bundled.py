"""The bundled task set builtin://tiny-python: well formed, reproducible, and every task sound.

Soundness is checked the way the verifier scores a task: for every task, clone its bundle, check
out the base commit, apply the hidden tests and run the task's own test command, then read the
JUnit XML. At base every FAIL_TO_PASS test must fail (a real assertion failure, not a collection
error) and every PASS_TO_PASS test pass; with the gold patch all pass; with the wrong patch at
least one FAIL_TO_PASS still fails. Tasks are checked in parallel in one session fixture (each
needs three pytest runs) and reported one test per task, so a failure names its task.
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from legorl.sandbox import bundled
from legorl.sandbox.task import DEFAULT_TEST_COMMAND, Task, TaskSet, load_jsonl

IDS = bundled.instance_ids()
WRONG_PATCH = "legorl_wrong_patch"
# Visible test ids, hidden test ids, FAIL_TO_PASS and PASS_TO_PASS all live under tests/.
HIDDEN_PREFIX = "tests/test_hidden_"


@dataclass(frozen=True)
class Generated:
    manifest: Path
    seconds: float


@pytest.fixture(scope="session")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Generated:
    out = tmp_path_factory.mktemp("tiny-python") / "set"
    start = time.perf_counter()
    manifest = bundled.generate(out)
    return Generated(manifest, time.perf_counter() - start)


@pytest.fixture(scope="session")
def task_set(generated: Generated) -> TaskSet:
    return load_jsonl(generated.manifest)


def _git(cwd: Path, *args: str, stdin: str | None = None) -> str:
    proc = subprocess.run(
        ["git", "-c", "advice.detachedHead=false", *args],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def _diff_files(patch: str) -> set[str]:
    return {line.split(" b/", 1)[1] for line in patch.splitlines() if line.startswith("diff --git ")}


# ------------------------------------------------------------------------------------------------
# The manifest
# ------------------------------------------------------------------------------------------------


def test_manifest_is_well_formed(generated: Generated, task_set: TaskSet) -> None:
    assert len(task_set) >= 32
    assert [t.instance_id for t in task_set] == IDS
    assert len(set(IDS)) == len(IDS)
    assert generated.seconds < 60  # about 2 s on 2 cores; the bound only catches a pathology
    for task in task_set:
        iid = task.instance_id
        assert iid.startswith("tiny-python__")
        assert task.repo.startswith("legorl-tasks/")
        assert task.image == f"ghcr.io/legorl/tasks/tiny-python:{iid}"
        assert task.source == f"repos/{iid}.bundle"
        assert task_set.source_path(task).is_file()
        assert task.workspace_dir == "/testbed"
        assert task.version == "1.0"
        assert task.test_command == DEFAULT_TEST_COMMAND
        assert task.problem_statement.strip()
        # Round trip through the manifest row.
        assert Task.from_dict(task.to_dict()) == task
        # One hidden file, holding every FAIL_TO_PASS test; the patches touch sources only.
        (hidden,) = task.hidden_test_files
        assert hidden.startswith(HIDDEN_PREFIX)
        assert all(t.startswith(f"{hidden}::") for t in task.fail_to_pass)
        assert not set(task.fail_to_pass) & set(task.pass_to_pass)
        wrong = task.extra[WRONG_PATCH]
        assert isinstance(wrong, str)
        assert wrong != task.patch
        sources = _diff_files(task.patch)
        assert sources
        assert _diff_files(wrong) <= sources
        assert not any(f.startswith("tests/") for f in sources)
        assert hidden not in task.problem_statement


def test_every_template_file_is_in_the_set_once() -> None:
    # A package file that set.toml does not name would be silently left out of the set.
    folder = Path(bundled.__file__).with_name(bundled.TEMPLATES)
    listed = tomllib.loads((folder / "set.toml").read_text(encoding="utf-8"))["packages"]
    assert len(set(listed)) == len(listed)
    assert sorted(listed) == sorted(p.stem for p in folder.glob("*.toml") if p.name != "set.toml")
    assert [bug.package.name for bug in bundled.bugs()] == sorted(
        (bug.package.name for bug in bundled.bugs()), key=listed.index
    )


def test_bugs_are_varied(task_set: TaskSet) -> None:
    kinds = {t.extra["legorl_bug_kind"] for t in task_set}
    packages = {t.repo for t in task_set}
    assert len(kinds) >= 16
    assert len(packages) >= 16


def test_generation_is_reproducible_and_replaces_a_stale_set(generated: Generated, tmp_path: Path) -> None:
    # A set of an older generator version is in the way: it is replaced, not reused.
    second = tmp_path / "set"
    (second / "repos").mkdir(parents=True)
    (second / "repos" / "old.bundle").write_bytes(b"stale")
    (second / "tasks.jsonl").write_text("{}\n")
    (second / "VERSION").write_text("0\n")

    manifest = bundled.generate(second)

    first = generated.manifest.parent
    assert manifest.read_bytes() == generated.manifest.read_bytes()
    assert (second / "VERSION").read_text().strip() == bundled.GENERATOR_VERSION
    names = sorted(p.name for p in (first / "repos").iterdir())
    assert sorted(p.name for p in (second / "repos").iterdir()) == names
    # With pack.threads=1 git writes byte-identical bundles, so the whole set is reproducible.
    for name in names:
        assert (second / "repos" / name).read_bytes() == (first / "repos" / name).read_bytes(), name
    # Nothing is left behind: no staging or stale folders next to the set.
    assert [p.name for p in tmp_path.iterdir()] == ["set"]


def test_generate_is_idempotent(generated: Generated) -> None:
    bundle = next((generated.manifest.parent / "repos").iterdir())
    before = (generated.manifest.stat().st_mtime_ns, bundle.stat().st_mtime_ns)
    assert bundled.generate(generated.manifest.parent) == generated.manifest
    assert (generated.manifest.stat().st_mtime_ns, bundle.stat().st_mtime_ns) == before


def test_generate_refuses_to_replace_other_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"notes\.txt"):
        bundled.generate(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_builtin_task_set_lives_in_the_cache(
    generated: Generated, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A copy of the session's set where the cache expects it: found, not regenerated.
    cache = tmp_path / "cache"
    where = cache / "tasks" / f"tiny-python-{bundled.GENERATOR_VERSION}"
    shutil.copytree(generated.manifest.parent, where)
    stamp = (where / "tasks.jsonl").stat().st_mtime_ns

    monkeypatch.setenv("LEGORL_CACHE_DIR", str(cache))
    assert bundled.builtin_task_set() == where / "tasks.jsonl"
    assert bundled.builtin_task_set(cache) == where / "tasks.jsonl"
    assert (where / "tasks.jsonl").stat().st_mtime_ns == stamp

    monkeypatch.delenv("LEGORL_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert bundled.default_cache_dir() == tmp_path / "home" / ".cache" / "legorl"


def test_command_line_prints_the_manifest(generated: Generated, tmp_path: Path) -> None:
    run = [sys.executable, "-m", "legorl.sandbox.bundled"]
    proc = subprocess.run([*run, str(generated.manifest.parent)], capture_output=True, text=True, check=False)
    assert (proc.returncode, proc.stdout) == (0, f"{generated.manifest}\n"), proc.stderr
    (tmp_path / "notes.txt").write_text("mine")
    proc = subprocess.run([*run, str(tmp_path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 1
    assert "refusing to replace" in proc.stderr


# ------------------------------------------------------------------------------------------------
# Every task is sound
# ------------------------------------------------------------------------------------------------


@dataclass
class Verdict:
    heads: dict[str, str] = field(default_factory=dict)
    tag_commit: str = ""
    tag_descends_from_base: bool = False
    hidden_at_base: list[str] = field(default_factory=list)
    hidden_at_tag: list[str] = field(default_factory=list)
    gold_matches_tag: bool = False
    runs: dict[str, dict[str, str]] = field(default_factory=dict)
    """variant (base, gold, wrong) -> test id -> passed / failed / error / skipped."""
    logs: dict[str, str] = field(default_factory=dict)


_SEVERITY = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def parse_junit(path: Path) -> dict[str, str]:
    """Outcome by pytest id from xunit1 JUnit XML (its `file` attribute gives the path)."""
    outcomes: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("file", "")
        classname = case.get("classname", "")
        module = file.removesuffix(".py").replace("/", ".")
        cls = classname[len(module) + 1 :] if file and classname.startswith(f"{module}.") else ""
        test_id = "::".join(part for part in (file, cls, case.get("name", "")) if part)
        outcome = "passed"
        for child in case:
            tag = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(child.tag)
            if tag and _SEVERITY[tag] > _SEVERITY[outcome]:
                outcome = tag
        # A test can appear twice (a failing call and an erroring teardown): keep the worst.
        if _SEVERITY[outcome] >= _SEVERITY[outcomes.get(test_id, "passed")]:
            outcomes[test_id] = outcome
    return outcomes


def _test_argv(task: Task, junit: Path) -> list[str]:
    """The task's test command as an argument list, `python` still first."""
    command = task.test_command.format(
        junit=shlex.quote(str(junit)), tests=" ".join(shlex.quote(f) for f in task.test_files)
    )
    return shlex.split(command)


def _test_env() -> dict[str, str]:
    # Plugin autoload off: this venv's plugins (hypothesis, pytest-asyncio, kmock) take seconds to
    # import per run and are nothing a task image carries; the tiny repositories need none.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return env | {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def run_command(task: Task, repo: Path, junit: Path) -> str:
    """Run the task's test command exactly as the verifier does (this interpreter as `python`)."""
    argv = _test_argv(task, junit)
    assert argv[0] == "python"
    proc = subprocess.run(
        [sys.executable, *argv[1:]],
        cwd=repo,
        env=_test_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return proc.stdout[-4000:] + proc.stderr[-2000:]


# A fresh `python -m pytest` costs 0.5-1 s of CPU to import pytest, and the set needs three runs per
# task. The driver imports pytest once and forks a child per run, which then does what
# `python -m pytest ARGS` does: cwd and sys.path[0] are the repository, plugin autoload as in
# _test_env, and a fresh process state (nothing of one run survives into the next; only a warm-up
# session on a throwaway test ran before the fork). A SIGALRM ends a run that hangs.
# test_driver_matches_the_real_command checks that the driver agrees with the real command.
_DRIVER = r"""
import contextlib, io, json, os, signal, sys, tempfile, traceback
import pytest
# Warm up: one session on a throwaway test imports what every run needs (plugins, junitxml, ...).
with tempfile.TemporaryDirectory() as tmp:
    with open(os.path.join(tmp, "test_legorl_driver_warmup.py"), "w") as fh:
        fh.write("def test_warmup():\n    assert True\n")
    with contextlib.redirect_stdout(io.StringIO()):
        args = ["-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1", f"--junitxml={tmp}/j.xml"]
        pytest.main([*args, tmp])
sys.stdout.reconfigure(line_buffering=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            signal.alarm(120)
            os.chdir(job["cwd"])
            sys.path.insert(0, job["cwd"])
            sys.argv = [pytest.__file__, *job["args"]]
            code = int(pytest.main(job["args"]))
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)))
"""


class Driver:
    """One warm pytest driver process (used by one thread at a time)."""

    def __init__(self, cwd: Path) -> None:
        # Started outside this checkout, so nothing in it can shadow what the driver imports.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _DRIVER],
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_test_env(),
            text=True,
        )

    def run(self, task: Task, repo: Path, junit: Path) -> str:
        argv = _test_argv(task, junit)
        assert argv[:3] == ["python", "-m", "pytest"], argv
        log = junit.with_suffix(".log")
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"cwd": str(repo), "args": argv[3:], "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        status = self.proc.stdout.readline()
        assert status, "the pytest driver died"
        return log.read_text(encoding="utf-8", errors="replace")[-6000:]

    def close(self) -> None:
        with self.proc:  # closes the pipes (end of input: the driver exits) and waits
            pass


Runner = Callable[[Task, Path, Path], str]


def examine(task: Task, bundle: Path, work: Path, run: Runner) -> Verdict:
    verdict = Verdict()
    for line in _git(work, "bundle", "list-heads", str(bundle)).splitlines():
        sha, ref = line.split(" ", 1)
        verdict.heads[ref] = sha
    clone = work / "clone"
    _git(work, "clone", "-q", str(bundle), str(clone))
    _git(clone, "checkout", "-q", "--detach", task.base_commit)
    verdict.tag_commit = _git(clone, "rev-parse", f"{bundled.FIX_TAG}^{{commit}}").strip()
    ancestry = ["git", "merge-base", "--is-ancestor", task.base_commit, verdict.tag_commit]
    verdict.tag_descends_from_base = (
        verdict.tag_commit != task.base_commit
        and subprocess.run(ancestry, cwd=clone, check=False).returncode == 0
    )
    verdict.hidden_at_base = [f for f in task.hidden_test_files if (clone / f).exists()]
    tag_files = set(_git(clone, "ls-tree", "-r", "--name-only", bundled.FIX_TAG).splitlines())
    verdict.hidden_at_tag = [f for f in task.hidden_test_files if f in tag_files]

    wrong = task.extra[WRONG_PATCH]
    assert isinstance(wrong, str)
    variants = {
        "base": [task.test_patch],
        "gold": [task.test_patch, task.patch],
        "wrong": [task.test_patch, wrong],
    }
    for variant, patches in variants.items():
        tree = work / variant
        shutil.copytree(clone, tree, ignore=shutil.ignore_patterns(".git"))
        for patch in patches:
            # Outside any repository (the ceiling stops the search), `git apply` patches files.
            subprocess.run(
                ["git", "apply", "-"],
                cwd=tree,
                input=patch,
                text=True,
                env={**os.environ, "GIT_CEILING_DIRECTORIES": str(work)},
                check=True,
                capture_output=True,
            )
        if variant == "gold":
            # The gold fix is exactly what the future history holds (what a cheater would find).
            verdict.gold_matches_tag = all(
                (tree / f).read_text(encoding="utf-8") == _git(clone, "show", f"{bundled.FIX_TAG}:{f}")
                for f in _diff_files(task.patch)
            )
        junit = work / f"{variant}.xml"
        verdict.logs[variant] = run(task, tree, junit)
        if not junit.is_file():
            raise AssertionError(f"pytest wrote no JUnit XML for {variant}:\n{verdict.logs[variant]}")
        verdict.runs[variant] = parse_junit(junit)
    return verdict


def test_driver_matches_the_real_command(task_set: TaskSet, tmp_path: Path) -> None:
    # The soundness checks below run through the warm driver; on a few tasks, the task's real test
    # command (a fresh `python -m pytest` process) must give the same outcomes.
    driver = Driver(tmp_path)
    try:
        for task in [task_set.tasks[0], task_set.get("tiny-python__events-001")]:
            work = tmp_path / task.instance_id
            (work / "real").mkdir(parents=True)
            (work / "warm").mkdir()
            real = examine(task, task_set.source_path(task), work / "real", run_command)
            warm = examine(task, task_set.source_path(task), work / "warm", driver.run)
            assert real.runs == warm.runs
            assert set(real.runs["base"].values()) == {"passed", "failed"}
    finally:
        driver.close()


@pytest.fixture(scope="session")
def verdicts(
    request: pytest.FixtureRequest, task_set: TaskSet, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Verdict | str]:
    """Examine every selected task once, in parallel; a task whose examination broke maps to the
    traceback, so only its own test fails."""
    selected: set[str] = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)  # parametrized items only
        if callspec is not None and "instance_id" in callspec.params:
            selected.add(callspec.params["instance_id"])
    root = tmp_path_factory.mktemp("verdicts")

    workers = max(2, os.cpu_count() or 2)
    drivers: queue.Queue[Driver] = queue.Queue()

    def one(task: Task) -> Verdict | str:
        work = root / task.instance_id
        work.mkdir()
        driver = drivers.get()
        try:
            return examine(task, task_set.source_path(task), work, driver.run)
        except Exception:  # noqa: BLE001 - reported by this task's own test, not the whole session
            return traceback.format_exc()
        finally:
            drivers.put(driver)

    tasks = [t for t in task_set if t.instance_id in selected]
    for _ in range(workers):
        drivers.put(Driver(root))
    try:
        # A worker per core: each mostly waits on its driver's forked pytest run.
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return dict(zip([t.instance_id for t in tasks], pool.map(one, tasks), strict=True))
    finally:
        while not drivers.empty():
            drivers.get().close()


@pytest.mark.slow  # every bundled task built and graded, before and after its fix
@pytest.mark.parametrize("instance_id", IDS)
def test_task_is_sound(instance_id: str, task_set: TaskSet, verdicts: dict[str, Verdict | str]) -> None:
    task = task_set.get(instance_id)
    verdict = verdicts[instance_id]
    if isinstance(verdict, str):
        pytest.fail(f"examining the task failed:\n{verdict}")

    # History: base on main, the fix in the future (branch and tag), the hidden tests only there.
    assert set(verdict.heads) == {"HEAD", "refs/heads/main", "refs/heads/fix", "refs/tags/v1.0.1"}
    assert verdict.heads["refs/heads/main"] == verdict.heads["HEAD"] == task.base_commit
    assert verdict.tag_descends_from_base
    assert verdict.hidden_at_base == []
    assert verdict.hidden_at_tag == list(task.hidden_test_files)
    assert verdict.gold_matches_tag

    base, gold, wrong = verdict.runs["base"], verdict.runs["gold"], verdict.runs["wrong"]
    # Every test the command runs is accounted for, and nothing else is expected.
    assert set(gold) == {*task.fail_to_pass, *task.pass_to_pass}, verdict.logs["gold"]
    not_failing = {t: base.get(t, "missing") for t in task.fail_to_pass if base.get(t) != "failed"}
    assert not not_failing, f"FAIL_TO_PASS must fail at base: {not_failing}\n{verdict.logs['base']}"
    not_passing = {t: base.get(t, "missing") for t in task.pass_to_pass if base.get(t) != "passed"}
    assert not not_passing, f"PASS_TO_PASS must pass at base: {not_passing}\n{verdict.logs['base']}"
    not_passing = {t: o for t, o in gold.items() if o != "passed"}
    assert not not_passing, f"everything must pass with the gold patch: {not_passing}\n{verdict.logs['gold']}"
    still_failing = [t for t in task.fail_to_pass if wrong.get(t) == "failed"]
    assert still_failing, f"the wrong patch must leave a FAIL_TO_PASS failing\n{verdict.logs['wrong']}"
