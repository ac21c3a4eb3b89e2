"""Counts of what the parts of a checkout share by spelling instead of by type (issue 20's before/after).

Usage: python scripts/census.py [--repo DIR] [--json]

Every count is over the tracked `.py` files outside `tests/` and this script (and, for the string-keyed
reads, outside the component that owns the data). The counts are textual, so read them as a trend between
two trees measured the same way, not as exact facts:

- `dict_str_any`: occurrences of `dict[str, Any]`.
- `string_keyed_reads`: `x["key"]`, `x.get("key"` or `x.pop("key"` with a key of another component's
  data: the trainer's step figures (`FIGURE_KEYS`) outside `trainer/` and `legorl/api/figures.py` (their
  one definition), and the
  keys of the proxy's `/trajectory` body that the issue names outside `proxy/`.
- `cross_component_reads` (issue 37), by document: string-keyed reads of a document outside the module that
  owns its type, over the non-test, non-benchmark files: `progress` (the controller's `state.json`,
  `legorl.api.progress`), `trial_row` (trial-table columns, `legorl.api.trajectory`), `pod_notes` (the
  trial pods' annotations, `legorl.api.annotations`), `launch_env` (string literals naming the trainer's
  launch variables, `legorl.api.launch`) and `spec_status` (camelCase fields of the three CRDs' spec and
  status models, outside `legorl/api/` and the operator's `status/` and `render/` that write them, less
  `observedGeneration` and `startTime`, which every built-in kind's status has too); reads only, found in
  the syntax tree (a subscript assigned to is a write); `total` is the sum. `tests/project/test_census.py`
  keeps `total` at or below `scripts/census-ceiling.json`.
- `label_literals`: string literals `"legorl.dev/..."` (label and annotation keys, not apiVersions),
  definitions included.
- `store_path_literals`: string literals naming a run-store path (`batches/`, `weights/`, `metrics/`,
  `trials/`, `evals/`, `validation/`, `controller/state.json`, `trainer/state.json`, `run.json`, a marker
  file) outside `legorl/api/store.py`.
- `duplicate_pairs`: pairs of places sharing six or more lines, from the library's `duplicates` command
  over a copy of the non-test files (absent when the command is not installed).
- `largest_files`: the five largest files by line count.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

FIGURE_KEYS = frozenset(
    {
        "loss", "reward_mean", "fidelity_pearson", "fidelity_mean_abs_logprob_delta",
        "fidelity_max_abs_logprob_delta", "fidelity_kl", "replayed_token_share", "is_ess", "is_capped_share",
        "clip_fraction", "grad_norm", "entropy", "kl_ref", "tokens_per_second", "step_seconds", "trials_kept",
        "trials_dropped", "zero_variance_groups", "learning_rate", "sync_seconds",
    }
)  # fmt: skip
"""The trainer's step figures as its telemetry table named them before they had a type (a fixed list, so
two trees are measured alike; generic keys such as `step` are left out)."""
TRAJECTORY_KEYS = ("end", "policyVersions", "mergedTurnShare", "finishReasons", "turns")
"""The `/trajectory` keys issue 20 names as read back by string in the controller and the operator."""
STORE_PATH = re.compile(
    r"^(batches|weights|metrics|trials|evals|validation|controller|trainer)/"
    r"|^(run\.json|COMMIT\.json|PUBLISHED\.json|legorl-weights\.json|state\.json|latest\.json)$"
)
STORE_MODULE = "legorl/api/store.py"
PROGRESS_KEYS = frozenset(
    {
        "trials_total", "eval_trials", "trials_running", "trials_dropped", "zero_variance_groups",
        "by_reason", "held_out_solve_rate", "held_out_interval", "baseline_solve_rate",
        "fidelity_correlation", "max_abs_logprob_delta", "trials_per_minute", "eta_seconds",
        "elapsed_seconds", "phase_seconds", "fidelity_below_steps", "fidelity_guard_after",
        "degraded_reason", "degraded_message", "max_steps",
    }
)  # fmt: skip
"""The controller snapshot's fields (generic ones such as `step` or `message` left out)."""
ROW_KEYS = frozenset(
    {
        "task_id", "group_id", "termination_reason", "tamper_findings", "policy_versions", "num_turns",
        "merged_turn_share", "stage_seconds", "started_at", "ended_at", "tool_call_turns",
    }
)  # fmt: skip
"""Trial-table columns (generic ones such as `trial`, `step` or `error` left out)."""
NOTE_KEYS = frozenset({"taskId", "groupId", "stageSeconds"})
"""The trial pods' annotation documents' keys (`policyVersion` is also a status field, counted there;
`exitCode` is also the Kubernetes container status's)."""
LAUNCH_ENV = re.compile(
    r"^LEGORL_(RUN|NAMESPACE|STORE_URI|FLEET_URL|WEIGHT_SYNC_ADDRESS|WEIGHT_SYNC_PORT|METRICS_PORT)$"
)
KUBERNETES_STATUS_FIELDS = frozenset({"observedGeneration", "startTime"})
"""CRD status fields that the built-in kinds' statuses have too (left out of `spec_status`)."""

OWNERS = {
    "progress": ("legorl/api/progress.py", "legorl/controller/"),
    "trial_row": ("legorl/api/trajectory.py",),
    "pod_notes": ("legorl/api/annotations.py",),
    "launch_env": ("legorl/api/launch.py",),
    "spec_status": ("legorl/api/", "operator/legorl/operator/status/", "operator/legorl/operator/render/"),
}
"""Where each document's type lives (and, for spec and status, the code that writes them)."""


def crd_field_aliases() -> set[str]:
    """The camelCase wire names of every field of the CRDs' spec and status models, nested ones included
    (single words such as `name` or `image` left out: too generic to tell apart)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pydantic import BaseModel  # noqa: PLC0415

    from legorl.api.fleet import RolloutFleetSpec, RolloutFleetStatus  # noqa: PLC0415
    from legorl.api.pool import SandboxPoolSpec, SandboxPoolStatus  # noqa: PLC0415
    from legorl.api.run import RLRunSpec, RLRunStatus  # noqa: PLC0415

    aliases: set[str] = set()
    seen: set[type] = set()

    def walk(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, info in model.model_fields.items():
            alias = info.alias or name
            if re.search(r"[a-z][A-Z]", alias):
                aliases.add(alias)
            for inner in _models_in(info.annotation):
                walk(inner)

    for root in (
        RLRunSpec,
        RLRunStatus,
        RolloutFleetSpec,
        RolloutFleetStatus,
        SandboxPoolSpec,
        SandboxPoolStatus,
    ):
        walk(root)
    # Every Kubernetes object's status has these (Pods, Deployments, Jobs): a read of one is a read of a
    # built-in as often as of ours, and the census cannot tell which.
    return aliases - KUBERNETES_STATUS_FIELDS


def _models_in(annotation: Any) -> list[type]:
    from typing import get_args  # noqa: PLC0415

    from pydantic import BaseModel  # noqa: PLC0415

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


LABEL_KEY = re.compile(r"legorl\.dev/(?!v\d)")
"""A label or annotation key (or their prefix), not an apiVersion."""


def source_files(repo: Path) -> list[Path]:
    listed = subprocess.run(  # noqa: S603
        ["git", "-C", str(repo), "ls-files", "*.py"],  # noqa: S607
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [Path(name) for name in listed if not name.startswith("tests/") and name != "scripts/census.py"]


def string_keyed_reads(text: str, keys: set[str]) -> int:
    count = 0
    for key in keys:
        quoted = re.escape(f'"{key}"')
        count += len(re.findall(rf"\[\s*{quoted}\s*\]|\.(?:get|pop)\(\s*{quoted}", text))
    return count


def keyed_loads(text: str, keys: set[str]) -> int:
    """`string_keyed_reads` for the cross-component census, by the syntax tree: only reads count
    (`x["key"]` loaded, `x.get("key")`, `x.pop("key")`); a subscript assigned to (`x["key"] = v`) is a
    write, which the census of reads leaves out."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return string_keyed_reads(text, keys)

    def named(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in keys

    count = 0
    for node in ast.walk(tree):
        if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and named(node.slice)) or (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop")
            and node.args
            and named(node.args[0])
        ):
            count += 1
    return count


def string_literals(text: str) -> list[str]:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def duplicate_pairs(repo: Path, files: list[Path]) -> int | None:
    if shutil.which("duplicates") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        for name in files:
            target = Path(tmp) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(repo / name, target)
        out = subprocess.run(  # noqa: S603
            ["duplicates", "--repo", tmp, "--most", "1", "--seconds", "300"],  # noqa: S607
            capture_output=True,
            text=True,
            check=False,
        ).stdout
    match = re.search(r"^(\d+) pairs of places", out, re.MULTILINE)
    return int(match.group(1)) if match else 0


def cross_component_reads(repo: Path, files: list[Path]) -> dict[str, int]:
    keys = {
        "progress": set(PROGRESS_KEYS),
        "trial_row": set(ROW_KEYS),
        "pod_notes": set(NOTE_KEYS),
        "spec_status": crd_field_aliases(),
    }
    out = dict.fromkeys([*keys, "launch_env"], 0)
    for name in files:
        path = str(name)
        if path.startswith("benchmarks/"):
            continue
        text = (repo / name).read_text()
        for document, owned in keys.items():
            if not path.startswith(OWNERS[document]):
                out[document] += keyed_loads(text, owned)
        if not path.startswith(OWNERS["launch_env"]):
            out["launch_env"] += sum(1 for s in string_literals(text) if LAUNCH_ENV.match(s))
    out["total"] = sum(out.values())
    return out


def census(repo: Path) -> dict[str, Any]:
    files = source_files(repo)
    counts = {"dict_str_any": 0, "string_keyed_reads": 0, "label_literals": 0, "store_path_literals": 0}
    sizes = []
    for name in files:
        text = (repo / name).read_text()
        sizes.append((text.count("\n"), str(name)))
        counts["dict_str_any"] += text.count("dict[str, Any]")
        if not str(name).startswith("trainer/") and str(name) != "legorl/api/figures.py":
            counts["string_keyed_reads"] += string_keyed_reads(text, set(FIGURE_KEYS))
        if not str(name).startswith("proxy/"):
            counts["string_keyed_reads"] += string_keyed_reads(text, set(TRAJECTORY_KEYS))
        literals = string_literals(text)
        counts["label_literals"] += sum(1 for s in literals if LABEL_KEY.match(s))
        if str(name) != STORE_MODULE:
            counts["store_path_literals"] += sum(1 for s in literals if STORE_PATH.search(s))
    sizes.sort(reverse=True)
    return {
        **counts,
        "cross_component_reads": cross_component_reads(repo, files),
        "duplicate_pairs": duplicate_pairs(repo, files),
        "largest_files": [{"path": path, "lines": lines} for lines, path in sizes[:5]],
        "files": len(files),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--reads", action="store_true", help="only the cross-component reads (fast: no duplicates search)"
    )
    args = parser.parse_args(argv)
    if args.reads:
        files = source_files(args.repo)
        sys.stdout.write(json.dumps(cross_component_reads(args.repo, files), indent=2) + "\n")
        return
    result = census(args.repo)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return
    lines = []
    for key, value in result.items():
        if key == "largest_files":
            lines.append("largest_files:")
            lines.extend(f"  {item['lines']:6d}  {item['path']}" for item in value)
        else:
            lines.append(f"{key}: {value}")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
