"""Session admission under KV pressure: a new trial's first call waits while the engine is full."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from legorl.proxy.app import ProxyApp
from legorl.proxy.settings import ProxySettings
from legorl.proxy.testing import FakeEngine
from tests.support.asgi_server import serve

CALL = {"model": "m", "messages": [{"role": "user", "content": "SAY: hi"}]}


def test_a_new_session_waits_for_kv_room_and_later_calls_do_not(tmp_path: Path) -> None:
    engine = FakeEngine()
    engine.kv_usage = 0.99
    with serve(engine) as upstream:
        # A follow-up that went through admission again would wait the whole 20 s and count a timeout
        # and a second wait (asserted below): what the test checks is what the proxy did, not how fast
        # this machine answered.
        settings = ProxySettings(
            upstream=upstream,
            journal=tmp_path,
            admission_kv_usage=0.9,
            admission_poll_seconds=0.05,
            admission_max_wait_seconds=20.0,
        )
        app = ProxyApp(settings)
        with serve(app) as url:
            done: list[float] = []

            def first_call() -> None:
                response = httpx.post(f"{url}/v1/chat/completions", json=CALL, timeout=30)
                assert response.status_code == 200
                done.append(time.monotonic())

            worker = threading.Thread(target=first_call)
            worker.start()
            time.sleep(0.5)
            assert not done, "the session was admitted while the KV cache was full"
            assert engine.calls == 0
            released = time.monotonic()
            engine.kv_usage = 0.2
            worker.join(timeout=10)
            assert done and done[0] >= released
            # The session is in: its next call goes ahead even if the cache fills up again.
            engine.kv_usage = 0.99
            follow_up = {
                "model": "m",
                "messages": [*CALL["messages"], {"role": "user", "content": "SAY: more"}],
            }
            assert httpx.post(f"{url}/v1/chat/completions", json=follow_up, timeout=60).status_code == 200
            assert engine.calls == 2
            metrics = httpx.get(f"{url}/metrics").text
    assert "legorl_proxy_admission_wait_seconds_count 1" in metrics
    samples = [line for line in metrics.splitlines() if not line.startswith("#")]
    assert not any(line.startswith("legorl_proxy_admission_timeouts_total") for line in samples)


def test_a_session_that_waited_too_long_is_admitted_and_counted(tmp_path: Path) -> None:
    engine = FakeEngine()
    engine.kv_usage = 1.0
    with serve(engine) as upstream:
        settings = ProxySettings(
            upstream=upstream,
            journal=tmp_path,
            admission_kv_usage=0.9,
            admission_poll_seconds=0.05,
            admission_max_wait_seconds=0.3,
        )
        with serve(ProxyApp(settings)) as url:
            started = time.monotonic()
            assert httpx.post(f"{url}/v1/chat/completions", json=CALL, timeout=30).status_code == 200
            waited = time.monotonic() - started
            metrics = httpx.get(f"{url}/metrics").text
    assert waited >= 0.3
    assert "legorl_proxy_admission_timeouts_total 1" in metrics
