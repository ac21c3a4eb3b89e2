"""`GET /changes`: the agent's changes leave a trial pod through the proxy, read without trust."""

from __future__ import annotations

from pathlib import Path

import httpx

from legorl.proxy.app import ProxyApp
from legorl.proxy.settings import ProxySettings
from legorl.sandbox import changes
from tests.support.asgi_server import serve


def test_changes_are_served_from_the_read_only_workspace(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "pkg").mkdir(parents=True)
    (ws / "pkg" / "a.py").write_text("a = 1\n")
    (ws / "tests").mkdir()
    (ws / "tests" / "test_a.py").write_text("def test(): pass\n")
    baseline = tmp_path / "baseline" / "baseline.json"
    baseline.parent.mkdir()
    changes.save_baseline(changes.baseline(ws), baseline)
    # What an agent leaves behind: a fix, a test edit, a link and a hook in the repo's git config.
    (ws / "pkg" / "a.py").write_text("a = 2\n")
    (ws / "tests" / "test_a.py").unlink()
    (ws / "escape.py").symlink_to("/etc/passwd")
    (ws / ".git").mkdir()
    (ws / ".git" / "config").write_text(f"[core]\n\tfsmonitor = touch {tmp_path}/pwned\n")
    settings = ProxySettings(
        upstream="http://127.0.0.1:9", journal=tmp_path / "journal", workspace=str(ws), baseline=str(baseline)
    )
    with serve(ProxyApp(settings)) as url:
        got = httpx.get(f"{url}/changes").json()
    assert got["files"] == {"pkg/a.py": "a = 2\n"}
    assert got["deleted"] == ["tests/test_a.py"]
    assert [(f["kind"], f["path"]) for f in got["findings"]] == [("symlink", "escape.py")]
    assert not (tmp_path / "pwned").exists()
    # The verify stage loads exactly this JSON.
    assert changes.ChangeSet.from_dict(got).files == {"pkg/a.py": "a = 2\n"}


def test_changes_without_a_workspace_is_a_clear_404(tmp_path: Path) -> None:
    settings = ProxySettings(upstream="http://127.0.0.1:9", journal=tmp_path / "journal")
    with serve(ProxyApp(settings)) as url:
        response = httpx.get(f"{url}/changes")
    assert response.status_code == 404
    assert "--workspace/--baseline" in response.text
