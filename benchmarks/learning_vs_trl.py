"""A peer cross-check of legorl's GRPO trainer: TRL's GRPOTrainer on the same checkpoint, prompts and reward.

Issue 35's first part. `benchmarks/learning.py` found RL barely moved the tiny policy (RL − v0 ≈ −0.04 on
the test split); nothing had compared legorl's trainer with an independent implementation on the same
data. Here both train the same start, on the same prompts, with the same reward and the same budget, and
ONE evaluator scores both sides' checkpoints, so their curves are comparable.

**What is shared.**
- *Start*: one warm start of `builtin://tiny-read` (`legorl.trainer.warmstart.reading`: SFT on the
  training tasks' demonstrations, stopped once 0.15 of sampled validation fixes are exact), made once for a
  fixed seed and cached under `.legorl/learning-vs-trl/`.
- *Prompts*: the decision turns of the **training** tasks — the second turn, after the test output, where
  the agent must write `sed -i '<line>s/<found>/<expected>/' <file> && echo COMPLETE_...` — as the harness
  presented them: demonstrations recorded with mini-swe-agent's own loop in real checkouts, rendered with
  the checkpoint's chat template and mini's `bash` tool (`reading._second_turns`). Validation decision turns
  are only evaluated. Each step takes P tasks (a seeded pass over the training tasks, the same for both
  sides) × G samples.
- *Reward* (`_exact_fix.score`, one file both import): 1.0 when the answer is one well-formed `bash` tool
  call ended by `<|im_end|>` whose command is exactly the demonstration's; malformed calls are counted.
- *Sampling*: temperature 1, no top-k / top-p, stop at `<|im_end|>` (also trained on), the same token limit.
  legorl's side samples from its exported weights (each step's policy saved as the fleet gets it and loaded
  into transformers, as its loop samples from exported weights in vLLM), recording the behaviour log-probs
  its trainer's importance weights compare with; TRL's with `transformers.generate` (its default without
  vLLM). Same distribution, other random streams.
- *Evaluation* (`evaluate`, transformers, the same code for every checkpoint, the same random seed): on
  the validation decision turns (and a fixed 40 training tasks), the sampled exact-fix rate (n samples per
  task), the greedy one, the malformed share, the mean per-token entropy of the policy on its own samples,
  and the KL to the start on those samples (k1 = mean log π/π₀ per token, and k3). Each side also records
  its own per-step training reward and figures (legorl's `StepFigures`; TRL's logged metrics).

**The gradient check** (`gradient_check`): before comparing curves, ONE batch — the start's answers to the
first step whose groups have reward spread — goes to both trainers (TRL's through its public `rollout_func`),
and the gradients each applies are compared tensor by tensor in the checkpoint's layout (cosine, relative
difference, the norms before clipping against what the mapping below predicts).

**How legorl's settings map onto TRL's** (`_trl_grpo.grpo_config` is this list; legorl → TRL 1.16):

- GRPO with one mini-batch (one optimizer step per batch, ratio 1) → `steps_per_generation=1`,
  `num_iterations=1`, `gradient_accumulation_steps=1`, `per_device_train_batch_size=P·G`. Exact: both take
  the on-policy gradient −A·∇log π.
- `advantage: GroupMeanStd`, (r − mean)/(Bessel std + 1e-6), 0 for a flat group → `scale_rewards="group"`,
  (r − mean)/(Bessel std + 1e-4). Only the eps differs: the std of binary rewards in a group of 4 is ≥ 0.5,
  so the advantages differ by < 2e-4 relative.
- `lossAggregation: TokenMean` (Σ token losses / trained tokens of the batch) → `loss_type="dapo"` (Σ /
  completion tokens of the generation batch): the same, but for the filter below.
- `zeroVarianceGroups: Drop` (legorl's default): flat groups leave the batch, and their tokens the
  denominator. TRL keeps them, with advantage 0, in its denominator. **Not exact**: TRL's gradient is
  legorl's times (tokens of groups with spread / all tokens), the same direction; Adam largely cancels a
  scale, gradient clipping does not. The `...-keep-zero-variance` setting runs legorl with `Keep`, which is
  TRL's loss exactly, to measure whether it matters.
- `clipLow/High` 0.2 / 0.28 → `epsilon=0.2`, `epsilon_high=0.28`. Exact (and inactive on-policy).
- `klCoef` 0, `entropyCoef` 0 → `beta=0.0`, no entropy bonus. Exact.
- Importance correction `Truncated`, cap 2, on π_old/µ → none (no vLLM). µ here is transformers' forward
  of the weights legorl trains, π_old megatron's: the same function to ~1e-4 in a log-prob, so the weights
  are 1 to that precision (legorl's `fidelity_*` figures in each step's record say how close).
- AdamW β (0.9, 0.999), ε 1e-8, `weightDecay` 0, `warmupSteps` 0, a constant learning rate → `adam_beta1/2`,
  `adam_epsilon`, `weight_decay=0`, `warmup_steps=0`, `optim="adamw_torch"`, and
  `lr_scheduler_type="constant"` (TRL's default decays linearly to 0). Exact.
- `gradClip` 1.0 on the global norm → `max_grad_norm=1.0`. Exact.
- No MoE load-balancing loss → `router_aux_loss_coef=0.0` (TRL would add the Qwen3-MoE config's). Exact.
- float32 → `bf16=False` (TRL's default is bf16). Exact.
- Temperature 1 in sampling and loss → `temperature=1.0`, `top_k=0`, `top_p=1.0`. Exact.
- megatron-core's model (routing replay `Auto`; no routing is recorded here, so the model routes itself) →
  transformers' Qwen3-MoE: the same function, max |Δlogit| ~1e-4 (docs/trainer.md).
- Prompt token ids → prompt text, tokenized by TRL: asserted to give the same ids for every prompt.

Entropy and gradient norms in the two trainers' own figures are not the same quantity: legorl's entropy is
over the trained tokens (flat groups dropped), TRL's over every completion token; legorl's gradient norm is
of its loss, TRL's of a loss whose denominator also counts flat groups. The evaluator's figures are the
comparable ones.

    python benchmarks/learning_vs_trl.py            # the full comparison (≈ 25 min on 2 CPUs)
    python benchmarks/learning_vs_trl.py --quick --out /tmp/q.json   # the test's end-to-end run
    python benchmarks/learning_vs_trl.py --no-trl   # legorl's side only (no TRL virtualenv)

Results: `benchmarks/results/learning-vs-trl.json` (settings, both sides' per-step curves, evaluations,
the agreement figures, seeds, wall times, command, commit, machine, versions) and a plot
`benchmarks/results/learning-vs-trl.svg`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from _exact_fix import STOP, score
from provenance import git_commit

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
PY = sys.executable


# -- settings ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One comparison: the same run on both sides, for each seed."""

    name: str
    learning_rate: float
    seeds: tuple[int, ...]
    zero_variance_groups: str = "Drop"
    """legorl's `filter.zeroVarianceGroups` (TRL has no such filter: `Keep` is its loss exactly)."""
    trl: bool = True
    """Run TRL's side too (a legorl-only variant measures one mapping difference)."""


@dataclass(frozen=True)
class Plan:
    """Everything a run of the benchmark is made of (the warm start's part keys its cache)."""

    settings: tuple[Setting, ...]
    steps: int = 40
    prompts_per_step: int = 8
    group_size: int = 4
    save_every: int = 5
    eval_every: int = 20
    """Checkpoints evaluated: every `eval_every` steps and the last (one costs ~15 s of a CPU)."""
    eval_samples: int = 8
    """Sampled answers per validation task at every evaluated checkpoint."""
    eval_train_tasks: int = 10
    """Training tasks also evaluated (the first N of the task list, sampled `eval_samples // 4` times)."""
    eval_seed: int = 12345
    warm_seed: int = 1
    warm_steps: int = 400
    warm_learning_rate: float = 3e-3
    warm_target: float | None = 0.15
    demo_limit: int | None = None
    threads: int = 1
    """Torch threads of each process; two processes run at a time."""
    jobs: int = 2


FULL = Plan(
    settings=(
        # The learning benchmark's learning rate (benchmarks/learning.py), three seeds: the noise.
        Setting("lr1e-4", 1e-4, (1, 2, 3)),
        Setting("lr3e-5", 3e-5, (1,)),
        Setting("lr3e-4", 3e-4, (1,)),
        Setting("lr1e-3", 1e-3, (1,)),
        Setting("lr3e-3", 3e-3, (1,)),
        Setting("lr1e-4-keep-zero-variance", 1e-4, (1,), zero_variance_groups="Keep", trl=False),
        # Run on its own (--only lr3e-4,lr3e-4-keep-zero-variance --seeds 1,2,3): where legorl's Drop and
        # TRL parted in the full run.
        Setting("lr3e-4-keep-zero-variance", 3e-4, (1,), zero_variance_groups="Keep", trl=False),
    ),
)
QUICK = Plan(
    settings=(Setting("quick", 1e-3, (1,)),),
    steps=3,
    prompts_per_step=2,
    group_size=2,
    save_every=2,
    eval_every=2,
    eval_samples=4,
    eval_train_tasks=4,
    # A start that writes tool calls, not one that copies fixes: the quick run checks the machinery.
    warm_steps=40,
    warm_target=None,
    demo_limit=12,
)
LEGORL_DEFAULTS = {"clip_low": 0.2, "clip_high": 0.28, "grad_clip": 1.0, "weight_decay": 0.0}
"""legorl's `TrainerSettings` defaults the comparison runs with (and TRL is given)."""


def say(text: str) -> None:
    sys.stdout.write(f"[learning-vs-trl {time.strftime('%H:%M:%S')}] {text}\n")
    sys.stdout.flush()


# -- the shared start and prompts --------------------------------------------------------------------------


def record_demos(plan: Plan, work: Path) -> dict[str, Path]:
    """Demonstrations of the training and validation tasks, recorded with mini's loop (cached in `work`)."""
    from legorl.sandbox.reading import builtin_task_set  # noqa: PLC0415

    demos = {}
    for split in ("train", "validation"):
        path = work / f"demos-{split}{'' if plan.demo_limit is None else f'-{plan.demo_limit}'}.jsonl"
        if not path.exists():
            say(f"recording the {split} demonstrations with mini-swe-agent")
            limit = [] if plan.demo_limit is None else ["--limit", str(plan.demo_limit)]
            run([PY, "-m", "legorl.trainer.warmstart.reading", "demos", "--tasks", str(builtin_task_set()),
                 "--split", split, "--out", str(path), *limit])  # fmt: skip
        demos[split] = path
    return demos


def warm_start_folder(plan: Plan, work: Path, demos: dict[str, Path]) -> Path:
    """Where the start for `plan` lives: keyed by its seed, the recipe and the demonstrations."""
    from legorl.trainer.warmstart import reading  # noqa: PLC0415

    key = hashlib.sha256(
        json.dumps(
            [
                plan.warm_seed,
                plan.warm_steps,
                plan.warm_learning_rate,
                plan.warm_target,
                asdict(reading.READING_SETTINGS),
                reading.CHECK_FROM,
                reading.CHECK_EVERY,
            ]
        ).encode()
        + demos["train"].read_bytes()
        + demos["validation"].read_bytes()
    ).hexdigest()[:12]
    return work / f"warm-seed{plan.warm_seed}-{key}"


def warm_start(plan: Plan, work: Path, demos: dict[str, Path]) -> tuple[Path, dict[str, Any]]:
    """The shared start checkpoint: made once per seed, recipe and demonstrations, then reused."""
    out = warm_start_folder(plan, work, demos)
    if not ((out / "sft.json").is_file() and (out / "model.safetensors").is_file()):
        say(f"warm start (seed {plan.warm_seed}) into {out}")
        shutil.rmtree(out, ignore_errors=True)
        target = [] if plan.warm_target is None else ["--target-copying", str(plan.warm_target)]
        run([PY, "-m", "legorl.trainer.warmstart.reading", "warmstart", "--demos", str(demos["train"]),
             "--validation", str(demos["validation"]), "--out", str(out), "--seed", str(plan.warm_seed),
             "--steps", str(plan.warm_steps), "--learning-rate", str(plan.warm_learning_rate),
             *target])  # fmt: skip
    summary: dict[str, Any] = json.loads((out / "sft.json").read_text())
    return out, summary


def decision_turns(checkpoint: Path, demos_path: Path) -> list[dict[str, Any]]:
    """Each task's decision turn as the harness presented it: the prompt's text and token ids (the chat
    template over mini's messages, with its bash tool), the demonstration's answer ids and command."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    from legorl.trainer.warmstart import reading  # noqa: PLC0415
    from legorl.trainer.warmstart.demos import bash_tool  # noqa: PLC0415
    from legorl.trainer.warmstart.sft import engine_messages  # noqa: PLC0415

    tokenizer: Any = AutoTokenizer.from_pretrained(str(checkpoint))
    demos = reading.load_demonstrations(demos_path)
    tools = [bash_tool()]
    out = []
    for demo, (prompt_ids, answer_ids) in zip(
        demos, reading._second_turns(tokenizer, demos, tools), strict=True
    ):
        turn = demo.turns[1]
        text = tokenizer.apply_chat_template(
            engine_messages(turn.messages), tools=tools, add_generation_prompt=True, tokenize=False
        )
        if tokenizer.encode(text, add_special_tokens=False) != prompt_ids:
            raise RuntimeError(f"{demo.task_id}: the prompt's text does not round-trip to its token ids")
        out.append(
            {
                "task_id": demo.task_id,
                "prompt_text": text,
                "prompt_ids": prompt_ids,
                "answer_ids": answer_ids,
                "command": turn.command,
            }
        )
    return out


def schedule(tasks: int, steps: int, per_step: int, seed: int) -> list[list[int]]:
    """The training tasks of each step: seeded passes over all of them, P distinct tasks a step."""
    import random  # noqa: PLC0415

    rng = random.Random(seed)  # noqa: S311 -- a reproducible order, not a secret
    order: list[int] = []
    out = []
    for _ in range(steps):
        step: list[int] = []
        while len(step) < per_step:
            if not order:
                order = rng.sample(range(tasks), tasks)
            candidate = order.pop()
            if candidate not in step:
                step.append(candidate)
        out.append(step)
    return out


# -- legorl's side -----------------------------------------------------------------------------------------


def hf_policy(trainer: Any, source: Path, folder: Path) -> Any:
    """The trainer's current policy as a transformers model: exported as the fleet gets it (an HF
    checkpoint), loaded back. legorl's loop samples from exported weights too (vLLM), so its trainer sees
    behaviour log-probs of another implementation of the same function, as here."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from legorl.trainer.models import convert  # noqa: PLC0415

    convert.save_hf_checkpoint(trainer.model, trainer.arch, folder, source_dir=source)
    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    return model


def policy_trainer(job: dict[str, Any], out: Path) -> Any:
    """legorl's `PolicyTrainer` on the job's start, with the job's settings (the rest: legorl's defaults)."""
    from legorl.trainer.settings import TrainerSettings  # noqa: PLC0415
    from legorl.trainer.train import PolicyTrainer  # noqa: PLC0415

    s = job["settings"]
    settings = TrainerSettings(
        run="learning-vs-trl",
        store_uri=str(out / "store"),
        checkpoint_dir=Path(job["checkpoint"]),
        learning_rate=float(job["learning_rate"]),
        clip_low=float(s["clip_low"]),
        clip_high=float(s["clip_high"]),
        grad_clip=float(s["grad_clip"]),
        weight_decay=float(s["weight_decay"]),
        drop_zero_variance_groups=s["zero_variance_groups"] == "Drop",
        loss_aggregation=s.get("loss_aggregation", "TokenMean"),
        device="cpu",
        seed=int(job["seed"]),
    )
    return PolicyTrainer(settings)


def make_trials(
    step: int,
    tasks: Sequence[dict[str, Any]],
    answers: Sequence[Sequence[int]],
    logps: Sequence[Sequence[float]],
    rewards: Sequence[float],
) -> list[Any]:
    """The trials the run controller would commit for these answers (`tasks[k]`: answer k's task): one
    segment each, the prompt untrained, the answer trained with its behaviour log-probs; a group per task."""
    from legorl.trainer.sampling import Sample, to_trial  # noqa: PLC0415

    return [
        to_trial(
            Sample(list(task["prompt_ids"]) + list(a), len(task["prompt_ids"]), list(lp), None),
            run="learning-vs-trl",
            trial=f"s{step}-t{k}",
            group_id=f"s{step}-{task['task_id']}",
            reward=reward,
            step=step,
            policy_version=f"v{step - 1}",
            task_id=task["task_id"],
        )
        for k, (task, a, lp, reward) in enumerate(zip(tasks, answers, logps, rewards, strict=True))
    ]


def run_legorl_gradient(job: dict[str, Any]) -> None:
    """The gradient check's legorl side: one `train_step` on the job's recorded batch; the gradient the
    optimizer applied (after clipping), exported to the checkpoint's own tensor layout, and the figures."""
    import torch  # noqa: PLC0415

    from legorl.trainer.models import convert  # noqa: PLC0415

    torch.set_num_threads(int(job["threads"]))
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    trainer = policy_trainer(job, out)
    replay = job["replay"]
    tasks = [job["tasks"][i] for i in replay["rows"]]
    trials = make_trials(1, tasks, replay["completion_ids"], replay["logprobs"], replay["rewards"])
    applied: list[Any] = []
    step = trainer.optimizer.step

    def capture(*args: Any, **kwargs: Any) -> Any:
        applied[:] = [p.grad.detach().clone() for p in trainer.params]
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    figures = trainer.train_step(trials, step=1)
    with torch.no_grad():
        kept = [p.detach().clone() for p in trainer.params]
        for p, g in zip(trainer.params, applied, strict=True):
            p.copy_(g)
        convert.save_hf_checkpoint(
            trainer.model, trainer.arch, out / "gradient", source_dir=Path(job["checkpoint"])
        )
        for p, k in zip(trainer.params, kept, strict=True):
            p.copy_(k)
    (out / "figures.json").write_text(figures.model_dump_json(exclude_none=True) + "\n")


def run_legorl(job: dict[str, Any]) -> None:
    """legorl's side: sample with the policy (its exported weights, `hf_policy`), score, build the trials the
    run controller would commit, take `PolicyTrainer.train_step` on them; save HF checkpoints for the
    evaluator."""
    import torch  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    from legorl.trainer.models import convert  # noqa: PLC0415

    started = time.perf_counter()
    torch.set_num_threads(int(job["threads"]))
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = Path(job["checkpoint"])
    trainer = policy_trainer(job, out)
    tokenizer: Any = AutoTokenizer.from_pretrained(str(checkpoint))
    stop_id = int(tokenizer.convert_tokens_to_ids(STOP))
    pad_id = int(tokenizer.pad_token_id)
    generator = torch.Generator().manual_seed(int(job["seed"]))
    tasks = job["tasks"]
    group = int(job["group_size"])
    steps_file = (out / "steps.jsonl").open("w")
    for step, chosen in enumerate(job["schedule"], start=1):
        began = time.perf_counter()
        policy = hf_policy(trainer, checkpoint, out / "policy")
        answers = generate(
            policy,
            [tasks[i]["prompt_ids"] for i in chosen],
            samples=group,
            greedy=False,
            stop_id=stop_id,
            pad_id=pad_id,
            max_new_tokens=int(job["max_new_tokens"]),
            generator=generator,
        )
        sampled = time.perf_counter() - began
        texts = tokenizer.batch_decode([a["tokens"] for a in answers], skip_special_tokens=False)
        scored = [score(text, tasks[chosen[k // group]]["command"]) for k, text in enumerate(texts)]
        trials = make_trials(
            step,
            [tasks[chosen[k // group]] for k in range(len(answers))],
            [a["tokens"] for a in answers],
            [a["logps"] for a in answers],
            [sc.reward for sc in scored],
        )
        figures = trainer.train_step(trials, step=step)
        row = {
            "step": step,
            "tasks": chosen,
            "rewards": [sc.reward for sc in scored],
            "malformed": [sc.malformed for sc in scored],
            "completion_tokens": [len(a["tokens"]) for a in answers],
            "seconds": time.perf_counter() - began,
            "sample_seconds": sampled,
            "legorl": figures.model_dump(mode="json", exclude_none=True),
        }
        steps_file.write(json.dumps(row) + "\n")
        steps_file.flush()
        if step % int(job["save_every"]) == 0 or step == len(job["schedule"]):
            convert.save_hf_checkpoint(
                trainer.model, trainer.arch, out / "checkpoints" / f"step-{step}", source_dir=checkpoint
            )
    steps_file.close()
    shutil.rmtree(out / "policy", ignore_errors=True)
    import transformers  # noqa: PLC0415

    summary = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "megatron_core": _version("megatron-core"),
        "python": sys.version.split()[0],
        "seconds": time.perf_counter() - started,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def _version(package: str) -> str | None:
    import importlib.metadata  # noqa: PLC0415

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# -- the one evaluator -------------------------------------------------------------------------------------


def _left_padded(rows: Sequence[Sequence[int]], pad: int) -> tuple[Any, Any, Any]:
    import torch  # noqa: PLC0415

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(list(r))
        mask[i, width - len(r) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    samples: int,
    greedy: bool,
    stop_id: int,
    pad_id: int,
    max_new_tokens: int,
    generator: Any,
    reference: Any = None,
) -> list[dict[str, Any]]:
    """`samples` answers of a transformers model to each prompt (rows prompt by prompt; left-padded, KV
    cache, each prompt's prefill computed once and repeated), with the log-prob and the entropy of the
    policy at every generated token; greedy: the argmax. With `reference`, that model follows the same
    tokens: its log-prob of each and the exact KL(policy ‖ reference) of the next-token distributions."""
    import torch  # noqa: PLC0415

    ids, prompt_mask, positions = _left_padded(prompts, pad_id)
    rows = len(prompts) * samples
    mask = prompt_mask.repeat_interleave(samples, 0)
    last = positions[:, -1].repeat_interleave(samples, 0)
    models = [model] if reference is None else [model, reference]
    states = []
    with torch.no_grad():
        for net in models:
            out = net(input_ids=ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True)
            out.past_key_values.batch_repeat_interleave(samples)
            states.append([out.past_key_values, out.logits[:, -1].float().repeat_interleave(samples, 0)])
        answers: list[dict[str, list[Any]]] = [
            {"tokens": [], "logps": [], "entropy": [], "ref_logps": [], "kl": []} for _ in range(rows)
        ]
        done = torch.zeros(rows, dtype=torch.bool)
        for _ in range(max_new_tokens):
            logp = torch.log_softmax(states[0][1], dim=-1)
            probs = logp.exp()
            picked = (
                logp.argmax(-1) if greedy else torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            )
            entropy = -(probs * logp).sum(-1)
            chosen = logp.gather(1, picked[:, None]).squeeze(1)
            if reference is not None:
                ref_logp = torch.log_softmax(states[1][1], dim=-1)
                kl = (probs * (logp - ref_logp)).sum(-1)
                ref_chosen = ref_logp.gather(1, picked[:, None]).squeeze(1)
            for i in range(rows):
                if not done[i]:
                    a = answers[i]
                    a["tokens"].append(int(picked[i]))
                    a["logps"].append(float(chosen[i]))
                    a["entropy"].append(float(entropy[i]))
                    if reference is not None:
                        a["ref_logps"].append(float(ref_chosen[i]))
                        a["kl"].append(float(kl[i]))
            done |= picked == stop_id
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones(rows, 1, dtype=torch.long)], dim=1)
            last = last + 1
            for net, state in zip(models, states, strict=True):
                out = net(
                    input_ids=picked[:, None],
                    attention_mask=mask,
                    position_ids=last[:, None],
                    past_key_values=state[0],
                    use_cache=True,
                )
                state[0], state[1] = out.past_key_values, out.logits[:, -1].float()
    return answers


def evaluate_checkpoint(
    checkpoint: Path, start: Any, tasks: Sequence[dict[str, Any]], *, samples: int, seed: int, max_new: int
) -> dict[str, Any]:
    """One checkpoint on `tasks`' decision turns: sampled and greedy exact-fix rates, malformed share,
    entropy and KL to the start on its own samples, and the per-task sampled rates (paired comparisons)."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    tokenizer: Any = AutoTokenizer.from_pretrained(str(checkpoint))
    model: Any = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    model.eval()
    common: dict[str, Any] = {
        "stop_id": int(tokenizer.convert_tokens_to_ids(STOP)),
        "pad_id": int(tokenizer.pad_token_id),
        "max_new_tokens": max_new,
        "generator": torch.Generator().manual_seed(seed),
    }
    prompts = [t["prompt_ids"] for t in tasks]
    sampled_answers = generate(model, prompts, samples=samples, greedy=False, reference=start, **common)
    greedy_answers = generate(model, prompts, samples=1, greedy=True, **common)

    def scored(answers: list[dict[str, Any]], per: int) -> list[Any]:
        texts = tokenizer.batch_decode([a["tokens"] for a in answers], skip_special_tokens=False)
        return [score(text, tasks[i // per]["command"]) for i, text in enumerate(texts)]

    sampled, greedy_scored = scored(sampled_answers, samples), scored(greedy_answers, 1)
    n = len(sampled)
    k1 = [lp - ref for a in sampled_answers for lp, ref in zip(a["logps"], a["ref_logps"], strict=True)]
    tokens = max(1, len(k1))
    return {
        "tasks": len(tasks),
        "samples": n,
        "sampled_exact_fix": sum(s.reward for s in sampled) / n,
        "greedy_exact_fix": sum(s.reward for s in greedy_scored) / len(tasks),
        "malformed": sum(s.malformed for s in sampled) / n,
        "entropy": sum(e for a in sampled_answers for e in a["entropy"]) / tokens,
        "kl_start": sum(k for a in sampled_answers for k in a["kl"]) / tokens,
        "kl_start_k1": sum(k1) / tokens,
        "kl_start_per_answer": sum(k for a in sampled_answers for k in a["kl"]) / n,
        "answer_tokens": len(k1) / n,
        "per_task": [
            sum(s.reward for s in sampled[i * samples : (i + 1) * samples]) / samples
            for i in range(len(tasks))
        ],
    }


def run_evaluate(spec: dict[str, Any]) -> None:
    """Every checkpoint of `spec` by `evaluate_checkpoint`, on validation and on fixed training tasks."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    torch.set_num_threads(int(spec["threads"]))
    start: Any = AutoModelForCausalLM.from_pretrained(spec["start"], dtype=torch.float32)
    start.eval()
    results: dict[str, dict[str, Any]] = {}
    for name, folder in spec["checkpoints"].items():
        began = time.perf_counter()
        results[name] = {
            split: evaluate_checkpoint(
                Path(folder),
                start,
                spec["tasks"][split],
                samples=int(spec["samples"][split]),
                seed=int(spec["seed"]),
                max_new=int(spec["max_new_tokens"]),
            )
            for split in ("validation", "train")
        }
        results[name]["seconds"] = time.perf_counter() - began
    Path(spec["out"]).write_text(json.dumps(results) + "\n")


# -- the driver --------------------------------------------------------------------------------------------


def run(argv: list[str], *, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(argv, check=False, env=env)  # noqa: S603 -- our own interpreter and scripts
    if done.returncode != 0:
        raise RuntimeError(f"failed ({done.returncode}): {shlex.join(argv)}")


@dataclass
class Pool:
    """At most `jobs` child processes at a time; each logs to its own file."""

    jobs: int
    running: list[tuple[subprocess.Popen[bytes], str, Path]] = field(default_factory=list)

    def start(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        while len(self.running) >= self.jobs:
            self._reap()
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)  # noqa: S603
        self.running.append((proc, shlex.join(argv), log))

    def _reap(self) -> None:
        while True:
            for item in self.running:
                code = item[0].poll()
                if code is not None:
                    self.running.remove(item)
                    if code != 0:
                        tail = item[2].read_text(errors="replace")[-3000:]
                        raise RuntimeError(f"failed ({code}): {item[1]}\n{tail}")
                    return
            time.sleep(0.5)

    def wait(self) -> None:
        while self.running:
            self._reap()


def trl_python(explicit: str | None) -> str:
    """TRL's virtualenv python: given, or made/found by scripts/get-trl.sh (matching this transformers)."""
    if explicit:
        return explicit
    done = subprocess.run(  # noqa: S603 -- the repository's own script
        ["bash", str(REPO / "scripts" / "get-trl.sh"), PY],  # noqa: S607 -- bash from PATH
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"scripts/get-trl.sh failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(
            [str(REPO / p) for p in ("", "operator", "proxy", "sandbox-images", "trainer")]
            + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    )
    return env


def _cpu_model() -> str:
    """The CPU's model name (Linux), for the results file."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def read_steps(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "steps.jsonl").read_text().splitlines()]


def mean(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else None


def side_curves(steps: list[dict[str, Any]], evals: dict[str, Any], side: str) -> dict[str, Any]:
    """One side's per-step training figures and its evaluated checkpoints."""
    curve = {
        "train_reward": [mean(r["rewards"]) for r in steps],
        "train_malformed": [mean([float(m) for m in r["malformed"]]) for r in steps],
        "answer_tokens": [mean([float(n) for n in r["completion_tokens"]]) for r in steps],
        "seconds": [r.get("seconds") for r in steps],
    }
    if side == "legorl":
        for key in ("entropy", "grad_norm", "loss", "trials_kept", "zero_variance_groups", "is_ess"):
            curve[f"own_{key}"] = [r["legorl"].get(key) for r in steps]
    else:
        for key in ("entropy", "grad_norm", "loss", "frac_reward_zero_std"):
            curve[f"own_{key}"] = [r.get("trl", {}).get(key) for r in steps]
    evaluated = sorted(
        ((int(name.split("-")[-1]), result) for name, result in evals.items() if name.startswith(f"{side}-")),
        key=lambda item: item[0],
    )
    curve["evaluations"] = [{"step": step, **result} for step, result in evaluated]
    return curve


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    """Mean of a − b over tasks and its standard error (the same tasks, the same evaluation seed)."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    m = sum(d) / len(d)
    var = sum((x - m) ** 2 for x in d) / max(1, len(d) - 1)
    return {"difference": m, "standard_error": math.sqrt(var / len(d))}


def agreement(runs: list[dict[str, Any]], last: int) -> dict[str, Any]:
    """legorl − TRL, per seed and averaged, on the figures that decide "does it learn": the training
    reward of the last `last` steps, the final validation (and training-task) sampled exact-fix rates with
    their paired standard errors over tasks, and the seeds' own spread on each side (the noise)."""
    out: dict[str, Any] = {"per_seed": []}
    for r in runs:
        if "trl" not in r:
            continue
        lg, tr = r["legorl"], r["trl"]
        row: dict[str, Any] = {"seed": r["seed"]}
        row["train_reward_last"] = {
            "legorl": mean(lg["train_reward"][-last:]),
            "trl": mean(tr["train_reward"][-last:]),
        }
        row["train_reward_last"]["difference"] = (
            row["train_reward_last"]["legorl"] - row["train_reward_last"]["trl"]
        )
        for split in ("validation", "train"):
            a, b = lg["evaluations"][-1][split], tr["evaluations"][-1][split]
            row[f"final_{split}"] = {
                "legorl": a["sampled_exact_fix"],
                "trl": b["sampled_exact_fix"],
                **paired(a["per_task"], b["per_task"]),
                "legorl_kl": a["kl_start_k1"],
                "trl_kl": b["kl_start_k1"],
                "legorl_entropy": a["entropy"],
                "trl_entropy": b["entropy"],
            }
        out["per_seed"].append(row)
    if out["per_seed"]:
        out["mean_difference"] = {
            key: mean([row[key]["difference"] for row in out["per_seed"]])
            for key in ("train_reward_last", "final_validation", "final_train")
        }

    # Over seeds: each side's spread, and the difference of the sides' means with its standard error from
    # the seeds' own variance (run-to-run noise: sampling, task order), where there are several seeds.
    def read(curve: dict[str, Any], key: str) -> float:
        if key == "train_reward_last":
            return mean(curve["train_reward"][-last:]) or 0.0
        split = key.removeprefix("final_")
        value: float = curve["evaluations"][-1][split]["sampled_exact_fix"]
        return value

    over_seeds: dict[str, Any] = {}
    for key in ("final_validation", "final_train", "train_reward_last"):
        values = {side: [read(r[side], key) for r in runs if side in r] for side in ("legorl", "trl")}
        entry: dict[str, Any] = {side: v for side, v in values.items() if v}
        if all(len(v) > 1 for v in values.values()):
            sd = {side: _sd(v) for side, v in values.items()}
            entry["seed_sd"] = sd
            entry["difference_of_means"] = sum(values["legorl"]) / len(values["legorl"]) - sum(
                values["trl"]
            ) / len(values["trl"])
            entry["standard_error"] = math.sqrt(sum(sd[k] ** 2 / len(values[k]) for k in values))
        over_seeds[key] = entry
    out["over_seeds"] = over_seeds
    return out


def _sd(values: Sequence[float]) -> float:
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def gradient_check(
    plan: Plan,
    work: Path,
    *,
    start: Path,
    tasks: list[dict[str, Any]],
    max_new: int,
    trl_py: str,
    env: dict[str, str],
) -> dict[str, Any]:
    """The two trainers' gradients on ONE batch: the start's answers to the first step (of the first seed's
    order) whose groups have reward spread, given to both. legorl's with `Drop` (its default) and `Keep`,
    TRL's through its rollout_func. Same direction expected in both (flat groups add no gradient); the
    norms: equal with `Keep`, legorl's larger by all tokens / tokens of groups with spread with `Drop`."""
    import torch  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tokenizer: Any = AutoTokenizer.from_pretrained(str(start))
    model: Any = AutoModelForCausalLM.from_pretrained(str(start), dtype=torch.float32)
    model.eval()
    generator = torch.Generator().manual_seed(plan.eval_seed)
    group = plan.group_size
    batches = []
    for chosen in schedule(len(tasks), plan.steps, plan.prompts_per_step, plan.settings[0].seeds[0]):
        answers = generate(
            model,
            [tasks[i]["prompt_ids"] for i in chosen],
            samples=group,
            greedy=False,
            stop_id=int(tokenizer.convert_tokens_to_ids(STOP)),
            pad_id=int(tokenizer.pad_token_id),
            max_new_tokens=max_new,
            generator=generator,
        )
        texts = tokenizer.batch_decode([a["tokens"] for a in answers], skip_special_tokens=False)
        rewards = [score(t, tasks[chosen[k // group]]["command"]).reward for k, t in enumerate(texts)]
        batches.append((chosen, answers, rewards))
        if sum(len(set(rewards[g * group : (g + 1) * group])) > 1 for g in range(len(chosen))) >= 2:
            source = "exact fix"
            break
    else:
        # A start that never fixes (the quick run's): the gradients given rewards are what is compared, so
        # the first batch gets rewards by rule, the first answer of each group rewarded.
        chosen, answers, _ = batches[0]
        rewards = [1.0 if k % group == 0 else 0.0 for k in range(len(answers))]
        source = "synthetic: the first answer of each group"
    spread = [len(set(rewards[g * group : (g + 1) * group])) > 1 for g in range(len(chosen))]
    lengths = [len(a["tokens"]) for a in answers]
    spread_tokens = sum(n for k, n in enumerate(lengths) if spread[k // group])
    replay = {
        "rows": [i for i in chosen for _ in range(group)],
        "completion_ids": [a["tokens"] for a in answers],
        "logprobs": [a["logps"] for a in answers],
        "rewards": rewards,
    }
    job = {
        "checkpoint": str(start),
        "tasks": tasks,
        "schedule": [chosen],
        "group_size": group,
        "learning_rate": plan.settings[0].learning_rate,
        "max_new_tokens": max_new,
        "seed": 1,
        "save_every": 1,
        "threads": plan.threads,
        "replay": replay,
    }
    # (command, zeroVarianceGroups, lossAggregation). The control is a plausible mis-mapping (TRL's own
    # default "grpo" loss averages each sequence first): what the check reads when the losses differ.
    sides = {
        "legorl-drop": ("legorl-gradient", "Drop", "TokenMean"),
        "legorl-keep": ("legorl-gradient", "Keep", "TokenMean"),
        "control-sequence-mean": ("legorl-gradient", "Keep", "SequenceMeanTokenMean"),
        "trl": ("trl", "Drop", "TokenMean"),
    }
    pool = Pool(plan.jobs)
    for name, (command, zero_variance, aggregation) in sides.items():
        path = work / f"{name}-job.json"
        side_job = {
            **job,
            "out": str(work / name),
            "settings": {
                **LEGORL_DEFAULTS,
                "zero_variance_groups": zero_variance,
                "loss_aggregation": aggregation,
            },
        }
        path.write_text(json.dumps(side_job))
        argv = (
            [trl_py, str(HERE / "_trl_grpo.py"), str(path)]
            if command == "trl"
            else [PY, str(HERE / "learning_vs_trl.py"), command, str(path)]
        )
        pool.start(argv, work / f"{name}.log", env)
    pool.wait()

    def flat(name: str) -> Any:
        tensors = load_file(str(work / name / "gradient" / "model.safetensors"))
        return {k: v.double().reshape(-1) for k, v in sorted(tensors.items())}

    trl_grad = flat("trl")
    trl_norm = read_steps(work / "trl")[0]["trl"]["grad_norm"]
    out: dict[str, Any] = {
        "rewards": source,
        "samples": len(answers),
        "groups_with_spread": sum(spread),
        "reward_mean": sum(rewards) / len(rewards),
        "answer_tokens": sum(lengths),
        "answer_tokens_in_groups_with_spread": spread_tokens,
        "trl_grad_norm_before_clipping": trl_norm,
    }
    for name in ("legorl-drop", "legorl-keep", "control-sequence-mean"):
        mine = flat(name)
        if set(mine) != set(trl_grad):
            raise RuntimeError(f"{name}: other tensors than TRL's: {sorted(set(mine) ^ set(trl_grad))[:5]}")
        a = torch.cat([mine[k] for k in mine])
        b = torch.cat([trl_grad[k] for k in mine])
        a_unit, b_unit = a / a.norm(), b / b.norm()
        worst = max(
            float(
                (mine[k] / a.norm() - trl_grad[k] / b.norm()).norm()
                / (trl_grad[k] / b.norm()).norm().clamp(min=1e-30)
            )
            for k in mine
            if float(trl_grad[k].norm()) > 1e-6 * float(b.norm())
        )
        figures = json.loads((work / name / "figures.json").read_text())
        out[name] = {
            "cosine": float(a_unit @ b_unit),
            "relative_difference": float((a_unit - b_unit).norm()),
            "worst_tensor_relative_difference": worst,
            "grad_norm_before_clipping": figures["grad_norm"],
            "norm_ratio_to_trl": figures["grad_norm"] / trl_norm,
            "fidelity_max_abs_logprob_delta": figures.get("fidelity_max_abs_logprob_delta"),
        }
    out["expected_norm_ratio_drop"] = sum(lengths) / spread_tokens
    return out


def main(argv: Sequence[str] | None = None) -> int:  # noqa: PLR0915 -- the benchmark's one sequence
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument(
        "command",
        nargs="?",
        default="compare",
        choices=["compare", "gradient", "legorl", "legorl-gradient", "evaluate"],
    )
    p.add_argument("job", nargs="?", type=Path, help="legorl / evaluate: the job's JSON")
    p.add_argument("--quick", action="store_true", help="a few steps of one setting (the test's run)")
    p.add_argument("--no-trl", action="store_true", help="legorl's side only")
    p.add_argument("--trl-python", help="TRL's virtualenv python (default: scripts/get-trl.sh's)")
    p.add_argument("--work", type=Path, default=REPO / ".legorl" / "learning-vs-trl")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "learning-vs-trl.json")
    p.add_argument("--only", help="comma-separated setting names (default: all)")
    p.add_argument("--seeds", help="comma-separated seeds, replacing each setting's")
    p.add_argument("--steps", type=int, help="RL steps of every run (default: the plan's)")
    p.add_argument("--jobs", type=int, help="processes at a time (default 2, one torch thread each)")
    p.add_argument("--runs", help="the runs' folder under --work (default full, or quick)")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="keep a side's training whose folder holds the same job, finished",
    )
    p.add_argument("--no-gradient-check", action="store_true", help="leave the one-batch gradient check out")
    args = p.parse_args(argv)
    if args.command == "legorl":
        run_legorl(json.loads(args.job.read_text()))
        return 0
    if args.command == "evaluate":
        run_evaluate(json.loads(args.job.read_text()))
        return 0
    if args.command == "legorl-gradient":
        run_legorl_gradient(json.loads(args.job.read_text()))
        return 0

    started = time.monotonic()
    plan = QUICK if args.quick else FULL
    if args.only:
        wanted = set(args.only.split(","))
        plan = replace(plan, settings=tuple(s for s in plan.settings if s.name in wanted))
    if args.seeds:
        seeds = tuple(int(x) for x in args.seeds.split(","))
        plan = replace(plan, settings=tuple(replace(s, seeds=seeds) for s in plan.settings))
    plan = replace(plan, steps=args.steps or plan.steps, jobs=args.jobs or plan.jobs)
    commit = git_commit()
    work: Path = args.work / (args.runs or ("quick" if args.quick else "full"))
    work.mkdir(parents=True, exist_ok=True)
    trl_py = None if args.no_trl else trl_python(args.trl_python)

    demos = record_demos(plan, args.work)
    start, warm = warm_start(plan, args.work, demos)
    train_tasks = decision_turns(start, demos["train"])
    validation_tasks = decision_turns(start, demos["validation"])
    longest = max(len(t["answer_ids"]) for t in train_tasks + validation_tasks)
    max_new = longest + 8
    if args.command == "gradient":  # the gradient check alone, into its own results file
        env = child_env(plan.threads)
        check = gradient_check(
            plan, work / "gradient-check", start=start, tasks=train_tasks, max_new=max_new,
            trl_py=str(trl_py), env=env,
        )  # fmt: skip
        args.out.write_text(
            json.dumps(
                {
                    "benchmark": "learning-vs-trl gradient check",
                    "command": shlex.join(
                        [
                            "python",
                            "benchmarks/learning_vs_trl.py",
                            *(argv if argv is not None else sys.argv[1:]),
                        ]
                    ),
                    "git_commit": commit,
                    "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "cpu": _cpu_model()},
                    "start": start.name,
                    "gradient_check": check,
                },
                indent=1,
            )
            + "\n"
        )
        say(json.dumps(check, indent=1))
        return 0
    lengths = [len(t["prompt_ids"]) for t in train_tasks]
    say(
        f"start {start.name}; {len(train_tasks)} training and {len(validation_tasks)} validation decision "
        f"turns; prompts {min(lengths)}–{max(lengths)} tokens; at most {max_new} new tokens"
    )

    env = child_env(plan.threads)
    pool = Pool(plan.jobs)
    runs: list[dict[str, Any]] = []
    for setting in plan.settings:
        for seed in setting.seeds:
            folder = work / setting.name / f"seed-{seed}"
            job = {
                "checkpoint": str(start),
                "tasks": train_tasks,
                "schedule": schedule(len(train_tasks), plan.steps, plan.prompts_per_step, seed),
                "group_size": plan.group_size,
                "learning_rate": setting.learning_rate,
                "max_new_tokens": max_new,
                "seed": seed,
                "save_every": plan.save_every,
                "threads": plan.threads,
                "settings": {**LEGORL_DEFAULTS, "zero_variance_groups": setting.zero_variance_groups},
            }
            sides = ["legorl"] + (["trl"] if setting.trl and trl_py else [])
            for side in sides:
                side_job = {**job, "out": str(folder / side)}
                path = folder / f"{side}-job.json"
                done = (folder / side / "summary.json").is_file() and path.is_file()
                if args.reuse and done and json.loads(path.read_text()) == side_job:
                    say(f"{setting.name} seed {seed}: {side} trained before ({folder / side})")
                    continue
                shutil.rmtree(folder / side, ignore_errors=True)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(side_job))
                child = (
                    [PY, str(HERE / "learning_vs_trl.py"), "legorl", str(path)]
                    if side == "legorl"
                    else [str(trl_py), str(HERE / "_trl_grpo.py"), str(path)]
                )
                say(f"{setting.name} seed {seed}: {side}")
                pool.start(child, folder / f"{side}.log", env)
            runs.append({"setting": setting, "seed": seed, "folder": folder, "sides": sides, "job": job})
    pool.wait()
    trained = time.monotonic()

    # One evaluator for every checkpoint of both sides (and the start), the same seed for all.
    eval_tasks = {"validation": validation_tasks, "train": train_tasks[: plan.eval_train_tasks]}
    samples = {"validation": plan.eval_samples, "train": max(1, plan.eval_samples // 4)}
    specs = []
    for r in runs:
        checkpoints = {
            f"{side}-{folder.name}": str(folder)
            for side in r["sides"]
            for folder in sorted((r["folder"] / side / "checkpoints").iterdir())
            if int(folder.name.split("-")[-1]) % plan.eval_every == 0
            or int(folder.name.split("-")[-1]) == plan.steps
        }
        specs.append((r["folder"] / "evaluation.json", checkpoints))
    specs.append((work / "start-evaluation.json", {"start-0": str(start)}))
    for out_path, checkpoints in specs:
        spec = {
            "start": str(start),
            "checkpoints": checkpoints,
            "tasks": eval_tasks,
            "samples": samples,
            "seed": plan.eval_seed,
            "max_new_tokens": max_new,
            "threads": plan.threads,
            "out": str(out_path),
        }
        spec_path = out_path.with_suffix(".spec.json")
        spec_path.write_text(json.dumps(spec))
        pool.start(
            [PY, str(HERE / "learning_vs_trl.py"), "evaluate", str(spec_path)],
            out_path.with_suffix(".log"),
            env,
        )
    pool.wait()
    evaluated = time.monotonic()
    gradient = (
        None
        if args.no_gradient_check
        else gradient_check(
            plan,
            work / "gradient-check",
            start=start,
            tasks=train_tasks,
            max_new=max_new,
            trl_py=trl_py,
            env=env,
        )
        if trl_py
        else None
    )

    start_eval = json.loads((work / "start-evaluation.json").read_text())["start-0"]
    results_runs = []
    versions: dict[str, Any] = {}
    for r in runs:
        evals = json.loads((r["folder"] / "evaluation.json").read_text())
        entry: dict[str, Any] = {"setting": r["setting"].name, "seed": r["seed"]}
        for side in r["sides"]:
            curve = side_curves(read_steps(r["folder"] / side), evals, side)
            curve["evaluations"].insert(0, {"step": 0, **start_eval})
            summary = json.loads((r["folder"] / side / "summary.json").read_text())
            curve["wall_seconds"] = summary["seconds"]
            versions[side] = {k: v for k, v in summary.items() if k != "seconds"}
            entry[side] = curve
        results_runs.append(entry)
    last = max(1, min(10, plan.steps // 3))
    by_setting = {}
    for setting in plan.settings:
        mine = [e for e in results_runs if e["setting"] == setting.name]
        by_setting[setting.name] = agreement(mine, last)
    if "trl" in versions and versions["trl"]["transformers"] != versions["legorl"]["transformers"]:
        raise RuntimeError(f"transformers differs between the sides: {versions}")
    result = {
        "benchmark": "learning-vs-trl",
        "command": shlex.join(
            ["python", "benchmarks/learning_vs_trl.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "git_commit": commit,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "cpu": _cpu_model()},
        "versions": versions,
        "plan": {**asdict(plan), "settings": [asdict(s) for s in plan.settings]},
        "legorl_settings": LEGORL_DEFAULTS,
        "start": {
            "checkpoint": start.name,
            "warm_start": {
                k: warm.get(k) for k in ("steps_trained", "validation_checks", "validation_copying")
            },
        },
        "tasks": {"train": len(train_tasks), "validation": len(validation_tasks), "max_new_tokens": max_new},
        "agreement_last_steps": last,
        "agreement": by_setting,
        "runs": results_runs,
        "gradient_check": gradient,
        "wall_seconds": {
            "train": trained - started,
            "evaluate": evaluated - trained,
            "gradient_check": time.monotonic() - evaluated,
            "total": time.monotonic() - started,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".svg").write_text(plot(result))
    say(json.dumps(by_setting, indent=1))
    say(f"results: {args.out} and {args.out.with_suffix('.svg')} ({time.monotonic() - started:.0f} s)")
    return 0


# -- the plot (plain SVG: no plotting library in either environment) --------------------------------------

COLOURS = {"legorl": "#1f77b4", "trl": "#d62728"}
PANEL = (300, 190)
"""Width and height of one panel."""
PANELS = (
    ("training reward (exact fix, per step)", "train_reward", None),
    ("validation: sampled exact-fix rate", "evaluations", ("validation", "sampled_exact_fix")),
    ("validation: entropy per token (nats)", "evaluations", ("validation", "entropy")),
    ("validation: KL to the start per token (k1)", "evaluations", ("validation", "kl_start_k1")),
)


def _series(curve: dict[str, Any], key: str, path: tuple[str, str] | None) -> list[tuple[float, float]]:
    if path is None:
        return [(i + 1, v) for i, v in enumerate(curve[key]) if v is not None]
    return [(e["step"], e[path[0]][path[1]]) for e in curve[key]]


def _smoothed(points: list[tuple[float, float]], window: int) -> list[tuple[float, float]]:
    """A trailing moving average of `window` points."""
    out = []
    for i, (x, _) in enumerate(points):
        part = points[max(0, i - window + 1) : i + 1]
        out.append((x, sum(v for _, v in part) / len(part)))
    return out


def _text(x: float, y: float, text: str, **attrs: str) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    return f'<text x="{x:.1f}" y="{y:.1f}"{extra}>{text}</text>'


def _panel(
    x0: int, y0: int, title: str, lines: list[tuple[str, list[tuple[float, float]]]], rate: bool
) -> list[str]:
    """One panel: a frame, grid and tick labels, a polyline per (side, points); `rate`: a 0–1 scale."""
    w, h = PANEL
    xs = [x for _, pts in lines for x, _ in pts] or [0.0, 1.0]
    ys = [y for _, pts in lines for _, y in pts] or [0.0, 1.0]
    x_hi = max(xs) or 1.0
    y_lo = min(0.0, *ys)
    y_hi = (1.0 if max(ys) > 0.5 else 0.6) if rate else (max(ys) * 1.1 or 1.0)
    y_hi = max(y_hi, y_lo + 1e-9)

    def sx(x: float) -> float:
        return x0 + x / x_hi * w

    def sy(y: float) -> float:
        return y0 + h - (y - y_lo) / (y_hi - y_lo) * h

    out = [
        _text(x0, y0 - 6, title, font_weight="bold"),
        f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#999"/>',
    ]
    for i in range(5):
        yv = y_lo + (y_hi - y_lo) * i / 4
        out.append(f'<line x1="{x0}" x2="{x0 + w}" y1="{sy(yv):.1f}" y2="{sy(yv):.1f}" stroke="#eee"/>')
        out.append(_text(x0 - 4, sy(yv) + 4, f"{yv:.3g}", text_anchor="end", fill="#555"))
    for i in range(6):
        xv = x_hi * i / 5
        out.append(_text(sx(xv), y0 + h + 14, f"{xv:.0f}", text_anchor="middle", fill="#555"))
    for side, pts in lines:
        d = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        out.append(f'<polyline points="{d}" fill="none" stroke="{COLOURS[side]}" stroke-width="1.5"/>')
        if len(pts) < 12:  # evaluated checkpoints: mark them
            out += [
                f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{COLOURS[side]}"/>' for x, y in pts
            ]
    return out


def plot(result: dict[str, Any]) -> str:
    """One row per setting, one panel per figure; a line per side and seed (training reward: a 5-step
    trailing average)."""
    settings = [s["name"] for s in result["plan"]["settings"]]
    (w, h), left, top, gap = PANEL, 60, 60, 40
    width = left + len(PANELS) * (w + gap)
    height = top + len(settings) * (h + gap + 20) + 30
    trl = result["versions"].get("trl", {}).get("trl", "")
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif"'
        ' font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
        _text(
            left,
            22,
            "legorl vs TRL: GRPO on the decision turns of builtin://tiny-read (commit "
            f"{result['git_commit'][:9]})",
            font_size="15",
        ),
        _text(left, 40, "legorl", fill=COLOURS["legorl"]),
        _text(left + 50, 40, f"TRL {trl}", fill=COLOURS["trl"]),
        _text(left + 130, 40, "one line per seed; training reward: 5-step trailing mean", fill="#555"),
    ]
    for row, name in enumerate(settings):
        runs = [r for r in result["runs"] if r["setting"] == name]
        y0 = top + row * (h + gap + 20)
        for col, (title, key, path) in enumerate(PANELS):
            lines = []
            for r in runs:
                for side in ("legorl", "trl"):
                    if side in r:
                        pts = _series(r[side], key, path)
                        lines.append((side, _smoothed(pts, 5) if path is None else pts))
            rate = path is None or path[1] == "sampled_exact_fix"
            parts += _panel(left + col * (w + gap), y0, f"{name}: {title}", lines, rate)
        parts.append(_text(width / 2, y0 + h + 30, "step", text_anchor="middle", fill="#555"))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
