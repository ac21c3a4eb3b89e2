"""The trainer at each CPU layout against one rank, in the same run: step time, tokens/s, weight export.

    python benchmarks/trainer_scale.py            # about 10 minutes on 2 CPUs
    python benchmarks/trainer_scale.py --quick    # one round, two steps (a smoke test, run by the tests)

Every layout is a real `legorl.trainer` under torchrun (gloo, CPU) on the same committed batch of a small
random Qwen3-MoE (hidden 256, 4 layers, 16 experts top-2, vocab 4000; routing replay on, fp32); layouts are
run in rotating order for `--rounds` rounds. Each run times, after one warm-up step that is not counted:
- `--steps` training steps (`PolicyTrainer.train_step`, the whole step: plan, forward, backward, reductions,
  optimizer) → the median step seconds and trained tokens per second;
- the weights' export to the writer (`HfExport`: every part gathered over the layout) and its publication as
  HF safetensors (`publish_weights`, local disk) → seconds and bytes per second.

What the figures are: overheads of a layout on a 2-core machine, where a layout of 2 or 4 processes shares
the same two cores as one rank does (one rank runs 2 threads, 2 ranks 1 thread each; 4 ranks
oversubscribe). They say what the parallel machinery costs here (collectives through gloo, pipeline
bubbles, padding to equal shapes), not what a GPU cluster gains. Results:
`benchmarks/results/trainer_scale.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from provenance import git_commit

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "trainer_scale.json"
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "one rank": (1, []),
    "DP2": (2, []),
    "TP2+SP": (2, ["--tp", "2"]),
    "EP2 (×DP2)": (2, ["--ep", "2"]),
    "PP2": (2, ["--pp", "2"]),
    "TP2×EP2×DP2": (4, ["--tp", "2", "--ep", "2"]),
}


def make(model: Path, store: Path, *, trials: int, tokens: int) -> None:
    """A small random Qwen3-MoE and one committed batch of `trials` trials of `tokens` tokens with routing."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import transformers as transformers_typed  # noqa: PLC0415

    transformers: Any = transformers_typed  # its constructors are partly untyped

    from legorl.api.store import RunStore  # noqa: PLC0415
    from legorl.trainer.models.tiny import byte_level_bpe, chat_tokenizer, qwen3_moe_config, training_corpus  # noqa: PLC0415
    from legorl.trainer.sampling import Sample, to_trial  # noqa: PLC0415

    tokenizer = chat_tokenizer(byte_level_bpe(training_corpus(0, documents=300), vocab_size=4000))
    tokenizer.save_pretrained(str(model))
    config = qwen3_moe_config(
        tokenizer,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        moe_intermediate_size=128,
        num_experts=16,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        initializer_range=0.02,
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).to(torch.float32).save_pretrained(str(model))
    rng = np.random.default_rng(0)
    vocab = len(tokenizer)
    records = []
    for i in range(trials):
        n = int(rng.integers(tokens // 2, tokens))
        prompt = int(rng.integers(8, n // 2))
        ids = rng.integers(0, vocab, size=n).tolist()
        routing = np.stack([rng.permutation(16)[:2] for _ in range((n - 1) * 4)]).reshape(n - 1, 4, 2)
        sample = Sample(
            token_ids=ids,
            prompt_length=prompt,
            completion_logprobs=(-rng.random(n - prompt) * 3).tolist(),
            routed_experts=routing.astype(np.uint8),
        )
        records.append(
            to_trial(
                sample,
                run="scale",
                trial=f"t{i:03d}",
                group_id=f"g{i // 4}",
                reward=float(i % 3 == 0),
                step=1,
                policy_version="v0",
            )
        )
    RunStore(str(store)).commit_batch(1, records, policy_version="v0")


def worker(args: argparse.Namespace) -> None:
    """One rank of one layout: warm-up, timed steps, timed export + publication; the writer saves figures."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from legorl.api.store import RunStore  # noqa: PLC0415
    from legorl.trainer import parallel  # noqa: PLC0415
    from legorl.trainer.models.convert import HfExport  # noqa: PLC0415
    from legorl.trainer.settings import TrainerSettings  # noqa: PLC0415
    from legorl.trainer.sync.publish import publish_weights  # noqa: PLC0415
    from legorl.trainer.train import PolicyTrainer  # noqa: PLC0415

    world = int(os.environ.get("WORLD_SIZE", "1"))
    settings = TrainerSettings(
        run="scale",
        store_uri=str(args.store),
        checkpoint_dir=args.model,
        device="cpu",
        ranks_per_node=world,
        tensor_parallel=args.tp,
        pipeline_parallel=args.pp,
        expert_parallel=args.ep,
        routing_replay="Enabled",
        max_tokens_per_micro_batch=args.micro_tokens,
        learning_rate=1e-6,
        max_staleness=None,
    )
    trainer = PolicyTrainer(settings)
    trials = RunStore(str(args.store)).read_batch(1).trials
    trainer.train_step(trials, step=1)  # warm-up: first-call allocations, gloo connections
    seconds, tokens = [], 0
    for step in range(2, args.steps + 2):
        dist.barrier()
        started = time.perf_counter()
        figures = trainer.train_step(trials, step=step)
        seconds.append(time.perf_counter() - started)
        tokens = int(figures.loss_tokens or 0)
    dist.barrier()
    started = time.perf_counter()
    export = HfExport(trainer.model, trainer.arch)
    weights = {name: tensor.to("cpu").contiguous() for name, tensor in export}
    gathered = time.perf_counter() - started
    published = None
    if trainer.ranks.writer:
        out = Path(args.out).with_suffix(".weights")
        started_publish = time.perf_counter()
        published = publish_weights(weights, out, version="v99", source_dir=args.model)
        published_seconds = time.perf_counter() - started_publish
    dist.barrier()
    if trainer.ranks.writer:
        assert published is not None
        result = {
            "layout": settings.layout.describe(),
            "ranks": world,
            "step_seconds": seconds,
            "trained_tokens": tokens,
            "export_seconds": gathered,
            "publish_seconds": published_seconds,
            "weight_bytes": published.bytes,
        }
        Path(args.out).write_text(json.dumps(result))
    parallel.shutdown()
    del torch


def run_layout(
    name: str, model: Path, store: Path, out: Path, *, steps: int, micro_tokens: int
) -> dict[str, Any]:
    ranks, extra = LAYOUTS[name]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
        str(Path(__file__).resolve()), "worker", "--model", str(model), "--store", str(store),
        "--out", str(out), "--steps", str(steps), "--micro-tokens", str(micro_tokens), *extra,
    ]  # fmt: skip
    # Every layout gets the whole machine: one rank runs as many threads as there are cores, N ranks share
    # them (torchrun would give every rank one thread, starving the one-rank baseline).
    threads = max(1, (os.cpu_count() or 1) // ranks)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False, cwd=REPO)  # noqa: S603 - our interpreter, fixed argv
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")
    w = sub.add_parser("worker")
    w.add_argument("--model", type=Path, required=True)
    w.add_argument("--store", type=Path, required=True)
    w.add_argument("--out", type=Path, required=True)
    w.add_argument("--steps", type=int, default=3)
    w.add_argument("--micro-tokens", type=int, default=2048)
    w.add_argument("--tp", type=int, default=1)
    w.add_argument("--pp", type=int, default=1)
    w.add_argument("--ep", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--trials", type=int, default=32)
    p.add_argument("--tokens", type=int, default=384)
    p.add_argument("--micro-tokens", type=int, default=2048)
    p.add_argument("--quick", action="store_true", help="one round, two steps, a small batch")
    p.add_argument("--layouts", help=f"comma-separated subset of: {', '.join(LAYOUTS)} (default: all)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.command == "worker":
        worker(args)
        return 0
    if args.quick:
        args.rounds, args.steps, args.trials, args.tokens = 1, 2, 8, 96
    with tempfile.TemporaryDirectory(prefix="legorl-scale-") as tmp:
        root = Path(tmp)
        model, store = root / "model", root / "store"
        make(model, store, trials=args.trials, tokens=args.tokens)
        names = [n.strip() for n in args.layouts.split(",")] if args.layouts else list(LAYOUTS)
        unknown = [n for n in names if n not in LAYOUTS]
        if unknown or "one rank" not in names:
            p.error(f"--layouts must name known layouts, 'one rank' among them (the baseline): {unknown}")
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for round_index in range(args.rounds):
            order = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in order:
                out = root / f"{len(runs[name])}-{name.replace(' ', '_').replace('×', 'x')}.json"
                runs[name].append(
                    run_layout(name, model, store, out, steps=args.steps, micro_tokens=args.micro_tokens)
                )
                median = statistics.median(runs[name][-1]["step_seconds"])
                print(f"round {round_index + 1}: {name}: {median:.3f} s/step")
    base = statistics.median(s for r in runs["one rank"] for s in r["step_seconds"])
    table = {}
    for name, results in runs.items():
        steps = [s for r in results for s in r["step_seconds"]]
        tokens = results[0]["trained_tokens"]
        median = statistics.median(steps)
        table[name] = {
            "layout": results[0]["layout"],
            "ranks": results[0]["ranks"],
            "step_seconds": _spread(steps),
            "tokens_per_second": tokens / median,
            "step_time_vs_one_rank": median / base,
            "export_seconds": _spread([r["export_seconds"] for r in results]),
            "publish_seconds": _spread([r["publish_seconds"] for r in results]),
            "publish_bytes_per_second": statistics.median(
                r["weight_bytes"] / (r["export_seconds"] + r["publish_seconds"]) for r in results
            ),
            "weight_bytes": results[0]["weight_bytes"],
        }
    report = {
        "benchmark": "trainer_scale",
        "command": "python benchmarks/trainer_scale.py" + (" --quick" if args.quick else ""),
        "git_commit": git_commit(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "model": "random Qwen3-MoE: hidden 256, 4 layers, 8 heads / 4 KV heads, 16 experts top-2, "
        "vocab 4000, fp32",
        "batch": {
            "trials": args.trials,
            "max_tokens_per_trial": args.tokens,
            "micro_batch_tokens": args.micro_tokens,
        },
        "rounds": args.rounds,
        "timed_steps_per_run": args.steps,
        "layouts": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for name, row in table.items():
        print(
            f"{name:14} {row['step_seconds']['median']:.3f} s/step "
            f"({row['step_time_vs_one_rank']:.2f}× one rank), {row['tokens_per_second']:.0f} tok/s; "
            f"export+publish {row['publish_bytes_per_second'] / 1e6:.1f} MB/s"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
