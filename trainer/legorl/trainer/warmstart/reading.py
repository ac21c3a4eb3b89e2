"""The warm start for `builtin://tiny-read`: SFT on the *training* split only, measured on validation.

A demonstration is what a careful agent does on a reading task, recorded with mini-swe-agent's own agent
loop (`demos.record`) in a real checkout: run the tests (`reading.TEST_COMMAND`, the same for every task),
then write the fix the output describes and submit in one command
(`sed -i '<line>s/<found>/<expected>/' <file> && echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`). The first
command is a habit; the second must be read off the observation, and its (found, expected) pair is never
the fix of a validation or test task (`legorl.sandbox.reading`'s pair split).

Nothing of the validation or test splits is trained on. The tokenizer is learned from the training
demonstrations only, split GPT-2 style (words, numbers and punctuation apart), so the names an agent
must copy are whole tokens wherever they occur: in `found=bonus` and in `s/bonus/weight/` alike.

How good the warm start is depends on how long it trains (`SftSettings.steps`): few steps teach the
action format and some copying; the copying is what RL can improve. `measure_copying` scores a checkpoint
on any split's second turns with the megatron model (greedy and sampled): the validation figure is what
settings are chosen by; the test split is never scored here.

`rejection_sft` is the "more SFT" baseline of `benchmarks/learning.py`: the warm start trained further,
with the same recipe, on the successful trials of a budget of rollouts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from legorl.trainer.models.tiny import IM_END
from legorl.trainer.warmstart.sft import (
    SftSequence,
    SftSettings,
    build_sequences,
    build_tokenizer,
    sample_completions,
    sft_train,
    write_skeleton,
)

if TYPE_CHECKING:
    from legorl.sandbox.task import TaskSet
    from legorl.trainer.warmstart.demos import Demonstration

__all__ = [
    "READING_SETTINGS",
    "demonstrations",
    "fix_and_submit",
    "load_demonstrations",
    "measure_copying",
    "rejection_sft",
    "save_demonstrations",
    "train_reading_policy",
]

READING_SETTINGS = SftSettings(
    steps=400, batch_tasks=16, learning_rate=3e-3, warmup_steps=10, sample_per_task=0
)
"""The warm start's defaults: at most 400 steps (seed 0 copies 0.9 of validation fixes by then), stopped
earlier by `TARGET_COPYING`."""
TARGET_COPYING = 0.15
"""Training stops once this share of sampled validation fixes is exact (checked every `CHECK_EVERY` steps
from `CHECK_FROM`): when the copying appears differs by seed (one seed copied 0.125 at 200 steps, another
0.0125), so a fixed step count gives warm starts of very different skill. Chosen on validation."""
CHECK_FROM = 100
CHECK_EVERY = 20


def fix_and_submit(fix_command: str) -> str:
    from legorl.trainer.warmstart.demos import SUBMIT_COMMAND  # noqa: PLC0415

    return f"{fix_command} && {SUBMIT_COMMAND}"


def demonstrations(
    task_set: TaskSet, split: str, *, workers: int | None = None, limit: int | None = None
) -> list[Demonstration]:
    """The careful agent's conversation on every task of `split` (its first LIMIT), recorded with mini's
    agent loop."""
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    from legorl.sandbox.reading import TEST_COMMAND  # noqa: PLC0415
    from legorl.sandbox.workspace import checkout_source  # noqa: PLC0415
    from legorl.trainer.warmstart.demos import Behaviour, Demonstration, mini_config, record  # noqa: PLC0415

    config = mini_config()
    tasks = [t for t in task_set if t.split == split][:limit]
    if not tasks:
        raise ValueError(f"no task of the task set is labelled {split!r}: use builtin://tiny-read")

    def one(task: Any) -> Demonstration:
        turns = [(None, TEST_COMMAND), (None, fix_and_submit(task.extra["legorl_fix_command"]))]
        with tempfile.TemporaryDirectory(prefix="legorl-demo-") as tmp:
            repo = Path(tmp) / "repo"
            checkout_source(task_set.source_path(task), task.base_commit, repo)
            recorded, observations = record(config, task, repo, turns)
        return Demonstration(task.instance_id, Behaviour.FIX, recorded, 1.0, observations)

    with ThreadPoolExecutor(max_workers=workers or min(8, (os.cpu_count() or 1) + 2)) as pool:
        return list(pool.map(one, tasks))


def save_demonstrations(demos: Sequence[Demonstration], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(d.to_json()) + "\n" for d in demos))
    tmp.replace(path)


def load_demonstrations(path: Path) -> list[Demonstration]:
    from legorl.trainer.warmstart.demos import Demonstration  # noqa: PLC0415

    return [Demonstration.from_json(json.loads(line)) for line in path.read_text().splitlines()]


@dataclass(frozen=True)
class CopyScore:
    """How often the policy writes the exact fix-and-submit command on a split's second turns."""

    tasks: int
    greedy: float
    """Share of tasks whose greedy second answer is exactly the demonstration's."""
    sampled: float
    """Share of sampled second answers (temperature 1) that are exactly the demonstration's."""
    samples: int


def _second_turns(
    tokenizer: Any, demos: Sequence[Demonstration], tools: Sequence[Mapping[str, Any]]
) -> list[tuple[list[int], list[int]]]:
    from legorl.trainer.warmstart.sft import _completion_ids, render_prompt  # noqa: PLC0415

    out = []
    for demo in demos:
        turn = demo.turns[1]
        out.append((render_prompt(tokenizer, turn.messages, tools), _completion_ids(tokenizer, turn)))
    return out


def measure_copying(
    net: Any, tokenizer: Any, demos: Sequence[Demonstration], *, samples: int = 4, seed: int = 0
) -> CopyScore:
    """Score the second turn (the fix, read off the test output) of `demos`' tasks with the megatron model."""
    from legorl.trainer.warmstart.demos import bash_tool  # noqa: PLC0415

    pairs = _second_turns(tokenizer, demos, [bash_tool()])
    stop = [tokenizer.convert_tokens_to_ids(IM_END)]
    longest = max(len(c) for _, c in pairs) + 8
    greedy = sample_completions(
        net, [p for p, _ in pairs], stop_ids=stop, max_new_tokens=longest, temperature=0
    )
    sampled = sample_completions(
        net, [p for p, _ in pairs for _ in range(samples)], stop_ids=stop, max_new_tokens=longest, seed=seed
    )
    hits = sum(g == c for g, (_, c) in zip(greedy, pairs, strict=True))
    sample_hits = sum(s == pairs[i // samples][1] for i, s in enumerate(sampled))
    return CopyScore(len(pairs), hits / len(pairs), sample_hits / max(1, len(sampled)), len(sampled))


def train_reading_policy(
    out: Path,
    train_demos: Sequence[Demonstration],
    settings: SftSettings = READING_SETTINGS,
    *,
    validation_demos: Sequence[Demonstration] = (),
    target_copying: float | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Tokenizer and model from `train_demos` only; the HF checkpoint goes to `out`. Returns the summary
    (also `out/sft.json`), with the copying score on `validation_demos` when given. With
    `target_copying`, training stops once that share of sampled validation fixes is exact."""
    import tempfile  # noqa: PLC0415

    from legorl.trainer.models import convert  # noqa: PLC0415
    from legorl.trainer.warmstart.demos import bash_tool  # noqa: PLC0415

    started = time.perf_counter()
    tools = [bash_tool()]
    # Split GPT-2 style, so a name the agent copies is one token in `found=bonus` and `s/bonus/weight/`.
    tokenizer = build_tokenizer(train_demos, tools, vocab_size=settings.vocab_size, split_lines=False)
    rows = build_sequences(tokenizer, train_demos, tools)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.skeleton-", dir=out.parent) as tmp:
        skeleton = write_skeleton(Path(tmp), tokenizer, settings)
        checks: list[dict[str, Any]] = []

        def reached(step: int, net: Any) -> bool:
            if target_copying is None or step < CHECK_FROM or step % CHECK_EVERY:
                return False
            score = measure_copying(net, tokenizer, validation_demos, samples=2, seed=settings.seed)
            checks.append({"step": step, **asdict(score)})
            log(f"step {step}: validation fixes exact {score.sampled:.3f} sampled, {score.greedy:.3f} greedy")
            return score.sampled >= target_copying

        if target_copying is not None and not validation_demos:
            raise ValueError("target_copying is measured on validation demonstrations: give them")
        result = sft_train(skeleton, rows, settings, log=log, stop_when=reached)
        summary: dict[str, Any] = {
            "settings": asdict(settings),
            "train_tasks": len({d.task_id for d in train_demos}),
            "vocab": len(tokenizer),
            "row_tokens": max(len(r.token_ids) for r in rows),
            "loss_first": result.losses[0],
            "loss_last": result.losses[-1],
            "train_seconds": result.seconds,
            "steps_trained": len(result.losses),
            "target_copying": target_copying,
            "validation_checks": checks,
        }
        if validation_demos:
            summary["validation_copying"] = asdict(
                measure_copying(result.model, tokenizer, validation_demos, seed=settings.seed)
            )
        (skeleton / "sft.json").write_text(json.dumps(summary, indent=2) + "\n")
        convert.save_hf_checkpoint(result.model, result.arch, out, source_dir=skeleton)
    summary["seconds"] = time.perf_counter() - started
    return summary


def rejection_sft(
    out: Path,
    start: Path,
    rows: Sequence[SftSequence],
    settings: SftSettings,
    *,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """`start` (an HF checkpoint) trained further with SFT on `rows` (successful trials' tokens, assistant
    tokens in the loss), written to `out`."""
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    from legorl.trainer.models import convert  # noqa: PLC0415

    out = Path(out)
    if not rows:  # nothing succeeded: SFT on nothing leaves the model as it was
        shutil.copytree(start, out, ignore=shutil.ignore_patterns("PUBLISHED.json"))
        return {"rows": 0, "loss_first": None, "loss_last": None, "seconds": 0.0}
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.skeleton-", dir=out.parent) as tmp:
        skeleton = Path(tmp) / "model"
        shutil.copytree(start, skeleton)
        result = sft_train(skeleton, rows, settings, log=log, init_weights=True)
        for stale in [*skeleton.glob("model*.safetensors*"), skeleton / "PUBLISHED.json"]:
            stale.unlink(missing_ok=True)
        convert.save_hf_checkpoint(result.model, result.arch, out, source_dir=skeleton)
    return {
        "rows": len(rows),
        "loss_first": result.losses[0],
        "loss_last": result.losses[-1],
        "seconds": result.seconds,
    }


# -- the rejection-sampled rows ----------------------------------------------------------------------------


def successful_rows(store_uri: str, *, train_ids: set[str]) -> list[SftSequence]:
    """Every segment of the successful (reward 1) trials of a run's committed training batches, as SFT rows
    (the tokens the policy sampled in the loss). Raises if a batch holds a task outside `train_ids`."""
    from legorl.api.store import RunStore  # noqa: PLC0415

    store = RunStore(store_uri)
    rows = []
    for step in store.committed_steps():
        for trial in store.read_batch(step).trials:
            if trial.task_id not in train_ids:
                raise ValueError(f"batch {step} holds {trial.task_id}, which is not a training task")
            if trial.reward != 1.0:
                continue
            for segment in trial.segments:
                rows.append(
                    SftSequence(
                        trial.task_id, "success", list(segment.token_ids), list(segment.loss_mask), 1.0, 0
                    )
                )
    return rows


# -- CLI (benchmarks/learning.py runs each in its own process: megatron's global state stays there) -------


def _say(text: str) -> None:
    import sys  # noqa: PLC0415

    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    import argparse  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from legorl.sandbox.task import load_task_set  # noqa: PLC0415

    p = argparse.ArgumentParser(
        prog="python -m legorl.trainer.warmstart.reading", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demos", help="record the demonstrations of one split to a JSONL file")
    d.add_argument("--tasks", type=Path, required=True, help="tasks.jsonl of builtin://tiny-read")
    d.add_argument("--split", required=True, choices=["train", "validation", "test"])
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--limit", type=int, help="only the split's first N tasks (a quick check)")
    w = sub.add_parser("warmstart", help="SFT a fresh model on training demonstrations")
    w.add_argument("--demos", type=Path, required=True, help="training demonstrations (JSONL)")
    w.add_argument("--validation", type=Path, help="validation demonstrations: the copying score")
    w.add_argument("--out", type=Path, required=True)
    w.add_argument("--seed", type=int, default=READING_SETTINGS.seed)
    w.add_argument("--steps", type=int, default=READING_SETTINGS.steps)
    w.add_argument("--learning-rate", type=float, default=READING_SETTINGS.learning_rate)
    w.add_argument(
        "--target-copying",
        type=float,
        help="stop once this share of sampled validation fixes is exact (needs --validation)",
    )
    r = sub.add_parser("rejection", help="SFT a checkpoint further on a run's successful training trials")
    r.add_argument("--start", type=Path, required=True)
    r.add_argument("--store", required=True, help="the run store of the RL run whose rollouts are reused")
    r.add_argument("--train-ids", type=Path, required=True, help="JSON list of the training task ids")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--steps", type=int, required=True)
    r.add_argument("--learning-rate", type=float, required=True)
    args = p.parse_args(argv)
    if args.command == "demos":
        task_set = load_task_set(args.tasks)
        made = demonstrations(task_set, args.split, limit=args.limit)
        if any(task_set.get(x.task_id).split != args.split for x in made):  # pragma: no cover -- guard
            raise SystemExit("a demonstration of another split was recorded")
        save_demonstrations(made, args.out)
        _say(f"{len(made)} demonstrations of the {args.split} split: {args.out}")
        return 0
    if args.command == "warmstart":
        settings = replace(
            READING_SETTINGS, steps=args.steps, seed=args.seed, learning_rate=args.learning_rate
        )
        validation = load_demonstrations(args.validation) if args.validation else ()
        summary = train_reading_policy(
            args.out,
            load_demonstrations(args.demos),
            settings,
            validation_demos=validation,
            target_copying=args.target_copying,
            log=_say,
        )
        sys.stdout.write(json.dumps(summary) + "\n")
        return 0
    train_ids = set(json.loads(args.train_ids.read_text()))
    rows = successful_rows(args.store, train_ids=train_ids)
    settings = replace(
        READING_SETTINGS,
        steps=args.steps,
        seed=args.seed,
        learning_rate=args.learning_rate,
        min_learning_rate=args.learning_rate,
        warmup_steps=0,
    )
    summary = rejection_sft(args.out, args.start, rows, settings, log=_say)
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
