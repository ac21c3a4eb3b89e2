#!/usr/bin/env bash
# A real Kubernetes control plane and node for tests, built here: kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet and kube-proxy v1.20.2 from Debian bookworm's own
# `kubernetes` source package (no registry ships these binaries), compiled offline with Debian's Go,
# the pause container from the same tree (build/pause/linux/pause.c, static), plus etcd (Debian's
# etcd-server). kubectl is scripts/get-helm.sh's (v1.35; against 1.20 it only warns about the
# version skew). The node's runtime (docker.io, CNI plugins, dnsmasq) is scripts/get-node.sh's.
#
# Go >= 1.18 changed reflect.mapiterinit to fill an iterator the caller allocates; the vendored
# github.com/modern-go/reflect2 v1.0.1 still expects one back and crashes the apiserver on the
# first custom-resource write. scripts/kube/reflect2-mapiterinit.patch is this project's fix
# (the change reflect2 v1.0.2 made, written from its description). Built with that Go, the vendored
# OpenAPI validators also take every empty string in a custom resource for a null and refuse it
# ("spec.s in body must be of type string: \"null\""); scripts/kube/openapi-empty-string.patch
# restores what their check meant. Every scripts/kube/*.patch is applied, in name order.
#
# The binaries are cached in ~/.cache/legorl/kube/<key>/bin, keyed by the source package
# version, the patches and the Go version: the first run builds (the longest step of a fresh test run), later
# runs reuse. Prints the bin directory on its last line.
# Usage: bash scripts/get-kube.sh            (as root, or with golang-go and etcd-server installed)
set -euo pipefail
trap 'echo "get-kube.sh: failed at line $LINENO: $BASH_COMMAND" >&2' ERR
cd "$(dirname "$0")/.."
REPO=$PWD

VERSION="1.20.5+really1.20.2"
TREE="kubernetes-1.20.2"
PATCHES=("$REPO"/scripts/kube/*.patch)
TARGETS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)

need=()
command -v go >/dev/null 2>&1 || need+=(golang-go)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v make >/dev/null 2>&1 || need+=(make)
command -v rsync >/dev/null 2>&1 || need+=(rsync)  # the Kubernetes build copies its generators with it
if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "get-kube.sh: missing ${need[*]} (Debian: apt-get install ${need[*]})" >&2
    exit 1
  fi
  apt-get update -qq >/dev/null
  # policy-rc.d keeps etcd-server's postinst from starting a system etcd; tests start their own.
  # (A policy-rc.d the machine already has is left as it is.)
  ours=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && ours=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  [ -z "$ours" ] || rm -f /usr/sbin/policy-rc.d
fi

go_version=$(go env GOVERSION)
key=$(printf '%s\n%s\n' "$VERSION" "$go_version" | cat - "${PATCHES[@]}" | sha256sum | cut -c1-16)
CACHE="${LEGORL_CACHE:-$HOME/.cache/legorl}/kube/$key"
BIN="$CACHE/bin"

complete=1
for t in "${TARGETS[@]}" pause; do [ -x "$BIN/$t" ] || complete=""; done
if [ -z "$complete" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  # A private apt configuration with a deb-src entry of the machine's own archive: the system's
  # sources and lists are left as they are.
  mkdir -p "$work/apt/sources.list.d" "$work/apt/lists/partial" "$work/apt/cache/archives/partial" "$work/dl"
  archive=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
  archive=${archive:-http://deb.debian.org/debian}
  cat >"$work/apt/sources.list.d/src.sources" <<EOF
Types: deb-src
URIs: $archive
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  apt_private=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$work/apt/sources.list.d"
    -o "Dir::State::Lists=$work/apt/lists" -o "Dir::Cache=$work/apt/cache" -o APT::Sandbox::User=root)
  apt-get "${apt_private[@]}" update -qq
  (cd "$work/dl" && apt-get "${apt_private[@]}" source --download-only -qq kubernetes)
  orig="$work/dl/kubernetes_${VERSION}.orig.tar.gz"
  [ -f "$orig" ] || { echo "get-kube.sh: bookworm no longer has kubernetes $VERSION: $(ls "$work/dl")" >&2; exit 1; }
  tar -xzf "$orig" -C "$work"
  cd "$work/$TREE"
  for p in "${PATCHES[@]}"; do patch -p1 --quiet <"$p"; done
  echo "get-kube.sh: building ${TARGETS[*]} $TREE with $go_version" >&2
  start=$(date +%s)
  CGO_ENABLED=0 GOPROXY=off GOFLAGS=-mod=vendor GOTOOLCHAIN=local GOCACHE="$work/gocache" \
    make WHAT="${TARGETS[*]/#/cmd/}" >"$work/build.log" 2>&1 ||
    { tail -40 "$work/build.log" >&2; exit 1; }
  mkdir -p "$BIN.partial"
  for t in "${TARGETS[@]}"; do cp _output/local/bin/linux/*/"$t" "$BIN.partial/"; done
  # The pod sandbox ("pause") image's one program, as the tree's own build makes it.
  gcc -Os -static -DVERSION=3.2 -o "$BIN.partial/pause" build/pause/linux/pause.c
  rm -rf "$BIN" && mv "$BIN.partial" "$BIN"
  echo "get-kube.sh: built in $(($(date +%s) - start)) s" >&2
  cd "$REPO"
fi

ln -sf "$(command -v etcd)" "$BIN/etcd"
echo "$BIN"
