"""Every figure README and docs quote comes from a results file that its benchmark wrote: each benchmark
script has its results under `benchmarks/results/` (named after the script), and every results file the
README, docs/ and benchmarks/README.md cite is there. A figure whose source file is missing fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
RESULTS = BENCHMARKS / "results"
HELPERS = {"provenance"}
"""Modules of benchmarks/ that are not benchmarks (nothing to measure, no results); so is every module whose
name starts with `_` (a part another benchmark runs, e.g. `_trl_grpo.py` in TRL's own environment)."""


def documents() -> list[Path]:
    return [REPO / "README.md", BENCHMARKS / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_benchmark_has_its_results_file() -> None:
    scripts = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in HELPERS and p.stem[0] != "_")
    assert scripts, "no benchmark scripts found"
    # A results file may spell the script's underscores as hyphens (learning_vs_trl.py: learning-vs-trl.json).
    missing = [
        s
        for s in scripts
        if not any(RESULTS.glob(f"{s}*.json")) and not any(RESULTS.glob(f"{s.replace('_', '-')}*.json"))
    ]
    assert missing == [], f"benchmarks without a results file under benchmarks/results/: {missing}"


def test_every_cited_results_file_exists_and_is_json() -> None:
    cited: dict[str, list[str]] = {}
    for doc in documents():
        text = doc.read_text(encoding="utf-8")
        # `benchmarks/results/X.json` anywhere; `results/X.json` in benchmarks/README.md (relative to it).
        for name in re.findall(r"(?:benchmarks/)?results/([\w.-]+\.json)", text):
            cited.setdefault(name, []).append(doc.relative_to(REPO).as_posix())
    assert cited, "no results file is cited at all"
    missing = {name: docs for name, docs in cited.items() if not (RESULTS / name).is_file()}
    assert missing == {}, f"results files cited but absent: {missing}"
    for name in cited:
        json.loads((RESULTS / name).read_text(encoding="utf-8"))


def test_every_results_file_is_cited() -> None:
    """A results file no document names is a figure nobody can check a claim against."""
    text = "\n".join(doc.read_text(encoding="utf-8") for doc in documents())
    uncited = [p.name for p in sorted(RESULTS.glob("*.json")) if p.name not in text]
    assert uncited == [], f"results files no document cites: {uncited}"
