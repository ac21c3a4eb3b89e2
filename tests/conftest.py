"""Shared test fixtures: the repository root, example manifests, the CLI, and tool binaries."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from legorl.cli.main import main

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """Run `legorl ARGS...` in-process; returns (exit code, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(scope="session")
def helm() -> str:
    """The helm binary: $LEGORL_HELM, .cache/tools/bin/helm (scripts/get-helm.sh), or PATH."""
    candidates = [os.environ.get("LEGORL_HELM"), str(REPO / ".cache/tools/bin/helm"), shutil.which("helm")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    pytest.fail("helm not found: run `bash scripts/get-helm.sh .cache/tools` (scripts/test.sh does)")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--with-cluster",
        action="store_true",
        default=False,
        help="also run tests/test_cluster.py against the cluster in $KUBECONFIG (makes a namespace)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--with-cluster"):
        return
    skip = pytest.mark.skip(reason="needs a real cluster: pytest --with-cluster (uses $KUBECONFIG)")
    for item in items:
        if "cluster" in item.keywords:
            item.add_marker(skip)
