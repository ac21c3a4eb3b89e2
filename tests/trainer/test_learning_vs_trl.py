"""benchmarks/learning_vs_trl.py: the shared reward, the settings mapping, and the quick run end to end.

The reward both trainers use (`benchmarks/_exact_fix.py`) and the assumption the mapping onto TRL makes of
legorl's defaults are checked without any model. The end-to-end test runs `--quick` for real: demonstrations
recorded with mini-swe-agent, a warm start by megatron-core, legorl's `PolicyTrainer` and TRL's
`GRPOTrainer` (in its own virtualenv, `scripts/get-trl.sh`: `$LEGORL_TRL_PYTHON` when scripts/test.sh made
it, else made here, ~4 minutes the first time) on the same decision turns, the one evaluator over both
sides' checkpoints, the results file and the plot. Its curves mean nothing at three steps; what is checked
is that every part ran and wrote what the full comparison reads, and the gradient check: on one batch,
legorl's gradient is TRL's (cosine > 0.99999), at the norm the mapping predicts. A change to legorl's loss,
advantages, masks, aggregation or importance weights that TRL does not share fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from legorl.trainer.settings import TrainerSettings
from tests.support.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
# The benchmark imports its helpers by their bare names (its folder is sys.path[0] when run): registered
# first, so nothing else of benchmarks/ lands on sys.path.
exact_fix = load_script("_exact_fix", REPO / "benchmarks" / "_exact_fix.py")
load_script("provenance", REPO / "benchmarks" / "provenance.py")
bench = load_script("learning_vs_trl", REPO / "benchmarks" / "learning_vs_trl.py")

FIX = "sed -i '13s/bonus/weight/' shopkit/cart.py && echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def call(command: str, before: str = "") -> str:
    body = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"{before}<tool_call>\n{body}\n</tool_call><|im_end|>"


def test_the_reward_is_the_exact_command_in_one_well_formed_call() -> None:
    assert exact_fix.score(call(FIX), FIX) == exact_fix.Scored(1.0, False, FIX)
    assert exact_fix.score(call(FIX, before="Reading the output.\n"), FIX).reward == 1.0
    wrong = exact_fix.score(call(FIX.replace("weight", "height")), FIX)
    assert (wrong.reward, wrong.malformed) == (0.0, False)
    for malformed in [
        call(FIX).removesuffix("<|im_end|>"),  # cut off at the token limit
        call(FIX).replace('"bash"', '"python"'),
        call(FIX).replace("}}", "}"),  # not JSON
        call(FIX) + "<|im_end|>",  # text after the call
        call(FIX).replace("<|im_end|>", "") + call(FIX),  # two calls
        f"{FIX}<|im_end|>",  # no tool call
    ]:
        scored = exact_fix.score(malformed, FIX)
        assert (scored.reward, scored.malformed) == (0.0, True), malformed


def test_the_mapping_onto_trl_assumes_legorl_defaults() -> None:
    """The TRL config is written for these legorl settings; a changed default must change the mapping."""
    defaults = TrainerSettings(run="x", store_uri="file:///x", checkpoint_dir=Path("/x"))
    assert {k: getattr(defaults, k) for k in bench.LEGORL_DEFAULTS} == bench.LEGORL_DEFAULTS
    assert (defaults.algorithm, defaults.advantage, defaults.loss_aggregation) == (
        "GRPO",
        "GroupMeanStd",
        "TokenMean",
    )
    assert (defaults.mini_batches, defaults.kl_coef, defaults.entropy_coef, defaults.warmup_steps) == (
        1,
        0,
        0,
        0,
    )
    assert (defaults.temperature, defaults.dtype, defaults.drop_zero_variance_groups) == (
        1.0,
        "float32",
        True,
    )


def test_every_step_takes_distinct_tasks_in_passes_over_all_of_them() -> None:
    steps = bench.schedule(24, 6, 8, seed=3)
    assert all(len(set(step)) == 8 for step in steps)
    assert sorted(i for step in steps[:3] for i in step) == list(range(24))
    assert steps == bench.schedule(24, 6, 8, seed=3) != bench.schedule(24, 6, 8, seed=4)


def trl_python() -> str:
    if os.environ.get("LEGORL_TRL_PYTHON"):
        return os.environ["LEGORL_TRL_PYTHON"]
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "get-trl.sh"), sys.executable],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.integration
def test_the_quick_comparison_runs_both_trainers_end_to_end(tmp_path: Path) -> None:
    python = trl_python()
    out = tmp_path / "learning-vs-trl.json"
    script = REPO / "benchmarks" / "learning_vs_trl.py"
    done = subprocess.run(
        [sys.executable, str(script), "--quick", "--work", str(tmp_path / "work"), "--out", str(out),
         "--trl-python", python],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    plan = bench.QUICK
    (run,) = result["runs"]
    assert (run["setting"], run["seed"]) == ("quick", 1)
    for side in ("legorl", "trl"):
        curve = run[side]
        assert len(curve["train_reward"]) == plan.steps
        assert all(0.0 <= r <= 1.0 for r in curve["train_reward"])
        # The start, then every `save_every` steps and the last: scored by the same evaluator.
        assert [e["step"] for e in curve["evaluations"]] == [0, 2, 3]
        for evaluation in curve["evaluations"]:
            assert (
                evaluation["validation"]["samples"] == evaluation["validation"]["tasks"] * plan.eval_samples
            )
            assert evaluation["train"]["tasks"] == plan.eval_train_tasks
            assert evaluation["validation"]["entropy"] > 0
    # The start is scored once, for both sides alike.
    assert run["legorl"]["evaluations"][0] == run["trl"]["evaluations"][0]
    assert result["versions"]["trl"]["transformers"] == result["versions"]["legorl"]["transformers"]
    assert result["versions"]["trl"]["prompt_ids_checked"] == result["tasks"]["train"] > 0
    # TRL's own tokenization of every prompt it generated from (P prompts × G samples a step).
    assert (
        result["versions"]["trl"]["prompt_ids_observed"]
        == plan.steps * plan.prompts_per_step * plan.group_size
    )
    assert result["legorl_settings"] == bench.LEGORL_DEFAULTS
    assert set(result["agreement"]["quick"]["mean_difference"]) == {
        "train_reward_last",
        "final_validation",
        "final_train",
    }
    # One batch, both trainers' gradients: the same direction, and with legorl's `Keep` the same norm (the
    # advantages' eps, 1e-6 against TRL's 1e-4, is the only difference: 2e-4 here, as the docstring says).
    check = result["gradient_check"]
    for side in ("legorl-keep", "legorl-drop"):
        assert check[side]["cosine"] > 0.99999, check
        assert check[side]["worst_tensor_relative_difference"] < 1e-3, check
    assert check["legorl-keep"]["norm_ratio_to_trl"] == pytest.approx(1.0, abs=2e-3)
    assert check["legorl-drop"]["norm_ratio_to_trl"] == pytest.approx(
        check["expected_norm_ratio_drop"], rel=2e-3
    )
    svg = ET.fromstring(out.with_suffix(".svg").read_text())
    assert svg.tag.endswith("svg") and len(svg.findall("{http://www.w3.org/2000/svg}polyline")) == 8
