"""scripts/build-images.sh and its driver, scripts/images/build_images.py, without a Docker engine.

The builds themselves run in CI (`scripts/test.sh` runs `scripts/build-images.sh`) and their figures
are in benchmarks/results/images.json; these tests check what decides how each image is built: the
bases every Dockerfile needs are made, the Dockerfile reaches the engine unchanged but for its
syntax line, python-build-standalone images are skipped with their reason, and the runc wrapper
changes the OOM score and nothing else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[1]
WRAPPER = REPO / "scripts" / "images" / "runc-oom-clamp"


bi = load_script("build_images", REPO / "scripts/images/build_images.py")
ROWS = json.loads((REPO / "sandbox-images/images.json").read_text(encoding="utf-8"))["images"]
BUILT = [row for row in ROWS if row["dockerfile"]]


@pytest.mark.parametrize("row", BUILT, ids=lambda row: row["image"])
def test_every_base_a_dockerfile_names_is_made_here(row: dict[str, str]) -> None:
    text = (REPO / row["dockerfile"]).read_text(encoding="utf-8")
    names = bi.image_args(text)
    assert names, f"{row['dockerfile']} takes no base as a build argument"
    assert set(names) <= set(bi.BASES), (
        f"{row['dockerfile']}: no base made here for {set(names) - set(bi.BASES)}"
    )
    args = bi.build_args(text, {})
    assert args == [w for name in names for w in ("--build-arg", f"{name}={bi.BASES[name]}")]


def test_every_base_made_here_has_its_dockerfile() -> None:
    for image in set(bi.BASES.values()) - {bi.DEBIAN}:
        text = (REPO / "scripts/images/bases" / f"{bi.short_name(image)}.Dockerfile").read_text(
            encoding="utf-8"
        )
        assert bi.image_args(text) == ["DEBIAN_IMAGE"]


def test_an_unknown_base_is_refused_by_name() -> None:
    with pytest.raises(bi.BuildError, match="ARG CUDA_IMAGE: no base is made here"):
        bi.build_args("ARG CUDA_IMAGE=nvcr.io/nvidia/cuda:12.8.0-runtime\nFROM ${CUDA_IMAGE}\n", {})


def test_pbs_base_url_goes_only_to_the_dockerfiles_that_take_it() -> None:
    init = (REPO / "sandbox-images/init/Dockerfile").read_text(encoding="utf-8")
    proxy = (REPO / "sandbox-images/proxy/Dockerfile").read_text(encoding="utf-8")
    mirror = {"PBS_BASE_URL": "http://127.0.0.1:9/pbs"}
    assert "PBS_BASE_URL=http://127.0.0.1:9/pbs" not in bi.build_args(proxy, mirror)
    assert "PBS_BASE_URL=http://127.0.0.1:9/pbs" in bi.build_args(init, mirror)


def test_the_python_build_standalone_images_are_the_ones_skipped_without_a_mirror(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PBS_BASE_URL", raising=False)
    skipped = {}
    for row in BUILT:
        if row["image"].startswith("ghcr.io/legorl/tasks/"):
            continue
        if bi.needs_pbs((REPO / row["dockerfile"]).read_text(encoding="utf-8")):
            nowhere = bi.Docker("/nonexistent/docker", {})  # a call to the engine would raise
            result = bi.build_image(nowhere, row, no_cache=False)
            skipped[row["image"].split("/")[-1]] = result
    assert sorted(skipped) == [
        "harness-mini-swe-agent:0.1.0",
        "harness-openhands:0.1.0",
        "sandbox-init:0.1.0",
    ]
    assert all(r.status == "skipped" and "PBS_BASE_URL" in r.reason for r in skipped.values())


def test_only_the_syntax_directive_is_dropped() -> None:
    text = "# syntax=docker/dockerfile:1\n# ghcr.io/legorl/x\nARG A_IMAGE=a:1\nFROM ${A_IMAGE}\n"
    assert bi.without_syntax_line(text) == "# ghcr.io/legorl/x\nARG A_IMAGE=a:1\nFROM ${A_IMAGE}\n"
    # A later line is an ordinary comment to Docker: kept.
    later = "FROM a:1\n\n\n# syntax=docker/dockerfile:1\n"
    assert bi.without_syntax_line(later) == later


def test_the_local_copy_keeps_the_dockerfiles_own_ignore_file() -> None:
    path = REPO / "operator/Dockerfile"
    with bi.local_copy(path) as copy:
        assert copy.read_text(encoding="utf-8") == bi.without_syntax_line(path.read_text(encoding="utf-8"))
        ignore = copy.with_name("Dockerfile.dockerignore").read_text(encoding="utf-8")
        assert ignore == path.with_name("Dockerfile.dockerignore").read_text(encoding="utf-8")
    assert not copy.exists()


def test_every_image_built_here_has_a_smoke_run() -> None:
    for row in BUILT:
        if bi.short_name(row["image"]).startswith("tasks/"):
            continue  # build_task_image returns its own
        assert bi.smoke_for(row["image"], row) is not None, f"{row['image']} has no smoke run"


def test_each_harness_kind_has_its_binary_to_run() -> None:
    kinds = {row["role"].rsplit(" ", 1)[-1] for row in BUILT if "/harness-" in row["image"]}
    assert kinds == set(bi.HARNESS_BINARIES)


# --- scripts/images/runc-oom-clamp ----------------------------------------------------------------


def _run_wrapper(tmp_path: Path, config: dict[str, Any], *args: str) -> tuple[dict[str, Any], str]:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(config), encoding="utf-8")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "runc").write_text('#!/bin/sh\necho "runc $*"\n', encoding="utf-8")
    (fake / "runc").chmod(0o755)
    argv = [a.replace("BUNDLE", str(bundle)) for a in args]
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    out = subprocess.run([str(WRAPPER), *argv], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads((bundle / "config.json").read_text(encoding="utf-8")), out.strip()


@pytest.mark.parametrize("form", [("--bundle", "BUNDLE"), ("--bundle=BUNDLE",), ("-b", "BUNDLE")])
def test_the_wrapper_raises_a_negative_oom_score_to_zero(tmp_path: Path, form: tuple[str, ...]) -> None:
    config = {"ociVersion": "1.0.2", "process": {"oomScoreAdj": -999, "args": ["sh"]}}
    after, out = _run_wrapper(tmp_path, config, "create", *form, "ctr")
    assert after == {"ociVersion": "1.0.2", "process": {"oomScoreAdj": 0, "args": ["sh"]}}
    assert out.startswith("runc create") and out.endswith(" ctr")


def test_the_wrapper_leaves_a_non_negative_score_and_other_commands_alone(tmp_path: Path) -> None:
    config = {"process": {"oomScoreAdj": 500}}
    after, out = _run_wrapper(tmp_path, config, "create", "--bundle", "BUNDLE", "ctr")
    assert after == config
    (tmp_path / "bundle").rename(tmp_path / "old")
    (tmp_path / "bin").rename(tmp_path / "oldbin")
    _, out = _run_wrapper(tmp_path, {"process": {"oomScoreAdj": -5}}, "state", "ctr")
    assert out == "runc state ctr"


def test_build_images_script_parses() -> None:
    script = REPO / "scripts/build-images.sh"
    assert os.access(script, os.X_OK) and os.access(WRAPPER, os.X_OK)
    for path in (script, WRAPPER):
        result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stderr


def test_the_trainer_is_built_here_with_the_torch_its_lock_was_resolved_with() -> None:
    header = (REPO / "trainer/requirements.txt").read_text(encoding="utf-8").splitlines()[0]
    assert header.endswith(f" torch=={bi.CPU_TORCH}"), header
    assert "--exclude torch" in (REPO / "sandbox-images/lock_requirements.py").read_text(encoding="utf-8")


def test_the_task_builder_takes_the_recipe_copy_and_the_network(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "legorl.sandbox.bundled", str(tmp_path)], check=True, capture_output=True
    )
    first = json.loads((tmp_path / "tasks.jsonl").read_text(encoding="utf-8").splitlines()[0])
    builder = REPO / "sandbox-images/task/build_task_images.py"
    args = [
        "--dry-run",
        "--only",
        first["instance_id"],
        "--dockerfile",
        "/copy/Dockerfile",
        "--network",
        "host",
    ]
    out = subprocess.run(
        [sys.executable, str(builder), str(tmp_path / "tasks.jsonl"), *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("docker build -f /copy/Dockerfile --network host --build-arg SOURCE="), out
