"""Small helpers the rules share: medians, runs of steps, step ranges, error samples, keyword hints."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence

from legorl.diagnostics.facts import TrialFacts


def median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def runs(steps: Sequence[int], hits: set[int]) -> list[list[int]]:
    """Maximal runs of consecutive entries of `steps` (an ordered series) that are in `hits`."""
    out: list[list[int]] = []
    current: list[int] = []
    for step in steps:
        if step in hits:
            current.append(step)
        elif current:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def step_ranges(steps: Iterable[int]) -> str:
    """`[1, 2, 3, 7]` → `"1–3, 7"`."""
    ordered = sorted(set(steps))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}–{ordered[j]}")
        i = j + 1
    return ", ".join(parts)


def steps_phrase(steps: Iterable[int]) -> str:
    ordered = sorted(set(steps))
    return f"step {ordered[0]}" if len(ordered) == 1 else f"steps {step_ranges(ordered)}"


def common_errors(
    trials: Iterable[TrialFacts], *, limit: int = 3, chars: int = 200
) -> list[dict[str, object]]:
    """The most frequent error texts (first `chars` characters, digits folded) with a count and an example."""
    counts: Counter[str] = Counter()
    example: dict[str, str] = {}
    for trial in trials:
        if not trial.error:
            continue
        text = trial.error.strip()[:chars]
        key = re.sub(r"[0-9]+", "N", text)
        counts[key] += 1
        example.setdefault(key, text)
    return [{"count": n, "error": example[key]} for key, n in counts.most_common(limit)]


def mentions(texts: Iterable[str | None], *words: str) -> int:
    """How many texts mention any of `words` (case-insensitive)."""
    pattern = re.compile("|".join(re.escape(w) for w in words), re.IGNORECASE)
    return sum(1 for t in texts if t and pattern.search(t))


def ranked(causes: Sequence[tuple[float, str]]) -> list[str]:
    """Causes by score, highest first; equal scores keep their given order."""
    order = sorted(range(len(causes)), key=lambda i: -causes[i][0])
    return [causes[i][1] for i in order]


def pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "n/a"
