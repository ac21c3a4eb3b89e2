"""The real engine the proxy tests run against: a tiny random Qwen3-MoE served by vLLM's CPU build."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest

from tests.support.engine import IM_END, SERVED_MODEL_NAME, VllmServer, make_tiny_model

pytestmark = pytest.mark.slow


def test_vllm_serves_the_tiny_model_with_token_ids_and_logprobs(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "model", seed=0)
    with (
        VllmServer(model_dir, log_path=tmp_path / "vllm.log") as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        response = client.post(
            "/v1/chat/completions",
            json={
                "model": SERVED_MODEL_NAME,
                "messages": [{"role": "user", "content": "List the files in the repository."}],
                "max_tokens": 16,
                "temperature": 1.0,
                "seed": 1,
                "logprobs": True,
                "return_token_ids": True,
            },
        )
        assert response.status_code == 200, response.text
        body = response.json()

        tokenized = client.post(
            "/tokenize",
            json={
                "model": SERVED_MODEL_NAME,
                "messages": [{"role": "user", "content": "List the files in the repository."}],
                "add_generation_prompt": True,
            },
        )
        assert tokenized.status_code == 200, tokenized.text

    prompt_ids = body["prompt_token_ids"]
    assert prompt_ids == tokenized.json()["tokens"]
    choice = body["choices"][0]
    token_ids = choice["token_ids"]
    assert 1 <= len(token_ids) <= 16
    assert all(isinstance(t, int) for t in prompt_ids + token_ids)
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == len(token_ids)
    content = choice["logprobs"]["content"]
    assert len(content) == len(token_ids)
    assert all(math.isfinite(entry["logprob"]) and entry["logprob"] <= 0 for entry in content)
    assert choice["finish_reason"] in {"stop", "length"}
    assert IM_END not in (choice["message"]["content"] or "")
