"""A demonstrations file round-trips: what `legorl.trainer.warmstart.reading` saves, it loads the same."""

from __future__ import annotations

from pathlib import Path

from legorl.trainer.warmstart.demos import Behaviour, Demonstration, Turn
from legorl.trainer.warmstart.reading import load_demonstrations, save_demonstrations


def test_demonstrations_round_trip_through_their_file(tmp_path: Path) -> None:
    demos = [
        Demonstration(
            task_id="tiny-read__a-001",
            behaviour=Behaviour.FIX,
            turns=(
                Turn(
                    ({"role": "user", "content": "fix it"},),
                    "Restoring the intended behaviour.",
                    "sed -i s/a/b/ x",
                ),
                Turn(
                    ({"role": "user", "content": "done?"},),
                    None,
                    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
                ),
            ),
            weight=0.4,
            observations=("<returncode>0</returncode>",),
        ),
        Demonstration("tiny-read__b-002", Behaviour.SUBMIT, (), 0.3),
    ]
    path = tmp_path / "demos.jsonl"
    save_demonstrations(demos, path)
    assert load_demonstrations(path) == demos
    assert Demonstration.from_json(demos[0].to_json()) == demos[0]
