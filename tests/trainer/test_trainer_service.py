"""The trainer process end to end on CPU: committed batches in the run store → steps → published weights,
metrics and checkpoints; resume after a stop gives the same next-step loss; `legorl train` from a manifest.

Real megatron-core on CPU and a real run store on disk. Batches are sampled from the policy itself with
routing recorded (vLLM's CPU build cannot record routing; the vLLM path is in test_trainer_sync_e2e.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from legorl.api.store import RunStore
from legorl.api.termination import TerminationReason
from legorl.api.trajectory import TrialRecord
from legorl.manifests.generated import to_yaml
from legorl.trainer.models.tiny import make_tiny_model
from legorl.trainer.settings import SettingsError, TrainerSettings

pytestmark = [pytest.mark.slow]

PROMPTS = [[11, 42, 7, 300], [5, 900, 17]]
GROUP = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="module")
def batches(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[TrialRecord]]:
    """Three steps of trials sampled from the initial policy (with routing), rewarded by token parity."""
    from legorl.trainer.sampling import sample, to_trial  # noqa: PLC0415
    from legorl.trainer.train import PolicyTrainer  # noqa: PLC0415

    settings = TrainerSettings(
        run="svc", store_uri=str(tmp_path_factory.mktemp("scratch")), checkpoint_dir=tiny, device="cpu"
    )
    trainer = PolicyTrainer(settings)
    gen = torch.Generator().manual_seed(99)
    out = []
    for step in (1, 2, 3):
        samples = sample(
            trainer.model,
            trainer.arch,
            [p for p in PROMPTS for _ in range(GROUP)],
            max_new_tokens=6,
            generator=gen,
            record_routing=True,
        )
        trials = [
            to_trial(
                s,
                run="svc",
                trial=f"s{step}-t{i}",
                group_id=f"s{step}-g{i // GROUP}",
                reward=sum(t % 2 == 0 for t in s.token_ids[s.prompt_length :]) / 6,
                step=step,
                policy_version=f"v{step - 1}",
            )
            for i, s in enumerate(samples)
        ]
        # One infra failure per batch: it must be dropped from the loss and counted.
        broken = trials[0]
        trials[0] = TrialRecord(
            **{**broken.__dict__, "termination_reason": TerminationReason.SANDBOX_ERROR, "reward": None}
        )
        out.append(trials)
    return out


def make_settings(tiny: Path, store: Path, **extra: object) -> TrainerSettings:
    base: dict[str, object] = {
        "run": "svc",
        "store_uri": str(store),
        "checkpoint_dir": tiny,
        "device": "cpu",
        "learning_rate": 1e-3,
        "drop_reasons": frozenset({TerminationReason.SANDBOX_ERROR}),
        "max_staleness": 0,
        "checkpoint_interval": 1,
        "checkpoint_keep": 2,
        "max_steps": 3,
    }
    base.update(extra)
    return TrainerSettings(**base)


def commit(store: RunStore, batches: list[list[TrialRecord]], steps: range) -> None:
    for step in steps:
        store.commit_batch(step, batches[step - 1], policy_version=f"v{step - 1}")


def test_service_trains_publishes_and_records(
    tiny: Path, tmp_path: Path, batches: list[list[TrialRecord]]
) -> None:
    from legorl.trainer.service import TrainingService  # noqa: PLC0415
    from legorl.trainer.sync.publish import read_published  # noqa: PLC0415

    store = RunStore(str(tmp_path / "store"))
    commit(store, batches, range(1, 3))
    service = TrainingService(make_settings(tiny, tmp_path / "store"), store=store)
    # Only steps 1 and 2 are committed: without waiting, the service stops there.
    assert service.run(wait=False) == [1, 2]
    assert store.published_versions() == ["v1", "v2"]
    published = read_published(store.local_path(store.weights_path("v2")))  # type: ignore[arg-type]
    assert published.version == "v2"
    metrics = store.read_metrics()
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["trials_total"] == len(batches[0])
        assert m["dropped_by_reason.sandbox_error"] == 1
        assert m["replayed_token_share"] == 1.0
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
    # Every batch was sampled by the initial policy: step 1 trains on-policy, so rollout and training
    # probabilities agree; step 2's trainer is already v1, and the fidelity figure shows the gap.
    assert metrics[0]["fidelity_pearson"] > 0.9999
    assert metrics[1]["fidelity_pearson"] < 0.999
    state = store.read_trainer_state()
    assert state is not None and state["step"] == 2 and state["policy_version"] == "v2"
    # Two checkpoints kept (interval 1, keep 2).
    assert [c.step for c in service.checkpoints.list()] == [1, 2]


def test_published_weights_are_the_trained_policy(
    tiny: Path, tmp_path: Path, batches: list[list[TrialRecord]]
) -> None:
    """The safetensors of v1 loaded into a fresh trainer score exactly like the trainer that made them."""
    from legorl.trainer.service import TrainingService  # noqa: PLC0415
    from legorl.trainer.train import PolicyTrainer  # noqa: PLC0415

    store = RunStore(str(tmp_path / "store"))
    commit(store, batches, range(1, 2))
    service = TrainingService(make_settings(tiny, tmp_path / "store"), store=store)
    service.run(wait=False)
    held = batches[1][1:]
    mine = service.trainer.score_trials(held).train_logprobs
    v1 = store.local_path(store.weights_path("v1"))
    fresh = PolicyTrainer(make_settings(v1, tmp_path / "other"))  # type: ignore[arg-type]
    theirs = fresh.score_trials(held).train_logprobs
    v0 = PolicyTrainer(make_settings(tiny, tmp_path / "other")).score_trials(held).train_logprobs
    assert torch.equal(mine, theirs)
    assert (mine - v0).abs().max() > 1e-3  # the update changed the policy


def test_resume_gives_the_same_next_step(
    tiny: Path, tmp_path: Path, batches: list[list[TrialRecord]]
) -> None:
    """Stopped after step 2 (checkpoint at 1, v2 already published), resumed: step 3 is identical."""
    from legorl.trainer.service import TrainingService  # noqa: PLC0415

    straight_store = RunStore(str(tmp_path / "straight"))
    commit(straight_store, batches, range(1, 4))
    straight = TrainingService(make_settings(tiny, tmp_path / "straight"), store=straight_store)
    straight.run(wait=False)
    want = straight_store.read_metrics()[2]

    store = RunStore(str(tmp_path / "resumed"))
    commit(store, batches, range(1, 4))
    first = TrainingService(make_settings(tiny, tmp_path / "resumed", checkpoint_interval=1), store=store)
    first.run_step(1)
    first.settings = first.settings.model_copy(update={"checkpoint_interval": 100})
    first.run_step(2)  # published, but its checkpoint is never written: a crash right after the sync
    assert [c.step for c in first.checkpoints.list()] == [1]
    del first

    second = TrainingService(make_settings(tiny, tmp_path / "resumed"), store=store)
    assert second.resumed_from == 1
    assert second.trainer.step == 2  # step 2 re-trained from its batch, not published again
    assert store.published_versions() == ["v1", "v2"]
    assert second.run(wait=False) == [3]
    got = store.read_metrics()[2]
    assert got["step"] == 3
    for key in ("loss", "grad_norm", "fidelity_pearson", "entropy", "clip_fraction"):
        assert got[key] == want[key], key

    # The state itself, not only its figures: the weights published as v3 and AdamW's moments.
    def published(runs: RunStore) -> dict[str, torch.Tensor]:
        root = Path(str(runs.local_path(runs.weights_path("v3"))))
        out: dict[str, torch.Tensor] = {}
        for f in sorted(root.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    want_weights, got_weights = published(straight_store), published(store)
    assert want_weights and want_weights.keys() == got_weights.keys()
    assert all(torch.equal(want_weights[n], got_weights[n]) for n in want_weights)
    moments = [
        (a, b)
        for a, b in zip(straight.trainer.params, second.trainer.params, strict=True)
        if a in straight.trainer.optimizer.state
    ]
    assert moments
    for a, b in moments:
        sa, sb = straight.trainer.optimizer.state[a], second.trainer.optimizer.state[b]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


def test_settings_refuse_layouts_that_cannot_run(tiny: Path, tmp_path: Path) -> None:
    from legorl.trainer.models.model import MoeArchitecture  # noqa: PLC0415

    shape = MoeArchitecture.from_hf(tiny).shape()  # 4 heads, 2 KV heads, 8 experts, 2 layers
    with pytest.raises(SettingsError, match=r"parallelism.tensor: tensor × pipeline × context = 1 × 2 × 1"):
        make_settings(tiny, tmp_path, pipeline_parallel=2).check_supported()
    # Sizes that add up, but a model that cannot take them.
    with pytest.raises(
        SettingsError, match=r"parallelism.tensor: the model's 2 key/value heads do not split"
    ):
        make_settings(tiny, tmp_path, ranks_per_node=4, tensor_parallel=4).check_supported(model=shape)
    with pytest.raises(SettingsError, match=r"parallelism.expert: the model's 8 experts do not split over 3"):
        make_settings(tiny, tmp_path, ranks_per_node=3, expert_parallel=3).check_supported(model=shape)
    with pytest.raises(
        SettingsError, match=r"parallelism.pipeline: the model's 2 layers do not split evenly"
    ):
        make_settings(tiny, tmp_path, ranks_per_node=3, pipeline_parallel=3).check_supported(model=shape)
    with pytest.raises(
        SettingsError, match=r"parallelism.context: context parallelism 2: .*Transformer Engine"
    ):
        make_settings(tiny, tmp_path, ranks_per_node=2, context_parallel=2).check_supported(model=shape)
    with pytest.raises(SettingsError, match=r"topP=0.9.*Set topP to 1.0"):
        make_settings(tiny, tmp_path, top_p=0.9).check_supported()
    with pytest.raises(SettingsError, match=r"asks for 1 ranks .* but 4 were started.*--nproc-per-node=1"):
        make_settings(tiny, tmp_path).check_supported(world_size=4)
    # What the tiny model does take.
    for layout in ({"tensor_parallel": 2}, {"expert_parallel": 2}, {"pipeline_parallel": 2}, {}):
        make_settings(tiny, tmp_path, ranks_per_node=2, **layout).check_supported(world_size=2, model=shape)
    make_settings(tiny, tmp_path, ranks_per_node=4, tensor_parallel=2, expert_parallel=2).check_supported(
        world_size=4, model=shape
    )


def test_legorl_train_from_a_manifest(tiny: Path, tmp_path: Path, batches: list[list[TrialRecord]]) -> None:
    from legorl.cli.main import main  # noqa: PLC0415

    manifest = yaml.safe_load((Path(__file__).parents[2] / "examples" / "tiny-local.yaml").read_text())
    manifest["spec"]["policy"]["checkpoint"]["uri"] = f"file://{tiny}"
    manifest["spec"]["stop"]["maxSteps"] = 1
    manifest["spec"]["filter"] = {"dropReasons": ["sandbox_error"]}
    spec_file = tmp_path / "run.yaml"
    spec_file.write_text(to_yaml(manifest))
    store = RunStore(str(tmp_path / "store"))
    commit(store, batches, range(1, 2))
    rc = main(
        [
            "train",
            "--spec",
            str(spec_file),
            "--store",
            str(tmp_path / "store"),
            "--no-wait",
            "--device",
            "cpu",
        ]
    )
    assert rc == 0
    assert store.published_versions() == ["v1"]
    assert store.read_run_spec() is not None
    assert json.loads(json.dumps(store.read_metrics()))[0]["step"] == 1


def test_legorl_train_starts_the_layouts_ranks(
    tiny: Path, tmp_path: Path, batches: list[list[TrialRecord]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A CPU trainer of two ranks (tensor parallel 2): `legorl train` starts them under torchrun itself, the
    writer publishes v1, and the step is the one-rank step (fp32: equal up to rounding; exactness at every
    layout is tests/trainer/test_trainer_parallel.py's)."""
    from legorl.cli.main import main  # noqa: PLC0415

    manifest = yaml.safe_load((Path(__file__).parents[2] / "examples" / "tiny-local.yaml").read_text())
    manifest["spec"]["policy"]["checkpoint"]["uri"] = f"file://{tiny}"
    manifest["spec"]["stop"]["maxSteps"] = 1
    manifest["spec"]["filter"] = {"dropReasons": ["sandbox_error"]}
    figures = {}
    for name, parallelism in (
        ("one", {"gpusPerNode": 0}),
        ("tp2", {"gpusPerNode": 0, "processesPerNode": 2, "tensor": 2}),
    ):
        manifest["spec"]["trainer"]["parallelism"] = parallelism
        spec_file = tmp_path / f"{name}.yaml"
        spec_file.write_text(to_yaml(manifest))
        store = RunStore(str(tmp_path / name))
        commit(store, batches, range(1, 2))
        assert main(["train", "--spec", str(spec_file), "--store", str(tmp_path / name), "--no-wait"]) == 0
        assert store.published_versions() == ["v1"]
        figures[name] = store.read_metrics()[0]
    out = capsys.readouterr().out
    assert "starting 2 trainer ranks" in out
    assert figures["tp2"]["loss_tokens"] == figures["one"]["loss_tokens"] > 0
    for key in ("loss", "entropy", "fidelity_pearson", "is_ess"):
        assert math.isclose(figures["tp2"][key], figures["one"][key], rel_tol=1e-4), key


def test_legorl_train_check_accepts_the_flagship_layout_and_refuses_what_the_model_cannot_take(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """examples/gpu-swe-verified.yaml (4 × 8 GPUs, TP 2, EP 8) against a Qwen3-30B-A3B config (the config
    alone: 32 heads, 4 KV heads, 128 experts, 48 layers); TP 8 × EP 4 adds up but cannot split 4 KV heads."""
    from legorl.cli.main import main  # noqa: PLC0415

    example = Path(__file__).parents[2] / "examples" / "gpu-swe-verified.yaml"
    config = Path(__file__).parents[1] / "fixtures" / "qwen3-30b-a3b"
    assert main(["train", "--spec", str(example), "--check", "--checkpoint-dir", str(config)]) == 0
    out = capsys.readouterr().out
    assert "TP2 × EP8 × DP16 on 32 ranks" in out and "fits the layout" in out
    manifest = yaml.safe_load(example.read_text())
    # Sizes that divide the 32 ranks (CEL and preflight pass them): only the model says no.
    manifest["spec"]["trainer"]["parallelism"].update(tensor=8, expert=4)
    bad = tmp_path / "tp8.yaml"
    bad.write_text(to_yaml(manifest))
    assert main(["train", "--spec", str(bad), "--check", "--checkpoint-dir", str(config)]) == 2
    err = capsys.readouterr().err
    assert "spec.trainer.parallelism.tensor: the model's 4 key/value heads do not split over 8" in err


def test_legorl_train_rejects_a_bad_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from legorl.cli.main import main  # noqa: PLC0415

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: legorl.dev/v1alpha1\nkind: RLRun\nmetadata: {name: x}\n"
        "spec: {algorithm: {groupSize: 0}}\n"
    )
    assert main(["train", "--spec", str(bad), "--store", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "legorl train:" in err and "invalid RLRun" in err


def test_mini_batches_take_one_optimizer_step_each(
    tiny: Path, tmp_path: Path, batches: list[list[TrialRecord]]
) -> None:
    """miniBatches 2: two optimizer steps, the second off-policy against the pre-update log-probs."""
    from legorl.trainer.train import PolicyTrainer  # noqa: PLC0415

    steps_taken = {}
    for minis in (1, 2):
        trainer = PolicyTrainer(make_settings(tiny, tmp_path / f"m{minis}", mini_batches=minis))
        figures = trainer.train_step(batches[0], step=1)
        assert figures.mini_batches == minis
        # Rollout and the pre-update recompute are the same policy: the figure is taken before any update.
        assert (figures.fidelity_pearson or 0.0) > 0.9999
        state = trainer.optimizer.state[next(iter(trainer.model.parameters()))]
        steps_taken[minis] = int(state["step"])
    assert steps_taken == {1: 1, 2: 2}


def test_bf16_training_keeps_fp32_master_weights(
    tiny: Path, tmp_path: Path, batches: list[list[TrialRecord]]
) -> None:
    """At an RL learning rate a bf16 step is below bf16's resolution: the update lives in fp32 masters."""
    from legorl.trainer.train import PolicyTrainer  # noqa: PLC0415

    trainer = PolicyTrainer(make_settings(tiny, tmp_path, dtype="bfloat16", learning_rate=1e-6))
    assert trainer.masters is not None
    before = [m.detach().clone() for m in trainer.masters]
    figures = trainer.train_step(batches[0], step=1)
    assert figures.skipped is None
    changed = sum(int((m != b).sum()) for m, b in zip(trainer.masters, before, strict=True))
    total = sum(b.numel() for b in before)
    assert changed / total > 0.5, f"only {changed}/{total} master weights moved"
    for param, master in zip(trainer.params, trainer.masters, strict=True):
        assert param.dtype == torch.bfloat16
        assert torch.equal(param.detach(), master.detach().to(torch.bfloat16))


def test_crash_between_publishing_and_recording_weights(
    tiny: Path, tmp_path: Path, batches: list[list[TrialRecord]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weights written but never recorded are replaced on restart, not a permanent 'already exists'."""
    from legorl.trainer.service import TrainingService  # noqa: PLC0415

    store = RunStore(str(tmp_path / "store"))
    commit(store, batches, range(1, 2))

    def crash(*_args: object, **_kwargs: object) -> None:
        raise KeyboardInterrupt("killed after publish_weights, before record_weights")

    with monkeypatch.context() as patch:
        patch.setattr(RunStore, "record_weights", crash)
        first = TrainingService(make_settings(tiny, tmp_path / "store"), store=store)
        with pytest.raises(KeyboardInterrupt):
            first.run_step(1)
    assert (tmp_path / "store" / "weights" / "v1").is_dir()
    assert store.published_versions() == []
    second = TrainingService(make_settings(tiny, tmp_path / "store"), store=store)
    assert second.run(wait=False) == [1]
    assert store.published_versions() == ["v1"]


def test_replay_enabled_leaves_unrouted_segments_out(
    tiny: Path, tmp_path: Path, batches: list[list[TrialRecord]]
) -> None:
    """routingReplay Enabled never trains a token unreplayed: segments without routing leave the loss."""
    import dataclasses  # noqa: PLC0415

    from legorl.trainer.train import PolicyTrainer  # noqa: PLC0415

    stripped = [
        dataclasses.replace(
            t,
            segments=[
                dataclasses.replace(seg, routed_experts=None, routed_experts_shape=None) for seg in t.segments
            ],
        )
        for t in batches[0]
    ]
    strict = PolicyTrainer(make_settings(tiny, tmp_path, routing_replay="Enabled"))
    figures = strict.train_step(stripped, step=1)
    assert figures.dropped_unrouted_segments == len(batches[0]) - 1  # all but the dropped infra trial
    assert figures.skipped == "no sampled tokens"
    auto = PolicyTrainer(make_settings(tiny, tmp_path, routing_replay="Auto"))
    figures = auto.train_step(stripped, step=1)
    assert figures.skipped is None and figures.replayed_token_share == 0.0


def test_checkpoints_skip_a_damaged_manifest(tmp_path: Path) -> None:
    from legorl.trainer.checkpoint import CheckpointStore  # noqa: PLC0415

    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.save(1, {"format": 1, "x": torch.ones(2)}, keep=3)
    store.save(2, {"format": 1, "x": torch.zeros(2)}, keep=3)
    (tmp_path / "ckpt" / "step-000002" / "CHECKPOINT.json").write_text('{"step": 2, "sha')  # torn write
    assert [c.step for c in store.list()] == [1]
    assert torch.equal(store.load(1)["x"], torch.ones(2))


def test_scoring_requests_are_answered_between_steps(
    tiny: Path, tmp_path: Path, batches: list[list[TrialRecord]]
) -> None:
    """The operator's canary asks the running trainer to score its trial: the answer is the fidelity of
    the weights held at that moment, tagged with their version; a request that cannot be scored gets an
    error answer and training goes on."""
    from legorl.trainer.service import TrainingService  # noqa: PLC0415

    store = RunStore(str(tmp_path / "store"))
    service = TrainingService(make_settings(tiny, tmp_path / "store"), store=store)
    on_policy = batches[0][1:3]  # sampled by v0, routing recorded
    store.request_scoring("canary-a", on_policy)
    first = on_policy[0].segments[0]
    out_of_vocabulary = dataclasses.replace(first, token_ids=[10**9] * len(first.token_ids))
    broken = dataclasses.replace(on_policy[0], trial="canary-b", segments=[out_of_vocabulary])
    store.request_scoring("canary-b", [broken])
    assert store.scoring_requests() == ["canary-a", "canary-b"]
    assert service.run(wait=False) == []  # nothing committed: it only serves the requests
    assert store.scoring_requests() == []
    answer = store.read_scoring_answer("canary-a")
    assert answer is not None and answer["policy_version"] == "v0" and "error" not in answer
    assert answer["pearson"] > 0.9999 and answer["replayed_share"] == 1.0 and answer["tokens"] > 4
    failed = store.read_scoring_answer("canary-b")
    assert failed is not None and failed["error"] and "pearson" not in failed
    # After a step the same trial is scored by v1: the answer says so, and the figures moved.
    commit(store, batches, range(1, 2))
    store.request_scoring("canary-c", on_policy)
    assert service.run(wait=False) == [1]
    service.serve_scoring()
    later = store.read_scoring_answer("canary-c")
    assert later is not None and later["policy_version"] == "v1" and later["pearson"] < answer["pearson"]


def test_per_token_training_logprobs_are_stored_for_the_trained_segments(
    tiny: Path, tmp_path: Path, batches: list[list[TrialRecord]]
) -> None:
    """What the trajectory viewer colours by (training − rollout log-prob): every trained token's
    log-prob under the weights the step started from, aligned to the segment; nothing for dropped
    trials and nothing where no token was trained."""
    from legorl.trainer.service import TrainingService  # noqa: PLC0415

    store = RunStore(str(tmp_path / "store"))
    commit(store, batches, range(1, 3))
    # Two mini-batches: the second one's "old" log-probs come from the pre-update pass, not the live one.
    service = TrainingService(make_settings(tiny, tmp_path / "store", mini_batches=2), store=store)
    assert service.run(wait=False) == [1, 2]
    assert store.read_token_logprobs(3, "s3-t1") is None  # a step never trained
    dropped = batches[0][0]  # the sandbox_error trial: filtered, never trained on
    assert store.read_token_logprobs(1, dropped.trial) == {}
    for step in (1, 2):
        deltas = []
        for trial in batches[step - 1][1:]:
            stored = store.read_token_logprobs(step, trial.trial)
            assert stored is not None and set(stored) == {s.index for s in trial.segments}
            for seg in trial.segments:
                values = stored[seg.index]
                assert len(values) == len(seg.token_ids)
                assert [v is not None for v in values] == [bool(m) for m in seg.loss_mask]
                deltas += [
                    abs(v - b)
                    for v, b, m in zip(values, seg.behavior_logprobs, seg.loss_mask, strict=True)
                    if m and v is not None
                ]
        # Step 1 trains the policy that sampled the batch: the trainer's probabilities are the sampler's.
        # Step 2 trains v1 on trials v0 sampled (the batches were all sampled up front): they differ.
        if step == 1:
            assert max(deltas) < 1e-3, max(deltas)
        else:
            assert max(deltas) > 1e-3


def test_mixed_routed_and_unrouted_segments_keep_their_own_tokens(
    tiny: Path, tmp_path: Path, batches: list[list[TrialRecord]]
) -> None:
    """With replay on and only some segments routed, routed and plain segments are packed apart; each
    micro-batch row must still map back to its own segment (per-token values, on-policy flags)."""
    from legorl.trainer.service import TrainingService  # noqa: PLC0415

    mixed = [
        t
        if i % 2
        else dataclasses.replace(
            t,
            segments=[
                dataclasses.replace(s, routed_experts=None, routed_experts_shape=None) for s in t.segments
            ],
        )
        for i, t in enumerate(batches[0])
    ]
    store = RunStore(str(tmp_path / "store"))
    store.commit_batch(1, mixed, policy_version="v0")
    service = TrainingService(make_settings(tiny, tmp_path / "store", routing_replay="Auto"), store=store)
    assert service.run(wait=False, max_steps=1) == [1]
    trained = 0
    for trial in mixed[1:]:
        stored = store.read_token_logprobs(1, trial.trial)
        assert stored is not None
        for seg in trial.segments:
            values = stored[seg.index]
            assert len(values) == len(seg.token_ids), trial.trial
            assert [v is not None for v in values] == [bool(m) for m in seg.loss_mask], trial.trial
            trained += 1
    assert trained == len(mixed) - 1
    (metrics,) = store.read_metrics()
    assert 0 < metrics["replayed_token_share"] < 1
