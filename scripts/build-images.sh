#!/usr/bin/env bash
# Build every image legorl names (sandbox-images/images.json) from a Debian base made here, and
# smoke-run each entrypoint. Needs no registry: only Debian, PyPI and npm are reached.
#
#   bash scripts/build-images.sh [--only NAME ...] [--no-cache] [--results FILE]
#
# Installs docker.io and debootstrap (Debian, as root) where missing; starts a private Docker
# engine (its own data root under ~/.cache/legorl/images/docker, no bridge, no iptables, host
# network only) unless DOCKER_HOST names a working one, and stops it at the end; makes Debian
# bookworm and trixie minbase rootfs tars with debootstrap (cached in ~/.cache/legorl/images); then
# runs scripts/images/build_images.py, which makes the bases and builds, times, sizes and smoke-runs
# each image. Images that take python-build-standalone from github.com are built with Debian's own
# Python instead (PYTHON_SOURCE=debian) unless PBS_BASE_URL names a mirror of its releases.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${LEGORL_CACHE:-$HOME/.cache/legorl}/images
mkdir -p "$CACHE"

say() { printf 'build-images.sh: %s\n' "$*" >&2; }

missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    say "needs ${missing[*]} (Debian: apt-get install ${missing[*]}), as root"
    exit 2
  fi
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# A docker CLI that builds with BuildKit: one with the buildx plugin, or Debian's (20.10, BuildKit
# built in). A newer CLI without buildx only has the legacy builder, which lacks COPY --chmod.
if [ -z "${DOCKER:-}" ]; then
  if docker buildx version >/dev/null 2>&1; then
    DOCKER=docker
  elif [ -x /usr/bin/docker ]; then
    DOCKER=/usr/bin/docker
  else
    DOCKER=docker
  fi
fi
export DOCKER

dockerd_pid=
run=
cleanup() {
  if [ -n "$dockerd_pid" ]; then
    kill "$dockerd_pid" 2>/dev/null || true
    wait "$dockerd_pid" 2>/dev/null || true
    # dockerd leaves the mount of its network namespace behind.
    umount -l "$run/exec/netns/default" 2>/dev/null || true
    rm -rf "$run" 2>/dev/null || true
  fi
}
trap cleanup EXIT
if [ -z "${DOCKER_HOST:-}" ] || ! "$DOCKER" info >/dev/null 2>&1; then
  run=$(mktemp -d /tmp/legorl-docker.XXXXXX)
  export DOCKER_HOST="unix://$run/docker.sock"
  runtime=()
  # A negative OOM score needs CAP_SYS_RESOURCE; without it runc cannot start a container.
  if ! (echo -1 >/proc/self/oom_score_adj) 2>/dev/null; then
    runtime=(--add-runtime "oomclamp=$PWD/scripts/images/runc-oom-clamp" --default-runtime oomclamp)
    say "no CAP_SYS_RESOURCE here: containers run through scripts/images/runc-oom-clamp"
  fi
  dockerd --data-root "$CACHE/docker" --exec-root "$run/exec" -H "$DOCKER_HOST" \
    --pidfile "$run/dockerd.pid" --bridge=none --iptables=false --ip6tables=false \
    "${runtime[@]}" >"$run/dockerd.log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 1 60); do
    "$DOCKER" info >/dev/null 2>&1 && break
    kill -0 "$dockerd_pid" 2>/dev/null || { cat "$run/dockerd.log" >&2; exit 1; }
    sleep 0.5
  done
  "$DOCKER" info >/dev/null
  say "a private Docker engine at $DOCKER_HOST (data root $CACHE/docker)"
fi

# Debian minbase rootfs tars (cached): bookworm for every base, trixie for Debian's own Python 3.13
# (the harness runtimes that need Python >= 3.12, built without python-build-standalone).
rootfs_seconds=0
make_rootfs() {
  local suite=$1 tar="$CACHE/debian-$1-minbase.tar" start tree
  if [ ! -s "$tar" ]; then
    start=$(date +%s)
    tree=$(mktemp -d /tmp/legorl-rootfs.XXXXXX)
    debootstrap --variant=minbase --include=python3,ca-certificates "$suite" "$tree" \
      "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$CACHE/debootstrap-$suite.log" 2>&1 ||
      { tail -20 "$CACHE/debootstrap-$suite.log" >&2; rm -rf "$tree"; exit 1; }
    tar -C "$tree" -cf "$tar.part" .
    mv "$tar.part" "$tar"
    rm -rf "$tree"
    rootfs_seconds=$((rootfs_seconds + $(date +%s) - start))
    say "Debian $suite minbase rootfs made in $(($(date +%s) - start)) s ($tar)"
  fi
}
make_rootfs bookworm
make_rootfs trixie

PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
status=0
PYTHONPATH=sandbox-images${PYTHONPATH:+:$PYTHONPATH} "$PY" scripts/images/build_images.py \
  --base-rootfs "$CACHE/debian-bookworm-minbase.tar" --trixie-rootfs "$CACHE/debian-trixie-minbase.tar" \
  --rootfs-seconds "$rootfs_seconds" --docker "$DOCKER" "$@" || status=$?

# Every rebuild leaves the layers it replaced in BuildKit's cache, and nothing else ever frees
# them: a cache kept across CI runs grew to 38 GB of build cache beside 6.5 GB of images, and a CI
# run then failed with "No space left on device". Keep the most recently used layers (what the next
# rebuild reuses) up to LEGORL_BUILD_CACHE_KEEP, and drop images that a rebuild left untagged.
"$DOCKER" image prune -f >/dev/null || say "docker image prune failed"
"$DOCKER" builder prune -f --keep-storage "${LEGORL_BUILD_CACHE_KEEP:-10GB}" >/dev/null ||
  say "docker builder prune failed"
exit "$status"
