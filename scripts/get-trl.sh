#!/usr/bin/env bash
# Make the virtualenv TRL runs in for the GRPO cross-check (benchmarks/learning_vs_trl.py): its own
# environment, never legorl's, with a pinned trl, torch 2.13.0+cpu from the machine's local wheel store
# (PyPI has no +cpu builds; vLLM's CPU build pins the same one) and the transformers version of legorl's
# own environment, so both sides load and save the same checkpoint with the same library.
# Cached in ${LEGORL_CACHE:-~/.cache/legorl}/trl-venv/<key>, the key naming every pinned version; a
# folder is used only once its stamp is written (an interrupted install is redone), so a second run
# takes well under a second. Prints the venv's python on its last line.
# Usage: bash scripts/get-trl.sh [LEGORL_PYTHON]   (default .venv/bin/python: whose transformers to match;
#        TRL_TRANSFORMERS=X.Y.Z names the version instead)
set -euo pipefail
trap 'echo "get-trl.sh: failed at line $LINENO: $BASH_COMMAND" >&2' ERR
cd "$(dirname "$0")/.."

# trl 1.16.0: the newest release; its GRPO loss (`dapo` aggregation, `scale_rewards`, clipping) is what
# benchmarks/learning_vs_trl.py maps legorl's settings onto. accelerate and datasets: releases inside trl's
# requirements (accelerate>=1.10.1, datasets>=4.7.0), pinned so the environment does not drift.
TRL_VERSION=1.16.0
TORCH_VERSION=2.13.0+cpu
ACCELERATE_VERSION=1.15.0
DATASETS_VERSION=5.0.1

legorl_python=${1:-.venv/bin/python}
if [ -n "${TRL_TRANSFORMERS:-}" ]; then
  transformers_version=$TRL_TRANSFORMERS
elif [ -x "$legorl_python" ]; then
  transformers_version=$("$legorl_python" -c 'import importlib.metadata as m; print(m.version("transformers"))')
else
  echo "get-trl.sh: no $legorl_python to read legorl's transformers version from (give its python, or set TRL_TRANSFORMERS)" >&2
  exit 2
fi

PY=${PYTHON:-python3}
py_version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "get-trl.sh: trl $TRL_VERSION needs Python >= 3.11 ($PY is $py_version); set PYTHON=python3.11" >&2
  exit 2
fi
pins="trl==$TRL_VERSION torch==$TORCH_VERSION transformers==$transformers_version accelerate==$ACCELERATE_VERSION datasets==$DATASETS_VERSION"
key=$(printf '%s python%s' "$pins" "$py_version" | sha256sum | cut -c1-12)
venv="${LEGORL_CACHE:-$HOME/.cache/legorl}/trl-venv/$key"

if [ "$(cat "$venv/.legorl-installed" 2>/dev/null)" != "$pins" ]; then
  echo "get-trl.sh: creating $venv ($pins)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$PY" -m venv "$venv"
  # torch's +cpu build is only in the local wheel store (pip's find-links on these machines).
  # shellcheck disable=SC2086 # one requirement per word
  if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check $pins >&2; then
    echo "get-trl.sh: pip could not install $pins (is torch==$TORCH_VERSION in a local wheel store pip's find-links names?)" >&2
    exit 1
  fi
  # The stamp last: a folder without it is an interrupted install.
  echo "$pins" >"$venv/.legorl-installed"
fi
echo "get-trl.sh: trl $TRL_VERSION, transformers $transformers_version, torch $TORCH_VERSION in $venv" >&2
echo "$venv/bin/python"
