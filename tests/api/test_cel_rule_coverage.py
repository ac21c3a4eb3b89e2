"""Every CEL rule of every CRD, at every place it sits, has a manifest that only that rule rejects.

The cases live in `tests/support/cel_rule_cases.py` so that a real API server can be sent the same
manifests; here the API server is emulated as in `tests/api/test_invalid_manifests.py`: the schema
(unknown fields forbidden, list-map keys unique) must pass and cel-python must report exactly the
case's rule, evaluated to false rather than raising.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import jsonschema
import pytest

from legorl.api.crd import openapi_schema
from legorl.manifests import parse_documents, validate_documents
from legorl.manifests.generated import to_yaml
from legorl.manifests.structural import apply_defaults, cel_violations, prune_nulls
from tests.api.test_invalid_manifests import _list_map_duplicates, _manifest, _strict, api_server_rejections
from tests.support.cel_rule_cases import RULE_CASES, UNCOVERABLE, RuleCase, rule_entries

ENTRIES = {(kind, path, entry["rule"]): entry for kind, path, entry in rule_entries()}


def _concrete(path: str) -> str:
    """The object path a case breaks: schema path with the first list item, root as ''."""
    return "" if path == "." else path.replace("[]", "[0]")


def _where(case: RuleCase) -> str:
    """Where cel_violations reports the case's rule: its object path plus the rule's fieldPath."""
    field_path: str = ENTRIES[(case.kind, case.path, case.rule)].get("fieldPath", "")
    return _concrete(case.path) + field_path


def test_rule_entries_are_distinct() -> None:
    keys = Counter((kind, path, entry["rule"]) for kind, path, entry in rule_entries())
    assert [key for key, n in keys.items() if n > 1] == []
    assert set(keys) == set(ENTRIES)


def test_every_rule_entry_has_one_case_or_a_reason() -> None:
    cases = Counter((c.kind, c.path, c.rule) for c in RULE_CASES)
    assert [key for key, n in cases.items() if n > 1] == [], "one case per (kind, path, rule)"
    assert [key for key in ENTRIES if key not in cases and key not in UNCOVERABLE] == []
    assert [key for key in ENTRIES if key in cases and key in UNCOVERABLE] == [], "a case and a reason"
    assert [key for key in cases if key not in ENTRIES] == [], "cases for rules no CRD has"
    assert [key for key in UNCOVERABLE if key not in ENTRIES] == [], "reasons for rules no CRD has"
    assert all(reason.strip() for reason in UNCOVERABLE.values())


def test_case_names_are_unique() -> None:
    names = Counter(c.name for c in RULE_CASES)
    assert [name for name, n in names.items() if n > 1] == []


@pytest.mark.parametrize("case", RULE_CASES, ids=lambda c: c.name)
def test_only_the_case_rule_rejects_the_manifest(case: RuleCase) -> None:
    schema = openapi_schema(case.kind)
    manifest = _manifest(case.kind, case.edit)
    obj: dict[str, Any] = apply_defaults(schema, prune_nulls(schema, manifest))
    schema_errors = [e.message for e in jsonschema.Draft7Validator(_strict(schema)).iter_errors(obj)]
    assert schema_errors == [], "the schema stage must pass, or the API server never runs CEL"
    assert _list_map_duplicates(schema, obj) == []

    violations = cel_violations(schema, obj)
    assert [(v.rule, v.path, v.evaluated) for v in violations] == [(case.rule, _where(case), True)]
    # The whole emulated API server answers with that one rule's message and nothing else.
    message = ENTRIES[(case.kind, case.path, case.rule)]["message"]
    assert api_server_rejections(manifest) == [(_where(case).lstrip("."), message)]


@pytest.mark.parametrize("case", RULE_CASES, ids=lambda c: c.name)
def test_legorl_validate_rejects_the_manifest(case: RuleCase) -> None:
    (report,) = validate_documents(parse_documents(to_yaml(_manifest(case.kind, case.edit)), "x.yaml"))
    errors = [p for p in report.problems if p.severity == "error"]
    assert errors, f"legorl validate accepts a manifest the CRD rejects: {report.problems}"
    assert _where(case).lstrip(".") in [p.path for p in errors], errors
