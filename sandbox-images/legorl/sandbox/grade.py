"""Stage 3 grading: test results from JUnit XML (or pytest's `-rA` log) → per-test status → reward.

Reward is binary, as in SWE-bench: 1 when every FAIL_TO_PASS test passes and every PASS_TO_PASS
test still passes, else 0. A test that is missing from the results counts as failed, so deleting or
renaming a test can never earn reward.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Status = Literal["PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS"]
MAX_RESULTS_BYTES = 64 * 1024 * 1024
_LOG_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)")
_SKIP_COUNT = re.compile(r"^\[\d+\]$")  # "SKIPPED [2] file.py:10: reason" names no test


class GradeError(ValueError):
    """Results could not be read: the verifier did not run the tests (trial ends verifier_error)."""


def parse_junit(path: Path) -> dict[str, Status]:
    """Test id (`path/to/test_x.py::Class::test_name[param]`) → status, from pytest's xunit1 XML.

    xunit1 (`-o junit_family=xunit1`) records each case's `file`; the id is rebuilt from it and the
    dotted `classname` the way pytest prints node ids."""
    if not path.is_file():
        raise GradeError(f"no test results at {path} (did the test command run?)")
    if path.stat().st_size > MAX_RESULTS_BYTES:
        raise GradeError(f"test results {path} exceed {MAX_RESULTS_BYTES} bytes")
    try:
        root = ET.parse(path).getroot()  # noqa: S314 - expat in CPython ≥3.11 refuses entity expansion bombs
    except ET.ParseError as exc:
        raise GradeError(f"test results {path} are not valid XML: {exc}") from None
    results: dict[str, Status] = {}
    for case in root.iter("testcase"):
        name = case.get("name", "")
        file = case.get("file")
        classname = case.get("classname", "")
        if file:
            module = file[:-3].replace("/", ".") if file.endswith(".py") else file.replace("/", ".")
            rest = classname[len(module) + 1 :] if classname.startswith(module + ".") else ""
            parts = [file, *(rest.split(".") if rest else []), name]
            test_id = "::".join(p for p in parts if p)
        else:  # xunit2 has no file: rebuild the path from the dotted module name
            parts = classname.split(".")
            idx = next((i for i in range(len(parts), 0, -1) if parts[i - 1].startswith("test")), len(parts))
            test_id = "::".join(["/".join(parts[:idx]) + ".py", *parts[idx:], name])
        results[test_id] = _case_status(case)
    return results


def _case_status(case: ET.Element) -> Status:
    tags = {child.tag for child in case}
    if "failure" in tags:
        return "FAILED"
    if "error" in tags:
        return "ERROR"
    if "skipped" in tags:
        skipped = case.find("skipped")
        kind = skipped.get("type", "") if skipped is not None else ""
        return "XFAIL" if "xfail" in kind else "SKIPPED"
    return "PASSED"


def parse_pytest_log(log: str) -> dict[str, Status]:
    """Test id → status from pytest's `-rA` short summary (SWE-bench's log format)."""
    results: dict[str, Status] = {}
    for line in log.splitlines():
        match = _LOG_LINE.match(line)
        if match:
            status, test_id = match.groups()
            if not _SKIP_COUNT.match(test_id):
                results[test_id] = status  # type: ignore[assignment]
    return results


def parse_pytest_log_all(log: str) -> dict[str, list[Status]]:
    """Every status the `-rA` summary gives each test id, in order (a test appears once unless
    someone printed more summary lines)."""
    results: dict[str, list[Status]] = {}
    for line in log.splitlines():
        match = _LOG_LINE.match(line)
        if match:
            status, test_id = match.groups()
            if not _SKIP_COUNT.match(test_id):
                results.setdefault(test_id, []).append(status)  # type: ignore[arg-type]
    return results


@dataclass(frozen=True)
class Grade:
    """Per-test outcome of verification and the reward it earns."""

    reward: float
    fail_to_pass: dict[str, Status | None] = field(default_factory=dict)
    pass_to_pass: dict[str, Status | None] = field(default_factory=dict)

    @property
    def resolved(self) -> bool:
        return self.reward == 1.0

    def to_dict(self) -> dict[str, object]:
        return {"reward": self.reward, "FAIL_TO_PASS": self.fail_to_pass, "PASS_TO_PASS": self.pass_to_pass}


def grade(results: Mapping[str, Status], fail_to_pass: Sequence[str], pass_to_pass: Sequence[str]) -> Grade:
    """Reward 1 only when every listed test passed; a missing test is a failure."""
    f2p = {t: results.get(t) for t in fail_to_pass}
    p2p = {t: results.get(t) for t in pass_to_pass}
    ok = all(s in ("PASSED", "XPASS") for s in (*f2p.values(), *p2p.values()))
    return Grade(1.0 if ok and f2p else 0.0, f2p, p2p)
