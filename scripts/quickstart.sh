#!/usr/bin/env bash
# The main job on the embedded default, from a fresh clone: installs legorl into .venv, then
# validates every example manifest and renders what the operator would create for the shared
# fleet-and-pool example (every Kubernetes object, defaults applied).
# (`legorl run examples/tiny-local.yaml` replaces the render step once the embedded run lands.)
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/_python.sh
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e .

.venv/bin/legorl validate examples/*.yaml
.venv/bin/legorl render examples/shared-fleet-and-pool.yaml
