"""`legorl ui export STORE -o run.html`: one self-contained HTML file of a run (works from file://).

The page is the live UI's own front end: its ES modules bundled into one inline module script, its
stylesheet inline, and the JSON API's answers for the run embedded as a data block, produced by the
same handlers the server runs. A strict Content-Security-Policy allows exactly those inline blocks.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import posixpath
import re
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

import httpx

from .data import StoredTrial
from .schemas import to_json
from .server import STATIC_DIR, UiApp
from .settings import UiSettings

__all__ = ["bundle_modules", "export_html"]

_IMPORT: Final = re.compile(r"^import\s*\{([^}]*)\}\s*from\s*'([^']+)';[ \t]*$", re.M)
_EXPORT: Final = re.compile(
    r"^export\s+((?:async\s+)?(?:function\*?|const|let|class))\s+([A-Za-z_$][\w$]*)", re.M
)
_STRAY: Final = re.compile(r"^\s*(import|export)\b", re.M)


def _module_var(name: str) -> str:
    return "__m_" + re.sub(r"[^A-Za-z0-9]", "_", name.removesuffix(".js"))


def bundle_modules(js_dir: Path, entry: str = "main.js") -> str:
    """The front end's ES modules as one script: each module becomes a closure returning its exports,
    in dependency order (a bundler for this code base's own import style, not a general one)."""
    sources: dict[str, str] = {}
    deps: dict[str, list[str]] = {}

    def load(name: str) -> None:
        if name in sources:
            return
        text = (js_dir / name).read_text(encoding="utf-8")
        sources[name] = text
        deps[name] = []
        for _, target in _IMPORT.findall(text):
            resolved = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
            deps[name].append(resolved)
            load(resolved)

    load(entry)
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise ValueError(f"import cycle through {name}")
        visiting.add(name)
        for dep in deps[name]:
            visit(dep)
        visiting.discard(name)
        order.append(name)

    visit(entry)
    out = []
    for name in order:
        text = sources[name]

        def rewrite_import(match: re.Match[str], name: str = name) -> str:
            names = []
            for raw in match.group(1).split(","):
                item = raw.strip()
                if not item:
                    continue
                original, _, alias = (part.strip() for part in item.partition(" as "))
                names.append(f"{original}: {alias}" if alias else original)
            target = posixpath.normpath(posixpath.join(posixpath.dirname(name), match.group(2)))
            return f"const {{ {', '.join(names)} }} = {_module_var(target)};"

        body = _IMPORT.sub(rewrite_import, text)
        exported = [m.group(2) for m in _EXPORT.finditer(body)]
        body = _EXPORT.sub(lambda m: f"{m.group(1)} {m.group(2)}", body)
        stray = _STRAY.search(body)
        if stray:
            line = body[: stray.start()].count("\n") + 1
            raise ValueError(f"{name}:{line}: an import/export form the bundler does not handle")
        var, names = _module_var(name), ", ".join(exported)
        out.append(f"// --- {name}\nconst {var} = (() => {{\n{body}\nreturn {{ {names} }};\n}})();")
    return "\n".join(out) + "\n"


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def _pick_trials(rows: list[StoredTrial], limit: int) -> list[str]:
    """Trajectories worth embedding: tampered ones, then one per (split, step, reason), then the rest."""
    chosen: list[str] = []
    seen: set[tuple[Any, ...]] = set()
    for r in rows:
        if r.summary.tamper_findings:
            chosen.append(r.summary.trial)
    for r in rows:
        t = r.summary
        key = (t.split, t.step, t.termination_reason, (r.reward or 0) > 0)
        if key not in seen:
            seen.add(key)
            chosen.append(t.trial)
    chosen += [r.summary.trial for r in rows]
    unique = list(dict.fromkeys(chosen))
    return unique[:limit]


async def _responses(app: UiApp, max_trajectories: int) -> tuple[dict[str, Any], dict[str, Any], str]:
    async def ask(path: str) -> Any:
        response = await client.get("/" + path)
        if response.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {response.status_code}: {response.text[:500]}")
        return response.json()

    await app.startup()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ui")
    try:
        responses: dict[str, Any] = {}
        info = await ask("api/info")
        responses["api/info"] = {**info, "static": True, "actions_enabled": False}
        runs = await ask("api/runs")
        responses["api/runs"] = runs
        trials: dict[str, Any] = {}
        title = "legorl"
        for row in runs["runs"]:
            run_id = row["id"]
            title = f"legorl · {row['name']}"
            base = f"api/runs/{quote(run_id, safe='')}"
            for rest in ("", "/curves", "/outcomes", "/tasks", "/fleet", "/sandboxes", "/diagnostics"):
                responses[base + rest] = await ask(base + rest)
            entry = await app.catalog.get(run_id)
            assert entry.store is not None
            rows = await asyncio.to_thread(entry.store.trials)
            trials[run_id] = [to_json(r.row) for r in rows]  # as the trial list's items
            for trial in _pick_trials(rows, max_trajectories):
                responses[f"{base}/trials/{quote(trial, safe='')}"] = await ask(f"{base}/trials/{trial}")
        return responses, trials, title
    finally:
        await client.aclose()
        await app.shutdown()


def export_html(store: str, *, max_trajectories: int = 20, settings: UiSettings | None = None) -> str:
    """The HTML page of the run in `store` (a run store directory or fsspec URL)."""
    base = settings or UiSettings()
    app = UiApp(replace(base, stores=(store,), runs_dir=None, kube=None, action_token=None))
    responses, trials, title = asyncio.run(_responses(app, max_trajectories))
    data = {
        "static": True,
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "responses": responses,
        "trials": trials,
    }
    # `<` is escaped so no text inside the data (model output included) can close the script element.
    payload = json.dumps(data, allow_nan=False, separators=(",", ":"), default=str)
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    script = bundle_modules(STATIC_DIR / "js")
    style = (STATIC_DIR / "css" / "app.css").read_text(encoding="utf-8")
    csp = (
        f"default-src 'none'; script-src {_csp_hash(script)}; style-src {_csp_hash(style)}; "
        "img-src data:; base-uri 'none'; form-action 'none'"
    )
    safe_title = title.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        '<meta name="referrer" content="no-referrer">\n<link rel="icon" href="data:,">\n'
        f"<title>{safe_title}</title>\n<style>{style}</style>\n</head>\n<body>\n"
        '<div id="app"><p class="note muted">loading…</p></div>\n'
        f'<script type="application/json" id="legorl-data">{payload}</script>\n'
        f'<script type="module">{script}</script>\n</body>\n</html>\n'
    )
