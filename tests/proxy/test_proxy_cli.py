"""`legorl proxy`'s command line: the flags the operator renders are the flags the proxy takes."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from legorl.api.kinds import SandboxPool
from legorl.api.run import Harness
from legorl.operator.render.common import RenderContext
from legorl.operator.render.pool import TrialContext, trial_pod
from legorl.proxy.main import add_arguments, settings_from_args
from legorl.proxy.settings import ProxySettings

REPO = Path(__file__).resolve().parents[2]


def parse(argv: list[str]) -> ProxySettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings_from_args(parser.parse_args(argv))


def test_the_trial_pods_proxy_arguments_parse_into_the_settings_they_mean() -> None:
    docs = yaml.safe_load_all((REPO / "examples/shared-fleet-and-pool.yaml").read_text())
    body = next(d for d in docs if d and d["kind"] == "SandboxPool")
    body["metadata"] = {
        "namespace": "default",
        "uid": "00000000-0000-0000-0000-000000000000",
        **body["metadata"],
    }
    pool = SandboxPool.model_validate(body)
    trial = TrialContext(
        run_name="coder-grpo",
        trial_id="t-0001",
        task_image="ghcr.io/example/task:1",
        harness=Harness.model_validate({"kind": "ClaudeCode", "maxTurns": 40}),
        fleet_url="http://coder-fleet-engine.default.svc:8000",
        max_tokens_per_turn=2048,
        temperature="0.7",
        top_p="0.95",
        capture_routed_experts=True,
    )
    pod = trial_pod(pool, trial, RenderContext())
    proxy = next(c for c in pod["spec"]["initContainers"] if c["name"] == "proxy")
    assert proxy["args"][0] == "proxy"
    settings = parse(proxy["args"][1:])
    assert settings.upstream == "http://coder-fleet-engine.default.svc:8000"
    assert (settings.host, settings.port) == ("0.0.0.0", 4000)
    assert settings.journal == Path("/journal")
    assert (settings.run, settings.trial) == ("coder-grpo", "t-0001")
    assert settings.api_format == "AnthropicMessages"
    assert (settings.max_tokens, settings.max_turns) == (2048, 40)
    assert (settings.temperature, settings.top_p) == (0.7, 0.95)
    assert settings.capture_routed_experts is True


def test_every_setting_has_a_flag_and_help() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = parser.format_help()
    for name, field in ProxySettings.model_fields.items():
        assert "--" + name.replace("_", "-") in text
        assert field.description, f"{name} has no docstring"


def test_booleans_and_defaults() -> None:
    settings = parse(["--upstream", "unix:///run/engine.sock", "--journal", "j", "--no-fsync"])
    assert settings.fsync is False
    assert settings.record_bodies is True
    assert settings.upstream == "unix:///run/engine.sock"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--upstream", "ftp://x", "--journal", "j"], "upstream must be an http://"),
        (["--upstream", "http://x", "--journal", "j", "--temperature", "0"], "temperature"),
        (["--upstream", "http://x", "--journal", "j", "--listen", "nope"], "HOST:PORT"),
        (["--upstream", "http://x", "--journal", "j", "--max-turns", "many"], "max_turns"),
    ],
)
def test_invalid_settings_exit_2_with_the_reason(argv: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "legorl.cli", "proxy", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_importing_the_proxy_first_leaves_the_generated_crds_unchanged() -> None:
    # typing caches equal Literals whatever their order: a proxy setting spelled in another order
    # than the API's once reordered the RLRun CRD's enum whenever the proxy was imported first.
    code = (
        "import legorl.proxy.main, legorl.proxy.app\n"
        "from pathlib import Path\n"
        "from legorl.manifests.generated import stale_files\n"
        f"print(stale_files(Path({str(REPO)!r})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
