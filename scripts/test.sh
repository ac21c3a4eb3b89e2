#!/usr/bin/env bash
# Run every check CI runs, from a fresh clone: creates .venv, installs legorl with its dev
# extra, vLLM's CPU build and the harness CLIs the tests drive (scripts/get-engine.sh, which runs
# scripts/get-harnesses.sh: Codex CLI, Claude Code and OpenCode from npm), the
# sandbox's system tools (scripts/get-sandbox-tools.sh: bubblewrap, iptables), Chromium and
# Playwright for the UI's browser tests (scripts/get-browser.sh), fetches helm
# (scripts/get-helm.sh), builds a real kube-apiserver (scripts/get-kube.sh, in the background while
# the linters run; cached in ~/.cache/legorl/kube) and a Kubernetes 1.36 apiextensions-apiserver for
# the CRDs (scripts/get-apiext.sh, likewise; ~/.cache/legorl/apiext), TRL in its own virtualenv
# (scripts/get-trl.sh, likewise; ~/.cache/legorl/trl-venv) and installs what a real node
# needs (scripts/get-node.sh; its kubelet, scheduler and kube-proxy come from get-kube.sh), then
# lint, types, import layers, generated-file drift, every image built and smoke-run
# (scripts/build-images.sh: Docker and debootstrap from Debian, a private engine; LEGORL_IMAGES=0
# skips it) and the test suite.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/_python.sh

step() { printf '\n==> %s\n' "$*"; }

# Wait for scripts/NAME.sh, started in the background with its output in .cache/NAME.log: show its summary
# line, or its whole log and stop if it failed. Usage: finished PID NAME (its result: the log's last line).
finished() {
  if ! wait "$1"; then
    cat ".cache/$2.log" >&2
    exit 1
  fi
  grep "$2.sh:" ".cache/$2.log" || true
}

step "virtualenv and dependencies"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
bash scripts/get-engine.sh
bash scripts/get-sandbox-tools.sh
# The real node's runtime (docker.io, CNI plugins, dnsmasq, iptables, conntrack), before the
# background build below takes the dpkg lock.
bash scripts/get-node.sh
bash scripts/get-browser.sh
# build-images.sh's host tool, installed now: the image builds overlap get-kube.sh below, whose
# apt-get would hold the dpkg lock.
if [ "${LEGORL_IMAGES:-1}" != 0 ] && ! command -v debootstrap >/dev/null 2>&1; then
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi
# After the other apt users (one dpkg lock); the build overlaps with helm, the linters and mypy.
mkdir -p .cache
# At low priority: they overlap the linters, mypy and the image builds (which wait on downloads
# often); only pytest needs them, so they are waited for after the images.
nice -n 10 bash scripts/get-kube.sh >.cache/get-kube.log 2>&1 &
kube_pid=$!
# The CRDs' current API server (1.36, from Debian sid's Go sources; cached in ~/.cache/legorl/apiext).
nice -n 10 bash scripts/get-apiext.sh >.cache/get-apiext.log 2>&1 &
apiext_pid=$!
# TRL in its own virtualenv (benchmarks/learning_vs_trl.py's peer trainer; cached in
# ~/.cache/legorl/trl-venv): pip's downloads overlap the linters and the image builds.
nice -n 10 bash scripts/get-trl.sh .venv/bin/python >.cache/get-trl.log 2>&1 &
trl_pid=$!
bash scripts/get-helm.sh .cache/tools
export PATH="$PWD/.venv/bin:$PATH"
export LEGORL_HELM="$PWD/.cache/tools/bin/helm"

step "what the product writes is left alone (a seeded .legorl/ tree)"
# legorl run and the quick start write under .legorl/ (including copies of installed packages in their
# sandboxes' task env): the linters, the type checker and pytest must not see it. A probe that breaks all
# three sits there while they run.
probe=.legorl/ci-probe
mkdir -p "$probe"
printf 'import os, sys\nx: int = "not an int"\ndef test_probe():\n    assert False\n' > "$probe/test_probe.py"
trap 'rm -rf "$probe"' EXIT

step "ruff (lint and format)"
ruff check .
ruff format --check .

step "mypy"
mypy

step "import layers"
lint-imports

step "generated files (CRDs, chart CRDs, API reference) are current"
legorl crds --check

step "helm lint"
"$LEGORL_HELM" lint --strict charts/legorl

if [ "${LEGORL_IMAGES:-1}" != 0 ]; then
  step "every image built and smoke-run (scripts/build-images.sh; LEGORL_IMAGES=0 skips)"
  bash scripts/build-images.sh --results .cache/images.json
fi

step "a real control plane (scripts/get-kube.sh)"
finished "$kube_pid" get-kube
LEGORL_KUBE_BIN=$(tail -1 .cache/get-kube.log)
export LEGORL_KUBE_BIN LEGORL_REQUIRE_KUBE=1

step "a current API server for the CRDs (scripts/get-apiext.sh)"
finished "$apiext_pid" get-apiext
LEGORL_APIEXT_BIN=$(tail -1 .cache/get-apiext.log)
export LEGORL_APIEXT_BIN

step "TRL's own virtualenv (scripts/get-trl.sh)"
finished "$trl_pid" get-trl
LEGORL_TRL_PYTHON=$(tail -1 .cache/get-trl.log)
export LEGORL_TRL_PYTHON

step "pytest"
set +e
# The slowest tests, to keep CI inside its time (65 min fresh, 35 warm).
python -m pytest --durations=40 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
