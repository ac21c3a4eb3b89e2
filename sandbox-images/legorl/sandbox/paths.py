"""Which repository paths are tests or test-runner hooks: the agent may not change them."""

from __future__ import annotations

import fnmatch
import functools
import importlib.metadata
import sys
from pathlib import PurePosixPath

TEST_DIRS = frozenset({"test", "tests", "testing"})
TEST_FILES = ("test_*.py", "*_test.py", "tests.py")

# Files whose change alters how tests are collected or run, not what the code under test does.
HOOK_FILES = frozenset(
    {
        "conftest.py",
        "sitecustomize.py",
        "usercustomize.py",
        "pytest.ini",
        ".pytest.ini",
        "pytest.toml",
        ".pytest.toml",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "setup.py",
        "noxfile.py",
        "Makefile",
        ".gitlab-ci.yml",
        ".travis.yml",
        "azure-pipelines.yml",
        "Jenkinsfile",
        ".coveragerc",
    }
)
HOOK_PATTERNS = ("*.pth", "pytest_*.py", "*_pytest_plugin.py")
HOOK_DIRS = frozenset({".github", ".circleci", ".pytest_cache", "__pycache__"})
HOOK_DIR_SUFFIXES = (".egg-info", ".dist-info")  # entry_points.txt registers pytest plugins

# Top-level names the verifier imports before the code under test: a repository module with one of
# these names would replace the test runner itself (`python -m pytest` puts the repo first on sys.path).
RUNNER_MODULES = frozenset({"pytest", "_pytest", "pluggy", "iniconfig", "py", "packaging"})


def is_test_path(path: str, hidden: frozenset[str] = frozenset()) -> bool:
    """A test file or anything under a test folder (pytest's and unittest's conventions)."""
    if path in hidden:
        return True
    p = PurePosixPath(path)
    if any(part in TEST_DIRS for part in p.parts[:-1]):
        return True
    return any(fnmatch.fnmatchcase(p.name, pat) for pat in TEST_FILES)


@functools.cache
def installed_plugin_modules() -> frozenset[str]:
    """Top-level modules of the pytest plugins this interpreter would load (entry points
    `pytest11`): a repository module of the same name would be loaded in their place. Read once
    per process (scanning every distribution's metadata costs ~30 ms; verify runs per trial)."""
    names: set[str] = set()
    for entry in importlib.metadata.entry_points(group="pytest11"):
        names.add(entry.value.split(":", 1)[0].split(".", 1)[0])
    return frozenset(names)


def hook_reason(
    path: str, existing_tops: frozenset[str] = frozenset(), runner_modules: frozenset[str] = frozenset()
) -> str | None:
    """Why changing `path` could change how tests run (None when it cannot).

    `existing_tops` are the top-level names of the pristine repository: a package the project
    already has is never flagged for shadowing, only one the agent creates. `runner_modules` adds
    the verifying interpreter's pytest plugins (`installed_plugin_modules()`)."""
    p = PurePosixPath(path)
    for part in p.parts[:-1]:
        if part in HOOK_DIRS:
            return f"{part}/ holds CI or test-runner state"
        if part.endswith(HOOK_DIR_SUFFIXES):
            return f"{part}/ is package metadata (entry points can register pytest plugins)"
    if p.name in HOOK_FILES:
        return f"{p.name} configures the test runner, the package or CI"
    for pattern in HOOK_PATTERNS:
        if fnmatch.fnmatchcase(p.name, pattern):
            return f"{p.name} matches {pattern} (loaded by the interpreter or pytest)"
    top = p.parts[0]
    if top in existing_tops:
        return None
    module = top[:-3] if top.endswith(".py") and len(p.parts) == 1 else top
    if module in RUNNER_MODULES or module in runner_modules or module in sys.stdlib_module_names:
        return f"{top} would shadow the module {module!r} the test runner imports"
    return None
