#!/usr/bin/env bash
# The trainer's GPU check in one command: bash benchmarks/gpu_check.sh [gpu_check.py args...]
# Uses the machine's python3 with torch+CUDA and transformers. megatron-core, pydantic (and the rest of
# legorl's light deps) come from wheels in .whl/ when the machine cannot reach PyPI (see docs/trainer.md),
# else from pip. Results: JSON lines on stdout, and the whole list in ${OUT:-.}/gpu_check.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import megatron.core, pydantic' 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/legorl-site .whl/*.whl
  else
    "$PY" -m pip install -q --target /tmp/legorl-site "megatron-core==0.16.1" "pydantic>=2.11,<3"
  fi
  export PYTHONPATH="/tmp/legorl-site${PYTHONPATH:+:$PYTHONPATH}"
fi
# legorl is a namespace package assembled from the component folders (see pyproject.toml).
export PYTHONPATH="$PWD:$PWD/trainer:$PWD/operator:$PWD/proxy:$PWD/sandbox-images:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
exec "$PY" benchmarks/gpu_check.py --out "${OUT:-.}/gpu_check.json" "$@"
