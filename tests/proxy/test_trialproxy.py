"""A trial's proxy as the trial backends see it: its one command line and its one client's errors."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from legorl.api.kinds import RLRun
from legorl.api.termination import TerminationReason
from legorl.proxy.main import add_arguments, settings_from_args
from legorl.proxy.settings import ProxySettings
from legorl.trialproxy.client import ProxyCallError, ProxyClient
from legorl.trialproxy.command import ProxyTrial, proxy_command

REPO = Path(__file__).resolve().parents[2]


def parse(args: list[str]) -> ProxySettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings_from_args(parser.parse_args(args))


def example_run() -> RLRun:
    docs = yaml.safe_load_all((REPO / "examples/shared-fleet-and-pool.yaml").read_text())
    body = next(d for d in docs if d and d["kind"] == "RLRun")
    return RLRun.model_validate(body)


def test_the_local_proxy_gets_the_runs_sampling_and_budgets_on_a_unix_socket(tmp_path: Path) -> None:
    run = example_run()
    command = proxy_command(
        run,
        ProxyTrial(
            trial="t-0001",
            upstream="http://127.0.0.1:8000",
            journal=str(tmp_path / "journal"),
            unix_socket=str(tmp_path / "proxy.sock"),
            capture_routed_experts=True,
        ),
    )
    assert command.args[0] == "proxy" and command.env == {}
    settings = parse(command.args[1:])
    sampling = run.spec.algorithm.sampling
    assert settings.unix_socket == str(tmp_path / "proxy.sock")
    assert (settings.run, settings.trial) == (run.metadata.name, "t-0001")
    assert settings.journal == tmp_path / "journal"
    assert (settings.max_tokens, settings.max_turns) == (
        sampling.max_tokens_per_turn,
        run.spec.harness.max_turns,
    )
    assert (settings.temperature, settings.top_p) == (float(sampling.temperature), float(sampling.top_p))
    assert settings.capture_routed_experts is True
    assert (settings.workspace, settings.baseline) == (None, None)


def test_a_proxy_listens_on_exactly_one_of_an_address_or_a_socket() -> None:
    both = ProxyTrial(
        trial="t", upstream="http://e:8000", journal="/j", listen="0.0.0.0:4000", unix_socket="/s"
    )
    with pytest.raises(ValueError, match="exactly one"):
        proxy_command(example_run(), both)
    with pytest.raises(ValueError, match="exactly one"):
        proxy_command(example_run(), ProxyTrial(trial="t", upstream="http://e:8000", journal="/j"))


def client_of(handler: Callable[[httpx.Request], httpx.Response], **kwargs: Any) -> ProxyClient:
    return ProxyClient(
        httpx.Client(transport=httpx.MockTransport(handler)), "http://proxy", sleep=lambda _: None, **kwargs
    )


SUMMARY: dict[str, Any] = {
    "run": "r",
    "trial": "t",
    "state": "running",
    "end": None,
    "turns": 0,
    "segments": [],
}


def test_a_proxy_that_fails_for_a_moment_is_asked_again() -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:
            raise httpx.ConnectError("refused", request=request)
        if len(calls) == 2:
            return httpx.Response(503, text="busy")
        return httpx.Response(200, json=SUMMARY)

    assert client_of(handler).trajectory().state == "running"
    assert calls == ["/trajectory"] * 3


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (httpx.Response(503, text="busy"), r"did not answer GET /trajectory \(HTTP 503: busy\)"),
        (httpx.Response(404, text="no"), r"refused GET /trajectory: HTTP 404: no"),
        (httpx.Response(200, text="<html>"), r"/trajectory is not JSON"),
        (httpx.Response(200, json=[SUMMARY]), r"/trajectory is not a JSON object"),
        (
            httpx.Response(200, json={**SUMMARY, "turns": -1}),
            r"/trajectory breaks the trajectory contract: the trajectory is malformed: turns: ",
        ),
    ],
)
def test_a_proxy_that_answers_nothing_useful_is_a_clear_proxy_error(
    answer: httpx.Response, message: str
) -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return answer

    with pytest.raises(ProxyCallError, match=message):
        client_of(handler, attempts=2).trajectory()
    assert calls == (2 if answer.status_code >= 500 else 1)  # only a 5xx is worth another try


def test_finish_sends_the_harness_exit_and_reads_the_end_state() -> None:
    sent: list[bytes] = []
    end = {"reason": "turn_limit", "source": "proxy", "detail": "budget", "exitCode": None}
    end["endedAt"] = "2026-12-01T00:00:00+00:00"

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.content)
        return httpx.Response(200, json={**SUMMARY, "state": "ended", "end": end, "segments": 0})

    summary = client_of(handler).finish(TerminationReason.AGENT_ERROR, 1, "harness exit code 1")
    assert sent == [b'{"reason":"agent_error","exitCode":1,"detail":"harness exit code 1"}']
    assert summary.end is not None and summary.end.reason is TerminationReason.TURN_LIMIT
    assert summary.end.to_json() == end


def test_metrics_are_tried_once_and_never_fail_a_trial() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ConnectError("refused", request=request)

    assert client_of(handler).metrics() is None
    assert calls == 1
