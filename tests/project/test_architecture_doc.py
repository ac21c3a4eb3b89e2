"""docs/architecture.md names the parts and contracts by their import paths: every one must import."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
NAME = re.compile(r"`(legorl(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")


def names() -> list[str]:
    return sorted(set(NAME.findall(DOC.read_text())))


def resolve(name: str) -> object:
    """A module, or an attribute of the longest importable prefix (a class, a function, a class attribute)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(name)


def test_the_page_names_the_contracts() -> None:
    # Not an empty page nor a pattern that matches nothing: the contracts the page exists for are there.
    found = names()
    for expected in (
        "legorl.api.summary.TrajectorySummary",
        "legorl.api.store.StoreLayout",
        "legorl.api.figures.StepFigures",
        "legorl.api.weights.PublishedWeights",
        "legorl.trialproxy.client.ProxyClient",
    ):
        assert expected in found


@pytest.mark.parametrize("name", names())
def test_every_name_on_the_page_imports(name: str) -> None:
    resolve(name)
