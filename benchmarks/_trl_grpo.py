"""TRL's side of the GRPO cross-check: `trl.GRPOTrainer` on the job `benchmarks/learning_vs_trl.py` wrote.

Runs in TRL's own virtualenv (`scripts/get-trl.sh`), importing nothing of legorl: only `_exact_fix` (this
folder, standard library), the reward both trainers share. The job (JSON) names the start checkpoint, the
decision turns (prompt text, the token ids legorl samples after, the expected command), the prompts of
every step, and the settings; how each legorl setting maps onto a `GRPOConfig` field is written in
`benchmarks/learning_vs_trl.py`'s docstring, and `grpo_config()` below is that mapping.

Writes into the job's `out` folder: `steps.jsonl` (per step: the rewards of its samples, malformed
answers, TRL's own logged figures, seconds), `checkpoints/step-N/` (Hugging Face checkpoints every
`save_every` steps, scored afterwards by the same evaluator as legorl's) and `summary.json` (versions, wall
time, the prompt-token check).

    <trl-venv>/bin/python benchmarks/_trl_grpo.py JOB.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from _exact_fix import STOP, score


def grpo_config(job: dict[str, Any], out: Path) -> Any:
    """The GRPOConfig that matches legorl's settings in `job` (the mapping in learning_vs_trl.py)."""
    from trl import GRPOConfig  # noqa: PLC0415

    s = job["settings"]
    group = int(job["group_size"])
    prompts = len(job["schedule"][0])
    return GRPOConfig(
        output_dir=str(out / "trainer"),
        # One generation batch of P prompts × G samples per optimizer step, used once (on-policy): legorl's
        # one mini-batch per step.
        num_generations=group,
        per_device_train_batch_size=prompts * group,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_steps=len(job["schedule"]),
        # Prompts in the job's order (legorl's side takes the same ones), not TRL's own shuffle.
        shuffle_dataset=False,
        max_completion_length=int(job["max_new_tokens"]),
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        # Loss: legorl's TokenMean is TRL's "dapo" (the token losses of the whole generation batch over its
        # completion tokens); GroupMeanStd is scale_rewards="group"; clipLow/High are epsilon/epsilon_high.
        loss_type="dapo",
        scale_rewards="group",
        epsilon=float(s["clip_low"]),
        epsilon_high=float(s["clip_high"]),
        beta=0.0,
        importance_sampling_level="token",
        mask_truncated_completions=False,
        # legorl's model has no load-balancing loss (Qwen3-MoE's config would add one here by default).
        router_aux_loss_coef=0.0,
        # AdamW as legorl builds it, constant learning rate, clipping by the global gradient norm.
        learning_rate=float(job["learning_rate"]),
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=float(s["weight_decay"]),
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=float(s["grad_clip"]),
        optim="adamw_torch",
        # float32 throughout, as legorl's trainer (dtype float32) and the checkpoint; no recomputation.
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        seed=int(job["seed"]),
        data_seed=int(job["seed"]),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def main(argv: list[str]) -> int:  # noqa: PLR0915 -- one run, start to end
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    import trl  # noqa: PLC0415
    from datasets import Dataset  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: PLC0415

    job = json.loads(Path(argv[0]).read_text())
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(int(job.get("threads", 1)))
    started = time.perf_counter()

    tokenizer = AutoTokenizer.from_pretrained(job["checkpoint"])
    tasks = job["tasks"]
    # GRPOTrainer tokenizes a text prompt with `processing_class(text=prompts)["input_ids"]`: each must give
    # exactly the token ids legorl's side samples after (the decision turn as the harness rendered it).
    encoded = tokenizer(text=[t["prompt_text"] for t in tasks])["input_ids"]
    for task, ids in zip(tasks, encoded, strict=True):
        if list(ids) != task["prompt_ids"]:
            raise SystemExit(f"{task['task_id']}: TRL's tokenization of the prompt differs from legorl's")

    rows = [
        {"prompt": tasks[i]["prompt_text"], "command": tasks[i]["command"], "task": i}
        for step in job["schedule"]
        for i in step
    ]
    dataset = Dataset.from_list(rows)
    model = AutoModelForCausalLM.from_pretrained(job["checkpoint"], dtype=torch.float32)

    per_step: dict[int, dict[str, Any]] = {}
    trainer_box: list[Any] = []
    replay = job.get("replay")

    def exact_fix(
        prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kwargs: Any
    ) -> list[float]:
        step = int(trainer_box[0].state.global_step) + 1
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=False)
        scored = [score(text, command) for text, command in zip(texts, kwargs["command"], strict=True)]
        # The gradient check gives the batch's rewards (they may be set by rule); a run scores its answers.
        rewards = list(replay["rewards"]) if replay is not None else [s.reward for s in scored]
        per_step[step] = {
            "step": step,
            "tasks": kwargs["task"],
            "rewards": rewards,
            "malformed": [s.malformed for s in scored],
            "completion_tokens": [len(c) for c in completion_ids],
        }
        return rewards

    class Record(TrainerCallback):
        """Per-step figures, the step's time and the checkpoints the evaluator scores."""

        def __init__(self) -> None:
            self.began = time.perf_counter()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.began = time.perf_counter()

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and state.global_step in per_step:
                per_step[state.global_step].setdefault("trl", {}).update(
                    {k: v for k, v in logs.items() if isinstance(v, int | float)}
                )

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step = int(state.global_step)
            per_step.setdefault(step, {"step": step})["seconds"] = time.perf_counter() - self.began
            if step % int(job["save_every"]) == 0 or step == len(job["schedule"]):
                folder = out / "checkpoints" / f"step-{step}"
                trainer_box[0].model.save_pretrained(str(folder), safe_serialization=True)
                tokenizer.save_pretrained(str(folder))

    rollout = None
    if replay is not None:
        # The gradient check: no sampling, the recorded answers of one batch (TRL's public rollout_func),
        # and the gradient TRL steps with, saved as a checkpoint of gradients (after its clipping).
        def rollout(prompts: list[str], trainer: Any) -> dict[str, Any]:
            if len(prompts) != len(replay["completion_ids"]):
                raise RuntimeError(
                    f"{len(prompts)} prompts for {len(replay['completion_ids'])} recorded answers"
                )
            return {
                "prompt_ids": [tasks[i]["prompt_ids"] for i in replay["rows"]],
                "completion_ids": replay["completion_ids"],
                "logprobs": replay["logprobs"],
            }

    class SaveGradient(TrainerCallback):
        """The gradient the optimizer is about to apply, in the checkpoint's own tensor layout."""

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            net = trainer_box[0].model
            kept = {n: p.detach().clone() for n, p in net.named_parameters()}
            with torch.no_grad():
                for _, p in net.named_parameters():
                    p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
                net.save_pretrained(str(out / "gradient"), safe_serialization=True)
                for n, p in net.named_parameters():
                    p.copy_(kept[n])

    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=exact_fix,
        args=grpo_config(job, out),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Record()] + ([SaveGradient()] if replay is not None else []),
        rollout_func=rollout,
    )
    trainer_box.append(trainer)
    # And what TRL itself sends to generation and the loss, every step: its own tokenization, observed.
    expected = {t["prompt_text"]: t["prompt_ids"] for t in tasks}
    tokenize = trainer._tokenize_prompts
    observed = [0]

    def checked(prompts: list[Any]) -> Any:
        got = tokenize(prompts)
        for text, ids in zip(prompts, got[0], strict=True):
            if list(ids) != expected[text]:
                raise RuntimeError("TRL tokenized a prompt to other ids than legorl's side samples after")
        observed[0] += len(prompts)
        return got

    trainer._tokenize_prompts = checked
    if tokenizer.eos_token != STOP:  # TRL stops at the eos token: legorl's side stops at STOP
        raise SystemExit(f"the checkpoint's eos token is {tokenizer.eos_token!r}, not {STOP}")
    trainer.train()
    with (out / "steps.jsonl").open("w") as f:
        for step in sorted(per_step):
            f.write(json.dumps(per_step[step]) + "\n")
    summary = {
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "prompt_ids_checked": len(tasks),
        "prompt_ids_observed": observed[0],
        "seconds": time.perf_counter() - started,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
