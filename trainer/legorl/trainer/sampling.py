"""A reference sampler on the Megatron model: completions with their log-probs and expert routing.

It stands in for the rollout engine where one cannot run or cannot record what is needed: the learning
sanity tests (a toy reward, many short completions), the fidelity benchmark's routing-replay study (vLLM
cannot capture routed experts on CPU) and the GPU check (no vLLM there). No KV cache: each token is one
full forward of the batch, which is fine for the short completions it is used for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import torch

from legorl.api.trajectory import Segment, TerminationReason, TrialRecord, routing_array
from legorl.trainer import replay
from legorl.trainer.models import model


@dataclass(frozen=True)
class Sample:
    """One sampled sequence: prompt + completion, as an engine would report it."""

    token_ids: list[int]
    prompt_length: int
    completion_logprobs: list[float]
    """Log-probs of the completion tokens under the sampling distribution (logits / temperature)."""
    routed_experts: np.ndarray | None
    """Engine layout (len(token_ids) - 1, moe layers, top_k) when routing was recorded."""


@torch.no_grad()
def sample(
    net: torch.nn.Module,
    arch: model.MoeArchitecture,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    record_routing: bool = False,
    device: torch.device | None = None,
) -> list[Sample]:
    """Sample `max_new_tokens` tokens after each prompt (no early stop), recording routing when asked.

    Routing is read back with megatron's RECORD action on a final forward over the whole sequence, so it
    is exactly the routing of that forward (what an engine reports for the tokens it processed).
    """
    if record_routing and not replay.model_router_replays(net):
        raise ValueError(
            "record_routing needs a model built with routing_replay=True (it has no replaying routers)"
        )
    device = device or next(net.parameters()).device
    net.eval()
    seqs = [list(p) for p in prompts]
    logps: list[list[float]] = [[] for _ in seqs]
    for _ in range(max_new_tokens):
        lengths = torch.tensor([len(s) for s in seqs])
        width = int(lengths.max())
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        logits = model.forward_logits(net, ids.to(device), lengths.to(device)).float()
        last = logits[torch.arange(len(seqs)), lengths.to(device) - 1] / temperature
        probs = torch.softmax(last, dim=-1).cpu()
        picked = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        chosen_logp = torch.log_softmax(last.cpu(), dim=-1).gather(1, picked[:, None]).squeeze(1)
        for i, tok in enumerate(picked.tolist()):
            seqs[i].append(int(tok))
            logps[i].append(float(chosen_logp[i]))
    routing: list[np.ndarray | None] = [None] * len(seqs)
    if record_routing:
        replayer = replay.RouterReplayer(net)
        lengths = torch.tensor([len(s) - 1 for s in seqs])
        width = int(lengths.max())
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s) - 1] = torch.tensor(s[:-1])
        replayer.clear()
        replayer.record()
        model.forward_logits(net, ids.to(device), lengths.to(device))
        recorded = replayer.recorded()
        replayer.clear()
        routing = list(replay.megatron_to_engine(recorded, len(seqs), lengths))
    return [
        Sample(token_ids=s, prompt_length=len(p), completion_logprobs=lp, routed_experts=r)
        for s, p, lp, r in zip(seqs, prompts, logps, routing, strict=True)
    ]


def to_trial(
    s: Sample,
    *,
    run: str,
    trial: str,
    group_id: str,
    reward: float,
    step: int,
    policy_version: str,
    task_id: str = "toy",
) -> TrialRecord:
    """A completed trial of one segment holding `s`, shaped exactly as the run controller commits them."""
    n_prompt = s.prompt_length
    n = len(s.token_ids)
    routed = s.routed_experts
    segment = Segment(
        index=0,
        token_ids=list(s.token_ids),
        loss_mask=[0] * n_prompt + [1] * (n - n_prompt),
        behavior_logprobs=[0.0] * n_prompt + list(s.completion_logprobs),
        turn_indices=[0],
        policy_versions=[policy_version],
        routed_experts=None if routed is None else routing_array(routed),
    )
    now = datetime.now(UTC)
    return TrialRecord(
        run=run,
        trial=trial,
        task_id=task_id,
        group_id=group_id,
        split="train",
        step=step,
        harness="reference-sampler",
        termination_reason=TerminationReason.COMPLETED,
        reward=reward,
        started_at=now,
        ended_at=now,
        segments=[segment],
        policy_versions=[policy_version],
        num_turns=1,
    )


def to_trials(
    samples: Sequence[Sample],
    rewards: Sequence[float],
    *,
    run: str,
    prefix: str,
    group_size: int,
    step: int = 1,
    policy_version: str = "v0",
) -> list[TrialRecord]:
    """`to_trial` for each sample: trial `<prefix><i>`, consecutive `group_size` samples form group
    `<prefix>g<i // group_size>` (prompts repeated group_size times in a row, as the samplers here do)."""
    return [
        to_trial(
            s,
            run=run,
            trial=f"{prefix}{i}",
            group_id=f"{prefix}g{i // group_size}",
            reward=reward,
            step=step,
            policy_version=policy_version,
        )
        for i, (s, reward) in enumerate(zip(samples, rewards, strict=True))
    ]
