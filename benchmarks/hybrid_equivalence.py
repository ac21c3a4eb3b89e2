"""The hybrid-attention family's equivalence table: against transformers per feature, and across layouts.

    python benchmarks/hybrid_equivalence.py      # about 5 minutes on 2 CPUs

1. Against transformers (fp32, eager attention, its torch fallbacks), on the tiny random checkpoints of
   `legorl.trainer.models.tiny.make_tiny_hybrid` (Qwen3-Next and Qwen3.5-MoE's text model): logits of 12
   sequences of 80 tokens (4 seeds × 3; the gated delta rule's chunks are 64 tokens), each Gated DeltaNet
   layer on the reference's own input, every non-expert gradient (relative to its largest entry), the export
   round trip, and one control per new feature (that feature mis-mapped: how far the logits move).
2. Across layouts: tests/support/trainer_ranks.py (a real `TrainingService` under torchrun, gloo, routing
   replay on)
   on one committed batch of the Qwen3-Next preset, in float64, each layout against one rank — the same
   comparison as benchmarks/trainer_equivalence.py (whose functions it uses).
Results: `benchmarks/results/hybrid_equivalence.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from provenance import git_commit
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
# The layout comparison of the Qwen3-MoE table, used as it is (a sibling script, not a package).
layouts: Any = importlib.import_module("trainer_equivalence")

RESULTS = REPO / "benchmarks" / "results" / "hybrid_equivalence.json"
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "TP2+SP (full recompute)": (2, ["--tp", "2", "--recompute", "full"]),
    "EP2 (×DP2)": (2, ["--ep", "2"]),
    "PP2": (2, ["--pp", "2"]),
    "TP2×EP2×DP2": (4, ["--tp", "2", "--ep", "2"]),
    "TP2×EP2 without replay (control)": (4, ["--tp", "2", "--ep", "2", "--no-replay"]),
}
SEQ = 80


def _hf(directory: Path) -> Any:
    import transformers  # noqa: PLC0415

    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager"
    )
    return hf.eval()


def _ids(vocab: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _rewrite(source: Path, target: Path, change: Any) -> Path:
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    save_file(change(tensors), str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _controls(arch: Any, directory: Path, root: Path, net: Any) -> dict[str, float]:
    """max |Δ logit| with one feature mis-mapped at a time."""
    from legorl.trainer.models import convert, model  # noqa: PLC0415

    d, heads, nk, dk = (
        arch.head_dim,
        arch.num_attention_heads,
        arch.linear_num_key_heads,
        arch.linear_key_head_dim,
    )

    def blocked_gate(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for n in [n for n in tensors if n.endswith("q_proj.weight")]:
            w = tensors[n]
            tensors[n] = w.reshape(2, heads, d, -1).transpose(0, 1).reshape(w.shape).contiguous()
        return tensors

    def gdn_order(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for n in [n for n in tensors if n.endswith(("in_proj_qkvz.weight", "in_proj_qkv.weight"))]:
            w = tensors[n]
            if n.endswith("qkvz.weight"):
                tensors[n] = w.reshape(w.shape[0] // nk, nk, -1).transpose(0, 1).reshape(w.shape).contiguous()
            else:
                q = w[: nk * dk].reshape(nk, dk, -1).flip(0).reshape(nk * dk, -1)
                tensors[n] = torch.cat([q, w[nk * dk :]]).contiguous()
        return tensors

    controls: dict[str, float] = {}
    probe = _ids(arch.vocab_size, 2, SEQ, 6)
    with torch.no_grad():
        good = model.forward_logits(net, probe)
    for name, variant, change in (
        ("RMSNorm not zero-centred", dataclasses.replace(arch, zero_centered_norm=False), None),
        ("RoPE over the whole head", dataclasses.replace(arch, rotary_percent=1.0), None),
        ("q and gate read as blocks", arch, blocked_gate),
        ("Gated DeltaNet projection order", arch, gdn_order),
        ("shared expert without its gate", arch, None),
    ):
        source = directory if change is None else _rewrite(directory, root / name.replace(" ", "-"), change)
        broken: Any = model.build_model(variant)
        convert.load_hf_weights(broken, source, arch)
        if name.startswith("shared expert"):
            for layer in broken.decoder.layers:
                if hasattr(layer.mlp, "shared_experts"):
                    layer.mlp.shared_experts.use_shared_expert_gate = False
        broken.eval()
        with torch.no_grad():
            controls[name] = float((model.forward_logits(broken, probe) - good).abs().max())
    return controls


def against_transformers(directory: Path, root: Path) -> dict[str, Any]:
    from legorl.trainer.models import convert, model  # noqa: PLC0415

    arch = model.MoeArchitecture.from_hf(directory)
    net: Any = model.build_model(arch)
    convert.load_hf_weights(net, directory, arch)
    net.eval()
    hf = _hf(directory)
    per_sequence: list[float] = []
    scale = 0.0
    for seed in range(4):
        ids = _ids(arch.vocab_size, 3, SEQ, seed)
        with torch.no_grad():
            ref, got = hf(ids).logits, model.forward_logits(net, ids)
        per_sequence += [float((got[b] - ref[b]).abs().max()) for b in range(3)]
        scale = max(scale, float(ref.abs().max()))

    inputs: dict[int, torch.Tensor] = {}
    for i in arch.linear_layers:
        hf.model.layers[i].linear_attn.register_forward_pre_hook(
            lambda _m, args, kwargs, i=i: inputs.__setitem__(i, (args or (kwargs["hidden_states"],))[0]),
            with_kwargs=True,
        )
    layer_rel = {}
    with torch.no_grad():
        hf(_ids(arch.vocab_size, 2, SEQ, 9))
        for i in arch.linear_layers:
            ref = hf.model.layers[i].linear_attn(inputs[i])
            got, _ = net.decoder.layers[i].self_attention(inputs[i].transpose(0, 1).contiguous(), None)
            layer_rel[f"layer {i}"] = float((got.transpose(0, 1) - ref).abs().max() / ref.abs().max())

    ids = _ids(arch.vocab_size, 2, 40, 2)
    net.train()
    torch.autograd.backward(model.token_logprobs(model.forward_logits(net, ids[:, :-1]), ids[:, 1:]).mean())
    torch.autograd.backward(model.token_logprobs(hf(ids[:, :-1]).logits, ids[:, 1:]).mean())
    mine = convert.gather_hf_state_dict(
        net, arch, {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    )
    assert mine is not None
    grads = {
        n: float((mine[n] - p.grad).abs().max() / p.grad.abs().max())
        for n, p in hf.named_parameters()
        if p.grad is not None and ".experts." not in n
    }
    on_disk = load_file(str(directory / "model.safetensors"))
    exported = convert.export_hf_state_dict(net, arch)
    net.eval()

    controls = _controls(arch, directory, root, net)
    return {
        "logits": {
            "max_abs_dlogit": max(per_sequence),
            "median_abs_dlogit_per_sequence": statistics.median(per_sequence),
            "sequences": len(per_sequence),
            "logit_scale": scale,
        },
        "gated_delta_net_layer_rel_delta": layer_rel,
        "gradients": {
            "compared": len(grads),
            "worst_rel_delta": max(grads.values()),
            "worst": max(grads, key=grads.__getitem__),
        },
        "export_bit_exact": sorted(exported) == sorted(on_disk)
        and all(torch.equal(exported[n], on_disk[n]) for n in on_disk),
        "controls_max_abs_dlogit": controls,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--skip-layouts", action="store_true", help="only the comparison with transformers")
    args = p.parse_args(argv)
    from legorl.trainer.models import model  # noqa: PLC0415
    from legorl.trainer.models.tiny import HYBRID_FAMILIES, make_tiny_hybrid  # noqa: PLC0415

    model.init_distributed()
    report: dict[str, Any] = {
        "benchmark": "hybrid_equivalence",
        "command": "python benchmarks/hybrid_equivalence.py",
    }
    with tempfile.TemporaryDirectory(prefix="legorl-hybrid-") as tmp:
        root = Path(tmp)
        report["transformers"] = {}
        for family in HYBRID_FAMILIES:
            directory = make_tiny_hybrid(root / family, family=family)
            report["transformers"][family] = against_transformers(directory, root / f"{family}-variants")
            print(family, json.dumps(report["transformers"][family], indent=1), flush=True)
        if not args.skip_layouts:
            tiny, template = root / "qwen3_next", root / "template"
            subprocess.run(  # noqa: S603 - our interpreter, fixed argv
                [sys.executable, str(layouts.WORKER), "make", "--tiny", str(tiny), "--store", str(template)],
                cwd=REPO,
                check=True,
                capture_output=True,
            )
            one = layouts.launch(1, [], tiny=tiny, template=template, root=root, name="one")
            rows: dict[str, Any] = {}
            for name, (ranks, extra) in LAYOUTS.items():
                got = layouts.launch(
                    ranks, extra, tiny=tiny, template=template, root=root, name=f"l{len(rows)}"
                )
                rows[name] = layouts.compare(one, got)
                print(name, rows[name], flush=True)
            report["layouts_float64"] = rows
    report["commit"] = git_commit()
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
