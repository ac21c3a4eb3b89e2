"""Token ids → the text each token stands for, with the run's own tokenizer (when one can be found).

The UI never re-tokenizes anything: it shows the recorded token ids and, beside each, its text piece.
Byte-level BPE tokenizers (Qwen, Llama 3, GPT) map each token to bytes; a character split across
tokens is shown on the token that completes it, so pieces always concatenate to the decoded text.
"""

from __future__ import annotations

import codecs
import json
import logging
import threading
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["TokenText", "load_token_text"]

log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's reversible byte → printable-character table (what byte-level BPE vocabularies use).
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenText:
    """Text pieces of token ids under one tokenizer (`tokenizers`' tokenizer.json)."""

    def __init__(self, tokenizer: Any, byte_level: bool, source: str) -> None:
        self._tok = tokenizer
        self._byte_level = byte_level
        self.source = source
        self._lock = threading.Lock()
        self._special: set[int] = set()
        try:
            added = tokenizer.get_added_tokens_decoder()
            self._special = {int(i) for i, t in added.items() if getattr(t, "special", False)}
        except AttributeError:
            self._special = set()

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """One text piece per id; pieces concatenate to the decoded text."""
        with self._lock:  # tokenizers' objects are not documented as thread-safe
            if self._byte_level:
                return self._byte_pieces(ids)
            return [self._tok.decode([i], skip_special_tokens=False) for i in ids]

    def _byte_pieces(self, ids: Sequence[int]) -> list[str]:
        table = _byte_decoder()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out: list[str] = []
        for i in ids:
            token = self._tok.id_to_token(int(i))
            if token is None:
                out.append(decoder.decode(b"", final=True) + f"⟨{i}⟩")
                decoder.reset()
                continue
            if int(i) in self._special or any(c not in table for c in token):
                # Added/special tokens are stored as plain text, not byte-mapped.
                out.append(decoder.decode(b"", final=True) + token)
                decoder.reset()
                continue
            out.append(decoder.decode(bytes(table[c] for c in token)))
        tail = decoder.decode(b"", final=True)
        if tail and out:
            out[-1] += tail
        return out


def load_token_text(path: Path) -> TokenText | None:
    """The tokenizer at `path` (a tokenizer.json), or None when it cannot be used (logged once)."""
    try:
        from tokenizers import Tokenizer  # noqa: PLC0415 - optional: the `ui` extra installs it
    except ImportError:
        log.warning("the `tokenizers` package is not installed: trajectories show token ids only")
        return None
    try:
        tok = Tokenizer.from_file(str(path))
        spec = json.loads(path.read_text(encoding="utf-8")).get("decoder") or {}
    except (OSError, ValueError, RuntimeError) as exc:  # tokenizers raises Exception subclasses
        log.warning("cannot load tokenizer %s (%s): trajectories show token ids only", path, exc)
        return None
    kinds = {spec.get("type")} | {d.get("type") for d in spec.get("decoders") or [] if isinstance(d, dict)}
    return TokenText(tok, byte_level="ByteLevel" in kinds, source=str(path))
