"""`legorl train` start-up: the trainer Job may start before the run controller wrote run.json."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import yaml

from legorl.api.kinds import RLRun
from legorl.api.launch import TrainerLaunch
from legorl.api.store import RunStore
from legorl.operator.render.common import RenderContext
from legorl.operator.render.run import render_run
from legorl.trainer.main import EXIT_USAGE, _load_run, main, parser

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-local.yaml"


def test_a_pod_waits_for_run_json(tmp_path: Path) -> None:
    store = RunStore(str(tmp_path))
    body = yaml.safe_load(EXAMPLE.read_text())
    timer = threading.Timer(0.5, store.write_run_spec, args=(body,))
    timer.start()
    args = parser().parse_args(["--store", str(tmp_path), "--run", "tiny-local", "--spec-timeout", "30"])
    run = _load_run(args)
    timer.join()
    assert run.metadata.name == "tiny-local"


def test_without_run_json_a_person_is_told_at_once(tmp_path: Path) -> None:
    args = parser().parse_args(["--store", str(tmp_path)])
    with pytest.raises(ValueError, match=r"no run.json yet; pass --spec FILE"):
        _load_run(args)


def test_the_trainer_jobs_command_line_parses_with_torchrun_and_then_legorl() -> None:
    """What the trainer Job's container runs, as the kubelet expands it (`$(VAR)` from the container's env),
    goes through torchrun's own parser and hands the script arguments `legorl train` accepts. torchrun
    refuses any script argument that starts with `--run` (ambiguous with its `--run-path`), which is how
    the first trainer pod on a real node died; the run's name now comes from $LEGORL_RUN."""
    run_module = pytest.importorskip("torch.distributed.run", reason="torch is installed by get-engine.sh")
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    body = next(d for d in docs if d["kind"] == "RLRun")
    body["spec"]["policy"]["checkpoint"]["uri"] = "pvc://models/tiny-swe"
    body["metadata"] = {
        **body["metadata"],
        "namespace": "runs",
        "uid": "00000000-0000-0000-0000-000000000000",
    }
    run = RLRun.model_validate(body)
    (job,) = [o for o in render_run(run, RenderContext(), 8000) if o["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value", "0") for e in container["env"]}  # NODE_RANK: the index, 0
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], arg) for arg in container["command"]]
    assert argv[0] == "torchrun"
    torchrun = run_module.get_args_parser().parse_args(argv[1:])
    assert (torchrun.module, torchrun.training_script) == (True, "legorl.trainer")
    assert (torchrun.nnodes, torchrun.nproc_per_node, torchrun.node_rank) == ("1", "1", 0)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        args = parser().parse_args(torchrun.training_script_args)
    assert args.run == "tiny-local" and args.store == env["LEGORL_STORE_URI"]


def test_the_launch_contract_round_trips_and_refuses_a_bad_port() -> None:
    """What the trainer Job sets is what `legorl train` reads: one encoder, one decoder."""
    launch = TrainerLaunch(
        run="r",
        namespace="ns",
        store_uri="file:///store/ns/r",
        fleet_urls=("dns+http://r-fleet-engine-replicas.ns.svc:8000",),
        weight_sync_address="r-trainer-0.r-trainer",
        weight_sync_port=29600,
    )
    env = {e["name"]: e["value"] for e in launch.env()}
    assert TrainerLaunch.from_env(env) == launch
    assert TrainerLaunch.from_env({}) == TrainerLaunch()
    with pytest.raises(ValueError, match=r"\$LEGORL_WEIGHT_SYNC_PORT='x' is not a port number"):
        TrainerLaunch.from_env({**env, "LEGORL_WEIGHT_SYNC_PORT": "x"})


def test_a_bad_metrics_port_in_the_environment_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LEGORL_METRICS_PORT", "http")
    assert main(["--check"]) == EXIT_USAGE
    assert "$LEGORL_METRICS_PORT='http' is not a port number" in capsys.readouterr().err
