"""`legorl run` end to end on this machine, and resume after a kill mid-step.

Everything is real: vLLM's CPU build serving `builtin://tiny-moe`, one `legorl proxy` per trial,
mini-swe-agent (PyPI) in bubblewrap sandboxes on the bundled tasks, verify in fresh sandboxes,
megatron-core training on CPU, weight sync into the running vLLM. The policy is random (its rewards are
all 0), so the run keeps zero-variance groups in the loss (`filter.zeroVarianceGroups: Keep`) to make every
step a real Megatron step with fidelity figures; the learning result lives in the README's quick start.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from legorl.api.store import RunStore
from legorl.api.termination import INFRA_REASONS
from legorl.manifests.generated import to_yaml

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("bwrap") is None, reason="needs bubblewrap (scripts/get-sandbox-tools.sh)"
    ),
]

MANIFEST = {
    "apiVersion": "legorl.dev/v1alpha1",
    "kind": "RLRun",
    "metadata": {"name": "e2e"},
    "spec": {
        "policy": {"checkpoint": {"uri": "builtin://tiny-moe"}},
        "fleet": {
            "replicas": 1,
            "parallelism": {"gpusPerNode": 0},
            "settings": {
                "dtype": "float32",
                "routedExpertsCapture": "Disabled",
                "toolCallParser": "hermes",
                "maxModelLen": 2048,
            },
        },
        "pool": {
            "source": {"taskSet": {"uri": "builtin://tiny-python"}},
            "deadlines": {"agentSeconds": 240, "verifySeconds": 120},
        },
        "harness": {"kind": "MiniSweAgent", "maxTurns": 2},
        "tasks": {
            "source": {"uri": "builtin://tiny-python"},
            "split": {"heldOutTaskIds": ["tiny-python__intervals-001"]},
            "seed": 1,
        },
        "algorithm": {
            "name": "GRPO",
            "groupSize": 2,
            "tasksPerStep": 2,
            "learningRate": "1e-4",
            "sampling": {"maxTokensPerTurn": 32},
        },
        "filter": {"zeroVarianceGroups": "Keep"},
        "schedule": {"mode": "Sync", "maxConcurrentTrials": 2},
        "trainer": {"parallelism": {"gpusPerNode": 0}, "dtype": "float32", "routingReplay": "Auto"},
        "stop": {"maxSteps": 2},
        "evaluation": {"intervalSteps": 2, "trialsPerTask": 1},
    },
}


def _start(manifest: Path, root: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "legorl.cli",
                "run",
                str(manifest),
                "--dir",
                str(root),
                "--log-level",
                "INFO",
                "--ui-port",
                "0",
                "--metrics-port",
                "0",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def test_run_trains_syncs_and_resumes_after_a_kill(tmp_path: Path) -> None:
    manifest = tmp_path / "run.yaml"
    manifest.write_text(to_yaml(MANIFEST))
    root = tmp_path / "run"
    log = tmp_path / "run.log"
    store = RunStore(str(root / "store"))

    # 1. Run until step 2 has a finished trial, then kill everything without warning.
    proc = _start(manifest, root, log)
    deadline = time.monotonic() + 900
    try:
        while not store.saved_trials("train", 2) if (root / "store").exists() else True:
            assert proc.poll() is None, log.read_text()[-5000:]
            assert time.monotonic() < deadline, log.read_text()[-5000:]
            time.sleep(1)
        # The live UI serves this run while it runs.
        found = re.search(r"UI: (http://127\.0\.0\.1:\d+/)", log.read_text())
        assert found, log.read_text()[-3000:]
        runs = httpx.get(found.group(1) + "api/runs", timeout=30).json()
        assert "e2e" in json.dumps(runs), runs
        # ... and so do its Prometheus metrics.
        port = re.search(r"metrics: http://127\.0\.0\.1:(\d+)/metrics", log.read_text())
        assert port, log.read_text()[-3000:]
        exposition = httpx.get(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=30).text
        assert 'legorl_run_step{namespace="",run="e2e"}' in exposition, exposition[:2000]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    before = {r.trial: r for r in store.saved_trials("train", 2)}
    assert store.committed_steps() == [1]
    assert store.published_versions() == ["v1"]
    assert len(before) < 4, "the kill was meant to land mid-step"
    time.sleep(2)  # children die with their parent (PR_SET_PDEATHSIG, bwrap --die-with-parent)
    leftovers = subprocess.run(
        ["pgrep", "-f", "legorl.cli proxy .*--run=e2e"], check=False, capture_output=True, text=True
    )
    assert not leftovers.stdout.strip(), f"proxies outlived the killed run: {leftovers.stdout}"

    # 2. The same command resumes and finishes.
    proc = _start(manifest, root, log)
    try:
        code = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 0, text[-6000:]
    assert "Succeeded (MaxSteps)" in text, text[-3000:]
    assert "trainer resumed at step 1" in text, text[-3000:]

    # The store is consistent: both steps committed, trained, published and synced.
    assert store.committed_steps() == [1, 2]
    assert store.published_versions() == ["v1", "v2"]
    trainer_state = store.read_trainer_state()
    assert trainer_state is not None and trainer_state["step"] == 2
    after = {r.trial: r for r in store.saved_trials("train", 2)}
    for trial, record in before.items():  # finished before the kill: kept, not run again
        assert after[trial].started_at == record.started_at
    metrics = {m["step"]: m for m in store.read_metrics()}
    for step in (1, 2):
        batch = store.read_batch(step)
        assert len(batch.trials) == 4
        assert not [t for t in batch.trials if t.termination_reason in INFRA_REASONS], [
            (t.trial, t.termination_reason, t.error) for t in batch.trials
        ]
        for record in batch.trials:
            assert record.reward is not None  # scored in a verify sandbox
            assert record.segments and record.num_turns >= 1  # journaled by the proxy
            assert record.stage_seconds["verify"] > 0
            assert record.tool_call_turns is not None  # the engine's finish reasons, via the proxy
        # (The random policy writes no call vLLM's parser recognises: the counts are 0 here; the UI
        # fixture, recorded with the warm-started policy, has them — tests/ui/test_ui_api.py.)
        # The trainer recorded its log-prob of each trained token (the trajectory viewer's colouring).
        trained = [store.read_token_logprobs(step, t.trial) for t in batch.trials]
        assert any(trained), f"no per-token training log-probs for step {step}"
        # Trials of step s ran on v(s-1): the engine served the synced weights (the proxy read the
        # version from vLLM's /weight_info).
        assert {v for t in batch.trials for v in t.policy_versions} == {f"v{step - 1}"}
        m = metrics[step]
        assert m.get("skipped") is None, m
        assert m["fidelity_pearson"] > 0.999, m  # fp32 engine vs fp32 trainer, same tokens
        assert m["sync_seconds"] > 0
    evals = store.read_evals()
    assert [e["step"] for e in evals] == [0, 2]
    assert all(e["trials"] == 1 and e["infra_failures"] == 0 for e in evals)
    state = store.read_controller_state()
    assert state is not None and state["step"] == 2 and state["trials_total"] == 8


def test_canary_runs_one_trial_and_checks_parity(tmp_path: Path) -> None:
    manifest = tmp_path / "run.yaml"
    manifest.write_text(to_yaml(MANIFEST))
    root = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "legorl.cli", "run", str(manifest), "--dir", str(root), "--canary"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    text = out.stdout + out.stderr
    # The random tiny policy fails its task, but every part of the machinery works: a warning (no
    # routing on vLLM's CPU build), no failure.
    assert out.returncode == 0, text[-4000:]
    assert "canary of run e2e: Warning" in text, text[-3000:]
    report = json.loads((root / "store" / "validation" / "latest.json").read_text())
    checks = {c["check"]: c for c in report["checks"]}
    assert [checks[c]["result"] for c in ("preflight", "trial", "token-parity", "routing-parity")] == [
        "Passed",
        "Passed",
        "Passed",
        "Warning",
    ], checks
    assert checks["trial"]["figures"]["termination_reason"] == "completed"
    assert checks["token-parity"]["figures"]["pearson"] > 0.999
    assert checks["token-parity"]["figures"]["tokens"] > 0
    store = RunStore(str(root / "store"))
    assert store.committed_steps() == [] and store.saved_steps("train") == []  # nothing trained on
