"""Packaging: one `legorl` namespace, no top-level `operator` import, light extras per component."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

HEAVY = ("torch", "vllm", "megatron", "transformers")


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=False)


@pytest.mark.parametrize("where", ["<repo>", "<repo>/operator", "<elsewhere>"])
def test_stdlib_operator_is_not_shadowed(repo: Path, tmp_path: Path, where: str) -> None:
    # From the checkout root a folder named `operator/` sits on sys.path[0]; it has no
    # __init__.py, so the standard library's module must still win.
    cwd = Path(where.replace("<repo>", str(repo)).replace("<elsewhere>", str(tmp_path)))
    result = _python(
        "import operator, sysconfig, legorl.operator, legorl.api\n"
        "assert operator.add(2, 3) == 5, operator\n"
        "assert operator.__file__.startswith(sysconfig.get_paths()['stdlib']), operator.__file__\n"
        "print(legorl.operator.__name__)",
        cwd,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "legorl.operator"


def test_no_folder_is_an_importable_top_level_operator(repo: Path) -> None:
    for folder in ("operator", "proxy", "trainer", "legorl"):
        assert not (repo / folder / "__init__.py").exists(), f"{folder}/__init__.py would shadow imports"


def test_components_share_one_namespace() -> None:
    import legorl  # noqa: PLC0415
    import legorl.operator  # noqa: PLC0415
    import legorl.proxy  # noqa: PLC0415
    import legorl.trainer  # noqa: PLC0415

    assert not hasattr(legorl, "__file__") or legorl.__file__ is None, "legorl must be a namespace package"
    roots = {Path(p).parent.name for p in legorl.__path__}
    assert {"operator", "proxy", "trainer"} <= roots


def test_wheel_holds_only_the_legorl_namespace(repo: Path, tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(repo),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("legorl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/", 1)[0] for name in names}
    assert top == {"legorl", f"legorl-{metadata.version('legorl')}.dist-info"}, top
    for package in ("api", "cli", "manifests", "operator", "proxy", "trainer", "controller", "embedded"):
        assert f"legorl/{package}/__init__.py" in names
    assert not any(name.startswith("legorl/__init__") for name in names), "legorl must stay a namespace"
    assert "legorl/api/py.typed" in names
    # `legorl run` finds the harness launcher and the compact mini-swe-agent settings in the package.
    assert "legorl/sandbox/legorl-harness" in names
    # The UI's front end ships inside the package: nothing is fetched at run time.
    assert {
        "legorl/ui/static/index.html",
        "legorl/ui/static/js/main.js",
        "legorl/ui/static/css/app.css",
    } <= set(names)
    assert "legorl/controller/harness/mini.yaml" in names
    # The bundled task set's generator reads its templates from the package.
    templates = repo / "sandbox-images/legorl/sandbox/tiny-python"
    assert {f"legorl/sandbox/tiny-python/{p.name}" for p in templates.glob("*.toml")} <= set(names)
    assert "legorl/sandbox/tiny-python/set.toml" in names


def test_extras_keep_the_ml_stack_out_of_operator_and_proxy(repo: Path) -> None:
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    base = project["dependencies"]
    extras = project["optional-dependencies"]
    for group, deps in (("base", base), ("operator", extras["operator"]), ("proxy", extras["proxy"])):
        for dep in deps:
            assert not dep.lower().startswith(HEAVY), f"{group} depends on {dep}"
    assert any(dep.startswith("torch") for dep in extras["trainer"])
    assert any(dep.startswith("kopf") for dep in extras["operator"])


def test_cli_help_imports_nothing_heavy(repo: Path) -> None:
    result = _python(
        "import sys\n"
        "from legorl.cli.main import build_parser\n"
        "build_parser().format_help()\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'vllm', 'megatron', 'celpy', 'pyarrow', 'kopf', 'kubernetes', 'pydantic'))\n"
        "print(heavy)",
        repo,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_console_script_is_installed() -> None:
    result = subprocess.run(
        [str(Path(sys.executable).parent / "legorl"), "version"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "legorl.dev/v1alpha1" in result.stdout
