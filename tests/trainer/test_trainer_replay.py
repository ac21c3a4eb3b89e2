"""Routing replay: engine <-> Megatron index layout, its errors, and replay on a real Megatron MoE on CPU.

The routers' own output (the routing map each MoE layer dispatches with) is read through forward hooks,
so "replay pins the experts" is observed in the layer rather than inferred from the inputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from legorl.trainer import replay
from legorl.trainer.models import convert, model
from legorl.trainer.models.model import MoeArchitecture
from legorl.trainer.models.tiny import make_tiny_model
from legorl.trainer.replay import ReplayError, RouterReplayer

pytestmark = [
    # megatron-core 0.16's own RowParallelLinear passes tp_group=None to its helper, which then warns on
    # every call; nothing a caller can pass avoids it.
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

SMALL = MoeArchitecture(
    vocab_size=100,
    hidden_size=16,
    num_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    ffn_hidden_size=32,
    moe_ffn_hidden_size=8,
    num_experts=8,
    top_k=2,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    moe_layers=(0, 1),
)
DENSE = MoeArchitecture(
    **{
        **SMALL.__dict__,
        "num_experts": 0,
        "top_k": 0,
        "moe_ffn_hidden_size": 0,
        "moe_layers": (),
        "model_type": "qwen3",
    }
)


# -- layout ------------------------------------------------------------------------------------------------


def test_engine_to_megatron_is_sequence_major_with_padding_filled() -> None:
    # Sequence 0 ran 3 tokens, sequence 1 one token; the micro-batch has 4 positions.
    seq0 = np.array([[[1, 2], [7, 0]], [[3, 4], [1, 3]], [[5, 6], [2, 5]]])  # (rows, layers, top_k)
    seq1 = np.array([[[6, 7], [4, 5]]])
    per_layer, covered = replay.engine_to_megatron([seq0, torch.from_numpy(seq1)], 4, SMALL)
    # token index = s*B + b; uncovered tokens get experts 0..top_k-1.
    assert per_layer[0].tolist() == [[1, 2], [6, 7], [3, 4], [0, 1], [5, 6], [0, 1], [0, 1], [0, 1]]
    assert per_layer[1].tolist() == [[7, 0], [4, 5], [1, 3], [0, 1], [2, 5], [0, 1], [0, 1], [0, 1]]
    assert all(t.dtype == torch.int64 and t.shape == (8, 2) for t in per_layer)
    assert covered.tolist() == [[True, True, True, False], [True, False, False, False]]


def test_sequences_without_routing_and_fallback() -> None:
    seq0 = np.array([[[1, 2], [3, 4]]], dtype=np.uint16)  # the trajectory store keeps uint16
    per_layer, covered = replay.engine_to_megatron([None, seq0], 2, SMALL)
    assert per_layer[0].tolist() == [[0, 1], [1, 2], [0, 1], [0, 1]]
    assert covered.tolist() == [[False, False], [True, False]]
    fallback = [torch.tensor([[5, 6], [7, 7], [4, 3], [2, 1]]) + i for i in range(2)]
    merged, _ = replay.engine_to_megatron([None, seq0], 2, SMALL, fallback=fallback)
    assert merged[0].tolist() == [[5, 6], [1, 2], [4, 3], [2, 1]]
    assert merged[1].tolist() == [[6, 7], [3, 4], [5, 4], [3, 2]]


@pytest.mark.parametrize(
    ("routing", "seq_len", "message"),
    [
        ([np.zeros((2, 3, 2), dtype=np.int64)], 4, r"3 layers recorded, the model has 2 MoE layers"),
        ([np.zeros((2, 2, 1), dtype=np.int64)], 4, r"top_k is 1, the model routes to 2 experts per token"),
        ([np.array([[[0, 8], [1, 2]]])], 4, r"expert id 8 is out of range \[0, 8\)"),
        ([np.array([[[0, -1], [1, 2]]])], 4, r"expert id -1 is out of range"),
        (
            [np.tile(np.array([0, 1]), (5, 2, 1))],
            4,
            r"5 rows but the micro-batch has only 4 positions",
        ),
        ([np.array([[[3, 3], [1, 2]]])], 4, r"lists the same expert twice"),
        ([np.zeros((2, 2), dtype=np.int64)], 4, r"is not \(rows, layers, top_k\)"),
        ([np.array([[[0.0, 1.0], [1.0, 2.0]]])], 4, r"expert ids must be integers"),
    ],
)
def test_engine_to_megatron_errors(routing: list[np.ndarray], seq_len: int, message: str) -> None:
    with pytest.raises(ReplayError, match=message):
        replay.engine_to_megatron(routing, seq_len, SMALL)


def test_engine_to_megatron_refuses_dense_models() -> None:
    with pytest.raises(ReplayError, match="dense"):
        replay.engine_to_megatron([None], 3, DENSE)


def test_round_trip() -> None:
    rng = np.random.default_rng(0)
    rows = [5, 0, 3]
    layers, k = SMALL.num_moe_layers, SMALL.top_k
    routing = [
        np.array([rng.permutation(SMALL.num_experts)[:k] for _ in range(n * layers)], dtype=np.int64).reshape(
            n, layers, k
        )
        for n in rows
    ]
    per_layer, _ = replay.engine_to_megatron(routing, 6, SMALL)
    back = replay.megatron_to_engine(per_layer, 3, rows)
    assert len(back) == 3
    for original, returned in zip(routing, back, strict=True):
        assert returned.shape == original.shape
        assert np.array_equal(returned, original)
    with pytest.raises(ReplayError, match=r"lengths \[7, 0, 3\] must lie in \[0, 6\]"):
        replay.megatron_to_engine(per_layer, 3, [7, 0, 3])


def test_resolve_routing_replay() -> None:
    assert replay.resolve_routing_replay("Auto", SMALL) is True
    assert replay.resolve_routing_replay("Auto", DENSE) is False
    assert replay.resolve_routing_replay("Enabled", SMALL) is True
    assert replay.resolve_routing_replay("Disabled", SMALL) is False
    assert replay.resolve_routing_replay("Disabled", DENSE) is False
    with pytest.raises(ReplayError, match="Enabled but the model is dense"):
        replay.resolve_routing_replay("Enabled", DENSE)


# -- on a real Megatron model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model.init_distributed()
    return make_tiny_model(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="module")
def arch(tiny: Path) -> MoeArchitecture:
    return MoeArchitecture.from_hf(tiny)


def _build(tiny: Path, arch: MoeArchitecture, **kwargs: Any) -> Any:
    net = model.build_model(arch, **kwargs)
    convert.load_hf_weights(net, tiny, arch)
    return net


def _batch(arch: MoeArchitecture) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, arch.vocab_size, (4, 40), generator=torch.Generator().manual_seed(0))
    return ids, torch.tensor([40, 33, 21, 9])


def _perturb_routers(net: Any, scale: float = 0.5, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in net.named_parameters():
            if name.endswith("mlp.router.weight"):
                param.add_(torch.randn(param.shape, generator=gen) * float(param.std()) * scale)


@contextmanager
def _routing_maps(net: Any) -> Iterator[list[list[torch.Tensor]]]:
    """Every routing map ([tokens, experts] bool) each MoE router produced, per router, in call order."""
    from megatron.core.transformer.moe.router import TopKRouter  # noqa: PLC0415

    routers = [m for m in net.modules() if isinstance(m, TopKRouter)]
    seen: list[list[torch.Tensor]] = [[] for _ in routers]
    handles = [
        router.register_forward_hook(lambda _m, _i, out, i=i: seen[i].append(out[1].detach().clone()))
        for i, router in enumerate(routers)
    ]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _as_map(indices: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.zeros(indices.shape[0], experts, dtype=torch.bool).scatter(1, indices, True)


def _same_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


def test_replay_keeps_recorded_experts_after_routers_change(tiny: Path, arch: MoeArchitecture) -> None:
    net = _build(tiny, arch, routing_replay=True)
    replay.check_replay_active(net, arch)
    replayer = RouterReplayer(net)
    ids, lengths = _batch(arch)
    rows = (lengths - 1).tolist()
    net.eval()

    # The "engine": record the routing of the unchanged policy, then hand it over in the engine layout.
    replayer.record()
    with torch.no_grad():
        model.forward_logits(net, ids[:, :-1], lengths - 1)
    engine = replay.megatron_to_engine(replayer.recorded(), ids.shape[0], rows)
    replayer.clear()
    indices, covered = replay.engine_to_megatron(engine, ids.shape[1] - 1, arch)
    valid = covered.T.reshape(-1)  # sequence-major, like the indices
    assert int(covered.sum()) == sum(rows)

    _perturb_routers(net)
    replayer.record()
    with torch.no_grad():
        model.forward_logits(net, ids[:, :-1], lengths - 1)
    free = replayer.recorded()
    replayer.clear()
    kept_free = torch.stack([_same_experts(f, r)[valid] for f, r in zip(free, indices, strict=True)]).all(0)
    share_free = float(kept_free.float().mean())

    replayer.replay(indices)
    with _routing_maps(net) as maps, torch.no_grad():
        model.forward_logits(net, ids[:, :-1], lengths - 1)
    replayer.clear()
    used = [layer_maps[0] for layer_maps in maps]
    kept_replay = torch.stack(
        [(u == _as_map(r, arch.num_experts)).all(-1)[valid] for u, r in zip(used, indices, strict=True)]
    ).all(0)
    share_replay = float(kept_replay.float().mean())
    print(
        f"tokens keeping their recorded experts: {share_free:.1%} without replay, "
        f"{share_replay:.1%} with replay"
    )
    assert share_free < 0.9, "the perturbation did not move routing; the test would prove nothing"
    assert share_replay == 1.0
    # Padding positions were replayed too (with the fixed set), so the whole map is the given one.
    assert all(torch.equal(u, _as_map(r, arch.num_experts)) for u, r in zip(used, indices, strict=True))


def _train_pass(
    net: Any,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    indices: list[torch.Tensor],
    *,
    clear_before_backward: bool = False,
) -> tuple[float, dict[str, torch.Tensor], list[int]]:
    replayer = RouterReplayer(net)
    net.train()
    net.zero_grad(set_to_none=True)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    mask = torch.arange(inputs.shape[1])[None, :] < (lengths - 1)[:, None]
    with _routing_maps(net) as maps:
        replayer.replay(indices)
        logp = model.token_logprobs(model.forward_logits(net, inputs, lengths - 1), targets)
        loss = -(logp * mask).sum() / mask.sum()
        if clear_before_backward:
            replayer.clear()
        else:
            replayer.before_backward()
        torch.autograd.backward(loss)
    replayer.clear()
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, [len(m) for m in maps]


def test_replay_survives_full_recomputation(tiny: Path, arch: MoeArchitecture) -> None:
    ids, lengths = _batch(arch)
    # Routing the perturbed routers would not choose, so replay has to hold through recomputation.
    probe = _build(tiny, arch, routing_replay=True)
    replayer = RouterReplayer(probe)
    replayer.record()
    with torch.no_grad():
        model.forward_logits(probe, ids[:, :-1], lengths - 1)
    indices = [t.clone() for t in replayer.recorded()]
    replayer.clear()

    plain = _build(tiny, arch, routing_replay=True, recompute="none")
    _perturb_routers(plain)
    loss_plain, grads_plain, calls_plain = _train_pass(plain, ids, lengths, indices)

    full = _build(tiny, arch, routing_replay=True, recompute="full")
    replay.check_replay_active(full, arch)
    _perturb_routers(full)
    loss_full, grads_full, calls_full = _train_pass(full, ids, lengths, indices)
    # Full recomputation really ran every router again in backward.
    assert calls_plain == [1, 1] and calls_full == [2, 2]
    worst = max(
        float((grads_full[n] - g).abs().max()) / max(float(g.abs().max()), 1e-12)
        for n, g in grads_plain.items()
    )
    print(
        f"recompute full vs none with replay: Δloss {abs(loss_full - loss_plain):.1e}, "
        f"max relative Δgrad {worst:.1e}"
    )
    assert sorted(grads_full) == sorted(grads_plain)
    assert abs(loss_full - loss_plain) < 1e-6
    assert worst < 1e-5

    # Teeth: clearing replay before backward lets recomputation route with the perturbed routers.
    loss_cleared, grads_cleared, _ = _train_pass(full, ids, lengths, indices, clear_before_backward=True)
    assert abs(loss_cleared - loss_plain) < 1e-6  # the forward was still replayed
    drift = max(
        float((grads_cleared[n] - g).abs().max()) / max(float(g.abs().max()), 1e-12)
        for n, g in grads_plain.items()
    )
    print(f"replay cleared before backward: max relative Δgrad {drift:.2f}")
    assert drift > 1e-2


def test_check_replay_active_catches_silent_no_ops(tiny: Path, arch: MoeArchitecture) -> None:
    without = model.build_model(arch)
    with pytest.raises(ReplayError, match="built without routing replay"):
        replay.check_replay_active(without, arch)

    first = model.build_model(arch, routing_replay=True)
    replay.check_replay_active(first, arch)
    # The router reads the shared config at forward time; flipping it after the build is what a model built
    # with the fused router looks like (building one needs Transformer Engine).
    config = model.unwrap(first).config
    config.moe_router_fusion = True
    try:
        with pytest.raises(ReplayError, match="moe_router_fusion=True"):
            replay.check_replay_active(first, arch)
    finally:
        config.moe_router_fusion = False

    fewer = MoeArchitecture(**{**arch.__dict__, "moe_layers": (0,)})
    with pytest.raises(
        ReplayError,
        match=r"2 routers with replay, but its layers include 1 of the architecture.s 1 MoE layers",
    ):
        replay.check_replay_active(first, fewer)

    second = model.build_model(arch, routing_replay=True)
    replay.check_replay_active(second, arch)
    with pytest.raises(ReplayError, match="global list of replay instances is not this model's routers"):
        replay.check_replay_active(first, arch)


def test_replayer_rules(tiny: Path, arch: MoeArchitecture) -> None:
    net = model.build_model(arch, routing_replay=True)
    replayer = RouterReplayer()  # megatron's global list: the model built last
    with pytest.raises(ReplayError, match="1 layers of routing for 2 routers"):
        replayer.replay([torch.zeros(4, 2, dtype=torch.int64)])
    with pytest.raises(ReplayError, match="int64"):
        replayer.replay([torch.zeros(4, 2, dtype=torch.int32)] * 2)
    with pytest.raises(ReplayError, match="recorded nothing"):
        replayer.recorded()
    # A backward after a plain forward stays plain; only replaying routers switch.
    replayer.before_backward()
    assert all(r.router_replay_action is None for r in replay.model_router_replays(net))
    ids, _ = _batch(arch)
    replayer.replay([torch.zeros(ids.numel(), 2, dtype=torch.int64) + torch.tensor([3, 5])] * 2)
    replayer.before_backward()
    instances = replay.model_router_replays(net)
    assert all(
        r.router_replay_action is not None and r.router_replay_action.value == "replay_backward"
        for r in instances
    )
    replayer.clear()
    assert all(
        r.router_replay_action is None and r.target_topk_idx is None and not r.replay_backward_list
        for r in instances
    )


def test_routing_parity_compares_the_engine_experts_with_the_router_own_choice(
    tiny: Path, tmp_path: Path
) -> None:
    """The canary's routing parity on a real trainer: trials sampled with their routing recorded score
    100% agreement; the same trials with a wrong routing row (one trial's rows recorded one token late, as a
    proxy that misaligned them would) are still fully replayed, but routing parity fails."""
    import dataclasses  # noqa: PLC0415

    from legorl.controller.canary import parity_checks  # noqa: PLC0415
    from legorl.embedded.runner import load_run  # noqa: PLC0415
    from legorl.trainer.sampling import sample, to_trials  # noqa: PLC0415
    from legorl.trainer.settings import TrainerSettings  # noqa: PLC0415
    from legorl.trainer.train import PolicyTrainer  # noqa: PLC0415

    trainer = PolicyTrainer(
        TrainerSettings(run="parity", store_uri=str(tmp_path / "store"), checkpoint_dir=tiny, device="cpu")
    )
    gen = torch.Generator().manual_seed(3)
    samples = sample(
        trainer.model, trainer.arch, [[11, 42, 7, 300], [5, 900, 17]], max_new_tokens=12, generator=gen,
        record_routing=True,
    )  # fmt: skip
    trials = to_trials(samples, [1.0, 0.0], run="parity", prefix="t", group_size=2)
    good = trainer.score_trials(trials).fidelity()
    assert good["replayed_share"] == 1.0 and good["routing_compared"] > 0
    assert good["routing_agreement"] == 1.0

    first = trials[0].segments[0]
    assert first.routed_experts is not None
    late = np.roll(first.routed_experts, 1, axis=0)  # row i now holds token i-1's experts
    wrong = dataclasses.replace(trials[0], segments=[dataclasses.replace(first, routed_experts=late)])
    bad = trainer.score_trials([wrong]).fidelity()
    assert bad["replayed_share"] == 1.0  # every token still "has" routing: coverage alone sees nothing
    assert bad["routing_agreement"] < 0.9, bad
    run = load_run(str(Path(__file__).parents[2] / "examples" / "tiny-local.yaml"))
    assert parity_checks(trials[0], good, run)[1].result == "Passed"
    routing = parity_checks(wrong, bad, run)[1]
    assert routing.result == "Failed" and "(token, MoE layer) pairs" in routing.message
