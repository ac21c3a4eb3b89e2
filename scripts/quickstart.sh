#!/usr/bin/env bash
# The main job on the embedded default, end to end, from a fresh clone (no cluster, no GPU):
# installs legorl with vLLM's CPU build, megatron-core and mini-swe-agent into .venv and the
# sandbox tools (bubblewrap; needs root), validates the examples, then runs a short version of the
# learning run in examples/tiny-local.yaml: the warm-started tiny policy (builtin://tiny-swe, made by
# `legorl sft` on first use and cached) solving bundled tasks with mini-swe-agent in local sandboxes,
# trained by megatron-core, weights synced into vLLM after every step. It prints progress, a summary
# and where the run store is. Extra arguments go to `legorl run` (e.g. --steps 12 for the full run).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/get-engine.sh
bash scripts/get-sandbox-tools.sh

.venv/bin/legorl validate examples/*.yaml
exec .venv/bin/legorl run examples/tiny-local.yaml --dir .legorl/runs/quickstart --steps 1 --eval-trials 1 "$@"
