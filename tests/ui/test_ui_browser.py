"""The UI in a real headless Chromium (Playwright), serving the recorded fixture run and a copy of it with
a planted failure: every view renders with data, the trajectory viewer shows tokens and their masks,
untrusted text stays text, the diagnostics page shows the planted failure, and the static export works
from file://. Screenshots go to $LEGORL_ARTIFACTS/ui (else the test's tmp folder), and with
LEGORL_UI_DOCS_SCREENSHOTS=1 also to docs/ui/.

Needs Chromium and Playwright: `bash scripts/get-browser.sh`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from legorl.api.store import RunStore
from legorl.api.trajectory import TamperFinding
from legorl.controller.canary import CanaryCheck, CanaryReport, write_report
from legorl.ui.server import start_in_thread
from legorl.ui.synthetic import write_synthetic_store

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "ui-run" / "store"
CHROMIUM = os.environ.get("LEGORL_CHROMIUM", "/usr/bin/chromium")
RUN = "ui-fixture"
PLANTED = "ui-fixture-planted"
EVIL = '<img src=x onerror="window.__xss=1"><script>window.__xss=2</script>'

playwright_sync = pytest.importorskip(
    "playwright.sync_api", reason="bash scripts/get-browser.sh installs Playwright"
)
if not Path(CHROMIUM).is_file():
    pytest.skip(f"no Chromium at {CHROMIUM} (bash scripts/get-browser.sh)", allow_module_level=True)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = os.environ.get("LEGORL_ARTIFACTS")
    folder = Path(base) / "ui" if base else tmp_path_factory.mktemp("ui-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _plant(store_dir: Path) -> None:
    """A copy of the fixture run with a fidelity collapse and an untrusted-text trial planted."""
    store = RunStore(str(store_dir))
    spec = store.read_run_spec() or {}
    spec["metadata"]["name"] = PLANTED
    store.write_run_spec(spec)
    for figures in store.read_metrics():
        step = int(figures["step"])
        store.write_metrics(
            step, {**figures, "fidelity_pearson": 0.93, "fidelity_max_abs_logprob_delta": 2.6}
        )
    # A canary whose token parity failed (what `legorl run --canary` or the operator writes).
    write_report(
        store,
        CanaryReport(
            run=PLANTED,
            time="2026-12-01T09:00:00+00:00",
            seconds=180.0,
            checks=[
                CanaryCheck("trial", "Passed", "canary-t0-r0 completed, reward 0"),
                CanaryCheck("token-parity", "Failed", "Pearson 0.4100 over 52 tokens is below 0.99"),
            ],
            trial="canary-t0-r0",
        ),
    )
    record = store.read_batch(store.committed_steps()[0]).trials[0]
    store.save_trial(
        replace(
            record,
            trial="evil-1",
            step=9,
            error=EVIL,
            tamper_findings=[TamperFinding(kind="test_hook_added", detail=EVIL, path="conftest.py")],
        )
    )


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    runs = tmp_path_factory.mktemp("runs")
    shutil.copytree(FIXTURE, runs / RUN / "store")
    shutil.copytree(FIXTURE, runs / PLANTED / "store")
    _plant(runs / PLANTED / "store")
    url, stop = start_in_thread(runs_dir=str(runs), port=0)
    yield url
    stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_sync.sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-background-networking",
            ],
        )
        yield chromium
        chromium.close()


class Page:
    """A browser tab that records console errors and uncaught exceptions (CSP violations included)."""

    def __init__(self, browser: Any, artifacts: Path) -> None:
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.artifacts = artifacts
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def open(self, url: str, route: str) -> Any:
        self.page.goto(url + route)
        hash_ = route if route.startswith("#") else "#/"
        self.page.wait_for_function(
            "h => { const m = document.querySelector('#main'); return m && m.dataset.ready === h; }",
            arg=hash_,
            timeout=20_000,
        )
        return self.page

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(self.artifacts / f"{name}.png"), full_page=True)
        if os.environ.get("LEGORL_UI_DOCS_SCREENSHOTS") == "1":
            (REPO / "docs" / "ui").mkdir(exist_ok=True)
            self.page.screenshot(path=str(REPO / "docs" / "ui" / f"{name}.png"))

    def close(self) -> None:
        assert not self.errors, f"browser console errors: {self.errors}"
        self.page.close()


@pytest.fixture
def tab(browser: Any, artifacts: Path) -> Iterator[Page]:
    page = Page(browser, artifacts)
    yield page
    page.close()


def _api(ui: str, path: str, **params: Any) -> Any:
    return httpx.get(ui + path, params=params, timeout=30).json()


def _text(page: Any, selector: str) -> str:
    return str(page.locator(selector).first.inner_text())


def test_runs_list_and_compare(ui: str, tab: Page) -> None:
    page = tab.open(ui, "#/")
    rows = page.locator("[data-view=runs] tbody tr")
    assert rows.count() == 2
    assert RUN in _text(page, "[data-view=runs] tbody")
    tab.shot("runs")
    for run in (RUN, PLANTED):
        page.locator(f"input[data-run='{run}']").check()
    page.get_by_role("button", name="Compare selected").click()
    page.wait_for_function("() => document.querySelector('#main').dataset.ready.startsWith('#/compare/')")
    assert page.locator("[data-view=compare] figure.chart").count() >= 6
    assert (
        page.locator(
            "[data-view=compare] figure.chart polyline, [data-view=compare] figure.chart circle"
        ).count()
        > 0
    )
    tab.shot("compare")


VIEWS = [
    # (view, route, selector that must match at least `count` elements, text the view must show)
    ("overview", "", ".timeline li", 1, "Training steps"),
    ("curves", "curves", "figure.chart svg circle", 10, "Held-out solve rate"),
    ("outcomes", "outcomes", "figure.chart rect.bar", 1, "Dropped share"),
    ("tasks", "tasks", "table.grid td.cell:not(.empty)", 3, "Held-out tasks"),
    ("trials", "trials", "[data-view=trials] tbody tr", 3, "held-out"),
    ("fleet", "fleet", "[data-view=fleet] .card", 1, "not available locally"),
    ("sandboxes", "sandboxes", "[data-view=sandboxes] tbody tr", 3, "not available locally"),
]


@pytest.mark.parametrize("view", VIEWS, ids=[v[0] for v in VIEWS])
def test_every_run_view_renders_with_data(ui: str, tab: Page, view: tuple[str, str, str, int, str]) -> None:
    name, route, selector, count, text = view
    page = tab.open(ui, f"#/run/{RUN}/{route}" if route else f"#/run/{RUN}")
    assert page.locator(f"[data-view={name}]").count() == 1
    assert page.locator(".note.error").count() == 0, _text(page, "#main")
    assert page.locator(selector).count() >= count, f"{name}: fewer than {count} of {selector}"
    assert text in page.inner_text(f"[data-view={name}]")
    tab.shot(name)


def test_overview_shows_the_last_canary(ui: str, tab: Page) -> None:
    page = tab.open(ui, f"#/run/{PLANTED}")
    card = page.locator("[data-validation=Failed]")
    assert card.count() == 1, _text(page, "[data-view=overview]")
    assert "Pearson 0.4100" in card.inner_text() and "token-parity" in card.inner_text()
    clean = tab.open(ui, f"#/run/{RUN}")
    assert "legorl run FILE --canary" in _text(clean, "[data-view=overview]")


def test_trial_filters_and_paging(ui: str, tab: Page) -> None:
    page = tab.open(ui, f"#/run/{RUN}/trials?split=train&limit=2")
    assert page.locator("[data-view=trials] tbody tr").count() == 2
    assert "1–2 of" in _text(page, ".pager .count")
    page.get_by_role("button", name="Next →").click()
    page.wait_for_function("() => document.querySelector('#main').dataset.ready.includes('offset=2')")
    assert "3–" in _text(page, ".pager .count")
    page.locator("th.sortable", has_text="Reward").click()
    page.wait_for_function("() => document.querySelector('#main').dataset.ready.includes('sort=reward')")
    assert page.locator("th.sortable.asc").count() == 1


def test_trajectory_viewer_shows_tokens_and_masks(ui: str, tab: Page) -> None:
    items = _api(ui, f"api/runs/{RUN}/trials", split="train", limit=500)["items"]
    trial = max(items, key=lambda r: r["num_turns"])["trial"]
    page = tab.open(ui, f"#/run/{RUN}/trial/{trial}")
    sampled = page.locator(".tok.s")
    everything = page.locator(".tok")
    assert sampled.count() > 0 and everything.count() > sampled.count()
    assert page.locator(".turn").count() >= 1
    text = page.inner_text(".turns")
    assert "<tool_call>" in text, "markup in model output is shown as text"
    assert page.locator(".toolcall").count() >= 1
    mask_colour = sampled.first.evaluate("e => e.style.backgroundColor")
    assert mask_colour, "sampled tokens are coloured by the loss mask"
    assert everything.first.evaluate("e => e.style.backgroundColor") == "", "context tokens are not"
    sampled.first.hover()
    assert "behaviour log-prob" in page.inner_text(".inspector")
    tab.shot("trajectory")
    page.select_option("select[name=mode]", "logprob")
    assert sampled.first.evaluate("e => e.style.backgroundColor") != mask_colour or sampled.count() > 1
    tab.shot("trajectory-logprob")


def test_trajectory_viewer_colours_training_minus_rollout(ui: str, tab: Page) -> None:
    items = _api(ui, f"api/runs/{RUN}/trials", split="train", limit=500)["items"]
    trained = [
        r["trial"]
        for r in items
        if any(s["training_logprobs"] for s in _api(ui, f"api/runs/{RUN}/trials/{r['trial']}")["segments"])
    ]
    assert trained, "the recorded run trained on some of its trials"
    page = tab.open(ui, f"#/run/{RUN}/trial/{trained[0]}")
    assert not page.locator("option[value=delta]").is_disabled()
    page.select_option("select[name=mode]", "delta")
    sampled = page.locator(".tok.s")
    assert sampled.count() > 0
    assert sampled.first.evaluate("e => e.style.backgroundColor"), (
        "trained tokens are coloured by the difference"
    )
    sampled.first.hover()
    assert "training log-prob" in page.inner_text(".inspector")
    assert "v0" in page.inner_text("[data-view=trajectory]"), "the note names the weights that scored it"
    tab.shot("trajectory-delta")
    held_out = _api(ui, f"api/runs/{RUN}/trials", split="validation", limit=1)["items"][0]["trial"]
    page = tab.open(ui, f"#/run/{RUN}/trial/{held_out}")
    assert page.locator("option[value=delta]").is_disabled(), "held-out trials are never trained on"
    assert "never trained on" in page.inner_text("[data-view=trajectory]")


def test_untrusted_text_stays_text(ui: str, tab: Page) -> None:
    page = tab.open(ui, f"#/run/{PLANTED}/trial/evil-1")
    assert EVIL in page.inner_text("pre.error")
    assert EVIL in page.inner_text("[data-view=trajectory]")
    assert page.locator("[data-view=trajectory] img, [data-view=trajectory] script").count() == 0
    assert page.evaluate("() => window.__xss") is None


def test_diagnostics_show_the_planted_failure(ui: str, tab: Page) -> None:
    page = tab.open(ui, f"#/run/{PLANTED}/diagnostics")
    finding = page.locator(".finding[data-rule='fidelity-below-threshold']")
    assert finding.count() == 1, page.inner_text("#main")
    assert "Next step" in finding.inner_text()
    assert "0.93" in finding.inner_text(), "the planted figures are the evidence"
    tab.shot("diagnostics")
    clean = tab.open(ui, f"#/run/{RUN}/diagnostics")
    assert clean.locator(".finding[data-rule='fidelity-below-threshold']").count() == 0


def test_static_export_works_from_file_url(tmp_path: Path, tab: Page) -> None:
    out = tmp_path / "run.html"
    result = subprocess.run(
        [sys.executable, "-m", "legorl.cli", "ui", "export", str(FIXTURE), "-o", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    html = out.read_text()
    assert (
        '<script type="module">' in html and "http://" not in html.split('<script type="application/json"')[0]
    )
    assert out.stat().st_size < 3_000_000
    url = out.as_uri()
    page = tab.open(url, f"#/run/{RUN}/curves")
    assert page.locator("figure.chart svg circle").count() >= 10
    data = json.loads(page.locator("#legorl-data").text_content())
    trial = next(k.rsplit("/", 1)[1] for k in data["responses"] if "/trials/" in k)
    page = tab.open(url, f"#/run/{RUN}/trial/{trial}")
    assert page.locator(".tok").count() > 0
    page = tab.open(url, f"#/run/{RUN}/trials?split=validation")
    assert page.locator("[data-view=trials] tbody tr").count() >= 1
    tab.shot("export")


def test_routed_experts_are_shown_per_token(tmp_path: Path, tab: Page) -> None:
    store = tmp_path / "store"
    write_synthetic_store(
        store, name="moe", steps=1, tasks_per_step=1, group_size=2, held_out_tasks=0, routing=True, seed=1
    )
    url, stop = start_in_thread([str(store)], port=0)
    try:
        trial = next(r for r in _api(url, "api/runs/moe/trials")["items"] if r["num_turns"])["trial"]
        page = tab.open(url, f"#/run/moe/trial/{trial}")
        page.select_option("select[name=mode]", "experts")
        assert page.locator(".tok").first.evaluate("e => e.style.backgroundColor"), "coloured by expert"
        page.locator(".tok").nth(3).hover()
        assert "layer 1 experts" in page.inner_text(".inspector")
        assert "⟨" in page.inner_text(".turns"), "no tokenizer: token ids are shown"
        tab.shot("trajectory-experts")
    finally:
        stop()
