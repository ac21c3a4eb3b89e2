"""Weight sync into a running vLLM (CPU build): publish, validate, load in place, serve new weights exactly.

The publisher and manifest checks run without an engine. The rest runs one real vLLM CPU server with the
`legorl_filesystem` backend (the flags the operator renders) and compares what it serves with a transformers
fp32 forward on the same weights: a 200 proves nothing (vLLM's CPU MoE reload bug answers 200 with garbage).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from openai.types.chat import ChatCompletionMessageParam
from safetensors.torch import load_file, save_file

from legorl.api.store import RunStore
from legorl.api.weights import PUBLISHED_MARKER, PublishedWeights
from legorl.proxy.app import ProxyApp
from legorl.proxy.journal import read_journal
from legorl.proxy.settings import ProxySettings
from legorl.trainer.models.tiny import make_tiny_model
from legorl.trainer.sync.fleet_sync import FleetWeightSync, update_info
from legorl.trainer.sync.publish import (
    INDEX_FILE,
    REJECTED,
    WeightSyncError,
    publish_weights,
    read_published,
    sha256_files,
)
from tests.support.asgi_server import serve
from tests.support.engine import SERVED_MODEL_NAME, VllmServer, free_port

ENGINE_ARGS = [
    "--weight-transfer-config",
    '{"backend":"legorl_filesystem"}',
    "--worker-extension-cls",
    "legorl.trainer.engine.plugin.FilesystemWeightTransfer",
    "--middleware",
    "legorl.trainer.engine.versions.WeightVersions",
]
# Exactness bars (fp32 engine vs fp32 transformers). Measured: Pearson 1.000000 (to 1e-10), max |Δlogp|
# ≈ 5e-5 to 8e-5 on the prompt log-probs; the perturbed weights move log-probs by ~20 and a stale MoE
# layout gives Pearson ≈ 0.
PEARSON_EXACT = 0.999999
PEARSON_SYNCED = 0.999
MAX_ABS_DELTA = 1e-3


# ---------------------------------------------------------------------------------------------------------
# Without an engine: the publisher and its manifest
# ---------------------------------------------------------------------------------------------------------


def _source_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """A small HF-style checkpoint directory (weights, config, tokenizer files); returns its tensors."""
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(50, 8, generator=generator),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=generator),
        "model.layers.0.mlp.experts.0.up_proj.weight": torch.randn(16, 8, generator=generator),
        "model.layers.1.self_attn.q_proj.weight": torch.randn(8, 8, generator=generator),
        "model.layers.10.self_attn.q_proj.weight": torch.randn(8, 8, generator=generator),
        "model.norm.weight": torch.ones(8),
        "lm_head.weight": torch.randn(50, 8, generator=generator),
    }
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"]}\n')
    (directory / "generation_config.json").write_text("{}\n")
    (directory / "tokenizer.json").write_text('{"model": {}}\n')
    (directory / "tokenizer_config.json").write_text("{}\n")
    (directory / "chat_template.jinja").write_text("{{ messages }}\n")
    (directory / "README.md").write_text("not copied\n")
    return tensors


def _shifted(tensors: Mapping[str, torch.Tensor], by: float = 1.0) -> dict[str, torch.Tensor]:
    return {name: tensor + by for name, tensor in tensors.items()}


def test_publish_then_read_round_trips(tmp_path: Path) -> None:
    source = tmp_path / "source"
    tensors = _shifted(_source_checkpoint(source))
    published = publish_weights(tensors, tmp_path / "weights" / "v1", version="v1", source_dir=source)

    assert Path(published.path) == tmp_path / "weights" / "v1"
    assert published.version == "v1"
    assert published.num_tensors == len(tensors)
    safetensors_file = Path(published.path) / "model.safetensors"
    assert published.bytes == safetensors_file.stat().st_size
    assert published.sha256 == sha256_files([safetensors_file])
    assert read_published(published.path) == published

    on_disk = load_file(str(safetensors_file))
    assert on_disk.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(on_disk[name], tensor), name
    copied = sorted(p.name for p in Path(published.path).iterdir())
    assert copied == sorted(
        [
            "chat_template.jinja",
            "config.json",
            "generation_config.json",
            PUBLISHED_MARKER,
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    manifest = json.loads((Path(published.path) / PUBLISHED_MARKER).read_text())
    assert manifest["version"] == "v1"
    assert manifest["sha256"] == published.sha256
    assert manifest["num_tensors"] == len(tensors)
    assert manifest["published_at"].endswith("+00:00")
    assert update_info(published) == {
        "path": str(published.path),
        "version": "v1",
        "sha256": published.sha256,
    }
    # Nothing but the version directory is left next to it (no temporary directory).
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v1"]
    # Readable by any uid (an engine may run as another user than the trainer): safetensors itself
    # creates its files 0600.
    assert {p.name: p.stat().st_mode & 0o777 for p in Path(published.path).glob("*.safetensors")} == {
        "model.safetensors": 0o644
    }


def test_the_run_store_reads_the_marker_the_publisher_writes(tmp_path: Path) -> None:
    """One marker: a directory published on its own is a published version of the run store around it."""
    source = tmp_path / "source"
    tensors = _shifted(_source_checkpoint(source))
    store = RunStore(str(tmp_path / "store"))
    published = publish_weights(
        tensors, tmp_path / "store" / "weights" / "v1", version="v1", source_dir=source
    )
    assert store.published_versions() == ["v1"]
    assert store.read_published("v1") == published
    unmarked = publish_weights(
        tensors, tmp_path / "store" / "weights" / "v2", version="v2", source_dir=source, marker=False
    )
    assert store.published_versions() == ["v1"]
    recorded = store.record_weights(
        "v2", 2, unmarked.sha256, files=unmarked.files, num_tensors=unmarked.num_tensors
    )
    assert (
        read_published(unmarked.path)
        == recorded
        == dataclasses.replace(unmarked, published_at=recorded.published_at)
    )


def test_publish_shards_large_state_dicts_with_an_index(tmp_path: Path) -> None:
    source = tmp_path / "source"
    tensors = _shifted(_source_checkpoint(source))
    published = publish_weights(
        tensors, tmp_path / "v2", version="v2", source_dir=source, max_shard_bytes=1200
    )
    shards = sorted(Path(published.path).glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3
    assert not (Path(published.path) / "model.safetensors").exists()
    index = json.loads((Path(published.path) / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert published.sha256 == sha256_files(shards)
    assert published.bytes == sum(s.stat().st_size for s in shards)
    assert read_published(published.path) == published
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        merged.update(load_file(str(shard)))
    assert all(torch.equal(merged[name], tensor) for name, tensor in tensors.items())
    # Layer order, numerically: layers.1 is written before layers.10.
    assert (
        index["weight_map"]["model.layers.1.self_attn.q_proj.weight"]
        <= (index["weight_map"]["model.layers.10.self_attn.q_proj.weight"])
    )


def test_publish_handles_tensors_that_share_storage(tmp_path: Path) -> None:
    source = tmp_path / "source"
    tensors = _shifted(_source_checkpoint(source))
    tied = dict(tensors)
    tied["lm_head.weight"] = tied["model.embed_tokens.weight"]  # tied embeddings share one tensor
    published = publish_weights(tied, tmp_path / "tied", version="tied", source_dir=source)
    on_disk = load_file(str(Path(published.path) / "model.safetensors"))
    assert torch.equal(on_disk["lm_head.weight"], tensors["model.embed_tokens.weight"])


def test_publish_is_atomic_when_writing_fails(tmp_path: Path) -> None:
    source = tmp_path / "source"
    tensors = _shifted(_source_checkpoint(source))
    # A parameter that was never materialized: its shard fails after the earlier shards were written.
    tensors["model.norm.weight"] = torch.empty(8, device="meta")
    parent = tmp_path / "weights"
    parent.mkdir()
    with pytest.raises(NotImplementedError, match="meta tensor"):
        publish_weights(tensors, parent / "v3", version="v3", source_dir=source, max_shard_bytes=700)
    assert list(parent.iterdir()) == []


def test_publish_refuses_an_existing_directory_and_leaves_it_alone(tmp_path: Path) -> None:
    source = tmp_path / "source"
    tensors = _source_checkpoint(source)
    first = publish_weights(tensors, tmp_path / "v1", version="v1", source_dir=source)
    with pytest.raises(WeightSyncError, match="already exists: publish each version to a new directory"):
        publish_weights(_shifted(tensors), tmp_path / "v1", version="v1", source_dir=source)
    assert read_published(first.path) == first


def test_publish_checks_names_and_shapes_against_the_source(tmp_path: Path) -> None:
    source = tmp_path / "source"
    tensors = _source_checkpoint(source)

    missing = dict(tensors)
    del missing["model.norm.weight"]
    with pytest.raises(
        WeightSyncError, match=r"1 tensor\(s\) missing from the state dict.*model.norm.weight"
    ):
        publish_weights(missing, tmp_path / "a", version="a", source_dir=source)

    extra = {**tensors, "model.layers.0.mlp.gate.weight": torch.zeros(4, 8)}
    with pytest.raises(WeightSyncError, match=r"the model does not have.*model.layers.0.mlp.gate.weight"):
        publish_weights(extra, tmp_path / "b", version="b", source_dir=source)

    wrong = {**tensors, "lm_head.weight": torch.zeros(49, 8)}
    with pytest.raises(WeightSyncError, match=r"lm_head.weight: \[49, 8\] instead of \[50, 8\]"):
        publish_weights(wrong, tmp_path / "c", version="c", source_dir=source)

    integer = {**tensors, "model.norm.weight": torch.ones(8, dtype=torch.int64)}
    with pytest.raises(WeightSyncError, match="weights must be float"):
        publish_weights(integer, tmp_path / "d", version="d", source_dir=source)

    with pytest.raises(WeightSyncError, match="non-empty string"):
        publish_weights(tensors, tmp_path / "e", version=" ", source_dir=source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def test_read_published_explains_what_is_wrong(tmp_path: Path) -> None:
    source = tmp_path / "source"
    tensors = _source_checkpoint(source)

    with pytest.raises(WeightSyncError, match="do not exist"):
        read_published(tmp_path / "nowhere")
    with pytest.raises(
        WeightSyncError, match=f"has no {PUBLISHED_MARKER}: it was not written by publish_weights"
    ):
        read_published(source)

    published = publish_weights(tensors, tmp_path / "v1", version="v1", source_dir=source)
    data = Path(published.path) / "model.safetensors"
    manifest_path = Path(published.path) / PUBLISHED_MARKER
    manifest = json.loads(manifest_path.read_text())

    # Same size, one byte different (inside the last tensor's data): only the hash can tell.
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(WeightSyncError, match=r"sha256 is [0-9a-f]{64} but the manifest records"):
        read_published(published.path)
    assert read_published(published.path, verify_sha256=False) == published  # the cheap checks pass

    with data.open("ab") as handle:
        handle.write(b"\0" * 8)
    with pytest.raises(WeightSyncError, match=r"hold \d+ bytes but the manifest records"):
        read_published(published.path)

    manifest_path.write_text(json.dumps({**manifest, "num_tensors": 3}))
    data.write_bytes(bytes(raw[:-1]) + bytes([raw[-1] ^ 0xFF]))
    with pytest.raises(WeightSyncError, match="7 tensors on disk but the manifest records 3"):
        read_published(published.path)

    manifest_path.write_text(json.dumps({**manifest, "sha256": "nothex"}))
    with pytest.raises(WeightSyncError, match=r"not a valid manifest: .*sha256"):
        read_published(published.path)

    manifest_path.write_text("{not json")
    with pytest.raises(WeightSyncError, match="not a valid manifest"):
        read_published(published.path)

    manifest_path.write_text(json.dumps({**manifest, "files": ["../source/model.safetensors"]}))
    with pytest.raises(WeightSyncError, match="outside its directory"):
        read_published(published.path)

    manifest_path.write_text(json.dumps(manifest))
    data.unlink()
    with pytest.raises(WeightSyncError, match=r"missing the safetensors file\(s\) its manifest lists"):
        read_published(published.path)


def test_fleet_client_rejects_bad_configuration() -> None:
    with pytest.raises(WeightSyncError, match="non-empty list"):
        FleetWeightSync([])
    with pytest.raises(WeightSyncError, match="non-empty list"):
        FleetWeightSync("http://one:8000")
    with pytest.raises(WeightSyncError, match="must start with http"):
        FleetWeightSync(["engine-0:8000"])
    with pytest.raises(WeightSyncError, match="repeat"):
        FleetWeightSync(["http://a:1", "http://a:1/"])
    with pytest.raises(WeightSyncError, match="pause_mode"):
        FleetWeightSync(["http://a:1"], pause_mode="later")  # type: ignore[arg-type]


@pytest.mark.slow
def test_importing_the_engine_plugin_pulls_in_neither_vllm_nor_megatron_nor_httpx() -> None:
    # vLLM's worker processes import this module; the trainer image may have no vLLM.
    code = (
        "import sys, legorl.trainer.engine.plugin as w; "
        "heavy = sorted(m for m in ('vllm', 'megatron', 'httpx', 'transformers') if m in sys.modules); "
        "print(heavy); assert not heavy"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------------------
# A real vLLM CPU engine
# ---------------------------------------------------------------------------------------------------------

PROMPT = [int(t) for t in torch.randint(0, 3900, (40,), generator=torch.Generator().manual_seed(1))]
LONG_PROMPT = [int(t) for t in torch.randint(0, 3900, (700,), generator=torch.Generator().manual_seed(2))]


@dataclasses.dataclass
class Engine:
    server: VllmServer
    model_dir: Path
    weights_dir: Path
    http: httpx.Client
    base_state: dict[str, torch.Tensor]
    initial_prompt_logprobs: list[Any]

    def publish(
        self, version: str, *, seed: int, scale: float = 0.05, strict: bool = True
    ) -> PublishedWeights:
        """The served checkpoint with seeded noise on every expert and attention weight, published."""
        return publish_weights(
            perturbed(self.base_state, seed=seed, scale=scale),
            self.weights_dir / version,
            version=version,
            source_dir=self.model_dir,
            strict=strict,
        )


def perturbed(state: Mapping[str, torch.Tensor], *, seed: int, scale: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in state.items():
        noisy = ".experts." in name or ".self_attn." in name
        out[name] = tensor + scale * torch.randn(tensor.shape, generator=generator) if noisy else tensor
    return out


def prompt_logprobs(http: httpx.Client, prompt: list[int] = PROMPT) -> list[Any]:
    """vLLM's prompt log-probs (top 5 plus the prompt token, per position) for a token-id prompt."""
    response = http.post(
        "/v1/completions",
        json={
            "model": SERVED_MODEL_NAME,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprobs": 5,
        },
    )
    assert response.status_code == 200, response.text
    logprobs: list[Any] = response.json()["choices"][0]["prompt_logprobs"]
    return logprobs


def next_token_logprobs(http: httpx.Client, prompt: list[int]) -> dict[int, float]:
    """Top-5 log-probs of the first generated token: a normal completion, which uses the prefix cache."""
    response = http.post(
        "/v1/completions",
        json={
            "model": SERVED_MODEL_NAME,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": 5,
            "return_tokens_as_token_ids": True,
        },
    )
    assert response.status_code == 200, response.text
    top = response.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    return {int(token.removeprefix("token_id:")): logprob for token, logprob in top.items()}


_REFERENCE: dict[tuple[str, int], torch.Tensor] = {}


def reference_logprobs(model_dir: Path | str, prompt: list[int] = PROMPT) -> torch.Tensor:
    """transformers fp32 log-softmax over the vocabulary at every prompt position, [len(prompt), vocab]."""
    key = (str(model_dir), hash(tuple(prompt)))
    if key not in _REFERENCE:
        import transformers  # noqa: PLC0415 -- only the engine tests need it

        model: Any = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0]
        _REFERENCE[key] = torch.log_softmax(logits.double(), dim=-1)
    return _REFERENCE[key]


def agreement(reference: torch.Tensor, served: list[Any]) -> tuple[float, float]:
    """(Pearson of probabilities, max |Δlogprob|) over every (position, token) vLLM reported."""
    ours, theirs = [], []
    for position, entry in enumerate(served):
        if entry is None:
            continue
        for token, item in entry.items():
            ours.append(item["logprob"])
            theirs.append(reference[position - 1, int(token)].item())
    a, b = np.array(ours), np.array(theirs)
    return float(np.corrcoef(np.exp(a), np.exp(b))[0, 1]), float(np.abs(a - b).max())


def next_token_delta(reference: torch.Tensor, served: dict[int, float]) -> float:
    return max(abs(logprob - reference[-1, token].item()) for token, logprob in served.items())


def weight_sync_state(http: httpx.Client) -> dict[str, Any]:
    response = http.post("/collective_rpc", json={"method": "legorl_weight_sync_state"})
    assert response.status_code == 200, response.text
    state: dict[str, Any] = response.json()["results"][0]
    return state


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("weight-sync")
    model_dir = make_tiny_model(root / "model", seed=0)
    server = VllmServer(model_dir, extra_args=ENGINE_ARGS, log_path=root / "vllm.log")
    with server, httpx.Client(base_url=server.url, timeout=120) as http:
        print(f"vLLM started in {server.startup_seconds:.1f}s")
        yield Engine(
            server=server,
            model_dir=model_dir,
            weights_dir=root / "weights",
            http=http,
            base_state=load_file(str(model_dir / "model.safetensors")),
            initial_prompt_logprobs=prompt_logprobs(http),
        )


@pytest.mark.slow
def test_engine_serves_the_checkpoint_exactly_before_any_sync(engine: Engine) -> None:
    pearson, delta = agreement(reference_logprobs(engine.model_dir), engine.initial_prompt_logprobs)
    print(f"before sync: Pearson {pearson:.8f}, max |Δlogp| {delta:.2e}")
    assert pearson >= PEARSON_EXACT
    assert delta < MAX_ABS_DELTA
    assert weight_sync_state(engine.http)["backend"] == "legorl_filesystem"


@pytest.mark.slow
def test_sync_serves_the_new_weights_and_in_flight_requests_finish(engine: Engine) -> None:
    published = engine.publish("v1", seed=11)
    old, new = reference_logprobs(engine.model_dir), reference_logprobs(published.path)

    # A request in flight across the sync: mode=keep holds it, then it recomputes under the new weights.
    in_flight: dict[str, Any] = {}

    def generate() -> None:
        response = httpx.post(
            f"{engine.server.url}/v1/completions",
            json={"model": SERVED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True},
            timeout=120,
        )
        in_flight["status"] = response.status_code
        in_flight["body"] = response.json()

    thread = threading.Thread(target=generate)
    thread.start()
    with FleetWeightSync([engine.server.url], pause_mode="keep", timeout=60) as fleet:
        report = fleet.sync(published)
        assert fleet.served_versions() == ["v1"]
    thread.join(timeout=120)

    print(f"sync: {report.seconds * 1000:.0f} ms ({report.replica_seconds})")
    assert report.version == "v1"
    assert [r.url for r in report.replicas] == [engine.server.url]
    assert report.replicas[0].attempts == 1
    assert engine.http.get("/weight_info").json() == {"weight_version": "v1"}
    state = weight_sync_state(engine.http)
    assert state["version"] == "v1"
    assert state["sha256"] == published.sha256
    assert state["moe_layers_repacked"] == 2  # both decoder layers are MoE layers on the CPU kernel

    served = prompt_logprobs(engine.http)
    pearson_new, delta_new = agreement(new, served)
    pearson_old, delta_old = agreement(old, served)
    print(f"after sync: vs new weights Pearson {pearson_new:.8f}, max |Δlogp| {delta_new:.2e}")
    print(f"after sync: vs old weights Pearson {pearson_old:.4f}, max |Δlogp| {delta_old:.2f}")
    assert pearson_new >= PEARSON_SYNCED
    assert delta_new < MAX_ABS_DELTA
    assert delta_old > 1.0

    assert in_flight["status"] == 200, in_flight
    assert in_flight["body"]["choices"][0]["finish_reason"] == "length"
    assert in_flight["body"]["usage"]["completion_tokens"] == 200


@pytest.mark.slow
def test_prefix_cache_is_reset_so_long_prompts_see_the_new_weights(engine: Engine) -> None:
    a = engine.publish("cache-a", seed=21)
    b = engine.publish("cache-b", seed=22)
    ref_a, ref_b = reference_logprobs(a.path, LONG_PROMPT), reference_logprobs(b.path, LONG_PROMPT)
    http = engine.http
    with FleetWeightSync([engine.server.url], timeout=60) as fleet:
        fleet.sync(a)
        assert (
            next_token_delta(ref_a, next_token_logprobs(http, LONG_PROMPT)) < MAX_ABS_DELTA
        )  # warms the cache

        # What the reset protects against: the same update without any cache clearing serves the long
        # prompt's cached KV, computed by the old weights.
        http.post("/pause", params={"mode": "keep", "clear_cache": "false"}).raise_for_status()
        http.post("/start_weight_update").raise_for_status()
        http.post("/update_weights", json={"update_info": update_info(b)}).raise_for_status()
        http.post("/finish_weight_update", json={"weight_version": "cache-b"}).raise_for_status()
        http.post("/resume").raise_for_status()
        stale = next_token_delta(ref_b, next_token_logprobs(http, LONG_PROMPT))
        http.post("/reset_prefix_cache").raise_for_status()
        fresh = next_token_delta(ref_b, next_token_logprobs(http, LONG_PROMPT))  # and warms the cache again
        print(f"long prompt on stale prefix cache: max |Δlogp| {stale:.2f}; after a reset {fresh:.1e}")
        assert stale > 0.1
        assert fresh < MAX_ABS_DELTA

        fleet.sync(a)
        synced = next_token_delta(ref_a, next_token_logprobs(http, LONG_PROMPT))
        print(f"long prompt after FleetWeightSync over a warm cache: max |Δlogp| {synced:.1e}")
        assert synced < MAX_ABS_DELTA


@pytest.mark.slow
def test_cpu_fused_moe_repack_is_what_makes_the_reload_correct(engine: Engine) -> None:
    published = engine.publish("moe", seed=31)
    reference = reference_logprobs(published.path)
    http = engine.http
    with FleetWeightSync([engine.server.url], timeout=60) as fleet:
        http.post(
            "/collective_rpc", json={"method": "legorl_set_moe_repack", "args": ["0"]}
        ).raise_for_status()
        try:
            fleet.sync(published)  # every call answers 200
            without, without_delta = agreement(reference, prompt_logprobs(http))
        finally:
            http.post(
                "/collective_rpc", json={"method": "legorl_set_moe_repack", "args": ["1"]}
            ).raise_for_status()
        fleet.sync(published)
        with_fix, with_delta = agreement(reference, prompt_logprobs(http))
    print(
        f"without the MoE re-pack: Pearson {without:.3f} (max |Δlogp| {without_delta:.1f}); "
        f"with it {with_fix:.8f}"
    )
    assert without < 0.99
    assert with_fix >= PEARSON_SYNCED
    assert with_delta < MAX_ABS_DELTA


def _still_serves(engine: Engine, version: str, reference: torch.Tensor) -> None:
    assert engine.http.get("/weight_info").json() == {"weight_version": version}
    assert engine.http.get("/is_paused").json() == {"is_paused": False}
    pearson, delta = agreement(reference, prompt_logprobs(engine.http))
    assert pearson >= PEARSON_SYNCED, pearson
    assert delta < MAX_ABS_DELTA, delta


@pytest.mark.slow
def test_rejected_payloads_leave_the_engine_serving_the_previous_weights(engine: Engine) -> None:
    base = engine.publish("base", seed=41)
    reference = reference_logprobs(base.path)
    with FleetWeightSync([engine.server.url], timeout=60, retry_delay=0.05) as fleet:
        fleet.sync(base)
        _still_serves(engine, "base", reference)

        # A directory that does not exist: refused before any engine pauses.
        with pytest.raises(WeightSyncError, match="do not exist"):
            fleet.sync(dataclasses.replace(base, path=str(engine.weights_dir / "missing")))
        _still_serves(engine, "base", reference)

        # A published object that is not what the directory holds.
        with pytest.raises(WeightSyncError, match="not the base being synced"):
            fleet.sync(dataclasses.replace(base, sha256="0" * 64))
        _still_serves(engine, "base", reference)

        # The engine's checks: each reaches /update_weights, is refused there, and the engine resumes.
        wrong_shape = perturbed(engine.base_state, seed=42, scale=0.05)
        name = "model.layers.1.mlp.experts.3.up_proj.weight"
        wrong_shape[name] = wrong_shape[name][:-1]
        bad = publish_weights(
            wrong_shape,
            engine.weights_dir / "shape",
            version="shape",
            source_dir=engine.model_dir,
            strict=False,
        )
        with pytest.raises(WeightSyncError) as shape_error:
            fleet.sync(bad)
        print(f"wrong shape: {shape_error.value}")
        message = str(shape_error.value)
        assert message.count(REJECTED) == 1
        assert "collective_rpc" not in message  # vLLM's wrapping is peeled off
        assert f"{name}: [63, 128] instead of [64, 128]" in message
        assert "the engine still serves its previous weights" in message
        assert message.endswith("(the replica was resumed)")
        assert "attempt" not in message  # a rejected payload is not retried
        _still_serves(engine, "base", reference)

        missing = perturbed(engine.base_state, seed=43, scale=0.05)
        del missing["model.layers.0.self_attn.q_proj.weight"]
        bad = publish_weights(
            missing,
            engine.weights_dir / "missing-tensor",
            version="mt",
            source_dir=engine.model_dir,
            strict=False,
        )
        with pytest.raises(
            WeightSyncError, match=r"1 tensor\(s\) missing from .*model.layers.0.self_attn.q_proj"
        ):
            fleet.sync(bad)
        _still_serves(engine, "base", reference)

        # A manifest whose sha256 does not match the bytes (the client does not hash; the engine does).
        lying = engine.publish("lying", seed=44)
        manifest_path = Path(lying.path) / PUBLISHED_MARKER
        manifest = json.loads(manifest_path.read_text())
        manifest_path.write_text(json.dumps({**manifest, "sha256": "1" * 64}))
        with pytest.raises(WeightSyncError, match=f"hash to {lying.sha256}, not 1{{64}}"):
            fleet.sync(dataclasses.replace(lying, sha256="1" * 64))
        _still_serves(engine, "base", reference)

        # And a good version still goes through afterwards.
        manifest_path.write_text(json.dumps(manifest))
        fleet.sync(lying)
        _still_serves(engine, "lying", reference_logprobs(lying.path))


@pytest.mark.slow
def test_a_session_left_open_by_a_crashed_client_is_closed_and_the_sync_goes_through(engine: Engine) -> None:
    published = engine.publish("after-crash", seed=61)
    # A client that died between /start_weight_update and /finish_weight_update.
    engine.http.post("/start_weight_update").raise_for_status()
    again = engine.http.post("/start_weight_update")
    assert again.status_code == 500
    assert "already active" in again.text
    with FleetWeightSync([engine.server.url], timeout=60) as fleet:
        report = fleet.sync(published)
    assert report.replicas[0].attempts == 1
    _still_serves(engine, "after-crash", reference_logprobs(published.path))


@pytest.mark.slow
def test_a_dead_replica_is_reported_and_the_live_one_is_synced(engine: Engine) -> None:
    published = engine.publish("partial", seed=51)
    dead = f"http://127.0.0.1:{free_port()}"
    with FleetWeightSync([engine.server.url, dead], timeout=10, retry_delay=0.01) as fleet:
        with pytest.raises(WeightSyncError) as error:
            fleet.sync(published)
        message = str(error.value)
        print(message)
        assert "failed on 1 of 2 replica(s)" in message
        assert f"{engine.server.url}: ok, serves partial" in message
        assert f"{dead}: FAILED: POST {dead}/pause: ConnectError" in message
        with pytest.raises(WeightSyncError, match=f"GET {dead}/weight_info: ConnectError"):
            fleet.served_versions()
    _still_serves(engine, "partial", reference_logprobs(published.path))


@pytest.mark.slow
def test_the_proxy_records_the_versions_that_served_each_call_across_a_sync(
    engine: Engine, tmp_path: Path
) -> None:
    # vLLM names the versions with each answer (legorl's middleware, the flag the operator renders): the
    # proxy reads /weight_info once, before its first call, and never again. A stream the sync pauses half
    # way records the version it started on and the one it finished on, and its tokens prove it: the first
    # ones carry the old weights' log-probs, the rest the new weights' (transformers fp32 on each).
    #
    # Whether the swap lands mid-stream is a race the test cannot rule out: the engine core samples far
    # faster than its API server streams (a whole answer of the old weights, 755 tokens, can be sampled
    # before the pause lands), so an attempt whose stream ended first is checked for what it is (one
    # version, every token the old weights') and another attempt is made with a fresh pair of versions.
    settings = ProxySettings(upstream=engine.server.url, journal=tmp_path / "journal", fsync=False)
    app = ProxyApp(settings)
    model = SERVED_MODEL_NAME
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "count to ten"}]
    straddling: dict[str, Any] | None = None
    seen = 0
    with serve(app) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0) as client:
        chat = client.chat.completions
        for attempt in range(4):
            before, after = f"call-start-{attempt}", f"mid-call-{attempt}"
            start = engine.publish(before, seed=71 + 2 * attempt)
            published = engine.publish(after, seed=72 + 2 * attempt)
            with FleetWeightSync([engine.server.url], timeout=60) as fleet:
                fleet.sync(start)
            chat.create(model=model, messages=messages, max_tokens=4)
            assert app.upstream is not None and app.upstream.engine_names_versions

            stream = chat.create(model=model, messages=messages, max_tokens=3000, stream=True, temperature=0)
            chunks = iter(stream)
            next(chunks)
            # Held at once, so the swap lands early in the answer if the engine is still sampling it; the
            # sync then pauses (again), loads, finishes with the version and resumes, as it always does.
            engine.http.post("/pause", params={"mode": "keep", "clear_cache": "false"}).raise_for_status()
            with FleetWeightSync([engine.server.url], pause_mode="keep", timeout=60) as fleet:
                fleet.sync(published)
            for _ in chunks:
                pass
            chat.create(model=model, messages=messages, max_tokens=4)
            turns = [r for r in read_journal(tmp_path / "journal").records if r["type"] == "turn"][seen:]
            seen += len(turns)
            assert [t["policy_versions"] for t in turns] in (
                [[before], [before, after], [after]],
                [[before], [before], [after]],
            )
            under_old, under_new = _served_by(turns[1], start.path, published.path)
            if turns[1]["policy_versions"] == [before]:
                # The stream was sampled whole before the swap: one version, and its tokens say so.
                assert all(under_old), f"attempt {attempt}: a token not of {before} recorded under it alone"
                continue
            straddling = turns[1]
            break
    assert straddling is not None, "no attempt's stream was still being sampled when the swap landed"
    completion = straddling["completion_token_ids"]
    split = next((i for i, same in enumerate(under_old) if not same), len(completion))
    print(f"{len(completion)} tokens: the first {split} sampled by {before}, the rest by {after}")
    assert 0 < split < len(completion)
    assert all(under_old[:split])
    assert all(under_new[split:])


def _served_by(turn: dict[str, Any], old_dir: str, new_dir: str) -> tuple[list[bool], list[bool]]:
    """For each sampled token of `turn`: whether its recorded log-prob is the old weights', the new's."""
    prompt, completion = turn["prompt_token_ids"], turn["completion_token_ids"]
    sequence = prompt + completion
    old, new = reference_logprobs(old_dir, sequence), reference_logprobs(new_dir, sequence)
    positions = range(len(prompt) - 1, len(sequence) - 1)
    steps = list(zip(positions, completion, turn["completion_logprobs"], strict=True))
    under_old = [abs(lp - old[p, t].item()) < MAX_ABS_DELTA for p, t, lp in steps]
    under_new = [abs(lp - new[p, t].item()) < MAX_ABS_DELTA for p, t, lp in steps]
    return under_old, under_new
