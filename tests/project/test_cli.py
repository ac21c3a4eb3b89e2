"""The `legorl` command line: exit codes, output, and the error paths people hit."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from legorl.api.progress import Progress
from legorl.cli.main import build_parser
from legorl.embedded.runner import EmbeddedRun, format_progress, load_run
from legorl.operator.settings import OperatorSettings, from_environment

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))

Cli = Callable[..., tuple[int, str, str]]

GOOD = (Path(__file__).parents[2] / "examples" / "tiny-local.yaml").read_text()


def test_validate_examples_passes(run_cli: Cli) -> None:
    code, out, _ = run_cli("validate", *map(str, EXAMPLES))
    assert code == 0, out
    assert out.splitlines()[-1] == "6 document(s): 0 error(s), 0 warning(s)"


def test_validate_reports_every_problem_with_location(run_cli: Cli, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        GOOD.replace("groupSize: 4", "groupSize: 1")
        .replace("maxTurns: 4", "maxTurn: 4")
        .replace('learningRate: "5e-4"', "learningRate: 0.0005")
    )
    code, out, _ = run_cli("validate", str(bad))
    assert code == 1
    lines = [line for line in out.splitlines() if ": error: " in line]
    assert all(line.startswith(f"{bad}:10 (RLRun/tiny-local): error: ") for line in lines), lines
    text = "\n".join(lines)
    assert "spec.harness.maxTurn: unknown field 'maxTurn'; did you mean 'maxTurns'?" in text
    assert (
        "spec.algorithm.learningRate: must be a string; Kubernetes reads the unquoted 0.0005 as a number: "
        'quote it: "0.0005"'
    ) in text
    # CEL problems are reported even while schema problems exist, where the rule can run.
    assert "spec.algorithm.groupSize: every algorithm here takes its baseline from the trial's group" in text
    assert out.splitlines()[-1] == "1 document(s): 3 error(s), 0 warning(s)"


def test_validate_json_output(run_cli: Cli, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("groupSize: 4", "groupSize: 1"))
    code, out, _ = run_cli("validate", "-o", "json", str(bad))
    assert code == 1
    report = json.loads(out)
    assert report["documents"] == 1
    (problem,) = report["problems"]
    assert problem["path"] == "spec.algorithm.groupSize"
    assert problem["check"] == "cel"
    assert problem["severity"] == "error"


def test_warnings_pass_unless_strict(run_cli: Cli, tmp_path: Path) -> None:
    manifest = tmp_path / "warn.yaml"
    manifest.write_text(GOOD.replace("maxSteps: 6", "maxSteps: 2"))
    code, out, _ = run_cli("validate", str(manifest))
    assert code == 0
    assert "warning: spec.evaluation.intervalSteps: validation every 6 steps never happens mid-run" in out
    code, _, _ = run_cli("validate", "--strict", str(manifest))
    assert code == 1


def test_validate_warns_of_an_engine_image_without_legorls_plugin(run_cli: Cli, tmp_path: Path) -> None:
    shared = (Path(__file__).parents[2] / "examples" / "shared-fleet-and-pool.yaml").read_text()
    manifest = tmp_path / "fleet.yaml"
    manifest.write_text(
        shared.replace("image: ghcr.io/legorl/engine:0.1.0", "image: vllm/vllm-openai:v0.33.0")
    )
    code, out, _ = run_cli("validate", str(manifest))
    assert code == 0, out
    (line,) = [line for line in out.splitlines() if ": warning: " in line]
    assert line.startswith(f"{manifest}:4 (RolloutFleet/coder-fleet): warning: spec.engine.image: ")
    assert "vllm/vllm-openai:v0.33.0 is not legorl's engine image" in line and "engine/Dockerfile" in line
    assert out.splitlines()[-1] == "4 document(s): 0 error(s), 1 warning(s)"
    code, _, _ = run_cli("validate", "--strict", str(manifest))
    assert code == 1


def test_validate_reads_stdin(run_cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(GOOD))
    code, out, _ = run_cli("validate", "-")
    assert code == 0, out
    assert out.startswith("-:10 (RLRun/tiny-local): valid")


def test_unreadable_and_malformed_files_exit_2(run_cli: Cli, tmp_path: Path) -> None:
    code, _, err = run_cli("validate", str(tmp_path / "missing.yaml"))
    assert code == 2
    assert "missing.yaml: cannot read" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: RLRun\nspec: [unclosed\n")
    code, _, err = run_cli("validate", str(broken))
    assert code == 2
    assert f"{broken}:3:1: invalid YAML" in err
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    code, _, err = run_cli("validate", str(empty))
    assert code == 2
    assert "no YAML documents found" in err


def test_unknown_kind_and_non_mapping(run_cli: Cli, tmp_path: Path) -> None:
    manifest = tmp_path / "other.yaml"
    manifest.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n---\n- a\n- b\n")
    code, out, _ = run_cli("validate", str(manifest))
    assert code == 1
    assert (
        "kind: unknown kind 'ConfigMap'; legorl manifests are one of RolloutFleet, SandboxPool, RLRun" in out
    )
    assert ":5: error: a manifest must be a mapping" in out


def test_status_in_a_manifest_is_a_warning(run_cli: Cli, tmp_path: Path) -> None:
    manifest = tmp_path / "status.yaml"
    manifest.write_text(GOOD + "status:\n  step: 3\n")
    code, out, _ = run_cli("validate", str(manifest))
    assert code == 0
    assert "warning: status: status is written by the operator" in out


def test_references_resolve_across_documents(run_cli: Cli, tmp_path: Path) -> None:
    shared = (Path(__file__).parents[2] / "examples" / "shared-fleet-and-pool.yaml").read_text()
    runs_only = "---".join(part for part in shared.split("---") if "kind: RLRun" in part)
    manifest = tmp_path / "runs.yaml"
    manifest.write_text(runs_only)
    code, out, _ = run_cli("validate", str(manifest))
    assert code == 0
    assert "warning: spec.fleetRef.name: RolloutFleet 'coder-fleet' is not among the given files" in out
    mismatched = tmp_path / "mismatch.yaml"
    mismatched.write_text(
        shared.replace(
            "uri: pvc://models/qwen3-coder-30b-a3b\n  replicas", "uri: pvc://models/other\n  replicas"
        )
    )
    code, out, _ = run_cli("validate", str(mismatched))
    assert code == 1
    assert (
        "error: spec.policy.checkpoint.uri: the run's policy pvc://models/qwen3-coder-30b-a3b differs" in out
    )


def test_render_refuses_invalid_input(run_cli: Cli, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("groupSize: 4", "groupSize: 1"))
    code, out, err = run_cli("render", str(bad))
    assert code == 1
    assert out == ""
    assert "nothing rendered" in err


def test_crds_outside_a_checkout(run_cli: Cli, tmp_path: Path) -> None:
    code, _, err = run_cli("crds", "--check", "--root", str(tmp_path))
    assert code == 2
    assert "not a legorl checkout" in err


def test_help_lists_commands(run_cli: Cli) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_cli("--help")
    assert exit_info.value.code == 0


def test_duplicate_keys_are_an_error_as_in_kubectl(run_cli: Cli, tmp_path: Path) -> None:
    manifest = tmp_path / "dup.yaml"
    manifest.write_text(GOOD.replace("    replicas: 1\n", "    replicas: 1\n    replicas: 2\n"))
    code, _, err = run_cli("validate", str(manifest))
    assert code == 2
    assert "found duplicate key 'replicas' (first at line" in err


def test_unquoted_dates_stay_strings(run_cli: Cli, tmp_path: Path) -> None:
    manifest = tmp_path / "date.yaml"
    manifest.write_text(
        GOOD.replace(
            "      uri: builtin://tiny-moe", "      uri: builtin://tiny-moe\n      revision: 2024-01-01"
        )
    )
    code, out, _ = run_cli("validate", str(manifest))
    assert code == 0, out


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "apiVersion: legorl.dev/v1alpha1\nkind: [RLRun]\nmetadata: {name: x}\n",
            "kind: unknown kind ['RLRun']",
        ),
        ("x: &a [*a]\n", "a YAML alias refers to itself"),
        (
            GOOD.replace("    replicas: 1", "    replicas: 99999999999999999999"),
            "spec.fleet.replicas: must be ≤ 1024",
        ),
        (
            GOOD.replace("  name: tiny-local", "  name: tiny-local\n  annotations: {a: !!binary aGk=}"),
            "metadata.annotations.a",
        ),
        (
            GOOD.replace("  name: tiny-local", "  name: tiny-local\n  generation: 99999999999999999999"),
            "metadata.generation: must be ≤",
        ),
        (GOOD.replace("spec:\n", "spec: null\n").split("  policy:")[0], "spec: required field is missing"),
        (
            "apiVersion: legorl.dev/v1alpha1\nkind: RLRun\nmetadata: []\nspec: {}\n",
            "metadata: must be a mapping",
        ),
    ],
    ids=[
        "kind-is-a-list",
        "recursive-alias",
        "huge-int",
        "binary-value",
        "huge-generation",
        "null-spec",
        "list-metadata",
    ],
)
def test_odd_yaml_gets_a_clear_answer_not_a_traceback(
    run_cli: Cli, tmp_path: Path, text: str, expected: str
) -> None:
    manifest = tmp_path / "odd.yaml"
    manifest.write_text(text)
    code, out, err = run_cli("validate", str(manifest))
    assert code in (0, 1, 2)
    assert expected in out + err, out + err


def test_integer_map_keys_are_not_list_indexes(run_cli: Cli, tmp_path: Path) -> None:
    manifest = tmp_path / "intkey.yaml"
    manifest.write_text(
        GOOD.replace(
            "    dtype: float32\n    routingReplay",
            "    dtype: float32\n    resources: {limits: {1: 2}}\n    routingReplay",
        )
    )
    code, out, _ = run_cli("validate", str(manifest))
    assert code == 1
    # Kubernetes makes the key the string "1" (sigs.k8s.io/yaml), which is no container resource.
    assert "error: spec.trainer.resources.limits.1: '1' is not a container resource" in out, out


def test_render_multi_node_fleet_with_and_without_leader_worker_set(run_cli: Cli, repo: Path) -> None:
    path = str(repo / "tests/golden/inputs/fleet-multinode.yaml")
    code, out, err = run_cli("render", path)
    assert code == 0, err
    kinds = [doc["kind"] for doc in yaml.safe_load_all(out) if doc]
    assert kinds.count("StatefulSet") == 2 and "LeaderWorkerSet" not in kinds
    code, out, err = run_cli("render", "--leader-worker-set", "-n", "ml", path)
    assert code == 0, err
    docs = [doc for doc in yaml.safe_load_all(out) if doc]
    assert [d["kind"] for d in docs].count("LeaderWorkerSet") == 1
    # The input sets its namespace; -n only fills in namespaces that are missing.
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] != "RolloutFleet"} == {"research"}


def test_operator_command_parses_the_charts_arguments() -> None:
    args = build_parser().parse_args(
        [
            "operator",
            "--health-port=8080",
            "--log-level=info",
            "--namespace=a",
            "--namespace=b",
            "--peering=legorl",
        ]
    )
    assert (args.log_level, args.namespace, args.peering, args.health_port) == (
        "INFO",
        ["a", "b"],
        "legorl",
        8080,
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["operator", "--log-level=verbose"])


def test_operator_settings_take_images_and_store_from_the_chart_environment() -> None:
    settings = from_environment(
        OperatorSettings(),
        {
            "LEGORL_PROXY_IMAGE": "r/proxy:2",
            "LEGORL_DEFAULT_STORE_URI": "s3://b/runs",
            "LEGORL_TRAINER_IMAGE": "",
        },
    )
    assert settings.images.proxy == "r/proxy:2"
    assert settings.images.trainer == OperatorSettings().images.trainer  # empty keeps the default
    assert settings.default_store_uri == "s3://b/runs"


def test_operator_json_logs_are_one_object_per_line() -> None:
    from legorl.operator.logs import JsonFormatter  # noqa: PLC0415

    record = logging.LogRecord("kopf.objects", logging.WARNING, __file__, 1, "retrying %s", ("x",), None)
    record.k8s_ref = {"apiVersion": "legorl.dev/v1alpha1", "kind": "RLRun", "namespace": "rl", "name": "r1"}
    line = JsonFormatter().format(record)
    assert "\n" not in line
    data = json.loads(line)
    assert (data["level"], data["logger"], data["message"]) == ("warning", "kopf.objects", "retrying x")
    assert data["object"] == {
        "apiVersion": "legorl.dev/v1alpha1",
        "kind": "RLRun",
        "namespace": "rl",
        "name": "r1",
    }


def test_run_overrides_apply_and_bad_ones_exit_2(run_cli: Cli, tmp_path: Path) -> None:
    run = load_run(str(EXAMPLES[0].parent / "tiny-local.yaml"))
    short = EmbeddedRun(run, root=tmp_path, steps=1, eval_trials=1).run_obj.spec
    assert (short.stop.max_steps, short.evaluation.trials_per_task) == (1, 1)
    assert (run.spec.stop.max_steps, run.spec.evaluation.trials_per_task) == (6, 3)  # manifest untouched
    # An override the schema refuses is a clear error before anything starts (nothing in --dir).
    code, _, err = run_cli(
        "run", str(EXAMPLES[0].parent / "tiny-local.yaml"), "--dir", str(tmp_path / "r"), "--eval-trials", "0"
    )
    assert code == 2
    assert "overrides make the manifest invalid" in err and "trialsPerTask" in err, err
    assert not (tmp_path / "r").exists()


def test_progress_line_says_when_the_fidelity_guard_fired() -> None:
    calm = format_progress(Progress(run="x", fidelity_correlation=0.9991))
    assert "fidelity 0.9991" in calm and "DEGRADED" not in calm
    fired = Progress(
        run="x", fidelity_correlation=0.5, fidelity_below_steps=3, degraded_reason="FidelityBelowThreshold"
    )
    assert "DEGRADED: FidelityBelowThreshold (3 step(s))" in format_progress(fired)


def test_the_readme_cli_table_lists_every_command_and_no_promise() -> None:
    """README.md describes the product as it is: every `legorl` subcommand has a row in its CLI reference,
    and no sentence promises what a later issue will add."""
    import argparse  # noqa: PLC0415
    import re  # noqa: PLC0415

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    table = readme[readme.index("## CLI reference") :]
    table = table[: table.index("\n## ")]
    rows = set(re.findall(r"^\| `legorl (\w+)", table, re.MULTILINE))
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) - rows == set()
    assert not re.search(r"\bnext issue\b|\bafter the [\w-]+ issue\b", readme, re.IGNORECASE)
