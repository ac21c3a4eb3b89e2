"""The prepared GPU check: the trainer's GPU configuration exercised end to end on one GPU, under 10 minutes.

    bash benchmarks/gpu_check.sh            # on a machine with a CUDA GPU (installs carried wheels if needed)
    bash benchmarks/gpu_check.sh --family qwen3_next        # the hybrid-attention family (or qwen3_5_moe)
    python benchmarks/gpu_check.py --device cpu --size tiny   # the same script on CPU, to test the script

What it checks and prints (JSON lines, and a summary table at the end):
1. Equivalence on the device: transformers vs. the Megatron model on the same weights, fp32 and bf16, with
   the allgather and the alltoall token dispatcher (max |Δ logit|, argmax agreement).
2. Routing replay on the device: routing recorded in bf16, router weights perturbed; the share of recorded
   experts the perturbed routers use with replay (read from their routing maps: 1.0) and without it; replay
   under full recomputation.
3. Fidelity in bf16 at a realistic size: bf16 rollout (sampled, routing recorded) vs. fp32 and bf16
   recompute with replay on and off.
4. Train-step throughput in bf16 with the alltoall dispatcher: tokens/s with and without replay, with and
   without full recomputation (ratios in the same run).
5. Export: Megatron → Hugging Face safetensors → transformers gives the same logits.
6. The trainer's vocab-parallel log-probs and entropy on the device (bf16 logits of a 151,936 vocabulary)
   against torch's log_softmax: values and gradients. Steps 3–4 already run the multi-rank trainer's code
   path (plan, pipeline schedule, gradient reductions) at one rank on the GPU.
With `--family qwen3_next` / `qwen3_5_moe` the same checks run on a random model of the hybrid-attention
family (Gated DeltaNet + gated full attention, shared experts, partial RoPE, zero-centred norms): 3 is then
the question the family asks, Pearson of bf16 rollout vs training log-probs with replay on and off. The
rollout is the trainer's own bf16 sampler with routing recorded, not vLLM: vLLM's Gated DeltaNet layers need
its Triton/FlashInfer kernels and a CUDA vLLM build, which the check machine lacks (run the embedded loop on
a GPU image for the engine side). Without flash-linear-attention installed, Gated DeltaNet runs the torch
gated delta rule on the GPU too (`legorl.trainer.models.hybrid`).
Not here (one GPU): tensor, expert and pipeline parallelism over NCCL, and NCCL weight sync into vLLM (no
CUDA vLLM fits the check machine). Transformer Engine is not used: it is not installed on the check
machine and cannot be fetched there; the local layer spec runs the same model (see docs/trainer.md for the
TE settings on a production image).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for extra in (REPO, REPO / "trainer"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import torch  # noqa: E402

RESULTS: list[dict[str, Any]] = []

SIZES: dict[str, dict[str, Any]] = {
    # ~0.6B parameters, 64 experts top-8: big enough for real kernels, small enough for minutes.
    "mid": {
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "moe_intermediate_size": 512,
        "intermediate_size": 2048,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "vocab_size": 32000,
        "seq": 1024,
        "batch": 16,
        "new_tokens": 32,
    },
    "tiny": {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "moe_intermediate_size": 64,
        "intermediate_size": 256,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 4000,
        "seq": 128,
        "batch": 4,
        "new_tokens": 8,
    },
}


def report(check: str, **figures: Any) -> None:
    row = {"check": check, **figures}
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def make_model(directory: Path, size: dict[str, Any], seed: int = 0) -> Path:
    """A random Qwen3-MoE checkpoint of `size` (config + safetensors; no tokenizer is needed here)."""
    import transformers  # noqa: PLC0415

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=size["vocab_size"],
        hidden_size=size["hidden_size"],
        intermediate_size=size["intermediate_size"],
        num_hidden_layers=size["num_hidden_layers"],
        num_attention_heads=size["num_attention_heads"],
        num_key_value_heads=size["num_key_value_heads"],
        max_position_embeddings=8192,
        initializer_range=0.02 if size["hidden_size"] > 256 else 0.5,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        decoder_sparse_step=1,
        moe_intermediate_size=size["moe_intermediate_size"],
        num_experts=size["num_experts"],
        num_experts_per_tok=size["num_experts_per_tok"],
        norm_topk_prob=True,
        dtype="float32",
    )
    cfg.head_dim = size["head_dim"]
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = transformers.Qwen3MoeForCausalLM(cfg)  # type: ignore[no-untyped-call]
        model = model.to(torch.float32)
    model.save_pretrained(str(directory))
    return directory


HYBRID_SIZES: dict[str, dict[str, Any]] = {
    # ~0.5B parameters: 8 layers (Gated DeltaNet ×3, then full attention), 64 experts top-8 + a shared expert.
    "mid": {
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "full_attention_interval": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "linear_num_key_heads": 8,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "intermediate_size": 2048,
        "num_experts": 64,
        "num_experts_per_tok": 8,
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "intermediate_size": 96,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
}


def make_hybrid_model(directory: Path, size_name: str, family: str, seed: int = 0) -> Path:
    """A random checkpoint of the hybrid-attention family (`qwen3_next`, or `qwen3_5_moe`'s text model) with
    the vocabulary and sequence settings of SIZES[size_name]."""
    import transformers  # noqa: PLC0415

    shape = dict(HYBRID_SIZES[size_name])
    interval = shape.pop("full_attention_interval")
    layers = shape["num_hidden_layers"]
    common = {
        **shape,
        "vocab_size": SIZES[size_name]["vocab_size"],
        "layer_types": [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
        ],
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 8192,
        "initializer_range": 0.02 if shape["hidden_size"] > 256 else 0.1,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        "dtype": "float32",
    }
    tf: Any = transformers
    if family == "qwen3_next":
        cfg = tf.Qwen3NextConfig(**common, norm_topk_prob=True)
        cls = tf.Qwen3NextForCausalLM
    else:
        common.pop("intermediate_size")
        cfg = tf.Qwen3_5MoeTextConfig(**common)
        cls = tf.Qwen3_5MoeForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = cls(cfg).to(torch.float32)
        with torch.no_grad():  # the norms, decays and biases transformers starts at constants
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(torch.randn_like(param) * 0.2)
                elif name.endswith(("A_log", "dt_bias")):
                    param.copy_(torch.rand_like(param) * 2.0 - 0.5)
    model.save_pretrained(str(directory))
    return directory


def hf_logits(model_dir: Path, ids: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    import transformers  # noqa: PLC0415

    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, attn_implementation="eager"
    )
    hf.to(device).eval()
    with torch.no_grad():
        out: torch.Tensor = hf(input_ids=ids.to(device)).logits.float().cpu()
    del hf
    return out


def check_equivalence(model_dir: Path, size: dict[str, Any], device: torch.device) -> None:
    from legorl.trainer.models import convert, model  # noqa: PLC0415

    arch = model.MoeArchitecture.from_hf(model_dir)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (2, min(size["seq"], 256)), generator=gen)
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        ref = hf_logits(model_dir, ids, dtype, device)
        # The alltoall dispatcher needs CUDA streams: on CPU only allgather runs.
        for dispatcher in ("allgather", "alltoall") if device.type == "cuda" else ("allgather",):
            net = model.build_model(arch, dtype=dtype, device=device, moe_token_dispatcher=dispatcher)
            convert.load_hf_weights(net, model_dir, arch)
            with torch.no_grad():
                got = model.forward_logits(net, ids.to(device)).float().cpu()
            delta = (got - ref).abs()
            report(
                "equivalence",
                dtype=dtype_name,
                dispatcher=dispatcher,
                max_abs_dlogit=float(delta.max()),
                mean_abs_dlogit=float(delta.mean()),
                logit_scale=float(ref.abs().max()),
                argmax_agree=float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
            )
            del net


def check_replay(model_dir: Path, size: dict[str, Any], device: torch.device) -> None:
    from legorl.trainer import replay  # noqa: PLC0415
    from legorl.trainer.models import convert, model  # noqa: PLC0415

    arch = model.MoeArchitecture.from_hf(model_dir)
    gen = torch.Generator().manual_seed(1)
    batch, seq = size["batch"], min(size["seq"], 512)
    ids = torch.randint(0, arch.vocab_size, (batch, seq), generator=gen).to(device)
    for recompute in ("none", "full"):
        net = model.build_model(
            arch,
            dtype=torch.bfloat16,
            device=device,
            routing_replay=True,
            recompute=recompute,
            moe_token_dispatcher="alltoall" if device.type == "cuda" else "allgather",
        )
        convert.load_hf_weights(net, model_dir, arch)
        replayer = replay.RouterReplayer(net)
        replayer.clear()
        replayer.record()
        with torch.no_grad():
            model.forward_logits(net, ids)
        recorded = [t.clone() for t in replayer.recorded()]
        replayer.clear()
        with torch.no_grad():
            for name, param in net.named_parameters():
                if "router" in name:
                    param.add_(torch.randn_like(param) * param.float().std().to(param.dtype) * 0.5)
        replayer.record()
        with torch.no_grad():
            model.forward_logits(net, ids)
        free = replayer.recorded()
        replayer.clear()
        kept_free = _kept_share(recorded, free)
        # Replay forward + backward on the perturbed routers. The experts each router actually used come from
        # its output (the routing map), read by a forward hook in the forward (not in the recomputation).
        used: list[torch.Tensor] = []
        hooks = [
            m.register_forward_hook(
                lambda mod, _inp, out, used=used: used.append(
                    out[1].to(torch.int8).topk(mod.topk, dim=-1).indices
                )
            )
            for m in net.modules()
            if type(m).__name__ == "TopKRouter"
        ]
        replayer.replay(recorded)
        logits = model.forward_logits(net, ids)
        for hook in hooks:
            hook.remove()
        lossv = logits.float().logsumexp(-1).mean()
        replayer.before_backward()
        torch.autograd.backward(lossv)
        replayer.clear()
        report(
            "routing_replay",
            recompute=recompute,
            kept_experts_without_replay=kept_free,
            kept_experts_with_replay=_kept_share(recorded, used),
            loss_with_replay=float(lossv.detach()),
            grad_finite=all(
                bool(torch.isfinite(p.grad).all()) for p in net.parameters() if p.grad is not None
            ),
        )
        del net


def _kept_share(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    same = [
        (x.sort(-1).values == y.sort(-1).values).all(-1).float().mean() for x, y in zip(a, b, strict=True)
    ]
    return float(torch.stack(same).mean())


def check_fidelity_and_throughput(model_dir: Path, size: dict[str, Any], device: torch.device) -> None:
    from legorl.trainer.sampling import sample, to_trials  # noqa: PLC0415
    from legorl.trainer.settings import TrainerSettings  # noqa: PLC0415
    from legorl.trainer.train import PolicyTrainer  # noqa: PLC0415

    def settings(**kw: Any) -> TrainerSettings:
        base: dict[str, Any] = {
            "run": "gpu-check",
            "store_uri": str(model_dir.parent / "store"),
            "checkpoint_dir": model_dir,
            "device": device.type,
            "moe_token_dispatcher": "alltoall" if device.type == "cuda" else "allgather",
            "max_tokens_per_micro_batch": size["seq"] * size["batch"] // 2,
            "learning_rate": 1e-5,
        }
        base.update(kw)
        return TrainerSettings(**base)

    gen = torch.Generator().manual_seed(5)
    arch_vocab = PolicyTrainer(settings(routing_replay="Enabled", dtype="bfloat16"))
    prompts = [
        torch.randint(0, arch_vocab.arch.vocab_size, (16,), generator=gen).tolist()
        for _ in range(size["batch"])
    ]
    started = time.perf_counter()
    samples = sample(
        arch_vocab.model,
        arch_vocab.arch,
        prompts,
        max_new_tokens=size["new_tokens"],
        generator=gen,
        record_routing=True,
    )
    report("bf16_rollout", seconds=time.perf_counter() - started, sequences=len(samples))
    del arch_vocab
    rewards = [float(i % 3) for i in range(len(samples))]
    trials = to_trials(samples, rewards, run="g", prefix="t", group_size=4)
    for dtype in ("float32", "bfloat16"):
        for replay_mode in ("Enabled", "Disabled"):
            trainer = PolicyTrainer(settings(routing_replay=replay_mode, dtype=dtype))
            fid = trainer.score_trials(trials).fidelity()
            report(
                "fidelity_bf16_rollout",
                recompute_dtype=dtype,
                replay=replay_mode,
                pearson=fid["pearson"],
                mean_abs_dlogp=fid["mean_abs_logprob_delta"],
                max_abs_dlogp=fid["max_abs_logprob_delta"],
                tokens=int(fid["tokens"]),
            )
            del trainer

    check_throughput(model_dir, size, device, settings, gen)


def check_throughput(
    model_dir: Path,
    size: dict[str, Any],
    device: torch.device,
    settings: Callable[..., Any],
    gen: torch.Generator,
) -> None:
    """Train-step time in bf16, replay on vs off (and full recomputation), on long sequences."""
    from legorl.trainer.sampling import sample, to_trials  # noqa: PLC0415
    from legorl.trainer.train import PolicyTrainer  # noqa: PLC0415

    # Throughput: long random sequences (routing recorded on the model itself), bf16, replay on/off.
    seq, batch = size["seq"], size["batch"]
    probe = PolicyTrainer(settings(routing_replay="Enabled", dtype="bfloat16"))
    long_prompts = [
        torch.randint(0, probe.arch.vocab_size, (seq - 1,), generator=gen).tolist() for _ in range(batch)
    ]
    long_samples = sample(
        probe.model, probe.arch, long_prompts, max_new_tokens=1, generator=gen, record_routing=True
    )
    del probe
    rewards = [float(i % 2) for i in range(len(long_samples))]
    long_trials = to_trials(long_samples, rewards, run="g", prefix="l", group_size=4)
    for t in long_trials:  # train on every token, not only the one sampled
        seg = t.segments[0]
        seg.loss_mask[:] = [0] + [1] * (len(seg.token_ids) - 1)
    timings: dict[str, float] = {}
    for recompute in ("none", "full"):
        # Both trainers live at once and their steps alternate, so allocator state, clocks and caches hit
        # replay on and off alike (the first, sequential version of this check measured order, not replay).
        trainers = {
            mode: PolicyTrainer(settings(routing_replay=mode, dtype="bfloat16", recompute=recompute))
            for mode in ("Enabled", "Disabled")
        }
        times: dict[str, list[float]] = {mode: [] for mode in trainers}
        shares: dict[str, Any] = {}
        for i in range(5):
            for mode, trainer in trainers.items():
                if device.type == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                figures = trainer.train_step(long_trials, step=1)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if i > 0:
                    times[mode].append(time.perf_counter() - started)
                shares[mode] = figures.replayed_token_share
        for mode in trainers:
            ms = statistics.median(times[mode]) * 1000
            timings[f"{recompute}/{mode}"] = ms
            report(
                "train_step_bf16",
                recompute=recompute,
                replay=mode,
                step_ms=ms,
                tokens_per_second=seq * batch / (ms / 1000),
                replayed_share=shares[mode],
            )
        if device.type == "cuda":
            report(
                "memory", recompute=recompute, peak_gib_two_trainers=torch.cuda.max_memory_allocated() / 2**30
            )
            torch.cuda.reset_peak_memory_stats()
        del trainers
    report(
        "replay_overhead",
        ratio_no_recompute=timings["none/Enabled"] / timings["none/Disabled"],
        ratio_full_recompute=timings["full/Enabled"] / timings["full/Disabled"],
    )


def check_export(model_dir: Path, device: torch.device, out: Path) -> None:
    from legorl.trainer.models import convert, model  # noqa: PLC0415

    arch = model.MoeArchitecture.from_hf(model_dir)
    net = model.build_model(arch, dtype=torch.float32, device=device)
    convert.load_hf_weights(net, model_dir, arch)
    exported = convert.save_hf_checkpoint(net, arch, out, source_dir=model_dir)
    ids = torch.randint(0, arch.vocab_size, (1, 64), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        mine = model.forward_logits(net, ids.to(device)).float().cpu()
    theirs = hf_logits(exported, ids, torch.float32, device)
    report("export_roundtrip", max_abs_dlogit=float((mine - theirs).abs().max()))


def check_vocab_parallel(device: torch.device) -> None:
    """The trainer's log-prob and entropy (legorl.trainer.parallel; one tensor rank here) against torch's on
    the device, bf16 logits of a 151,936-token vocabulary, values and gradients."""
    from legorl.trainer import parallel  # noqa: PLC0415

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(4, 256, 151_936, generator=gen) * 4).to(device, torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 151_936, (4, 256), generator=gen).to(device)
    logp, ent = parallel.vocab_parallel_logprobs(logits, targets, temperature=0.7)
    torch.autograd.backward(logp.sum() + 0.1 * ent.sum())
    mine = logits.grad
    assert mine is not None
    reference = logits.detach().clone().requires_grad_(True)
    scaled = reference.float() / 0.7
    log_softmax = scaled.log_softmax(-1)
    ref_logp = log_softmax.gather(-1, targets[..., None]).squeeze(-1)
    ref_ent = -(log_softmax.exp() * log_softmax).sum(-1)
    torch.autograd.backward(ref_logp.sum() + 0.1 * ref_ent.sum())
    assert reference.grad is not None
    report(
        "vocab_parallel_logprobs",
        max_abs_dlogp=float((logp - ref_logp).abs().max()),
        max_abs_dentropy=float((ent - ref_ent).abs().max()),
        max_abs_dgrad=float((mine.float() - reference.grad.float()).abs().max()),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--size", choices=tuple(SIZES), default="mid")
    p.add_argument("--out", type=Path, help="write the JSON results here")
    p.add_argument(
        "--family",
        choices=("qwen3_moe", "qwen3_next", "qwen3_5_moe"),
        default="qwen3_moe",
        help="the model family to check (default: Qwen3-MoE)",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu to test the script itself", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    from legorl.trainer.models import compat, model  # noqa: PLC0415

    if device.type == "cpu":
        compat.enable_cpu_compat()
    model.init_distributed()
    report(
        "environment",
        torch=torch.__version__,
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        size=args.size,
        family=args.family,
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="legorl-gpu-check-") as tmp:
        root = Path(tmp)
        if args.family == "qwen3_moe":
            tiny = make_model(root / "tiny", SIZES["tiny"])
            big = tiny if args.size == "tiny" else make_model(root / args.size, SIZES[args.size])
        else:
            tiny = make_hybrid_model(root / "tiny", "tiny", args.family)
            big = tiny if args.size == "tiny" else make_hybrid_model(root / args.size, args.size, args.family)
        steps: list[tuple[str, Callable[[], None]]] = [
            ("equivalence tiny", lambda: check_equivalence(tiny, SIZES["tiny"], device)),
            ("equivalence size", lambda: check_equivalence(big, SIZES[args.size], device)),
            ("replay", lambda: check_replay(big, SIZES[args.size], device)),
            ("fidelity+throughput", lambda: check_fidelity_and_throughput(big, SIZES[args.size], device)),
            ("export", lambda: check_export(big, device, root / "export")),
            ("vocab-parallel log-probs", lambda: check_vocab_parallel(device)),
        ]
        if args.size == "tiny":
            steps.pop(1)
        for name, fn in steps:
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 -- one failing check must not hide the others
                report("error", step=name, error=f"{type(exc).__name__}: {exc}")
            report("timing", step=name, seconds=time.perf_counter() - t0)
    report("total", seconds=time.perf_counter() - started)
    if args.out:
        args.out.write_text(json.dumps(RESULTS, indent=2))
    return 1 if any(r["check"] == "error" for r in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())
