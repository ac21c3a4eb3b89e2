"""A trainer rank for tests/trainer/test_trainer_parallel.py (run under torchrun, gloo, CPU) and its batch
maker.

`make`: one process makes the tiny MoE (if missing) and commits two batches of trials to a run store: prompt
groups sampled from the policy itself, with the engine's routing standing in as the router's own choice with
a fifth of the tokens' experts moved (what a bf16 engine's near-ties look like), so that replaying it
changes the forward and a trainer that ignores it is caught.

`run` (every rank of one layout, on its own copy of that store): a real `TrainingService` at the layout
(resuming from the store's checkpoint if there is one), then
- the HF export of the weights as loaded (or resumed), and the checkpoint state assembled layout-free;
- before the first step, the full-vocabulary logits of every sequence of batch 1 (gathered over the tensor
  ranks here, in the test — never in the trainer), by (trial, segment);
- `run_step` up to `--steps`: train, publish (the writer writes weights/vN), checkpoint; the gradients of the
  first step trained here are kept as they are after the layout's reductions (before clipping), in HF names;
and the writer saves all of it with `torch.save` to `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch


def make(tiny: Path, store: Path) -> None:
    from legorl.api.store import RunStore  # noqa: PLC0415
    from legorl.trainer.models.tiny import make_tiny_model  # noqa: PLC0415
    from legorl.trainer.sampling import sample, to_trial  # noqa: PLC0415
    from legorl.trainer.settings import TrainerSettings  # noqa: PLC0415
    from legorl.trainer.train import PolicyTrainer  # noqa: PLC0415

    if not (tiny / "config.json").is_file():
        make_tiny_model(tiny)
    trainer = PolicyTrainer(
        TrainerSettings(run="ranks", store_uri=str(store), checkpoint_dir=tiny, device="cpu")
    )
    prompts = [[11, 42, 7, 300, 5, 19, 23], [5, 900, 17], [77, 3, 1000, 2, 64], [8, 8, 120, 9]]
    group = 4
    gen = torch.Generator().manual_seed(7)
    rng = np.random.default_rng(3)
    experts = trainer.arch.num_experts
    runs = RunStore(str(store))
    for step in (1, 2):
        samples = sample(
            trainer.model,
            trainer.arch,
            [p for p in prompts for _ in range(group)],
            max_new_tokens=9,
            generator=gen,
            record_routing=True,
        )
        moved = []
        for s in samples:
            assert s.routed_experts is not None
            routing = s.routed_experts.copy()
            pick = rng.random(routing.shape[:2]) < 0.2
            for row, layer in zip(*np.nonzero(pick), strict=True):
                routing[row, layer] = rng.choice(experts, size=routing.shape[2], replace=False)
            moved.append(dataclasses.replace(s, routed_experts=routing))
        trials = [
            to_trial(
                s,
                run="ranks",
                trial=f"s{step}-t{i:02d}",
                group_id=f"s{step}-g{i // group}",
                reward=sum(t % 3 == 0 for t in s.token_ids[s.prompt_length :]) / 9,
                step=step,
                # Batch 2 is trained by v1 (it was sampled by v0: the test is about layouts, not fidelity).
                policy_version=f"v{step - 1}",
            )
            for i, s in enumerate(moved)
        ]
        runs.commit_batch(step, trials, policy_version=f"v{step - 1}")


class RecordingTransfer:
    """Stands in for vLLM's `NCCLTrainerWeightTransferEngine`, which needs CUDA and NCCL: the same calls on
    the client and the same use of the source as its `trainer_init` / `send_weights`, with the broadcast
    replaced by keeping what the sender would have broadcast (saved under `out/round-N.pt`)."""

    def __init__(self, init_info: Any, *, client: Any, source: Any, out: Path) -> None:
        self.sender = init_info.rank == 0
        self.client, self.source, self.out = client, source, out
        self.rounds = 0
        if self.sender:
            self.client.init_weight_transfer_engine(
                {"master_address": init_info.master_address, "master_port": init_info.master_port,
                 "world_size": init_info.world_size, "packed": init_info.packed}
            )  # fmt: skip

    def send_weights(self) -> None:
        meta = self.source.metadata()
        if not self.sender:
            for _ in self.source:
                pass
            return
        self.client.start_weight_update()
        self.client.update_weights(
            {"names": [m.name for m in meta], "dtype_names": [str(m.dtype).split(".")[-1] for m in meta],
             "shapes": [list(m.shape) for m in meta]}
        )  # fmt: skip
        sent = {}
        for (name, tensor), declared in zip(self.source, meta, strict=True):
            assert (name, tensor.dtype, tuple(tensor.shape)) == (
                declared.name,
                declared.dtype,
                declared.shape,
            )
            sent[name] = tensor.detach().cpu().clone()
        self.client.finish_weight_update()
        self.rounds += 1
        torch.save(sent, self.out / f"round-{self.rounds}.pt")

    def shutdown(self) -> None:
        pass


def _assembled_state(trainer: Any) -> dict[str, dict[str, torch.Tensor]] | None:
    """Every rank's checkpoint state, each tensor whole (by key and field), on the writer."""
    from legorl.trainer import parallel  # noqa: PLC0415
    from legorl.trainer.models import convert  # noqa: PLC0415

    parts = parallel.gather_objects(trainer.state()["params"])
    if parts is None:
        return None
    pieces: dict[str, list[dict[str, Any]]] = {}
    for part in parts:
        for key, piece in part.items():
            pieces.setdefault(key, []).append(piece)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, saved in pieces.items():
        ordered = sorted(saved, key=lambda p: int(p["index"]))
        out[key] = {
            field: convert.assemble([p[field] for p in ordered], ordered[0]["split"])
            for field in ("value", "master", "exp_avg", "exp_avg_sq")
            if ordered[0][field] is not None
        }
    return out


def run(args: argparse.Namespace) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    from legorl.api.store import RunStore  # noqa: PLC0415
    from legorl.trainer import data, parallel  # noqa: PLC0415
    from legorl.trainer.service import TrainingService  # noqa: PLC0415
    from legorl.trainer.settings import TrainerSettings  # noqa: PLC0415

    world = int(os.environ.get("WORLD_SIZE", "1"))
    settings = TrainerSettings(
        run="ranks",
        store_uri=str(args.store),
        checkpoint_dir=args.tiny,
        device="cpu",
        ranks_per_node=world,
        tensor_parallel=args.tp,
        pipeline_parallel=args.pp,
        expert_parallel=args.ep,
        routing_replay="Disabled" if args.no_replay else "Enabled",
        recompute=args.recompute,
        learning_rate=1e-3,
        # Several micro-batches per rank, so the pipeline runs its warm-up, steady and drain phases.
        max_tokens_per_micro_batch=args.micro_tokens,
        mini_batches=args.mini_batches,
        kl_coef=args.kl_coef,
        entropy_coef=args.entropy_coef,
        checkpoint_interval=1,
        seed=5,
        dtype=args.dtype,
    )
    factory = None
    if args.fleet:
        settings = settings.model_copy(
            update={
                "fleet_urls": tuple(args.fleet),
                "weight_sync_method": "NCCL",
                "weight_sync_address": "127.0.0.1",
            }
        )
        args.out.parent.joinpath("nccl").mkdir(exist_ok=True)

        def factory(init_info: Any, *, client: Any, source: Any) -> RecordingTransfer:
            return RecordingTransfer(init_info, client=client, source=source, out=args.out.parent / "nccl")

    store = RunStore(str(args.store))
    service = TrainingService(settings, store=store, nccl_engine_factory=factory)
    trainer = service.trainer
    out: dict[str, Any] = {"layout": settings.layout.describe(), "resumed_from": service.resumed_from}
    out["loaded"] = trainer.hf_state_dict()
    out["loaded_state"] = _assembled_state(trainer)

    if trainer.step == 0:
        trials = store.read_batch(1).trials
        sequences = data.sequences_from_trials(trials, {t.trial: 0.0 for t in trials})
        micros = trainer._micro_batches(sequences)
        logits_by_key: dict[tuple[str, int], torch.Tensor] = {}

        def keep(i: int, logits: torch.Tensor) -> None:
            full = logits.detach()
            if trainer.ranks.tensor_size > 1:
                from megatron.core import parallel_state as ps  # noqa: PLC0415

                parts = [torch.empty_like(full) for _ in range(trainer.ranks.tensor_size)]
                dist.all_gather(parts, full.contiguous(), group=ps.get_tensor_model_parallel_group())
                full = torch.cat(parts, dim=-1)
            batch = micros[i].batch
            for row, index in enumerate(batch.seq_index.tolist()):
                if index >= 0 and trainer.ranks.reports_tokens:
                    q = sequences[index]
                    logits_by_key[(q.trial_id, q.segment_index)] = full[
                        row, : int(batch.lengths[row])
                    ].clone()

        trainer._pass(micros, keep, train=False)
        gathered = parallel.gather_objects(logits_by_key)
        if gathered is not None:
            out["logits"] = {k: v for part in gathered for k, v in part.items()}
        # Routing parity as the canary measures it (the same on every rank: summed over all of them).
        out["scored"] = trainer.score_trials(trials).fidelity()

    grads: dict[str, torch.Tensor] = {}
    reduce = parallel.reduce_gradients

    def spy(model: torch.nn.Module) -> None:
        reduce(model)
        if not grads:
            grads.update(
                {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            )

    parallel.reduce_gradients = spy
    token_logprobs = {}
    for step in range(trainer.step + 1, args.steps + 1):
        service.run_step(step)
        token_logprobs[step] = dict(trainer.token_logprobs)
    parallel.reduce_gradients = reduce
    from legorl.trainer.models import convert  # noqa: PLC0415

    out["grads"] = convert.gather_hf_state_dict(trainer.model, trainer.arch, values=grads) if grads else None
    out["state"] = _assembled_state(trainer)
    if trainer.ranks.writer:
        out["figures"] = {int(m["step"]): m for m in store.read_metrics()}
        out["token_logprobs"] = token_logprobs
        torch.save(out, args.out)
    parallel.shutdown()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("--tiny", type=Path, required=True)
    m.add_argument("--store", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("--tiny", type=Path, required=True)
    r.add_argument("--store", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--steps", type=int, default=1)
    r.add_argument("--tp", type=int, default=1)
    r.add_argument("--pp", type=int, default=1)
    r.add_argument("--ep", type=int, default=1)
    r.add_argument("--recompute", default="none")
    r.add_argument("--mini-batches", type=int, default=1)
    r.add_argument("--kl-coef", type=float, default=0.0)
    r.add_argument("--entropy-coef", type=float, default=0.0)
    r.add_argument("--no-replay", action="store_true")
    r.add_argument("--dtype", default="float64")
    r.add_argument("--micro-tokens", type=int, default=40)
    r.add_argument("--fleet", action="append", help="engine URL: sync over (recorded) NCCL")
    args = p.parse_args(argv)
    if args.command == "make":
        make(args.tiny, args.store)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
