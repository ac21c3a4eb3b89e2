"""A warm trial pod's gate, for real: the proxy's FIFO, `POST /claim`, and the agent container's
`GATE_SCRIPT` run by /bin/sh as the pod runs it (the FIFO's path moved into a temporary folder)."""

from __future__ import annotations

import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from legorl.operator.render.pool import CLAIM_FIFO, GATE_SCRIPT
from legorl.proxy.app import ProxyApp
from legorl.proxy.settings import ProxySettings
from legorl.proxy.testing import FakeEngine
from legorl.trialproxy.client import ProxyCallError, ProxyClient, ProxyUnreachable
from tests.support.asgi_server import serve


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A proxy with `--claim-fifo` (in front of a fake engine it never calls here): its URL and FIFO."""
    fifo = tmp_path / "claim" / "go"
    fifo.parent.mkdir()
    with serve(FakeEngine()) as engine_url:
        settings = ProxySettings(
            upstream=engine_url, journal=tmp_path / "journal", run="r", trial="t", claim_fifo=str(fifo)
        )
        with serve(ProxyApp(settings)) as url:
            yield url, fifo


def agent(fifo: Path, *command: str) -> subprocess.Popen[str]:
    """The agent container's command: `/bin/sh -c GATE_SCRIPT legorl-gate COMMAND...`."""
    script = GATE_SCRIPT.replace(CLAIM_FIFO, str(fifo))
    assert script != GATE_SCRIPT
    return subprocess.Popen(
        ["/bin/sh", "-c", script, "legorl-gate", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_reader(fifo: Path, proc: subprocess.Popen[str]) -> None:
    """Until the shell has the FIFO open for reading (it blocks in open until a writer comes)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        fds = Path(f"/proc/{proc.pid}/fd")
        if any(os.path.realpath(fd) == str(fifo) for fd in fds.iterdir()) or _opening(proc.pid, fifo):
            return
        time.sleep(0.01)
    raise AssertionError("the gate script never opened the FIFO")


def _opening(pid: int, fifo: Path) -> bool:
    # `sh` blocks inside open(2) on a FIFO with no writer; /proc/PID/syscall then names openat.
    try:
        return Path(f"/proc/{pid}/wchan").read_text() in ("fifo_open", "wait_for_partner")
    except OSError:
        return False


def test_the_proxy_makes_a_fifo_only_it_can_write(gated: tuple[str, Path]) -> None:
    url, fifo = gated
    mode = fifo.stat().st_mode
    assert stat.S_ISFIFO(mode) and stat.S_IMODE(mode) == 0o644
    assert httpx.get(f"{url}/claim").json()["state"] == "waiting"


def test_a_claim_releases_the_waiting_agent_which_becomes_its_command(gated: tuple[str, Path]) -> None:
    url, fifo = gated
    proc = agent(fifo, "/bin/sh", "-c", 'echo "agent started as $0"', "the-harness")
    wait_for_reader(fifo, proc)
    time.sleep(0.2)
    assert proc.poll() is None  # still waiting: nothing opened the gate
    answer = httpx.post(f"{url}/claim")
    assert answer.status_code == 200 and answer.json()["state"] == "released"
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0 and out == "agent started as the-harness\n", err
    # Idempotent: a second claim (a restarted operator's) changes nothing.
    again = httpx.post(f"{url}/claim").json()
    assert again["state"] == "released" and again["releasedAt"] == answer.json()["releasedAt"]


def test_a_claim_before_the_agent_waits_is_pending_until_it_comes(gated: tuple[str, Path]) -> None:
    url, fifo = gated
    answer = httpx.post(f"{url}/claim")
    assert answer.status_code == 202 and answer.json()["state"] == "pending"
    proc = agent(fifo, "/bin/echo", "late agent")
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0 and out == "late agent\n", err
    deadline = time.monotonic() + 5
    while httpx.get(f"{url}/claim").json()["state"] != "released":
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_gate_closed_without_go_runs_nothing(tmp_path: Path) -> None:
    """Whatever else ends the wait (a writer that sends no `go`), the agent's command never runs."""
    fifo = tmp_path / "go"
    os.mkfifo(fifo, 0o644)
    proc = agent(fifo, "/bin/echo", "must not run")
    wait_for_reader(fifo, proc)
    with fifo.open("w") as writer:
        writer.write("nope\n")
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 125 and out == "" and "without a claim" in err


def test_a_proxy_without_a_gate_has_no_claim(tmp_path: Path) -> None:
    with serve(FakeEngine()) as engine_url:
        settings = ProxySettings(upstream=engine_url, journal=tmp_path / "journal", run="r", trial="t")
        with serve(ProxyApp(settings)) as url:
            answer = httpx.post(f"{url}/claim")
    assert answer.status_code == 404 and "not a warm one" in answer.text


def test_the_backends_client_claims_through_the_real_gate(gated: tuple[str, Path], tmp_path: Path) -> None:
    """`ProxyClient.claim` (what the Kubernetes backend calls) against the proxy: pending (202) before the
    agent waits, released (200) once it has; no gate is a refusal; no proxy is `ProxyUnreachable`."""
    url, fifo = gated
    with httpx.Client() as http:
        client = ProxyClient(http, url)
        assert client.claim() is False  # taken; the agent is not at the gate yet
        proc = agent(fifo, "/bin/echo", "released")
        assert proc.communicate(timeout=10)[0] == "released\n"
        deadline = time.monotonic() + 5
        while not client.claim():  # idempotent: once released, every claim says so
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with serve(FakeEngine()) as engine_url:
            settings = ProxySettings(upstream=engine_url, journal=tmp_path / "j2", run="r", trial="u")
            with serve(ProxyApp(settings)) as plain:
                with pytest.raises(ProxyCallError, match="404") as refused:
                    ProxyClient(http, plain).claim()
                assert not isinstance(refused.value, ProxyUnreachable)
        with pytest.raises(ProxyUnreachable):
            ProxyClient(http, "http://127.0.0.1:9").claim(timeout=1.0)
