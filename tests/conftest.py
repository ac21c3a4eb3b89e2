"""Shared test fixtures: the repository root, example manifests, the CLI, tool binaries, and one vLLM
server for every test that needs a real engine."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Generator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from legorl.cli.main import main

if TYPE_CHECKING:
    from tests.support.vllm_proxy import Engine

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
        help="also run tests/operator/test_cluster.py against the cluster in $KUBECONFIG (makes a namespace)",
    )


E2E = REPO / "tests" / "e2e"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Everything under tests/e2e/ drives the whole system (a real node, the embedded default): slow by
    # where it lives, so `pytest -m "not slow"` never starts one.
    slow = pytest.mark.slow
    for item in items:
        if item.path.is_relative_to(E2E):
            item.add_marker(slow)
    if config.getoption("--with-cluster"):
        return
    skip = pytest.mark.skip(reason="needs a real cluster: pytest --with-cluster (uses $KUBECONFIG)")
    for item in items:
        if "cluster" in item.keywords:
            item.add_marker(skip)


class _SharedVllm:
    """One vLLM server (`tests.support.vllm_proxy.start_engine`) for consecutive tests that use `vllm_engine`.

    Starting vLLM costs 30-120 s, so the tests of tests/proxy/test_proxy_vllm.py and the harness CLI tests
    (which run one after the other: their modules sort together) share one. It is started by the
    first test that asks for it and stopped as soon as the next test does not, so it does not sit on
    ~3 GB and its threads through the rest of the suite; a later test that asks again gets a new one.
    """

    def __init__(self) -> None:
        self._stack: ExitStack | None = None
        self._engine: Engine | None = None

    def get(self, factory: pytest.TempPathFactory) -> Engine:
        if self._engine is None:
            # Imports the SDKs and the proxy: only in a run that needs the engine.
            from tests.support.vllm_proxy import start_engine  # noqa: PLC0415

            with ExitStack() as stack:
                self._engine = stack.enter_context(start_engine(factory.mktemp("vllm")))
                self._stack = stack.pop_all()
        assert self._engine is not None
        return self._engine

    def close(self) -> None:
        stack, self._stack, self._engine = self._stack, None, None
        if stack is not None:
            stack.close()


_VLLM = _SharedVllm()


@pytest.fixture
def vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """vLLM (CPU, fp32) serving the tiny random Qwen3-MoE behind a recording tap
    (tests/support/vllm_proxy.py),
    shared with the neighbouring tests that use it (see `_SharedVllm`)."""
    return _VLLM.get(tmp_path_factory)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    yield  # the test's own fixtures are torn down first (a proxy in front of the engine included)
    if "vllm_engine" in getattr(item, "fixturenames", ()) and (
        nextitem is None or "vllm_engine" not in getattr(nextitem, "fixturenames", ())
    ):
        _VLLM.close()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _VLLM.close()
