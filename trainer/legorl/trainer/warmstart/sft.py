"""`legorl sft` and `builtin://tiny-swe`: a tiny Qwen3-MoE warm-started on demonstrations of mini-swe-agent's
action format, so reinforcement learning on one machine starts from a policy that sometimes succeeds.

What it is trained on (`legorl.trainer.warmstart.demos`): for every task of `builtin://tiny-python`, three
recorded mini-swe-agent conversations — the correct fix then submit, a plausible wrong fix then submit, submit
at once — each opening with a fixed sentence shared by all tasks. The loss weights them by a mixture (default
40/30/30), so the trained policy *chooses* a behaviour with about those odds at temperature 1 (the first
token of its answer; the sentences are single tokens of the tokenizer) and then reproduces that behaviour's
command for the task. It is deliberately imperfect: about 40% of first answers fix the task. Reinforcement
learning (not this module) raises the share of the fixing sentence; because the choice is the same early
token for every task, what RL learns on its training tasks transfers to tasks it holds out.

Be honest about what this shows: SFT sees all 61 tasks (the RL run holds out 25% of them from RL, not from
SFT), so the fix commands of held-out tasks are memorised here; RL on held-out tasks measures whether the
*decision* to fix transfers, not whether the policy can find a fix it has never seen.

The pieces:
- Prompts are rendered as the engine renders them: the chat template applied to the messages mini sends
  (tool-call `arguments` parsed into objects, as vLLM does before templating) with mini's `bash` tool.
  The template is tiny-moe's ChatML/hermes template with one change (`SWE_CHAT_TEMPLATE`): an assistant
  message with tool calls drops trailing newlines from its text, so the history re-renders exactly the
  tokens the policy generated (vLLM's hermes parser returns the text before `<tool_call>` with its
  newline) and a trial's turns merge into one trajectory segment.
- The tokenizer is a byte-level BPE trained on the demonstrations' text (prompts included), split only
  after newlines, so fixed prompt lines become single tokens and conversations are ~60 tokens long.
- The model (hidden 128, 2 layers, 8 experts top-2, ~2.5M parameters) is initialised and trained by
  megatron-core through the trainer's own model code (`model.build_model`, `attention_masks`,
  `token_logprobs`; the output layer applied only at the loss positions, `selected_logits`) with
  cross-entropy on the assistant tokens only, Adam, deterministic for a seed, then exported with
  `convert.save_hf_checkpoint` (what vLLM serves and `legorl train` loads).

`builtin://tiny-swe` is made on first use under `$LEGORL_CACHE_DIR` (default `~/.cache/legorl`) in
`models/tiny-swe-<key>`, the key naming this module's version and digesting everything the demonstrations
depend on (mini's configs and version, the chat template, the task generator's version). It is built in a
child process (megatron's global state stays out of the caller) into a temporary folder renamed into
place, under a file lock, so two processes asking at once build it once.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from legorl.trainer.models.tiny import CHAT_TEMPLATE, IM_END

if TYPE_CHECKING:
    import torch

    from legorl.sandbox.task import TaskSet
    from legorl.trainer.warmstart.demos import Demonstration, Turn

__all__ = [
    "SFT_VERSION",
    "SWE_CHAT_TEMPLATE",
    "TINY_SWE",
    "SftSequence",
    "SftSettings",
    "build_sequences",
    "build_tokenizer",
    "completion_text",
    "engine_messages",
    "ensure_tiny_swe",
    "main",
    "make_tiny_swe",
    "render_prompt",
    "sft_train",
    "tiny_swe_key",
]

SFT_VERSION = "2"
"""Bump whenever what `make_tiny_swe` writes for the same inputs changes: the cache is keyed by it."""
TINY_SWE = "builtin://tiny-swe"

_ASSISTANT_LINE = "        {{- '<|im_start|>assistant\\n' + content }}\n"
if CHAT_TEMPLATE.count(_ASSISTANT_LINE) != 1:  # pragma: no cover -- guards the derivation below
    raise RuntimeError("tiny.CHAT_TEMPLATE changed: update SWE_CHAT_TEMPLATE's derivation")
SWE_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    _ASSISTANT_LINE,
    "        {%- if message.tool_calls %}\n"
    "            {%- set content = content.rstrip('\\n') %}\n"
    "        {%- endif %}\n" + _ASSISTANT_LINE,
)
"""tiny-moe's template, but an assistant message with tool calls renders its text without trailing
newlines (the template puts one newline before `<tool_call>` itself). The policy is trained to write
`<sentence>\\n<tool_call>...`; vLLM's hermes parser hands back `<sentence>\\n` as the content; the
unchanged template would render `<sentence>\\n\\n<tool_call>` in the next prompt, which is not what was
sampled, and every turn would start a new segment."""


@dataclass(frozen=True)
class SftSettings:
    """Everything `make_tiny_swe` is made from besides the task set (part of the cache key)."""

    steps: int = 200
    seed: int = 0
    mix: tuple[float, float, float] = (0.4, 0.3, 0.3)
    """Loss weights of the fix / wrong-fix / submit-at-once demonstrations (normalised)."""
    learning_rate: float = 3e-3
    min_learning_rate: float = 3e-4
    warmup_steps: int = 20
    batch_tasks: int = 16
    """Tasks per optimizer step; each brings all its behaviours' conversations, so every step sees the
    mixture on the same prompts."""
    micro_batch_tokens: int = 1024
    """Padded positions per forward pass (rows are grouped by length, so padding stays small)."""
    vocab_size: int = 8192
    """Upper bound: BPE stops earlier when no pair occurs twice."""
    hidden_size: int = 128
    num_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    top_k: int = 2
    moe_ffn_hidden_size: int = 128
    max_position_embeddings: int = 4096
    sample_per_task: int = 8
    """First turns sampled per task at temperature 1 to measure behaviour shares (0: skip)."""


@dataclass
class SftSequence:
    """One training row: a demonstration's turns merged as the proxy merges them (DESIGN §6)."""

    task_id: str
    behaviour: str
    token_ids: list[int]
    loss_mask: list[int]
    weight: float
    prompt_length: int
    """Tokens of the first prompt (what the engine sees before the first answer)."""
    turn_lengths: list[int] = field(default_factory=list)
    """Completion tokens of each turn."""


# -- rendering --------------------------------------------------------------------------------------------


def engine_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to the chat template: a copy whose assistant tool calls carry their
    `arguments` parsed from the JSON string into an object (vLLM's `_postprocess_messages`)."""
    out: list[dict[str, Any]] = json.loads(json.dumps(list(messages)))
    for message in out:
        if message.get("role") != "assistant" or not message.get("tool_calls"):
            continue
        for call in message["tool_calls"]:
            function = call.get("function", {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    parsed = json.loads(arguments) if arguments else {}
                except json.JSONDecodeError:
                    parsed = {}
                function["arguments"] = parsed if isinstance(parsed, dict) else {}
            elif not arguments:
                function["arguments"] = {}
    return out


def render_prompt(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[int]:
    """Prompt token ids for `messages` as vLLM computes them for `/v1/chat/completions` with `tools`: the chat
    template (generation prompt added) rendered to text, then encoded without extra special tokens."""
    text = tokenizer.apply_chat_template(
        engine_messages(messages), tools=list(tools), add_generation_prompt=True, tokenize=False
    )
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def completion_text(turn: Turn) -> str:
    """What the policy generates for `turn` (without the closing `<|im_end|>`): its sentence, then the
    hermes tool call with the arguments serialised as the chat template serialises them back."""
    call = {"name": "bash", "arguments": {"command": turn.command}}
    return f"{turn.content or ''}<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


def _completion_ids(tokenizer: Any, turn: Turn) -> list[int]:
    ids: list[int] = tokenizer.encode(completion_text(turn), add_special_tokens=False)
    return [*ids, tokenizer.convert_tokens_to_ids(IM_END)]


def build_sequences(
    tokenizer: Any, demos: Sequence[Demonstration], tools: Sequence[Mapping[str, Any]]
) -> list[SftSequence]:
    """Training rows: each turn's prompt rendered as the engine renders it, its completion after it, and
    turns merged into one row while each prompt extends the row exactly (else a new row starts)."""
    rows: list[SftSequence] = []
    for demo in demos:
        current: SftSequence | None = None
        for turn in demo.turns:
            prompt = render_prompt(tokenizer, turn.messages, tools)
            completion = _completion_ids(tokenizer, turn)
            if current is not None and prompt[: len(current.token_ids)] == current.token_ids:
                new = prompt[len(current.token_ids) :]
                current.token_ids += new + completion
                current.loss_mask += [0] * len(new) + [1] * len(completion)
            else:
                current = SftSequence(
                    demo.task_id,
                    demo.behaviour.value,
                    prompt + completion,
                    [0] * len(prompt) + [1] * len(completion),
                    demo.weight,
                    prompt_length=len(prompt),
                )
                rows.append(current)
            current.turn_lengths.append(len(completion))
    return rows


def build_tokenizer(
    demos: Sequence[Demonstration],
    tools: Sequence[Mapping[str, Any]],
    *,
    vocab_size: int,
    split_lines: bool = True,
) -> Any:
    """A byte-level BPE (split after newlines; GPT-2 style without `split_lines`) trained on every
    demonstration's full text as the engine renders it, with SWE_CHAT_TEMPLATE."""
    from legorl.trainer.models.tiny import byte_level_bpe, chat_tokenizer  # noqa: PLC0415

    # Rendering text needs only the template and the special tokens: an untrained tokenizer will do.
    renderer = chat_tokenizer(byte_level_bpe([], vocab_size=300, split_lines=True), SWE_CHAT_TEMPLATE)
    texts = []
    for demo in demos:
        last = demo.turns[-1]
        prompt = renderer.apply_chat_template(
            engine_messages(last.messages), tools=list(tools), add_generation_prompt=True, tokenize=False
        )
        texts.append(prompt + completion_text(last) + IM_END)
    return chat_tokenizer(
        byte_level_bpe(texts, vocab_size=vocab_size, split_lines=split_lines), SWE_CHAT_TEMPLATE
    )


def write_skeleton(directory: Path, tokenizer: Any, settings: SftSettings) -> Path:
    """Tokenizer, config.json and generation_config.json of the model (no weights yet)."""
    from legorl.trainer.models.tiny import generation_config, qwen3_moe_config  # noqa: PLC0415

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    config = qwen3_moe_config(
        tokenizer,
        hidden_size=settings.hidden_size,
        intermediate_size=2 * settings.moe_ffn_hidden_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_attention_heads,
        num_key_value_heads=settings.num_key_value_heads,
        head_dim=settings.head_dim,
        moe_intermediate_size=settings.moe_ffn_hidden_size,
        num_experts=settings.num_experts,
        num_experts_per_tok=settings.top_k,
        max_position_embeddings=settings.max_position_embeddings,
        initializer_range=0.02,  # megatron's init_method_std: the weights are initialised there
    )
    config.save_pretrained(str(directory))
    generation_config(tokenizer).save_pretrained(str(directory))
    return directory


# -- training ---------------------------------------------------------------------------------------------


@dataclass
class SftResult:
    """The trained megatron model and the run's figures."""

    model: Any
    arch: Any
    losses: list[float]
    seconds: float


def _batch(
    rows: Sequence[SftSequence],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, targets, lengths, loss mask, weights) of right-padded rows, shifted by one."""
    import torch  # noqa: PLC0415

    width = max(len(r.token_ids) for r in rows) - 1
    inputs = torch.zeros(len(rows), width, dtype=torch.long)
    targets = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        n = len(row.token_ids) - 1
        inputs[i, :n] = torch.tensor(row.token_ids[:-1])
        targets[i, :n] = torch.tensor(row.token_ids[1:])
        mask[i, :n] = torch.tensor(row.loss_mask[1:], dtype=torch.float32)
    lengths = torch.tensor([len(r.token_ids) - 1 for r in rows])
    weights = torch.tensor([r.weight for r in rows], dtype=torch.float32)
    return inputs, targets, lengths, mask, weights


def selected_logits(
    net: Any, inputs: torch.Tensor, lengths: torch.Tensor, where: torch.Tensor
) -> torch.Tensor:
    """Float32 logits [N, V] at the positions where `where` is set (row-major) of a right-padded batch: the
    same model code as `model.forward_logits`, but the output layer applied only there.

    The vocabulary projection is most of a tiny model's compute and only ~1 position in 6 carries a loss
    here. megatron's GPTModel returns its final (normed) hidden states when `post_process` is off; its own
    output layer then maps the selected ones to logits (a test checks this equals `forward_logits`).
    """
    import torch  # noqa: PLC0415

    from legorl.trainer.models import model  # noqa: PLC0415

    batch, seq_len = inputs.shape
    positions = torch.arange(seq_len).unsqueeze(0).expand(batch, seq_len)
    attention, padding = model.attention_masks(batch, seq_len, lengths, inputs.device)
    gpt = model.unwrap(net)
    gpt.post_process = False
    try:
        hidden = net(inputs, positions, attention, padding_mask=padding)  # [S, B, H]
    finally:
        gpt.post_process = True
    picked = hidden.transpose(0, 1)[where.bool()]
    logits, _ = gpt.output_layer(picked[:, None, :], runtime_gather_output=True)
    out: torch.Tensor = logits[:, 0].float()
    return out


def _micro_batches(rows: Sequence[SftSequence], max_tokens: int) -> list[list[SftSequence]]:
    """Rows longest first, packed into micro-batches of at most `max_tokens` padded positions (a longer row
    alone): rows of similar length share one, so little is padding."""
    ordered = sorted(rows, key=lambda r: -len(r.token_ids))
    out: list[list[SftSequence]] = []
    for row in ordered:
        if out and (len(out[-1]) + 1) * (len(out[-1][0].token_ids) - 1) <= max_tokens:
            out[-1].append(row)
        else:
            out.append([row])
    return out


def sft_train(
    checkpoint_dir: Path,
    rows: Sequence[SftSequence],
    settings: SftSettings,
    *,
    log: Callable[[str], None] = lambda _: None,
    init_weights: bool = False,
    stop_when: Callable[[int, Any], bool] | None = None,
) -> SftResult:
    """Supervised fine-tuning of a freshly initialised megatron model for `checkpoint_dir`'s config.json
    (with `init_weights`, of the weights `checkpoint_dir` holds: training further from a checkpoint).
    `stop_when(step, model)`, called after every step, ends training early when it returns True (the
    learning-rate schedule stays the one of `settings.steps`).

    Each step takes `batch_tasks` tasks (all their rows) in a seeded shuffled order, and minimises the
    weighted cross-entropy of the assistant tokens: sum over rows of weight × token losses, divided by
    the sum of weight × loss tokens. Adam with linear warm-up and cosine decay; deterministic for a seed on
    one machine.
    """
    import torch  # noqa: PLC0415

    from legorl.trainer.models import compat, model  # noqa: PLC0415

    compat.enable_cpu_compat()
    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    arch = model.MoeArchitecture.from_hf(checkpoint_dir)
    net = model.build_model(arch, dtype=torch.float32, device="cpu")
    if init_weights:
        from legorl.trainer.models import convert  # noqa: PLC0415

        convert.load_hf_weights(net, checkpoint_dir, arch)
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=settings.learning_rate, betas=(0.9, 0.98), eps=1e-8, foreach=True)

    by_task: dict[str, list[SftSequence]] = {}
    for row in rows:
        by_task.setdefault(row.task_id, []).append(row)
    task_ids = sorted(by_task)
    rng = random.Random(settings.seed)  # noqa: S311 -- a reproducible order, not a secret
    order: list[str] = []
    losses: list[float] = []
    net.train()
    for step in range(1, settings.steps + 1):
        batch_ids: list[str] = []
        while len(batch_ids) < min(settings.batch_tasks, len(task_ids)):
            if not order:
                order = rng.sample(task_ids, len(task_ids))
            batch_ids.append(order.pop())
        batch = [r for t in batch_ids for r in by_task[t]]
        lr = _learning_rate(settings, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        normalizer = sum(r.weight * sum(r.loss_mask[1:]) for r in batch)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in _micro_batches(batch, settings.micro_batch_tokens):
            inputs, targets, lengths, mask, weights = _batch(micro)
            where = mask.bool()
            logp = model.token_logprobs(selected_logits(net, inputs, lengths, where), targets[where])
            loss = -(logp * weights[:, None].expand_as(mask)[where]).sum() / normalizer
            loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(total)
        if step == 1 or step % 25 == 0 or step == settings.steps:
            elapsed = time.perf_counter() - started
            log(f"step {step}/{settings.steps}: loss {losses[-1]:.4f} lr {lr:.2e} ({elapsed:.0f} s)")
        if stop_when is not None and _stop_now(stop_when, step, net):
            log(f"stopped after step {step}: loss {losses[-1]:.4f}")
            break
    net.eval()
    return SftResult(net, arch, losses, time.perf_counter() - started)


def _stop_now(stop_when: Callable[[int, Any], bool], step: int, net: Any) -> bool:
    """`stop_when(step, net)` with the model in eval mode (dropout off, as sampled), then back."""
    net.eval()
    try:
        return stop_when(step, net)
    finally:
        net.train()


def _learning_rate(settings: SftSettings, step: int) -> float:
    if step <= settings.warmup_steps:
        return settings.learning_rate * step / max(1, settings.warmup_steps)
    span = max(1, settings.steps - settings.warmup_steps)
    progress = (step - settings.warmup_steps) / span
    low = settings.min_learning_rate
    return low + 0.5 * (settings.learning_rate - low) * (1 + math.cos(math.pi * progress))


# -- measuring --------------------------------------------------------------------------------------------


def sample_completions(
    net: Any,
    prompts: Sequence[Sequence[int]],
    *,
    stop_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 256,
) -> list[list[int]]:
    """Sampled completions (stop token included) of `prompts` with the megatron model, one full forward per
    new token (no KV cache: fine for a tiny model and short answers). Temperature 0 is greedy."""
    import torch  # noqa: PLC0415

    generator = torch.Generator().manual_seed(seed)
    out: list[list[int]] = []
    stops = set(stop_ids)
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            chunk = [list(p) for p in prompts[start : start + batch_size]]
            done = [False] * len(chunk)
            made: list[list[int]] = [[] for _ in chunk]
            for _ in range(max_new_tokens):
                live = [i for i, d in enumerate(done) if not d]
                if not live:
                    break
                rows = [chunk[i] + made[i] for i in live]
                width = max(len(r) for r in rows)
                ids = torch.zeros(len(rows), width, dtype=torch.long)
                for j, r in enumerate(rows):
                    ids[j, : len(r)] = torch.tensor(r)
                lengths = torch.tensor([len(r) for r in rows])
                where = torch.zeros(len(rows), width, dtype=torch.bool)
                where[torch.arange(len(rows)), lengths - 1] = True
                last = selected_logits(net, ids, lengths, where)
                if temperature <= 0:
                    picked = last.argmax(-1)
                else:
                    probs = torch.softmax(last / temperature, dim=-1)
                    picked = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
                for j, i in enumerate(live):
                    token = int(picked[j])
                    made[i].append(token)
                    if token in stops:
                        done[i] = True
            out.extend(made)
    return out


def teacher_forced(net: Any, rows: Sequence[SftSequence], *, batch_size: int = 64) -> dict[str, Any]:
    """Exact figures from one scoring pass over the demonstrations (no sampling noise).

    - `shares`: the mean over tasks of the probability that the first answer opens with each behaviour's
      sentence (one token: the sampled share at temperature 1 is this, up to other tokenizations);
    - `exact`: the mean probability of reproducing a behaviour's whole conversation (every answer token)
      once its opening token is drawn; `greedy_exact`: the share of rows whose every answer token after
      the opening one is the model's argmax.
    """
    import torch  # noqa: PLC0415

    from legorl.trainer.models import model  # noqa: PLC0415

    opening: dict[str, dict[str, float]] = {}
    exact: list[float] = []
    greedy: list[bool] = []
    net.eval()
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            chunk = list(rows[start : start + batch_size])
            inputs, targets, lengths, mask, _ = _batch(chunk)
            logits = selected_logits(net, inputs, lengths, mask)
            wanted = targets[mask.bool()]
            logp = model.token_logprobs(logits, wanted)
            hits = logits.argmax(-1) == wanted
            offset = 0
            for row in chunk:
                n = sum(row.loss_mask[1:])
                values, row_hits = logp[offset : offset + n], hits[offset : offset + n]
                offset += n
                opening.setdefault(row.task_id, {})[row.behaviour] = float(values[0].exp())
                exact.append(float(values[1:].sum().exp()))
                greedy.append(bool(row_hits[1:].all()))
    behaviours = sorted({b for per in opening.values() for b in per})
    shares = {b: sum(per.get(b, 0.0) for per in opening.values()) / len(opening) for b in behaviours}
    return {"shares": shares, "exact": sum(exact) / len(exact), "greedy_exact": sum(greedy) / len(greedy)}


def measure_first_turns(
    net: Any, tokenizer: Any, rows: Sequence[SftSequence], *, samples: int, seed: int
) -> dict[str, Any]:
    """Sample `samples` first answers per task at temperature 1 (and one greedy answer) and compare them with
    the demonstrations: the behaviour chosen (by its opening sentence) and whether the whole first turn is
    exactly the demonstration's for that behaviour."""
    from legorl.trainer.warmstart.demos import THOUGHTS, Behaviour  # noqa: PLC0415

    firsts: dict[str, dict[str, list[int]]] = {}
    prompts: dict[str, list[int]] = {}
    for row in rows:
        cut = row.prompt_length + row.turn_lengths[0]
        firsts.setdefault(row.task_id, {})[row.behaviour] = row.token_ids[row.prompt_length : cut]
        prompts[row.task_id] = row.token_ids[: row.prompt_length]
    task_ids = sorted(prompts)
    stop = [tokenizer.convert_tokens_to_ids(IM_END)]
    longest = max(len(c) for f in firsts.values() for c in f.values())
    batch = [prompts[t] for t in task_ids for _ in range(samples)]
    sampled = sample_completions(net, batch, stop_ids=stop, max_new_tokens=longest + 8, seed=seed)
    greedy = sample_completions(
        net, [prompts[t] for t in task_ids], stop_ids=stop, max_new_tokens=longest + 8, temperature=0
    )
    counts = {b.value: 0 for b in Behaviour} | {"other": 0}
    exact = 0
    for k, completion in enumerate(sampled):
        task_id = task_ids[k // samples]
        text = tokenizer.decode(completion, skip_special_tokens=False)
        kind = next((b.value for b in Behaviour if text.startswith(THOUGHTS[b])), "other")
        counts[kind] += 1
        if kind != "other" and completion == firsts[task_id].get(kind):
            exact += 1
    greedy_kinds = []
    for completion in greedy:
        text = tokenizer.decode(completion, skip_special_tokens=False)
        greedy_kinds.append(next((b.value for b in Behaviour if text.startswith(THOUGHTS[b])), "other"))
    total = len(sampled)
    return {
        "samples": total,
        "shares": {k: v / total for k, v in counts.items()},
        "exact_first_turn": exact / max(1, total - counts["other"]),
        "greedy_behaviours": {k: greedy_kinds.count(k) for k in counts},
    }


# -- the whole thing --------------------------------------------------------------------------------------


def make_tiny_swe(
    out: Path,
    settings: SftSettings | None = None,
    *,
    task_set: TaskSet | None = None,
    demonstrations: Sequence[Demonstration] | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Record the demonstrations (unless given), train the tokenizer and the model, and write the HF
    checkpoint to `out` (assembled next to it and renamed into place). Returns the run's summary (also
    written to `out/sft.json`)."""
    from legorl.sandbox.bundled import builtin_task_set  # noqa: PLC0415
    from legorl.sandbox.task import load_task_set  # noqa: PLC0415
    from legorl.trainer.models import convert  # noqa: PLC0415
    from legorl.trainer.warmstart import demos  # noqa: PLC0415

    settings = settings or SftSettings()
    started = time.perf_counter()
    task_set = task_set or load_task_set(builtin_task_set())
    recorded = (
        list(demonstrations)
        if demonstrations is not None
        else demos.make_demonstrations(task_set, mix=settings.mix)
    )
    tools = [demos.bash_tool()]
    t_demos = time.perf_counter() - started
    log(
        f"recorded {len(recorded)} demonstrations on {len(task_set)} tasks with mini-swe-agent "
        f"({t_demos:.1f} s)"
    )
    tokenizer = build_tokenizer(recorded, tools, vocab_size=settings.vocab_size)
    rows = build_sequences(tokenizer, recorded, tools)
    longest = max(len(r.token_ids) for r in rows)
    if longest + 512 > settings.max_position_embeddings:
        raise ValueError(
            f"the longest conversation has {longest} tokens: max_position_embeddings "
            f"{settings.max_position_embeddings} leaves under 512 for generation"
        )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.skeleton-", dir=out.parent) as tmp:
        skeleton = write_skeleton(Path(tmp), tokenizer, settings)
        log(
            f"tokenizer: {len(tokenizer)} tokens; {len(rows)} rows, prompt "
            f"{_span(r.prompt_length for r in rows)} tokens, answers "
            f"{_span(n for r in rows for n in r.turn_lengths)} tokens, longest row {longest}"
        )
        result = sft_train(skeleton, rows, settings, log=log)
        parameters = sum(p.numel() for p in result.model.parameters())
        scored = teacher_forced(result.model, rows)
        measured = (
            measure_first_turns(
                result.model, tokenizer, rows, samples=settings.sample_per_task, seed=settings.seed
            )
            if settings.sample_per_task > 0
            else None
        )
        summary = {
            "version": SFT_VERSION,
            "settings": asdict(settings),
            "tasks": len(task_set),
            "demonstrations": len(recorded),
            "parameters": parameters,
            "vocab": len(tokenizer),
            "rows": len(rows),
            "prompt_tokens": _stats(r.prompt_length for r in rows),
            "answer_tokens": _stats(n for r in rows for n in r.turn_lengths),
            "row_tokens": _stats(len(r.token_ids) for r in rows),
            "loss_first": result.losses[0],
            "loss_last": result.losses[-1],
            "loss_curve": [round(x, 4) for x in result.losses[:: max(1, len(result.losses) // 20)]],
            "train_seconds": result.seconds,
            "teacher_forced": scored,
            "first_turns": measured,
        }
        (skeleton / "sft.json").write_text(json.dumps(summary, indent=2) + "\n")
        convert.save_hf_checkpoint(result.model, result.arch, out, source_dir=skeleton)
    summary["seconds"] = time.perf_counter() - started
    return summary


def _stats(values: Iterator[int] | Sequence[int]) -> dict[str, float]:
    items = list(values)
    return {"min": min(items), "mean": round(sum(items) / len(items), 1), "max": max(items)}


def _span(values: Iterator[int]) -> str:
    s = _stats(values)
    return f"{s['min']}–{s['max']} (mean {s['mean']})"


# -- builtin://tiny-swe -----------------------------------------------------------------------------------


def tiny_swe_key(settings: SftSettings | None = None) -> str:
    """`<version>-<digest>`: the digest covers the settings and every input the demonstrations are rendered
    from (both mini configs, mini's version, the chat template, the task generator's version)."""
    from legorl.controller.harness import MINI_CONFIG  # noqa: PLC0415
    from legorl.sandbox.bundled import GENERATOR_VERSION  # noqa: PLC0415

    digest = hashlib.sha256()
    digest.update(json.dumps(asdict(settings or SftSettings()), sort_keys=True).encode())
    digest.update(MINI_CONFIG.read_bytes())
    spec = importlib.util.find_spec("minisweagent")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("builtin://tiny-swe needs mini-swe-agent: pip install 'legorl[harnesses]'")
    digest.update((Path(next(iter(spec.submodule_search_locations))) / "config" / "mini.yaml").read_bytes())
    digest.update(importlib.metadata.version("mini-swe-agent").encode())
    digest.update(SWE_CHAT_TEMPLATE.encode())
    digest.update(GENERATOR_VERSION.encode())
    return f"{SFT_VERSION}-{digest.hexdigest()[:12]}"


def _complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def ensure_tiny_swe(cache_dir: Path | None = None, *, build: Callable[[Path], None] | None = None) -> Path:
    """The `builtin://tiny-swe` checkpoint folder, made on first use (see the module docstring).

    `build(folder)` writes a checkpoint into a fresh folder; the default runs `python -m
    legorl.trainer.warmstart.sft --out FOLDER` in a child process. Concurrent callers wait on a lock and find
    the finished folder.
    """
    from legorl.sandbox.bundled import default_cache_dir  # noqa: PLC0415

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "models" / f"tiny-swe-{tiny_swe_key()}"
    if _complete(target):
        return target
    with _locked(target.parent / f".{target.name}.lock"):
        if _complete(target):
            return target
        # Everything a build writes lives in one folder: what a killed build left is removed here (the
        # lock says no other build of this key is running).
        work = target.parent / f".{target.name}.build"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            staging = work / "model"
            (build or _build_in_child)(staging)
            if not _complete(staging):
                raise RuntimeError(f"building {TINY_SWE} left no checkpoint in {staging}")
            if target.exists():  # a partial folder from before (never a complete one: checked above)
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def _build_in_child(folder: Path) -> None:
    proc = subprocess.run(  # noqa: S603 -- this interpreter, this module
        [sys.executable, "-m", "legorl.trainer.warmstart.sft", "--out", str(folder)], check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building {TINY_SWE} failed (exit {proc.returncode}); see the output above")


# -- CLI --------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="legorl sft",
        description=(
            "Warm-start a tiny Qwen3-MoE policy by supervised fine-tuning on recorded mini-swe-agent "
            f"demonstrations of the bundled tasks (what {TINY_SWE} is). Prints the loss curve, the time and "
            "the behaviour shares measured by sampling."
        ),
    )
    defaults = SftSettings()
    p.add_argument(
        "--tasks", default="builtin://tiny-python", help="the bundled task set (or its tasks.jsonl)"
    )
    p.add_argument("--out", type=Path, help=f"checkpoint folder (default: the {TINY_SWE} cache folder)")
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--mix", default=",".join(str(m) for m in defaults.mix), help="fix,wrong,submit shares")
    p.add_argument(
        "--samples", type=int, default=defaults.sample_per_task, help="first turns sampled per task"
    )
    return p


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        mix = tuple(float(x) for x in args.mix.split(","))
        if len(mix) != 3 or any(m < 0 for m in mix) or sum(mix) <= 0:
            raise ValueError
    except ValueError:
        sys.stderr.write(
            f"legorl sft: --mix {args.mix!r}: give three non-negative numbers, e.g. 0.4,0.3,0.3\n"
        )
        return 2
    if args.steps < 1:
        sys.stderr.write("legorl sft: --steps must be at least 1\n")
        return 2
    settings = SftSettings(
        steps=args.steps, seed=args.seed, mix=(mix[0], mix[1], mix[2]), sample_per_task=args.samples
    )
    from legorl.sandbox.bundled import BUILTIN_URI, builtin_task_set  # noqa: PLC0415
    from legorl.sandbox.bundled import instance_ids as bundled_ids  # noqa: PLC0415
    from legorl.sandbox.task import TaskError, load_task_set  # noqa: PLC0415

    try:
        manifest = builtin_task_set() if args.tasks == BUILTIN_URI else Path(args.tasks)
        task_set = load_task_set(manifest)
        unknown = sorted(set(t.instance_id for t in task_set) - set(bundled_ids()))
        if unknown:
            raise TaskError(
                f"{len(unknown)} task(s) are not in the bundled set {BUILTIN_URI} (e.g. {unknown[0]}); "
                "demonstrations are made from its generator's table of bugs"
            )
    except (TaskError, OSError) as exc:
        sys.stderr.write(f"legorl sft: --tasks {args.tasks}: {exc}\n")
        return 2
    out = args.out
    if out is None:
        if settings != SftSettings(sample_per_task=settings.sample_per_task) or args.tasks != BUILTIN_URI:
            sys.stderr.write(
                f"legorl sft: with other tasks or settings, give --out DIR (the cache holds {TINY_SWE}, "
                "the default run on the whole bundled set)\n"
            )
            return 2
        # Through the cache's lock and rename, building in this process.
        path = ensure_tiny_swe(build=lambda folder: _run(folder, settings, task_set))
        _say(f"{TINY_SWE}: {path}")
        return 0
    _run(out, settings, task_set)
    return 0


def _run(out: Path, settings: SftSettings, task_set: TaskSet) -> None:
    summary = make_tiny_swe(out, settings, task_set=task_set, log=_say)
    _say(f"loss {summary['loss_first']:.3f} -> {summary['loss_last']:.4f}; curve {summary['loss_curve']}")
    _say(
        f"{summary['parameters']:,} parameters; vocab {summary['vocab']}; prompts {summary['prompt_tokens']} "
        f"tokens; answers {summary['answer_tokens']} tokens"
    )
    scored = summary["teacher_forced"]
    shares = ", ".join(f"{k} {v:.1%}" for k, v in scored["shares"].items())
    _say(
        f"opening token probabilities (mean over tasks): {shares}; P(whole conversation | opening) "
        f"{scored['exact']:.1%}; greedy reproduces {scored['greedy_exact']:.1%} of them"
    )
    measured = summary["first_turns"]
    if measured is not None:
        shares = ", ".join(f"{k} {v:.1%}" for k, v in measured["shares"].items())
        _say(
            f"first turns sampled at temperature 1 ({measured['samples']}): {shares}; exact command "
            f"{measured['exact_first_turn']:.1%}; greedy: {measured['greedy_behaviours']}"
        )
    _say(f"training {summary['train_seconds']:.0f} s, total {summary['seconds']:.0f} s; checkpoint {out}")


if __name__ == "__main__":
    raise SystemExit(main())
