"""Fidelity table: how well the trainer's recomputed token probabilities match the rollout's.

    python benchmarks/fidelity.py                 # CPU: about 2–3 minutes (two vLLM servers start)
    python benchmarks/fidelity.py --skip-vllm     # only the Megatron rows (no vLLM needed)
    python benchmarks/fidelity.py --device cuda   # on a GPU (the GPU check runs this)

Rows (each: Pearson correlation of token probabilities, mean and max |Δ log-prob|, tokens):

(a) vLLM rollouts (fp32, then bf16) of the tiny MoE vs. the trainer's fp32 recompute on the same tokens.
    vLLM's CPU build cannot capture routed experts, so these rows run without replay.
(b) The routing-replay effect, measured where routing can be recorded: rollouts from the reference
    sampler on the Megatron model under one numeric condition, the trainer's fp32 recompute with replay
    on and off:
    - bf16 rollout (same weights, bf16 numerics) — the realistic engine/trainer dtype gap;
    - pre-update rollout: sampled and routed by policy v0, recomputed after one update step (v1), i.e.
      one step of staleness in async mode.
(c) Trainer step time with replay vs. without on the same batch (ratio, interleaved repeats).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from legorl.api.trajectory import TrialRecord  # noqa: E402
from legorl.trainer.sampling import sample, to_trial, to_trials  # noqa: E402
from legorl.trainer.settings import TrainerSettings  # noqa: E402
from legorl.trainer.train import PolicyTrainer  # noqa: E402

PROMPTS = [[11, 42, 7, 300, 25], [5, 900, 17, 3], [1200, 8, 64, 33, 2, 90], [77, 1500, 12]]


def settings_for(model_dir: Path, store: Path, *, replay: str, device: str, **extra: Any) -> TrainerSettings:
    return TrainerSettings(
        run="fidelity",
        store_uri=str(store),
        checkpoint_dir=model_dir,
        routing_replay=replay,
        device=device,
        max_tokens_per_micro_batch=4096,
        learning_rate=extra.pop("learning_rate", 1e-3),
        **extra,
    )


def stats_row(name: str, trainer: PolicyTrainer, trials: list[TrialRecord]) -> dict[str, Any]:
    fid = trainer.score_trials(trials).fidelity()
    return {
        "row": name,
        "pearson": fid["pearson"],
        "mean_abs_dlogp": fid["mean_abs_logprob_delta"],
        "max_abs_dlogp": fid["max_abs_logprob_delta"],
        "tokens": int(fid["tokens"]),
        "replayed_share": fid["replayed_share"],
    }


def vllm_rows(model_dir: Path, store: Path, trainer: PolicyTrainer, new_tokens: int) -> list[dict[str, Any]]:
    import httpx  # noqa: PLC0415

    from tests.support.engine import SERVED_MODEL_NAME, VllmServer  # noqa: PLC0415

    rows = []
    for dtype in ("float32", "bfloat16"):
        with VllmServer(model_dir, max_model_len=1024, extra_args=["--dtype", dtype]) as server:
            trials = []
            for i, prompt in enumerate(PROMPTS * 4):
                body = {
                    "model": SERVED_MODEL_NAME,
                    "prompt": prompt,
                    "max_tokens": new_tokens,
                    "min_tokens": new_tokens,
                    "temperature": 1.0,
                    "logprobs": 0,
                    "return_token_ids": True,
                    "seed": 1000 + i,
                }
                out = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
                choice = out["choices"][0]
                completion = list(choice["token_ids"])
                logps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
                from legorl.trainer.sampling import Sample  # noqa: PLC0415

                s = Sample(list(prompt) + completion, len(prompt), logps, None)
                trials.append(
                    to_trial(
                        s, run="fid", trial=f"v{i}", group_id="g", reward=0.0, step=1, policy_version="v0"
                    )
                )
            rows.append(stats_row(f"(a) vLLM {dtype} rollout vs trainer fp32, no replay", trainer, trials))
    return rows


def replay_rows(model_dir: Path, store: Path, device: str, new_tokens: int) -> list[dict[str, Any]]:
    rows = []
    gen = torch.Generator().manual_seed(7)
    prompts = [p for p in PROMPTS for _ in range(8)]
    # bf16 rollout: the same weights run in bf16 sample and route.
    bf16 = PolicyTrainer(settings_for(model_dir, store, replay="Enabled", device=device, dtype="bfloat16"))
    samples = sample(
        bf16.model, bf16.arch, prompts, max_new_tokens=new_tokens, generator=gen, record_routing=True
    )
    del bf16
    trials = to_trials(samples, [0.0] * len(samples), run="fid", prefix="b", group_size=len(samples))
    for replay in ("Enabled", "Disabled"):
        fp32 = PolicyTrainer(settings_for(model_dir, store, replay=replay, device=device))
        rows.append(stats_row(f"(b) bf16 rollout vs fp32 recompute, replay {replay.lower()}", fp32, trials))
        del fp32
    # Pre-update rollout: v0 samples and routes; one update step on another batch; recompute with v1.
    sampler = PolicyTrainer(settings_for(model_dir, store, replay="Enabled", device=device))
    g = torch.Generator().manual_seed(11)
    rollout = sample(
        sampler.model, sampler.arch, prompts, max_new_tokens=new_tokens, generator=g, record_routing=True
    )
    update = sample(
        sampler.model, sampler.arch, prompts, max_new_tokens=new_tokens, generator=g, record_routing=True
    )
    del sampler
    held = to_trials(rollout, [0.0] * len(rollout), run="fid", prefix="h", group_size=len(rollout))
    batch = to_trials(update, [float(i % 3) for i in range(len(update))], run="fid", prefix="u", group_size=8)
    stale_rows = {}
    for replay in ("Enabled", "Disabled"):
        trainer = PolicyTrainer(
            settings_for(model_dir, store, replay=replay, device=device, learning_rate=3e-3)
        )
        trainer.train_step(batch, step=1)
        stale_rows[replay] = stats_row(
            f"(b) pre-update (v0) rollout vs v1 recompute, replay {replay.lower()}", trainer, held
        )
        del trainer
    rows += [stale_rows["Enabled"], stale_rows["Disabled"]]
    return rows


def overhead(model_dir: Path, store: Path, device: str, new_tokens: int, repeats: int) -> dict[str, Any]:
    """Step time with replay vs without, on the same batch; interleaved so drift hits both alike."""
    on = PolicyTrainer(settings_for(model_dir, store, replay="Enabled", device=device, learning_rate=1e-9))
    off = PolicyTrainer(settings_for(model_dir, store, replay="Disabled", device=device, learning_rate=1e-9))
    g = torch.Generator().manual_seed(3)
    prompts = [p for p in PROMPTS for _ in range(8)]
    samples = sample(on.model, on.arch, prompts, max_new_tokens=new_tokens, generator=g, record_routing=True)
    batch = to_trials(
        samples, [float(i % 2) for i in range(len(samples))], run="fid", prefix="o", group_size=8
    )
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(repeats + 1):
        for name, trainer in (("on", on), ("off", off)):
            started = time.perf_counter()
            trainer.train_step(batch, step=1)
            if device == "cuda":
                torch.cuda.synchronize()
            if i > 0:  # the first round warms up allocators and caches
                times[name].append(time.perf_counter() - started)
    on_ms = statistics.median(times["on"]) * 1000
    off_ms = statistics.median(times["off"]) * 1000
    return {"replay_ms": on_ms, "no_replay_ms": off_ms, "ratio": on_ms / off_ms, "repeats": repeats}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--skip-vllm", action="store_true", help="leave out the vLLM rows (a)")
    p.add_argument("--model-dir", type=Path, help="a Qwen3-MoE checkpoint (default: make the tiny one)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="legorl-fidelity-") as tmp:
        root = Path(tmp)
        model_dir = args.model_dir
        if model_dir is None:
            from legorl.trainer.models.tiny import make_tiny_model  # noqa: PLC0415

            model_dir = make_tiny_model(root / "tiny-moe")
        store = root / "store"
        rows: list[dict[str, Any]] = []
        if not args.skip_vllm:
            base = PolicyTrainer(settings_for(model_dir, store, replay="Disabled", device=args.device))
            rows += vllm_rows(model_dir, store, base, args.new_tokens)
            del base
        rows += replay_rows(model_dir, store, args.device, args.new_tokens)
        cost = overhead(model_dir, store, args.device, args.new_tokens, args.repeats)

    print(f"\n{'row':<62} {'pearson':>10} {'mean|Δlp|':>10} {'max|Δlp|':>10} {'tokens':>7} {'replayed':>8}")
    for r in rows:
        print(
            f"{r['row']:<62} {r['pearson']:>10.6f} {r['mean_abs_dlogp']:>10.2e} {r['max_abs_dlogp']:>10.2e} "
            f"{r['tokens']:>7} {r['replayed_share']:>8.0%}"
        )
    print(
        f"\n(c) trainer step, same batch, median of {cost['repeats']}: replay {cost['replay_ms']:.1f} ms, "
        f"no replay {cost['no_replay_ms']:.1f} ms, ratio {cost['ratio']:.3f}"
    )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "overhead": cost, "device": args.device}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
