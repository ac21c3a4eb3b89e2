#!/usr/bin/env bash
# Install what the sandbox stages and their tests run: bubblewrap (the local backend's
# namespaces), iptables (the Kubernetes egress lock, tested in network namespaces), iproute2,
# git, patchelf with Debian's python3 and pip wheel (sandbox-images/debian-python.sh, whose test
# must run, not skip), and swebench's instance schema (installed without its dependencies: only
# `swebench.types` is imported, to check the task format stays compatible).
# Idempotent. Usage: bash scripts/get-sandbox-tools.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_python.sh

missing=()
for tool in bwrap:bubblewrap iptables:iptables ip:iproute2 git:git prlimit:util-linux patchelf:patchelf; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
done
# sandbox-images/debian-python.sh (the harness images' Python from Debian, tested on this machine) copies
# Debian's own python3 and installs pip from its wheel.
[ -x /usr/bin/python3 ] && [ -d /usr/lib/python3/dist-packages ] || missing+=(python3)
compgen -G '/usr/share/python-wheels/pip-*.whl' >/dev/null || missing+=(python3-pip-whl)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "warning: missing ${missing[*]}; install them (Debian: apt-get install ${missing[*]})" >&2
    echo "         the sandbox tests that need them will be skipped and say why" >&2
  fi
fi
.venv/bin/python -c 'import swebench.types' >/dev/null 2>&1 ||
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps swebench==5.0.2
