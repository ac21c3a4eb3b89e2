"""Sizing the trainer for Qwen3-30B-A3B and Qwen3.5-35B-A3B on H200s: memory per GPU by layout (computed).

    python benchmarks/trainer_sizing.py       # instant; writes benchmarks/results/trainer_sizing.json

Nothing here is measured: every figure is arithmetic over the models' published shapes (Qwen3-30B-A3B:
tests/fixtures/qwen3-30b-a3b/config.json; Qwen3.5-35B-A3B: 40 layers, hidden 2048, full attention every 4th
layer (16 heads × 256, 2 KV heads, output gate), Gated DeltaNet in the others (16 key heads × 128, 32 value
heads × 128, conv 4), 256 experts × 512 + one shared expert of 512, top-8, vocabulary 248,320, untied
embeddings; its MTP layer is not trained). What the trainer holds per GPU:

- model states, per parameter of the GPU's shard (dense tensors split over TP × PP, experts over
  EP × TP × PP): this build keeps bf16 weights (2 B) and gradients (2 B), fp32 master weights (4 B), their
  gradients (4 B, during the optimizer step) and AdamW's two moments (8 B), replicated over data parallelism
  = 20 B; megatron's distributed optimizer (GPU only, not built here) would shard masters and moments over
  data parallelism: 4 + 16 / DP B;
- activations of one micro-batch (1F1B keeps up to PP of them on the first stage), bf16, sequence
  parallelism, divided by TP: with selective recomputation ~34·h bytes per token per layer for attention and
  norms (Korthikanti et al., "Reducing Activation Recomputation", selective row) plus the MoE block's
  dispatched tokens (top-k × (h + 3·F) × 2 bytes); with full recomputation the layers' inputs (2·h bytes per
  token per layer) plus one layer's working set recomputed in backward;
- the loss on the last stage: logits over this rank's vocabulary slice, bf16 from the output layer plus the
  fp32 copy and the fp32 log-probs `parallel.vocab_parallel_logprobs` keeps for backward: 10 bytes × V/TP
  per token.
A layout is "fits" when the sum stays under 85% of an H200's 141 GB (headroom for CUDA context, NCCL buffers,
fragmentation). Computed, not measured: the GPU check (benchmarks/gpu_check.py) is where these meet a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "trainer_sizing.json"
H200_BYTES = 141e9
BUDGET = 0.85 * H200_BYTES
GB = 1e9


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    experts: int
    top_k: int
    expert_ffn: int
    embedding_params: int
    """Embedding and output layer (on the first and last pipeline stage; split over TP by vocabulary)."""
    dense_layer_params: float
    """Attention (or linear attention), norms, router and shared expert of an average layer."""
    expert_params_per_layer: int


def qwen3_30b_a3b() -> Shape:
    c = json.loads((REPO / "tests" / "fixtures" / "qwen3-30b-a3b" / "config.json").read_text())
    h, d = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    attention = h * q + 2 * h * kv + q * h + 2 * d + 2 * h  # q, k, v, o, q/k norms, two layer norms
    router = c["num_experts"] * h
    experts = c["num_experts"] * 3 * h * c["moe_intermediate_size"]
    return Shape(
        name="Qwen3-30B-A3B",
        layers=c["num_hidden_layers"],
        hidden=h,
        heads=c["num_attention_heads"],
        kv_heads=c["num_key_value_heads"],
        vocab=c["vocab_size"],
        experts=c["num_experts"],
        top_k=c["num_experts_per_tok"],
        expert_ffn=c["moe_intermediate_size"],
        embedding_params=2 * c["vocab_size"] * h + h,
        dense_layer_params=attention + router,
        expert_params_per_layer=experts,
    )


def qwen35_35b_a3b() -> Shape:
    h, layers, vocab = 2048, 40, 248_320
    full = layers // 4
    d, heads, kv = 256, 16, 2
    gated_attention = h * (2 * heads * d) + 2 * h * kv * d + heads * d * h + 2 * d + 2 * h
    key_heads, key_dim, value_heads, value_dim, kernel = 16, 128, 32, 128, 4
    qkvz = h * (2 * key_heads * key_dim + 2 * value_heads * value_dim)
    ba = h * 2 * value_heads
    conv = (2 * key_heads * key_dim + value_heads * value_dim) * kernel
    gdn = qkvz + ba + conv + 2 * value_heads + value_dim + value_heads * value_dim * h + 2 * h
    experts, ffn = 256, 512
    shared = 3 * h * ffn + h  # the shared expert and its gate
    router = experts * h
    mixing = (full * gated_attention + (layers - full) * gdn) / layers
    return Shape(
        name="Qwen3.5-35B-A3B",
        layers=layers,
        hidden=h,
        heads=heads,
        kv_heads=kv,
        vocab=vocab,
        experts=experts,
        top_k=8,
        expert_ffn=ffn,
        embedding_params=2 * vocab * h + h,
        dense_layer_params=mixing + shared + router,
        expert_params_per_layer=experts * 3 * h * ffn,
    )


@dataclass(frozen=True)
class Row:
    model: str
    gpus: int
    tensor: int
    expert: int
    pipeline: int
    data: int
    expert_data: int
    micro_batch_tokens: int
    recompute: str
    params_per_gpu: float
    model_states_gb: float
    model_states_distributed_optimizer_gb: float
    activations_gb: float
    loss_gb: float
    total_gb: float
    fits: bool


def size(shape: Shape, gpus: int, *, tp: int, ep: int, pp: int, tokens: int, recompute: str) -> Row:
    dp = gpus // (tp * pp)
    edp = gpus // (tp * ep * pp)
    layers_here = shape.layers / pp
    dense = (
        shape.dense_layer_params * layers_here / tp + shape.embedding_params / 2 / tp
    )  # one end of the model
    expert = shape.expert_params_per_layer * layers_here / (ep * tp)
    params = dense + expert
    states = 20 * params
    distributed = 4 * params + 16 * (dense / dp + expert / edp)
    in_flight = pp  # 1F1B: the first stage holds PP micro-batches' activations
    per_token_layer = 34 * shape.hidden + shape.top_k * (shape.hidden + 3 * shape.expert_ffn) * 2
    if recompute == "Selective":
        activations = tokens * layers_here * per_token_layer / tp * in_flight
    else:
        activations = tokens * (layers_here * 2 * shape.hidden * in_flight + per_token_layer) / tp
    loss = tokens * 10 * shape.vocab / tp
    total = states + activations + loss
    return Row(
        model=shape.name,
        gpus=gpus,
        tensor=tp,
        expert=ep,
        pipeline=pp,
        data=dp,
        expert_data=edp,
        micro_batch_tokens=tokens,
        recompute=recompute,
        params_per_gpu=params,
        model_states_gb=states / GB,
        model_states_distributed_optimizer_gb=distributed / GB,
        activations_gb=activations / GB,
        loss_gb=loss / GB,
        total_gb=total / GB,
        fits=total < BUDGET,
    )


def layouts(shape: Shape, gpus: int, tokens: int) -> list[Row]:
    """Every layout this trainer takes for `shape` on `gpus` GPUs of 8 per node (TP within a node)."""
    rows = []
    for tp, ep, pp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16, 32), (1, 2, 4)):
        if tp > 8 or gpus % (tp * pp) or gpus % (tp * ep * pp):
            continue
        if shape.heads % tp or shape.kv_heads % tp or shape.vocab % tp or shape.experts % ep:
            continue
        if shape.layers % pp:
            continue
        for recompute in ("Selective", "Full"):
            rows.append(size(shape, gpus, tp=tp, ep=ep, pp=pp, tokens=tokens, recompute=recompute))
    return rows


def recommend(rows: list[Row]) -> Row | None:
    """The layout that fits with the least overhead: no pipeline if possible (no bubbles), selective rather
    than full recomputation (full recomputes every layer's forward: about a third more compute), the least
    TP (its collectives are per layer), then the most data parallelism."""
    fitting = [r for r in rows if r.fits]
    if not fitting:
        return None
    return min(fitting, key=lambda r: (r.pipeline, r.recompute != "Selective", r.tensor, -r.data, r.total_gb))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16_384, help="tokens per micro-batch per data-parallel rank")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    report: dict[str, Any] = {
        "benchmark": "trainer_sizing",
        "computed": True,
        "budget_gb": BUDGET / GB,
        "models": {},
    }
    for shape in (qwen3_30b_a3b(), qwen35_35b_a3b()):
        total = shape.embedding_params + shape.layers * (
            shape.dense_layer_params + shape.expert_params_per_layer
        )
        entry: dict[str, Any] = {
            "total_params": total,
            "expert_params": shape.layers * shape.expert_params_per_layer,
            "weights_bf16_gb": 2 * total / GB,
            "by_gpus": {},
        }
        for gpus in (8, 16, 32):
            rows = layouts(shape, gpus, args.tokens)
            best = recommend(rows)
            entry["by_gpus"][str(gpus)] = {
                "recommended": asdict(best) if best else None,
                "fitting_layouts": len([r for r in rows if r.fits]),
                "all": [asdict(r) for r in rows],
            }
            if best:
                print(
                    f"{shape.name} on {gpus} H200: TP{best.tensor} EP{best.expert} PP{best.pipeline} "
                    f"DP{best.data} {best.recompute}: {best.total_gb:.0f} GB/GPU "
                    f"(states {best.model_states_gb:.0f}, activations {best.activations_gb:.0f}, "
                    f"loss {best.loss_gb:.0f})"
                )
            else:
                print(f"{shape.name} on {gpus} H200: no layout fits")
        report["models"][shape.name] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
