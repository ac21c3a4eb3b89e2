"""The UI's JSON API over real run stores: the recorded fixture run (tests/fixtures/ui-run, made by
scripts/make-ui-fixture.sh from a real `legorl run`) and synthetic stores written with the RunStore
writers. Requests go through the ASGI app in-process (httpx's ASGI transport)."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from tokenizers import Tokenizer

from legorl.api.store import RunStore
from legorl.api.trajectory import TamperFinding
from legorl.controller.canary import CanaryCheck, CanaryReport, write_report
from legorl.ui.server import CSP, UiApp
from legorl.ui.settings import UiSettings
from legorl.ui.synthetic import write_synthetic_store
from tests.support.trajectory_v1 import write_v1_batch, write_v1_saved_trial

FIXTURE = Path(__file__).parents[1] / "fixtures" / "ui-run" / "store"
RUN = "ui-fixture"


async def _client(settings: UiSettings) -> AsyncIterator[httpx.AsyncClient]:
    app = UiApp(settings)
    await app.startup()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ui") as client:
            yield client
    finally:
        await app.shutdown()


@pytest_asyncio.fixture
async def api() -> AsyncIterator[httpx.AsyncClient]:
    async for client in _client(UiSettings(stores=(str(FIXTURE),))):
        yield client


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("synthetic") / "store"
    write_synthetic_store(
        root,
        name="synth",
        steps=4,
        tasks_per_step=3,
        group_size=2,
        held_out_tasks=2,
        eval_every=2,
        routing=True,
        save_trials=True,
        seed=3,
    )
    return root


def _error(response: httpx.Response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return str(body["error"]["message"])


def test_fixture_is_a_real_recorded_run() -> None:
    store = RunStore(str(FIXTURE))
    assert store.committed_steps(), "scripts/make-ui-fixture.sh records at least one training step"
    assert store.read_evals(), "and held-out evaluations"
    assert store.read_metrics(), "and the trainer's metrics"
    size = sum(p.stat().st_size for p in FIXTURE.rglob("*") if p.is_file())
    assert size < 2_500_000, f"the fixture grew to {size} bytes; keep it small"
    # vLLM's hermes parser recognised the warm-started policy's calls (finish reason `tool_calls`,
    # counted by each trial's proxy): real tool-call counts, which the diagnostics read.
    trials = [t for step in store.committed_steps() for t in store.read_batch(step).trials]
    assert all(t.tool_call_turns is not None and t.tool_call_turns <= t.num_turns for t in trials)
    assert sum(t.tool_call_turns or 0 for t in trials) > 0


@pytest.mark.asyncio
async def test_health_info_and_security_headers(api: httpx.AsyncClient) -> None:
    r = await api.get("/healthz")
    assert r.json() == {"ok": True}
    for path in ("/healthz", "/api/runs", "/", "/static/js/main.js", "/api/nope"):
        r = await api.get(path)
        assert r.headers["content-security-policy"] == CSP
        assert r.headers["x-content-type-options"] == "nosniff"
    info = (await api.get("/api/info")).json()
    assert info["actions_enabled"] is False
    assert "completed" in info["reasons"]


@pytest.mark.asyncio
async def test_runs_list_and_overview_of_the_recorded_run(api: httpx.AsyncClient) -> None:
    runs = (await api.get("/api/runs")).json()["runs"]
    assert [r["id"] for r in runs] == [RUN]
    row = runs[0]
    assert row["step"] >= 1 and row["phase"] in ("Succeeded", "Running", "Unknown")
    assert row["held_out"] is not None and len(row["held_out_interval"]) == 2
    assert row["fidelity"] is not None and row["trials_per_minute"] is not None
    overview = (await api.get(f"/api/runs/{RUN}")).json()
    assert overview["spec"]["kind"] == "RLRun"
    assert overview["batches"] and overview["evals"] and overview["conditions"]
    assert overview["published_versions"]
    assert overview["validation"] is None  # no canary ran on the recorded run


@pytest.mark.asyncio
async def test_overview_shows_the_stores_last_canary(tmp_path: Path) -> None:
    root = tmp_path / "store"
    write_synthetic_store(root, name="canaried", steps=1, tasks_per_step=1, group_size=2, held_out_tasks=1)
    report = CanaryReport(
        run="canaried",
        time="2026-12-01T09:00:00+00:00",
        seconds=212.0,
        checks=[
            CanaryCheck("trial", "Passed", "canary-t0-r0 completed, reward 1"),
            CanaryCheck("token-parity", "Passed", "Pearson 0.99990 over 40 tokens", {"pearson": 0.9999}),
            CanaryCheck("routing-parity", "Warning", "the engine recorded no routed experts"),
        ],
        trial="canary-t0-r0",
    )
    write_report(RunStore(str(root)), report)
    async for api in _client(UiSettings(stores=(str(root),))):
        overview = (await api.get("/api/runs/canaried")).json()
        canary = overview["validation"]
        assert (canary["source"], canary["state"], canary["trial"]) == ("store", "Warning", "canary-t0-r0")
        assert [(c["check"], c["result"]) for c in canary["checks"]] == [
            ("trial", "Passed"),
            ("token-parity", "Passed"),
            ("routing-parity", "Warning"),
        ]


@pytest.mark.asyncio
async def test_curves_outcomes_and_task_grid(api: httpx.AsyncClient) -> None:
    curves = (await api.get(f"/api/runs/{RUN}/curves")).json()
    keys = {s["key"] for s in curves["series"]}
    assert {"reward_mean", "entropy", "grad_norm", "fidelity_pearson", "is_ess", "tokens_per_second"} <= keys
    assert all(e["low"] <= (e["rate"] or 0) <= e["high"] for e in curves["held_out"])
    outcomes = (await api.get(f"/api/runs/{RUN}/outcomes")).json()
    assert (
        outcomes["steps"]
        and sum(outcomes["steps"][0]["by_reason"].values()) == outcomes["steps"][0]["trials"]
    )
    grid = (await api.get(f"/api/runs/{RUN}/tasks")).json()
    assert grid["train"]["tasks"] and grid["validation"]["tasks"]


@pytest.mark.asyncio
async def test_trial_list_filters_sorts_and_pages(api: httpx.AsyncClient) -> None:
    everything = (await api.get(f"/api/runs/{RUN}/trials", params={"limit": 500})).json()
    total = everything["total"]
    assert total == len(everything["items"]) >= 3
    page = (await api.get(f"/api/runs/{RUN}/trials", params={"limit": 2, "offset": 1})).json()
    assert page["total"] == total and [r["trial"] for r in page["items"]] == [
        r["trial"] for r in everything["items"][1:3]
    ]
    train = (await api.get(f"/api/runs/{RUN}/trials", params={"split": "train", "step": 1})).json()
    assert train["total"] and all(r["split"] == "train" and r["step"] == 1 for r in train["items"])
    held = (await api.get(f"/api/runs/{RUN}/trials", params={"split": "validation"})).json()
    assert held["total"] and all(r["split"] == "validation" for r in held["items"])
    by_reward = (await api.get(f"/api/runs/{RUN}/trials", params={"sort": "reward", "order": "desc"})).json()
    rewards = [r["reward"] for r in by_reward["items"] if r["reward"] is not None]
    assert rewards == sorted(rewards, reverse=True)
    task = everything["items"][0]["task_id"]
    one = (await api.get(f"/api/runs/{RUN}/trials", params={"task": task, "q": task[-3:]})).json()
    assert one["total"] and all(r["task_id"] == task for r in one["items"])
    assert "segments" not in everything["items"][0], "lists never carry token arrays"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("query", "status", "param"),
    [
        ("limit=0", 400, "limit"),
        ("limit=501", 400, "limit"),
        ("limit=ten", 400, "limit"),
        ("offset=-1", 400, "offset"),
        ("step=1.5", 400, "step"),
        ("step=999", 404, "step"),
        ("split=test", 400, "split"),
        ("reason=completed,exploded", 400, "reason"),
        ("sort=secret", 400, "sort"),
        ("order=up", 400, "order"),
        ("tampered=maybe", 400, "tampered"),
        ("min_reward=abc", 400, "min_reward"),
        ("min_reward=nan", 400, "min_reward"),
        ("min_reward=1&max_reward=0", 400, "min_reward"),
        ("limit=1&limit=2", 400, "limit"),
        ("page=2", 400, "page"),
    ],
)
async def test_bad_query_parameters_are_clear_4xx(
    api: httpx.AsyncClient, query: str, status: int, param: str
) -> None:
    r = await api.get(f"/api/runs/{RUN}/trials?{query}")
    message = _error(r, status, param)
    assert param in message or "step" in message


@pytest.mark.asyncio
async def test_unknown_runs_trials_and_endpoints_are_404(api: httpx.AsyncClient) -> None:
    _error(await api.get("/api/runs/no-such-run"), 404)
    _error(await api.get("/api/runs/no-such-run/curves"), 404)
    _error(await api.get(f"/api/runs/{RUN}/trials/no-such-trial"), 404)
    _error(await api.get(f"/api/runs/{RUN}/trials/..%2F..%2Frun.json"), 404)
    _error(await api.get("/api/elsewhere"), 404)
    _error(await api.get("/static/../../etc/passwd"), 404)
    _error(await api.get(f"/api/runs/{RUN}/curves?x=1"), 400, "x")
    _error(await api.post(f"/api/runs/{RUN}/curves"), 405)


@pytest.mark.asyncio
async def test_routing_answers_in_the_uis_own_terms(api: httpx.AsyncClient) -> None:
    """The framework's router answers as the UI always has: JSON errors that name the fix, a trailing
    slash served rather than redirected, static files uncached and GET only."""
    assert _error(await api.get("/api/elsewhere"), 404) == "no such endpoint: /api/elsewhere"
    assert _error(await api.post(f"/api/runs/{RUN}/curves"), 405) == "POST is not allowed here; use GET"
    assert _error(await api.get(f"/api/runs/{RUN}/actions/pause"), 405) == "GET is not allowed here; use POST"
    slash = await api.get("/api/runs/")
    assert slash.status_code == 200 and [r["id"] for r in slash.json()["runs"]] == [RUN]
    assert _error(await api.get("/static/nope.js"), 404) == "no static file 'nope.js'"
    assert _error(await api.post("/static/js/main.js"), 405) == "static files are GET only"
    page = await api.get("/")
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["cache-control"] == "no-store" and page.headers["x-frame-options"] == "DENY"
    assert (await api.get("/index.html")).content == page.content
    script = await api.get("/static/js/main.js")
    assert script.headers["content-type"] == "text/javascript; charset=utf-8"
    head = await api.head("/static/js/main.js")
    assert head.status_code == 200 and head.content == b""


@pytest.mark.asyncio
async def test_trajectory_shows_tokens_masks_logprobs_and_tool_calls(api: httpx.AsyncClient) -> None:
    items = (await api.get(f"/api/runs/{RUN}/trials", params={"split": "train", "limit": 500})).json()[
        "items"
    ]
    trial = next(r for r in items if r["num_turns"] >= 1)
    data = (await api.get(f"/api/runs/{RUN}/trials/{trial['trial']}")).json()
    assert data["trial"]["trial"] == trial["trial"]
    assert data["tokenizer"], "the run's published weights carry their tokenizer"
    segment = data["segments"][0]
    parts = [p for turn in segment["turns"] for p in turn["parts"]]
    ids = [i for p in parts for i in p["ids"]]
    text = "".join(t for p in parts for t in p["text"])
    record = RunStore(str(FIXTURE)).read_batch(trial["step"]).trials
    stored = next(r for r in record if r.trial == trial["trial"]).segments[0]
    assert ids == stored.token_ids
    assert [m for p in parts for m in p["mask"]] == stored.loss_mask
    tok = Tokenizer.from_file(str(next(FIXTURE.glob("weights/*/tokenizer.json"))))
    assert text == tok.decode(stored.token_ids, skip_special_tokens=False)
    completions = [p for p in parts if p["kind"] == "completion"]
    assert completions and all(all(m == 1 for m in p["mask"]) for p in completions)
    assert all(lp <= 0 for p in completions for lp in p["logprobs"])
    assert any(turn["tool_calls"] for turn in segment["turns"]), "mini-swe-agent calls its bash tool"
    assert data["trial"]["stage_seconds"]


@pytest.mark.asyncio
async def test_trajectory_carries_the_trainers_log_probs_of_trained_tokens(api: httpx.AsyncClient) -> None:
    store = RunStore(str(FIXTURE))
    batch = store.read_batch(1).trials
    trained = {t for t in (r.trial for r in batch) if store.read_token_logprobs(1, t)}
    assert trained, "the recorded run trained step 1 on some of its trials"
    trial = sorted(trained)[0]
    data = (await api.get(f"/api/runs/{RUN}/trials/{trial}")).json()
    segment = data["segments"][0]
    assert segment["training_logprobs"]["policy_version"] == "v0"
    parts = [p for turn in segment["turns"] for p in turn["parts"]]
    train = [v for p in parts for v in p["train"]]
    mask = [m for p in parts for m in p["mask"]]
    assert [v is not None for v in train] == [bool(m) for m in mask]
    behaviour = [lp for p in parts for lp in p["logprobs"]]
    # The run trained v0 on what v0 sampled (sync mode): vLLM's and megatron's probabilities agree.
    deltas = [abs(t - b) for t, b in zip(train, behaviour, strict=True) if t is not None]
    assert deltas and max(deltas) < 1e-3, max(deltas)  # 1e-5 measured (float32 on CPU)
    assert "v0" in data["training_logprobs_note"]
    held_out = (await api.get(f"/api/runs/{RUN}/trials", params={"split": "validation"})).json()["items"][0]
    other = (await api.get(f"/api/runs/{RUN}/trials/{held_out['trial']}")).json()
    assert other["segments"][0]["training_logprobs"] is None
    assert "never trained on" in other["training_logprobs_note"]


@pytest.mark.asyncio
async def test_fleet_and_sandboxes_say_what_is_not_available_locally(api: httpx.AsyncClient) -> None:
    fleet = (await api.get(f"/api/runs/{RUN}/fleet")).json()
    assert fleet["available"] is False and "not available locally" in fleet["note"]
    assert fleet["published_versions"]
    boxes = (await api.get(f"/api/runs/{RUN}/sandboxes")).json()
    assert boxes["available"] is False and "not available locally" in boxes["note"]
    assert {"setup", "agent", "verify"} <= set(boxes["stage_stats"])


@pytest.mark.asyncio
async def test_diagnostics_run_on_the_store(api: httpx.AsyncClient) -> None:
    data = (await api.get(f"/api/runs/{RUN}/diagnostics")).json()
    assert data["available"] is True, data
    assert "zero-tool-calls" not in {f["rule"] for f in data["findings"]}, "the recorded policy calls tools"
    rules = (await api.get("/api/rules")).json()
    assert rules["available"] and all(r["id"] and r["title"] for r in rules["rules"])


@pytest.mark.asyncio
async def test_synthetic_store_routing_tamper_and_infra_failures(synthetic: Path) -> None:
    async for api in _client(UiSettings(stores=(str(synthetic),))):
        items = (await api.get("/api/runs/synth/trials", params={"limit": 500})).json()["items"]
        reasons = {r["termination_reason"] for r in items}
        assert "completed" in reasons
        trial = next(r for r in items if r["num_turns"] and r["split"] == "train")
        data = (await api.get(f"/api/runs/synth/trials/{trial['trial']}")).json()
        seg = data["segments"][0]
        assert seg["routing"] == {"layers": 2, "top_k": 2}
        first = seg["turns"][0]["parts"][0]
        assert first["experts"][0] and len(first["experts"][0]) == 2 and len(first["experts"][0][0]) == 2
        assert data["tokenizer"] is None and first["text"] is None, "no tokenizer: ids only"
        outcomes = (await api.get("/api/runs/synth/outcomes")).json()
        assert [s["step"] for s in outcomes["steps"]] == [1, 2, 3, 4]


@pytest.mark.asyncio
async def test_untrusted_trajectory_text_comes_back_as_data(tmp_path: Path, synthetic: Path) -> None:
    store_dir = tmp_path / "store"
    shutil.copytree(synthetic, store_dir)
    store = RunStore(str(store_dir))
    record = store.saved_trials("train", 1)[0]
    evil = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    store.save_trial(
        replace(
            record,
            trial="evil-1",
            step=9,  # a step still in progress: its trials are read from trials/, not from a batch
            error=evil,
            tamper_findings=[TamperFinding(kind="test_hook_added", detail=evil, path="conftest.py")],
        )
    )
    async for api in _client(UiSettings(stores=(str(store_dir),))):
        r = await api.get("/api/runs/synth/trials/evil-1")
        assert r.headers["content-type"] == "application/json"
        assert json.loads(r.text)["trial"]["error"] == evil
        listed = (await api.get("/api/runs/synth/trials", params={"tampered": "true", "limit": 500})).json()
        assert "evil-1" in [t["trial"] for t in listed["items"]]


@pytest.mark.asyncio
async def test_new_files_show_up_without_a_restart(tmp_path: Path, synthetic: Path) -> None:
    store_dir = tmp_path / "store"
    shutil.copytree(synthetic, store_dir)
    async for api in _client(UiSettings(stores=(str(store_dir),))):
        before = (await api.get("/api/runs/synth/trials", params={"limit": 1})).json()["total"]
        store = RunStore(str(store_dir))
        record = store.saved_trials("train", 1)[0]
        store.save_trial(replace(record, trial="late-1", step=5))
        after = (await api.get("/api/runs/synth/trials", params={"limit": 1})).json()["total"]
        assert after == before + 1
        step5 = (await api.get("/api/runs/synth/trials", params={"step": 5})).json()
        assert [t["trial"] for t in step5["items"]] == ["late-1"]


@pytest.mark.asyncio
async def test_runs_dir_and_compare(tmp_path: Path, synthetic: Path) -> None:
    for name in ("a", "b"):
        shutil.copytree(synthetic, tmp_path / "runs" / name / "store")
    async for api in _client(UiSettings(runs_dir=str(tmp_path / "runs"))):
        runs = (await api.get("/api/runs")).json()["runs"]
        assert sorted(r["id"] for r in runs) == ["synth", "synth-2"]
        data = (await api.get("/api/compare", params={"runs": "synth,synth-2"})).json()
        assert len(data["runs"]) == 2 and all(r["curves"]["series"] for r in data["runs"])
        _error(await api.get("/api/compare", params={"runs": "synth"}), 400, "runs")
        _error(await api.get("/api/compare", params={"runs": "synth,synth"}), 400, "runs")
        _error(await api.get("/api/compare", params={"runs": "synth,nope"}), 404)


@pytest.mark.asyncio
async def test_actions_need_a_configured_token(synthetic: Path) -> None:
    async for api in _client(UiSettings(stores=(str(synthetic),))):
        message = _error(await api.post("/api/runs/synth/actions/pause"), 403)
        assert "LEGORL_UI_ACTION_TOKEN" in message
    async for api in _client(UiSettings(stores=(str(synthetic),), action_token="s3cret-token")):
        _error(await api.post("/api/runs/synth/actions/pause"), 401)
        r = await api.post("/api/runs/synth/actions/pause", headers={"Authorization": "Bearer wrong"})
        assert "s3cret" not in _error(r, 401)
        r = await api.post("/api/runs/synth/actions/pause", headers={"Authorization": "Bearer s3cret-token"})
        assert "local run store" in _error(r, 409)
        _error(
            await api.post(
                "/api/runs/synth/actions/explode", headers={"Authorization": "Bearer s3cret-token"}
            ),
            404,
        )
        info: dict[str, Any] = (await api.get("/api/info")).json()
        assert info["actions_enabled"] is True and "s3cret" not in json.dumps(info)


@pytest.mark.asyncio
async def test_routing_of_a_version_1_store_shows_the_same(tmp_path: Path, synthetic: Path) -> None:
    """A store written before the trajectory schema's bump (routing as list<uint16>) shows the same experts
    per token as today's (raw bytes + dtype)."""
    async for api in _client(UiSettings(stores=(str(synthetic),))):
        items = (await api.get("/api/runs/synth/trials", params={"limit": 500, "step": 1})).json()["items"]
        trial = next(r for r in items if r["num_turns"] and r["split"] == "train")
        assert trial["step"] == 1
        today = (await api.get(f"/api/runs/synth/trials/{trial['trial']}")).json()
    old_dir = tmp_path / "store"
    shutil.copytree(synthetic, old_dir)
    store = RunStore(str(old_dir))
    batch = store.read_batch(1)
    write_v1_batch(store, 1, batch.trials, policy_version=batch.ref.policy_version)
    for record in store.saved_trials("train", 1):
        write_v1_saved_trial(store, record)
    assert (
        json.loads(store.fs.cat_file(store.fs_path("batches/step-000001/COMMIT.json")))["schema_version"] == 1
    )
    async for api in _client(UiSettings(stores=(str(old_dir),))):
        before = (await api.get(f"/api/runs/synth/trials/{trial['trial']}")).json()
    assert before["segments"][0]["routing"] == {"layers": 2, "top_k": 2}
    assert before["segments"] == today["segments"]
