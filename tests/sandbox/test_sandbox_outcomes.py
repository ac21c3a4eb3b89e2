"""The termination reasons and tamper kinds have one definition, shared by the sandbox and the API."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import get_type_hints

import legorl.api
from legorl.api import _enum, termination, trajectory
from legorl.sandbox import changes, outcomes, trial

SANDBOX = Path(outcomes.__file__).parent


def test_the_api_re_exports_the_sandbox_definitions() -> None:
    assert termination.TerminationReason is outcomes.TerminationReason is legorl.api.TerminationReason
    assert termination.INFRA_REASONS is outcomes.INFRA_REASONS is legorl.api.INFRA_REASONS
    assert _enum.DocumentedEnum is outcomes.DocumentedEnum
    assert trajectory.TAMPER_KINDS is outcomes.TAMPER_KINDS
    assert get_type_hints(trajectory.TamperFinding)["kind"] is outcomes.TamperKind
    # One tamper finding type: the sandbox reports it, the API stores it.
    assert trajectory.TamperFinding is outcomes.TamperFinding
    assert get_type_hints(changes.ChangeSet)["findings"] == list[outcomes.TamperFinding]
    assert get_type_hints(trial.TrialOutcome)["termination_reason"] is outcomes.TerminationReason


def test_outcomes_imports_nothing_but_the_standard_library() -> None:
    # The API imports this module from below the sandbox layer (an import-linter exception): it must
    # stay a leaf, or the API would pull in sandbox code.
    tree = ast.parse((SANDBOX / "outcomes.py").read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.add((node.module or ".").split(".")[0])  # a relative import gives "", not stdlib
        elif isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
    assert imported <= sys.stdlib_module_names | {"__future__"}, imported


def test_no_sandbox_module_spells_a_termination_reason() -> None:
    # Every reason the stages report is a `TerminationReason` member, never a string literal.
    values = {r.value for r in outcomes.TerminationReason}
    spelled = [
        f"{path.name}:{node.lineno}: {node.value}"
        for path in sorted(SANDBOX.glob("*.py"))
        if path.name != "outcomes.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and node.value in values
    ]
    assert not spelled, spelled
