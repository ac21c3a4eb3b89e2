"""One RL step against a real vLLM (CPU build): vLLM rollouts → trainer step → published weights → sync.

After the step, vLLM's log-probs on a fixed prompt match the trainer's NEW log-probs (Pearson ≥ 0.999,
fp32) and differ from the old ones, and the engine reports policy version v1. The rollouts are real
vLLM samples with vLLM's own behaviour log-probs, so the step's fidelity figure is the real
engine-vs-trainer agreement (no routing replay: vLLM's CPU build cannot capture routed experts).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from legorl.api.store import RunStore
from legorl.api.trajectory import TrialRecord
from legorl.trainer.models.tiny import make_tiny_model
from legorl.trainer.settings import TrainerSettings
from tests.support.engine import SERVED_MODEL_NAME, VllmServer

pytestmark = [pytest.mark.slow]

PROMPTS = [[11, 42, 7, 300, 25], [5, 900, 17, 3]]
GROUP = 6
FIXED = [77, 1500, 12, 640, 19, 2048, 5, 3000, 4, 250, 11, 42, 7, 300, 25, 5, 900, 17]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[VllmServer]:
    extra = [
        "--weight-transfer-config",
        '{"backend":"legorl_filesystem"}',
        "--worker-extension-cls",
        "legorl.trainer.engine.plugin.FilesystemWeightTransfer",
    ]
    with VllmServer(tiny, max_model_len=1024, extra_args=extra) as running:
        yield running


def trainer_settings(tmp_path: Path, tiny: Path, server: VllmServer, **given: Any) -> TrainerSettings:
    """The trainer of these tests: the tiny model, its store under TMP_PATH, the one engine."""
    return TrainerSettings(
        run="e2e",
        store_uri=str(tmp_path / "store"),
        checkpoint_dir=tiny,
        fleet_urls=(server.url,),
        device="cpu",
        learning_rate=3e-3,
        **given,
    )


def rollouts(http: httpx.Client) -> list[TrialRecord]:
    from legorl.trainer.sampling import Sample, to_trial  # noqa: PLC0415

    trials = []
    for i, prompt in enumerate([p for p in PROMPTS for _ in range(GROUP)]):
        response = http.post(
            "/v1/completions",
            json={
                "model": SERVED_MODEL_NAME,
                "prompt": prompt,
                "max_tokens": 12,
                "min_tokens": 12,
                "temperature": 1.0,
                "logprobs": 0,
                "return_token_ids": True,
            },
        )
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        completion = [int(t) for t in choice["token_ids"]]
        logps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        assert len(logps) == len(completion) == 12
        reward = sum(t % 2 == 0 for t in completion) / len(completion)
        sample = Sample(list(prompt) + completion, len(prompt), logps, None)
        trials.append(
            to_trial(
                sample,
                run="e2e",
                trial=f"t{i}",
                group_id=f"g{i // GROUP}",
                reward=reward,
                step=1,
                policy_version="v0",
            )
        )
    return trials


def served_prompt_logprobs(http: httpx.Client, prompt: list[int]) -> np.ndarray:
    """vLLM's log-prob of each prompt token after the first (prompt_logprobs; no cache involved)."""
    response = http.post(
        "/v1/completions",
        json={
            "model": SERVED_MODEL_NAME,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprobs": 0,
        },
    )
    assert response.status_code == 200, response.text
    entries: list[Any] = response.json()["choices"][0]["prompt_logprobs"]
    return np.array([entry[str(tok)]["logprob"] for entry, tok in zip(entries[1:], prompt[1:], strict=True)])


def trainer_prompt_logprobs(trainer: Any, prompt: list[int]) -> np.ndarray:
    from legorl.trainer import data  # noqa: PLC0415

    seq = data.TrainSequence(
        token_ids=torch.tensor(prompt),
        loss_mask=torch.tensor([0] + [1] * (len(prompt) - 1)),
        behavior_logprobs=torch.zeros(len(prompt)),
        advantage=0.0,
        routed_experts=None,
        trial_id="fixed",
        group_id="fixed",
        segment_index=0,
        policy_versions=("v0",),
    )
    scored = trainer.score_sequences([seq])
    result: np.ndarray = scored.train_logprobs.double().numpy()
    return result


def pearson_of_probs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(np.exp(a), np.exp(b))[0, 1])


def test_one_step_then_sync_serves_the_new_policy(tiny: Path, server: VllmServer, tmp_path: Path) -> None:
    from legorl.trainer.service import TrainingService  # noqa: PLC0415

    with httpx.Client(base_url=server.url, timeout=120) as http:
        trials = rollouts(http)
        before_served = served_prompt_logprobs(http, FIXED)
        store = RunStore(str(tmp_path / "store"))
        store.commit_batch(1, trials, policy_version="v0")
        settings = trainer_settings(tmp_path, tiny, server, routing_replay="Auto", max_steps=1)
        service = TrainingService(settings, store=store)
        old = trainer_prompt_logprobs(service.trainer, FIXED)
        assert service.run(wait=False) == [1]
        new = trainer_prompt_logprobs(service.trainer, FIXED)
        after_served = served_prompt_logprobs(http, FIXED)
        info = http.get("/weight_info").json()

    figures = store.read_metrics()[0]
    print(
        f"rollout (vLLM fp32) vs trainer recompute: pearson {figures['fidelity_pearson']:.6f}, "
        f"max |Δlogp| {figures['fidelity_max_abs_logprob_delta']:.2e}; replayed share "
        f"{figures['replayed_token_share']}; sync {figures['sync_seconds']:.3f} s"
    )
    # The engine served exactly the initial policy, and the batch was sampled from it.
    assert pearson_of_probs(before_served, old) > 0.99999
    assert figures["fidelity_pearson"] > 0.999
    assert figures["replayed_token_share"] == 0.0  # no routing from the CPU engine: nothing replayed
    # After the sync the engine serves the trainer's new policy ...
    pearson_new = pearson_of_probs(after_served, new)
    delta_new = float(np.abs(after_served - new).max())
    # ... which differs from the old one.
    delta_old = float(np.abs(after_served - old).max())
    print(
        f"after sync: vs new pearson {pearson_new:.6f} max |Δ| {delta_new:.2e}; "
        f"vs old max |Δ| {delta_old:.3f}"
    )
    assert pearson_new >= 0.999
    assert delta_new < 1e-3
    assert delta_old > 20 * max(delta_new, 1e-4)
    assert info["weight_version"] == "v1"


def test_restart_after_a_failed_sync_brings_the_fleet_up_to_date(
    tiny: Path, server: VllmServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """v2 is published and recorded but its sync fails for good: the restarted trainer loads it."""
    from legorl.api.weights import PublishedWeights  # noqa: PLC0415
    from legorl.trainer.service import TrainingService  # noqa: PLC0415
    from legorl.trainer.sync.fleet_sync import FleetWeightSync  # noqa: PLC0415
    from legorl.trainer.sync.publish import WeightSyncError  # noqa: PLC0415

    with httpx.Client(base_url=server.url, timeout=120) as http:
        store = RunStore(str(tmp_path / "store"))
        trials = rollouts(http)
        store.commit_batch(1, trials, policy_version="v0")
        # Step 2's batch is the same trials, one version stale: dropped in Sync mode, but v2 is still
        # published (a skipped update publishes the unchanged policy, so versions never stall).
        store.commit_batch(2, trials, policy_version="v1")
    settings = trainer_settings(tmp_path, tiny, server, max_steps=2)
    real_sync = FleetWeightSync.sync

    def failing_v2(self: FleetWeightSync, published: PublishedWeights) -> object:
        if published.version == "v2":
            raise WeightSyncError("engine unreachable (simulated)")
        return real_sync(self, published)

    with monkeypatch.context() as patch:
        patch.setattr(FleetWeightSync, "sync", failing_v2)
        patch.setattr("threading.Event.wait", lambda self, timeout=None: False)  # no back-off pauses
        first = TrainingService(settings, store=store)
        with pytest.raises(WeightSyncError):
            first.run(wait=False)
    assert store.published_versions() == ["v1", "v2"]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/weight_info").json()["weight_version"] == "v1"  # the fleet is behind
    TrainingService(settings, store=store)  # restart: resume re-trains steps 1-2 and catches the fleet up
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/weight_info").json()["weight_version"] == "v2"


def test_a_replica_back_from_the_checkpoint_gets_the_newest_version_between_steps(
    tiny: Path, server: VllmServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet pod restarted after v1 was synced starts from the checkpoint (vLLM calls those weights
    `default`): while the trainer waits for the next batch, it finds the replica behind and loads v1
    again, rather than leaving every trial of the step on v0 (stale, dropped in Sync mode). The restart
    is played by the replica's first `/weight_info` answer here (restarting vLLM costs a minute); the load
    that follows goes to the real engine."""
    import threading  # noqa: PLC0415

    from legorl.api.weights import PublishedWeights  # noqa: PLC0415
    from legorl.trainer.service import TrainingService  # noqa: PLC0415
    from legorl.trainer.sync.fleet_sync import FleetWeightSync  # noqa: PLC0415

    store = RunStore(str(tmp_path / "store"))
    with httpx.Client(base_url=server.url, timeout=120) as http:
        store.commit_batch(1, rollouts(http), policy_version="v0")
    settings = trainer_settings(tmp_path, tiny, server, max_steps=2, fleet_check_seconds=0)
    service = TrainingService(settings, store=store)
    assert service.run(max_steps=1, wait=False) == [1]

    real_served, real_sync = FleetWeightSync.served_versions, FleetWeightSync.sync
    restarted = iter([["default"]])
    synced: list[str] = []

    def served(self: FleetWeightSync) -> list[str]:
        return next(restarted, None) or real_served(self)

    def sync(self: FleetWeightSync, published: PublishedWeights) -> object:
        synced.append(published.version)
        report = real_sync(self, published)
        service.stop.set()  # the check is what this test waits for
        return report

    monkeypatch.setattr(FleetWeightSync, "served_versions", served)
    monkeypatch.setattr(FleetWeightSync, "sync", sync)
    give_up = threading.Timer(120, service.stop.set)  # without the check, step 2's batch never comes
    give_up.start()
    try:
        assert service.run(max_steps=2, wait=True, poll_seconds=0.05) == []
    finally:
        give_up.cancel()
    assert synced == ["v1"]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/weight_info").json()["weight_version"] == "v1"
