"""`legorl ui`'s settings and the static export (bundling, CSP hashes, escaping), without a browser."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from legorl.ui.cli import serve_parser, settings_from_args
from legorl.ui.export import bundle_modules, export_html
from legorl.ui.kube import credentials
from legorl.ui.server import STATIC_DIR
from legorl.ui.synthetic import write_synthetic_store


def _settings(*argv: str, env: dict[str, str] | None = None) -> object:
    return settings_from_args(serve_parser().parse_args(list(argv)), environ=env or {})


def test_defaults_are_loopback_and_read_only(tmp_path: Path) -> None:
    settings = settings_from_args(serve_parser().parse_args(["--store", str(tmp_path)]), environ={})
    assert settings.host == "127.0.0.1" and settings.port == 8090
    assert settings.action_token is None and not settings.actions_enabled and settings.kube is None


def test_the_action_token_comes_from_the_environment_and_never_shows(tmp_path: Path) -> None:
    env = {"LEGORL_UI_ACTION_TOKEN": "  tok-123  "}
    settings = settings_from_args(serve_parser().parse_args(["--store", str(tmp_path)]), environ=env)
    assert settings.action_token == "tok-123" and settings.actions_enabled
    assert "tok-123" not in repr(settings)


def test_nothing_to_show_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="--store PATH, --runs-dir DIR or --kube"):
        _settings()
    (tmp_path / ".legorl" / "runs").mkdir(parents=True)
    settings = settings_from_args(serve_parser().parse_args([]), environ={})
    assert settings.runs_dir == str(Path(".legorl") / "runs")


def test_bad_flags(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="RUN=http"):
        _settings("--store", str(tmp_path), "--engine", "nope")
    with pytest.raises(ValueError, match="not a port"):
        _settings("--store", str(tmp_path), "--port", "70000")


def test_kube_server_and_kubeconfig(tmp_path: Path) -> None:
    settings = settings_from_args(
        serve_parser().parse_args(["--kube-server", "http://127.0.0.1:8001", "-n", "team-a"]), environ={}
    )
    assert settings.kube is not None and settings.kube.server == "http://127.0.0.1:8001"
    assert settings.kube.namespaces == ("team-a",)
    config = tmp_path / "kubeconfig"
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
        "clusters: [{name: k, cluster: {server: 'https://k.example:6443', insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: abc}}]\n"
    )
    kube = credentials(kubeconfig=str(config), environ={})
    assert kube.server == "https://k.example:6443" and kube.token == "abc" and kube.insecure
    assert "abc" not in repr(kube)
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
        "clusters: [{name: k, cluster: {server: 'https://k.example:6443'}}]\n"
        "users: [{name: u, user: {exec: {command: aws}}}]\n"
    )
    with pytest.raises(ValueError, match="kubectl proxy"):
        credentials(kubeconfig=str(config), environ={})


def test_ui_help_and_bad_export(run_cli: Callable[..., tuple[int, str, str]], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_cli("ui", "--help")
    assert exit_info.value.code == 0
    code, _, err = run_cli("ui", "export", str(tmp_path / "missing"), "-o", str(tmp_path / "x.html"))
    assert code == 2 and "not a folder" in err


def test_bundle_resolves_every_import() -> None:
    script = bundle_modules(STATIC_DIR / "js")
    assert not re.search(r"^\s*(import|export)\b", script, re.M)
    defined = set(re.findall(r"^const (__m_\w+) = ", script, re.M))
    used = set(re.findall(r"= (__m_\w+);", script))
    assert used <= defined and "__m_main" in defined
    assert script.index("const __m_dom") < script.index("const __m_charts") < script.index("const __m_main")


def test_export_is_one_self_contained_page(tmp_path: Path) -> None:
    store = tmp_path / "store"
    write_synthetic_store(
        store, name="exp", steps=2, tasks_per_step=2, group_size=2, held_out_tasks=1, eval_every=2
    )
    html = export_html(str(store), max_trajectories=3)
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', html)
    assert csp is not None
    script = html.split('<script type="module">', 1)[1].rsplit("</script>", 1)[0]
    style = html.split("<style>", 1)[1].split("</style>", 1)[0]
    for text in (script, style):
        digest = base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in csp.group(1)
    assert "default-src 'none'" in csp.group(1)
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), "nothing is fetched"
    payload = html.split('<script type="application/json" id="legorl-data">', 1)[1].split("</script>", 1)[0]
    assert "<" not in payload, "data cannot close its script element"
    data = json.loads(payload)
    assert data["static"] and len(data["trials"]["exp"]) == 2 * 2 * 2 + 2
    assert sum("/trials/" in key for key in data["responses"]) == 3
    assert data["responses"]["api/info"]["actions_enabled"] is False
