"""`legorl train` start-up: the trainer Job may start before the run controller wrote run.json."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml

from legorl.api.store import RunStore
from legorl.trainer.main import _load_run, parser

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-local.yaml"


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
