"""YAML as Kubernetes reads it: the loader's rules, every committed YAML file, the CRD defaults,
and `legorl validate` on unquoted numbers.

Kubernetes (kubectl, helm, the API server) reads YAML with sigs.k8s.io/yaml: go-yaml v2's scalar
rules, then JSON. The expected values below are go-yaml v2's (resolve.go: its resolve table, its
`yamlStyleFloat`, `strconv.ParseInt(s, 0, 64)` after removing `_`), not PyYAML's YAML 1.1 ones. No
Kubernetes binary runs here; the real API server is the next step (issue 17).
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from legorl.manifests import kubeyaml, parse_documents, validate_documents
from legorl.manifests.generated import to_yaml

REPO = Path(__file__).resolve().parents[2]

# plain scalar -> what Kubernetes receives (after the JSON step), where PyYAML differs or could.
CASES: list[tuple[str, Any]] = [
    ("1e-6", 1e-6),  # PyYAML: the string "1e-6" (its floats need a dot and a signed exponent)
    ("1.0e6", 1_000_000),  # a whole float is an integer once it is JSON
    ("5e-4", 5e-4),
    ("1e3", 1000),
    ("+.5", 0.5),
    (".5", 0.5),
    ("1.", 1),
    ("1.e5", 100000),
    ("y", True),  # PyYAML: "y"
    ("Y", True),
    ("n", False),
    ("N", False),
    ("yes", True),
    ("on", True),
    ("Off", False),
    ("TRUE", True),
    ("0o17", 15),  # PyYAML: "0o17"
    ("017", 15),
    ("08", 8),  # not octal, so go-yaml's float rule: 8.0, sent as 8
    ("0x1F", 31),
    ("-0b11", -3),
    ("1_000", 1000),
    ("0", 0),
    ("-0", 0),
    ("9223372036854775808", 9223372036854775808),  # ParseUint's range
    ("1:30", "1:30"),  # PyYAML: the integer 90 (sexagesimal)
    ("2024-01-01", "2024-01-01"),  # PyYAML: a date
    ("1e400", "1e400"),  # out of float range: ParseFloat fails, so a string
    ("0.5.5", "0.5.5"),
    ("-x", "-x"),
    ("=", "="),
    ("~", None),
    ("null", None),
    ("NULL", None),
    ("abc", "abc"),
]


@pytest.mark.parametrize(("text", "expected"), CASES, ids=[c[0] for c in CASES])
def test_plain_scalars_are_read_as_go_yaml_v2_reads_them(text: str, expected: Any) -> None:
    got = kubeyaml.load(f"v: {text}\n")["v"]
    assert got == expected
    assert type(got) is type(expected)


@pytest.mark.parametrize("text", [".nan", ".inf", "-.Inf"])
def test_nan_and_infinity_are_refused_because_json_cannot_carry_them(text: str) -> None:
    with pytest.raises(kubeyaml.KubeYamlError, match=r"spec\.v: .* JSON has no NaN or infinity"):
        kubeyaml.load(f"spec:\n  v: {text}\n")


def test_map_keys_become_strings_as_in_json() -> None:
    assert kubeyaml.load("on: 1\n3: b\nn: c\n'y': d\n") == {"true": 1, "3": "b", "false": "c", "y": "d"}


def test_merge_keys_and_explicit_tags_still_work() -> None:
    doc = kubeyaml.load("a: &x {p: 1e-6}\nb:\n  <<: *x\n  q: !!str 1e-6\nc: !!float 1\nd: !!int 0o10\n")
    assert doc == {"a": {"p": 1e-6}, "b": {"p": 1e-6, "q": "1e-6"}, "c": 1, "d": 8}
    with pytest.raises(yaml.YAMLError, match="'abc' is not a valid int"):
        kubeyaml.load("a: !!int abc\n")


@pytest.mark.parametrize(
    "value",
    [
        *(text for text, _ in CASES),
        "1e-6",
        "plain",
        "",
        " y",
        "yes please",
        "null",
        "<<",
        1e-6,
        7,
        True,
        None,
    ],
)
def test_the_dumper_writes_what_kubernetes_reads_back_unchanged(value: Any) -> None:
    written = to_yaml({"v": value})
    assert kubeyaml.load(written) == {"v": value}, written
    assert yaml.safe_load(written) == {"v": value}, written  # and PyYAML agrees: no reader-dependent scalar


def _committed_yaml() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "*.yaml", "*.yml"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    # Chart templates are Go templates, not YAML: test_helm.py reads what they render.
    return [REPO / name for name in listed if "/templates/" not in name]


def reader_differences(text: str) -> list[str]:
    """Every scalar that PyYAML's YAML 1.1 rules and Kubernetes' rules read differently, by path."""
    ours = list(yaml.load_all(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
    theirs = kubeyaml.load_all(text)
    out: list[str] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict) and len(a) == len(b):
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True):
                walk(ka, kb, f"{path}[key {ka!r}]")
                walk(va, vb, f"{path}.{ka}")
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (va, vb) in enumerate(zip(a, b, strict=True)):
                walk(va, vb, f"{path}[{i}]")
        elif not (a == b and type(a) is type(b)):
            out.append(f"{path}: PyYAML reads {a!r}, Kubernetes reads {b!r}")

    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        walk(a, b, f"document {i}")
    return out


def test_every_committed_yaml_file_means_the_same_to_kubernetes() -> None:
    files = _committed_yaml()
    names = {str(p.relative_to(REPO)) for p in files}
    assert {"crds/legorl.dev_rlruns.yaml", "charts/legorl/values.yaml", "examples/tiny-local.yaml"} <= names
    problems = [f"{p.relative_to(REPO)}: {d}" for p in files for d in reader_differences(p.read_text())]
    assert not problems, "\n".join(problems)


def test_the_old_generator_output_is_caught() -> None:
    # What `legorl crds` wrote before it used the Kubernetes rules: `default: 1e-6`, unquoted.
    assert reader_differences("default: 1e-6\n") == [
        "document 0.default: PyYAML reads '1e-6', Kubernetes reads 1e-06"
    ]


# That every CRD default has its schema's type as Kubernetes reads the file (what broke `helm
# install`): tests/api/test_crds.py::test_every_default_passes_its_own_schema_and_rules.


def test_validate_refuses_an_unquoted_number_where_kubernetes_wants_a_string() -> None:
    text = (REPO / "examples/tiny-local.yaml").read_text()
    assert 'learningRate: "5e-4"' in text
    bad = text.replace('learningRate: "5e-4"', "learningRate: 1e-6")
    (report,) = validate_documents(parse_documents(bad, "bad.yaml"))
    errors = [f"{p.path}: {p.message}" for p in report.problems if p.severity == "error"]
    assert errors == [
        "spec.algorithm.learningRate: must be a string; "
        'Kubernetes reads the unquoted 1e-6 as a number: quote it: "1e-6"'
    ]
    (report,) = validate_documents(
        parse_documents(bad.replace("learningRate: 1e-6", 'learningRate: "1e-6"'), "ok.yaml")
    )
    assert not [p for p in report.problems if p.severity == "error"]


def test_validate_names_an_unquoted_word_kubernetes_reads_as_a_bool() -> None:
    text = (REPO / "examples/tiny-local.yaml").read_text()
    assert "name: tiny-local" in text
    (report,) = validate_documents(
        parse_documents(text.replace("name: tiny-local", "name: y", 1), "bad.yaml")
    )
    messages = [p.message for p in report.problems if p.path == "metadata.name"]
    assert messages == ['must be a string; Kubernetes reads the unquoted y as true: quote it: "y"'], (
        report.problems
    )


def test_an_unsendable_value_is_a_load_error_with_its_place() -> None:
    with pytest.raises(ValueError, match=r"bad.yaml:1: spec.x: nan cannot be sent: JSON has no NaN"):
        parse_documents("spec:\n  x: .nan\n", "bad.yaml")
    assert math.isnan(yaml.safe_load("x: .nan\n")["x"])  # what PyYAML alone would have let through
