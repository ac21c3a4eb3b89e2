"""The tiny random Qwen3-MoE behind `builtin://tiny-moe`: made on the fly, no hub, deterministic for a seed.

`make_tiny_model(directory)` trains a byte-level BPE tokenizer (~4k tokens) on text generated here, wraps it
with a ChatML chat template with hermes-style tool calls (Qwen's layout), and saves a random
`Qwen3MoeForCausalLM` (hidden 128, 2 layers, 8 experts, top-2; ~1.5M parameters) in fp32 safetensors. The
embedded default serves and trains it; the tests use it as their real model. torch, transformers and
tokenizers are imported inside the function, so importing this module is cheap.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Plain added tokens, as in Qwen's tokenizers: matched as one token each, but not "special" (decoding keeps
# them even with skip_special_tokens, so a tool parser sees them).
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
VOCAB_SIZE = 4000

# A Qwen2.5/Qwen3-style ChatML template with hermes tool calls: tools listed as JSON lines inside
# <tools></tools> in the system turn; assistant tool calls as
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>; tool results folded into one user turn of
# <tool_response>...</tool_response> blocks.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments " }}
    {{- "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n" }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or not loop.first %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

_WORD_TEXT = (
    "the a an of to in is it that for on with as was by at from this be are or have not but had his they "
    "you which one we all were there when can will more if no out so said what up its about into than them "
    "only other new some could time these two may then first any like now over such our man me even most "
    "made after also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see work long get here "
    "between both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three file code test model agent tool call run build error value "
    "result request response token server client proxy engine policy reward trainer sample batch step "
    "update weight version cluster node pod job queue stream event message user assistant system function "
    "argument return list dict string number true false null data path command output input repository "
    "branch commit patch diff line column index offset length size limit timeout retry status health"
)
_NAME_TEXT = (
    "foo bar baz qux items values result total count index data config path name text line lines "
    "parser reader writer buffer request response client server tokens weights batch step seed"
)
_WORDS = _WORD_TEXT.split()
_NAMES = _NAME_TEXT.split()
_FUNCS = ("bash", "read_file", "write_file", "search", "list_dir", "run_tests", "apply_patch", "grep")
_ONSET_TEXT = "b c d f g h k l m n p r s t v w z br ch cl dr fl gr pl pr sh st str th tr qu sp sk"
_VOWEL_TEXT = "a e i o u ai ea ee io ou oo y"
_CODA_TEXT = "n r s t l m nd ng st ck rt ss x ght"
_ONSETS = ["", *_ONSET_TEXT.split()]
_VOWELS = _VOWEL_TEXT.split()
_CODAS = ["", "", *_CODA_TEXT.split()]


class _Corpus:
    """Draws words Zipf-style from a word list plus pseudo-words; writes prose, code, JSON and chat turns."""

    def __init__(self, seed: int, lexicon_size: int = 6000) -> None:
        self.rng = random.Random(seed)  # noqa: S311 -- reproducible text, not secrets
        words: set[str] = set()
        while len(words) < lexicon_size:
            syllables = self.rng.choice((1, 2, 2, 3, 3, 4))
            parts = (self._pick(_ONSETS) + self._pick(_VOWELS) + self._pick(_CODAS) for _ in range(syllables))
            words.add("".join(parts))
        lexicon = list(_WORDS) + sorted(words - set(_WORDS))
        self.lexicon = lexicon
        self.cum_weights = list(itertools.accumulate(1.0 / (rank + 10) for rank in range(len(lexicon))))

    def _pick(self, options: Sequence[str]) -> str:
        return options[self.rng.randrange(len(options))]

    def word(self) -> str:
        return self.rng.choices(self.lexicon, cum_weights=self.cum_weights)[0]

    def identifier(self) -> str:
        if self.rng.random() < 0.5:
            return self._pick(_NAMES)
        parts = [self.word() for _ in range(self.rng.randint(1, 3))]
        if self.rng.random() < 0.3:
            return parts[0] + "".join(p.capitalize() for p in parts[1:])
        return "_".join(parts)

    def sentence(self) -> str:
        rng = self.rng
        words = [self.word() for _ in range(rng.randint(4, 18))]
        words[0] = words[0].capitalize()
        if rng.random() < 0.3:
            cut = rng.randint(1, len(words) - 1)
            words[cut - 1] += ","
        return " ".join(words) + self._pick(".....?!:")

    def python(self) -> str:
        rng = self.rng
        name = self.identifier()
        args = ", ".join(self.identifier() for _ in range(rng.randint(0, 3)))
        lines = [
            f"def {self._pick(_FUNCS)}_{self.identifier()}({args}):",
            f'    """{self.sentence()}"""',
            f"    {name} = []",
            f"    for i in range({rng.randint(1, 100)}):",
            f"        if i % {rng.randint(2, 9)} == 0:",
            f"            {name}.append(i * {rng.randint(1, 50)})",
            f"        elif {self.identifier()} is None:",
            "            continue",
            f"    return {{'{self.identifier()}': {name}, 'ok': {self._pick(['True', 'False'])}}}",
        ]
        if rng.random() < 0.5:
            lines = ["import os", "import json", "from pathlib import Path", "", "", *lines]
        if rng.random() < 0.5:
            lines += ["", "", f"class {self.word().capitalize()}{self.word().capitalize()}:"]
            lines += ["    def __init__(self):"]
            lines += [f"        self.{self.identifier()} = {rng.randint(0, 999)}" for _ in range(3)]
        return "\n".join(lines) + "\n"

    def json_value(self, depth: int = 0) -> Any:
        rng = self.rng
        kind = rng.randint(0, 5 if depth < 2 else 3)
        if kind == 0:
            return rng.randint(-1000, 100000)
        if kind == 1:
            return " ".join(self.word() for _ in range(rng.randint(1, 6)))
        if kind == 2:
            return rng.choice([True, False, None])
        if kind == 3:
            return round(rng.uniform(-10, 10), rng.randint(1, 4))
        if kind == 4:
            return [self.json_value(depth + 1) for _ in range(rng.randint(0, 4))]
        return {self.identifier(): self.json_value(depth + 1) for _ in range(rng.randint(1, 4))}

    def chat(self) -> str:
        call = {"name": self._pick(_FUNCS), "arguments": {self.identifier(): self.json_value(2)}}
        return (
            f"{IM_START}user\n{self.sentence()}{IM_END}\n{IM_START}assistant\n{self.sentence()}\n"
            f"<tool_call>\n{json.dumps(call)}\n</tool_call>{IM_END}\n{IM_START}user\n<tool_response>\n"
            f"{json.dumps(self.json_value())}\n</tool_response>{IM_END}\n"
        )

    def document(self) -> str:
        kind = self.rng.randint(0, 3)
        if kind == 0:
            return " ".join(self.sentence() for _ in range(self.rng.randint(2, 8))) + "\n"
        if kind == 1:
            return self.python()
        if kind == 2:
            return json.dumps(self.json_value(), indent=self.rng.choice([None, 2])) + "\n"
        return self.chat()


def training_corpus(seed: int = 0, *, documents: int = 2000) -> Iterator[str]:
    """Deterministic English-ish prose, Python code, JSON and ChatML tool-call turns (~0.7 MB in all)."""
    corpus = _Corpus(seed)
    for _ in range(documents):
        yield corpus.document()


def byte_level_bpe(texts: Iterable[str], *, vocab_size: int, split_lines: bool = False) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` trained on `texts`, with the ChatML special tokens and the
    hermes tool tokens added after the learned vocabulary (Qwen's layout). `vocab_size` counts them.

    By default text is split GPT-2 style (words, numbers, punctuation, spaces) before merging. With
    `split_lines`, it is split only after each newline, so merges may span words: on a narrow corpus
    (fixed prompts, repeated commands) whole lines become single tokens and sequences get short. Either way
    a split point sits after every newline, so a chat-template boundary that ends a line (`assistant\\n`)
    never merges with what follows: a prompt and the completion sampled after it tokenize as their
    concatenation does.
    """
    import tokenizers  # noqa: PLC0415 -- heavy imports stay out of module import

    byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not split_lines)
    raw = tokenizers.Tokenizer(tokenizers.models.BPE())
    raw.pre_tokenizer = (
        tokenizers.pre_tokenizers.Sequence(
            [tokenizers.pre_tokenizers.Split("\n", behavior="merged_with_previous"), byte_level]
        )
        if split_lines
        else byte_level
    )
    raw.decoder = tokenizers.decoders.ByteLevel()
    raw.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(TOOL_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(texts, trainer=trainer)
    # Special and tool tokens go after the learned vocabulary, as in Qwen's tokenizers.
    raw.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    raw.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return raw


def chat_tokenizer(raw: Any, chat_template: str = CHAT_TEMPLATE) -> Any:
    """`raw` (a `tokenizers.Tokenizer`) as a transformers `PreTrainedTokenizerFast` with ChatML's special
    tokens (`<|im_end|>` ends a turn) and `chat_template`."""
    import transformers as transformers_typed  # noqa: PLC0415

    transformers: Any = transformers_typed  # partly untyped constructors

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def qwen3_moe_config(
    tokenizer: Any,
    *,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    moe_intermediate_size: int,
    num_experts: int,
    num_experts_per_tok: int,
    max_position_embeddings: int,
    initializer_range: float,
) -> Any:
    """A transformers `Qwen3MoeConfig` (fp32, untied embeddings, normalised top-k, no shared experts, every
    layer sparse) whose vocabulary and special token ids are `tokenizer`'s."""
    import transformers as transformers_typed  # noqa: PLC0415

    # transformers' constructors are partly untyped and its config fields are strict dataclass fields.
    transformers: Any = transformers_typed
    endoftext_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        decoder_sparse_step=1,
        moe_intermediate_size=moe_intermediate_size,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        norm_topk_prob=True,
        bos_token_id=endoftext_id,
        eos_token_id=im_end_id,
        pad_token_id=endoftext_id,
        dtype="float32",
    )
    config.head_dim = head_dim  # Qwen3 keeps head_dim explicit (readers look for the key)
    config.architectures = ["Qwen3MoeForCausalLM"]
    return config


def generation_config(tokenizer: Any) -> Any:
    """Generation defaults: a turn ends at `<|im_end|>` (or `<|endoftext|>`)."""
    import transformers as transformers_typed  # noqa: PLC0415

    transformers: Any = transformers_typed

    endoftext_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    return transformers.GenerationConfig(
        bos_token_id=endoftext_id,
        eos_token_id=[im_end_id, endoftext_id],
        pad_token_id=endoftext_id,
    )


def make_tiny_model(directory: Path, *, seed: int = 0) -> Path:
    """Write a tiny random Qwen3-MoE checkpoint (fp32 safetensors, tokenizer, chat template) to `directory`.

    hidden 128, 2 layers, 8 experts (top-2, moe_intermediate_size 64), 4 query heads and 2 KV heads of dim 32,
    vocab ~4000, untied embeddings, initializer_range 0.5 so next-token distributions are peaked rather than
    flat. Returns `directory`.
    """
    import torch  # noqa: PLC0415 -- heavy imports stay out of module import
    import transformers as transformers_typed  # noqa: PLC0415

    transformers: Any = transformers_typed

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    tokenizer = chat_tokenizer(byte_level_bpe(training_corpus(seed), vocab_size=VOCAB_SIZE))
    tokenizer.save_pretrained(str(directory))

    config = qwen3_moe_config(
        tokenizer,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32768,
        initializer_range=0.5,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen3MoeForCausalLM(config).to(torch.float32)
    model.generation_config = generation_config(tokenizer)
    model.save_pretrained(str(directory))
    return directory


HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_moe")


def hybrid_config(tokenizer: Any, family: str = "qwen3_next") -> Any:
    """A tiny config of the hybrid-attention family (`qwen3_next` or `qwen3_5_moe`'s text model): 4 layers
    (Gated DeltaNet, full, Gated DeltaNet, full), hidden 64, 4 query heads / 2 KV heads of dim 32 (RoPE on
    the first quarter), 2 key / 4 value linear heads of dim 16, 8 experts (top-2, width 32) and a shared
    expert (width 48) per MoE layer; Qwen3-Next's layer 2 is a dense MLP (`mlp_only_layers`)."""
    import transformers as transformers_typed  # noqa: PLC0415

    transformers: Any = transformers_typed
    if family not in HYBRID_FAMILIES:
        raise ValueError(f"family={family!r}: use one of {HYBRID_FAMILIES}")
    endoftext_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 32768,
        "initializer_range": 0.1,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
        "bos_token_id": endoftext_id,
        "eos_token_id": im_end_id,
        "pad_token_id": endoftext_id,
        "dtype": "float32",
    }
    if family == "qwen3_next":
        config = transformers.Qwen3NextConfig(
            **common, intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2]
        )
        config.architectures = ["Qwen3NextForCausalLM"]
    else:
        config = transformers.Qwen3_5MoeTextConfig(**common)
        config.architectures = ["Qwen3_5MoeForCausalLM"]
    return config


def make_tiny_hybrid(directory: Path, *, family: str = "qwen3_next", seed: int = 0) -> Path:
    """Write a tiny random checkpoint of the hybrid-attention family (`hybrid_config`; fp32 safetensors,
    the tiny-moe tokenizer and chat template) to `directory`. The norms, decays, time-step biases and
    convolutions that transformers initialises to constants are drawn at random too, so a wrong mapping of
    any of them shows in the logits. Returns `directory`."""
    import torch  # noqa: PLC0415
    import transformers as transformers_typed  # noqa: PLC0415

    transformers: Any = transformers_typed
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = chat_tokenizer(byte_level_bpe(training_corpus(seed), vocab_size=VOCAB_SIZE))
    tokenizer.save_pretrained(str(directory))
    config = hybrid_config(tokenizer, family)
    cls = transformers.Qwen3NextForCausalLM if family == "qwen3_next" else transformers.Qwen3_5MoeForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).to(torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("norm.weight", "layernorm.weight")):
                    param.add_(torch.randn_like(param) * 0.2)
                elif name.endswith(("A_log", "dt_bias")):
                    param.copy_(torch.rand_like(param) * 2.0 - 0.5)
                elif name.endswith("conv1d.weight"):
                    param.copy_(torch.randn_like(param) * 0.5)
    model.generation_config = generation_config(tokenizer)
    model.save_pretrained(str(directory))
    return directory
