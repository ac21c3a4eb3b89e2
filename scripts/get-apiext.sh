#!/usr/bin/env bash
# A current Kubernetes API server for the CRDs: `apiextensions-apiserver` at Kubernetes 1.36
# (k8s.io/apiextensions-apiserver 0.36.x), built here from Debian sid's own Go source packages with
# Debian's Go 1.27. It serves CRDs and custom resources only (no Pods, Jobs or RBAC; the 1.20 cluster
# of scripts/get-kube.sh covers those), with the CEL rules, defaulting, pruning, strict field
# validation, server-side apply and ratcheting of a current server. Nothing is installed
# system-wide: a private apt configuration (sid + trixie, its own lists and cache) downloads the
# dependency closure of golang-k8s-apiextensions-apiserver-dev and golang-1.27-go, `dpkg -x`
# unpacks it into one folder, and the server's own main.go is built in GOPATH mode, offline.
#
# Cached in ~/.cache/legorl/apiext/<key>/bin, keyed by the versions of every package unpacked:
# later runs reuse the binary; a new sid upload makes a new key (and a new build). Prints the
# bin directory on its last line (it holds apiextensions-apiserver and scripts/apiext/celcost.go
# built against the same sources). The tests run it with Debian's etcd, which scripts/get-kube.sh
# installs (this script installs nothing system-wide, so the two can run side by side).
# Usage: bash scripts/get-apiext.sh
set -euo pipefail
trap 'echo "get-apiext.sh: failed at line $LINENO: $BASH_COMMAND" >&2' ERR
cd "$(dirname "$0")/.."

ROOT_PKG=golang-k8s-apiextensions-apiserver-dev
GO_PKG=golang-1.27-go
CACHE_ROOT="${LEGORL_CACHE:-$HOME/.cache/legorl}/apiext"

# The private apt configuration lives in the cache so that its lists are reused between runs.
APT="$CACHE_ROOT/apt"
mkdir -p "$APT/sources.list.d" "$APT/preferences.d" "$APT/lists/partial" "$APT/cache/archives/partial"
archive=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
archive=${archive:-http://deb.debian.org/debian}
cat >"$APT/sources.list.d/sid.sources" <<EOF
Types: deb
URIs: $archive
Suites: sid trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
apt_private=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$APT/sources.list.d"
  -o "Dir::Etc::Preferences=/dev/null" -o "Dir::Etc::PreferencesParts=$APT/preferences.d"
  -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache" -o "Dir::State::status=$APT/status"
  -o APT::Default-Release=sid -o APT::Sandbox::User=root -o Debug::NoLocking=1)
: >"$APT/status"  # an empty dpkg status: every dependency is resolved from sid, none from this machine
apt-get "${apt_private[@]}" update -qq

# The closure: every package the server's sources and the Go toolchain depend on, with versions.
closure=$(apt-cache "${apt_private[@]}" depends --recurse --no-recommends --no-suggests --no-conflicts \
  --no-breaks --no-replaces --no-enhances "$ROOT_PKG" "$GO_PKG" | grep -v '^ ' | grep -v '^<' | sort -u)
# shellcheck disable=SC2086  # one word per package
versions=$(apt-cache "${apt_private[@]}" show --no-all-versions $closure 2>/dev/null |
  awk '/^Package: /{p=$2} /^Version: /{print p "=" $2}' | sort -u)
# RECIPE names the build steps below: bump it when they change (comments do not count).
RECIPE=2
key=$(printf '%s\n' "$RECIPE" "$versions" | cat - scripts/apiext/*.go | sha256sum | cut -c1-16)
BIN="$CACHE_ROOT/$key/bin"

if [ ! -x "$BIN/apiextensions-apiserver" ] || [ ! -x "$BIN/celcost" ]; then
  # Unpacked at the same place every time, so that the kept build cache matches its files.
  work="$CACHE_ROOT/work"
  rm -rf "$work"
  trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/debs" "$work/root"
  echo "get-apiext.sh: downloading $(printf '%s\n' "$versions" | wc -l) packages from sid" >&2
  # shellcheck disable=SC2046  # one word per package=version
  (cd "$work/debs" && apt-get "${apt_private[@]}" download -qq $(printf '%s\n' "$versions"))
  for deb in "$work"/debs/*.deb; do dpkg -x "$deb" "$work/root"; done
  goroot="$work/root/usr/lib/go-1.27"
  src="$work/root/usr/share/gocode/src/k8s.io/apiextensions-apiserver"
  [ -x "$goroot/bin/go" ] || { echo "get-apiext.sh: no Go 1.27 in $GO_PKG" >&2; exit 1; }
  [ -f "$src/main.go" ] || { echo "get-apiext.sh: no main.go in $ROOT_PKG" >&2; exit 1; }
  echo "get-apiext.sh: building apiextensions-apiserver ($(grep "^$ROOT_PKG=" <<<"$versions")) with $("$goroot/bin/go" version | cut -d' ' -f3)" >&2
  start=$(date +%s)
  mkdir -p "$BIN.partial"
  # The build cache is kept: a change to celcost.go rebuilds only what changed.
  gobuild() {
    GOROOT="$goroot" GOPATH="$work/root/usr/share/gocode" GO111MODULE=off GOPROXY=off \
      GOTOOLCHAIN=local CGO_ENABLED=0 GOCACHE="$CACHE_ROOT/gocache" GOFLAGS="" "$goroot/bin/go" build "$@"
  }
  # The release it is, as `/version` and `kubectl version` report it: 0.36.4-1 -> v1.36.4.
  upstream=$(sed -n "s/^$ROOT_PKG=0\.\([0-9]*\)\.\([0-9]*\).*/v1.\1.\2/p" <<<"$versions")
  ver=k8s.io/component-base/version
  (cd "$src" && gobuild -ldflags "-X $ver.gitVersion=$upstream -X $ver.gitTreeState=clean" \
    -o "$BIN.partial/apiextensions-apiserver" .) >"$work/build.log" 2>&1 ||
    { tail -40 "$work/build.log" >&2; exit 1; }
  # The CEL cost figures of scripts/apiext/celcost.go, from the same sources.
  (cd scripts/apiext && gobuild -o "$BIN.partial/celcost" celcost.go) >>"$work/build.log" 2>&1 ||
    { tail -40 "$work/build.log" >&2; exit 1; }
  printf '%s\n' "$versions" >"$BIN.partial/PACKAGES"
  rm -rf "$BIN" && mv "$BIN.partial" "$BIN"
  echo "get-apiext.sh: built in $(($(date +%s) - start)) s" >&2
fi

echo "$BIN"
