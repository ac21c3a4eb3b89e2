#!/bin/sh
# fetch-python.sh DEST: put a relocatable CPython (python-build-standalone, "install_only_stripped")
# for the image's architecture into DEST, checked against a pinned sha256.
#
# Runs in a Dockerfile build stage; the pins come from the stage's ARGs (visible here as
# environment variables):
#   PBS_RELEASE         release tag, e.g. 20261021
#   PBS_PYTHON_VERSION  e.g. 3.12.15
#   PBS_SHA256_AMD64    sha256 of the x86_64-unknown-linux-gnu tarball
#   PBS_SHA256_ARM64    sha256 of the aarch64-unknown-linux-gnu tarball
#   TARGETARCH          amd64 | arm64 (BuildKit sets it; defaults to this machine's)
#   PBS_BASE_URL        optional mirror of the GitHub release downloads (air-gapped builds)
#
# The interpreter finds its standard library relative to its own location, so DEST can later be
# copied anywhere (the trial pod copies it into an emptyDir and runs it inside the task image).
# Needs curl (or wget), sha256sum and tar.
set -eu

die() {
  echo "fetch-python: $*" >&2
  exit 1
}

[ "$#" -eq 1 ] || die "usage: fetch-python.sh DEST"
dest=$1
: "${PBS_RELEASE:?set PBS_RELEASE (python-build-standalone release tag)}"
: "${PBS_PYTHON_VERSION:?set PBS_PYTHON_VERSION}"

arch=${TARGETARCH:-$(uname -m)}
case $arch in
  amd64 | x86_64)
    triple=x86_64-unknown-linux-gnu
    sha=${PBS_SHA256_AMD64:-}
    ;;
  arm64 | aarch64)
    triple=aarch64-unknown-linux-gnu
    sha=${PBS_SHA256_ARM64:-}
    ;;
  *) die "unsupported architecture $arch (amd64 and arm64 are)" ;;
esac
case $sha in
  [0-9a-f][0-9a-f][0-9a-f][0-9a-f]*) ;;
  *) die "no sha256 pinned for $triple (set PBS_SHA256_AMD64 / PBS_SHA256_ARM64)" ;;
esac
[ "${#sha}" -eq 64 ] || die "PBS sha256 for $triple is not 64 hex digits: $sha"

name="cpython-${PBS_PYTHON_VERSION}+${PBS_RELEASE}-${triple}-install_only_stripped.tar.gz"
base=${PBS_BASE_URL:-https://github.com/astral-sh/python-build-standalone/releases/download}
url="${base%/}/${PBS_RELEASE}/cpython-${PBS_PYTHON_VERSION}%2B${PBS_RELEASE}-${triple}-install_only_stripped.tar.gz"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT INT TERM
archive="$work/$name"
if command -v curl >/dev/null 2>&1; then
  curl --fail --silent --show-error --location --retry 3 --output "$archive" "$url"
else
  wget -q -O "$archive" "$url"
fi
echo "$sha  $archive" | sha256sum -c - >/dev/null || die "sha256 mismatch for $name (expected $sha)"

mkdir -p "$dest"
# The tarball holds one top folder, python/.
tar -xzf "$archive" -C "$dest" --strip-components=1
[ -x "$dest/bin/python3" ] || die "$name has no bin/python3"

# Drop what no legorl runtime uses: the test suite, Tk, IDLE, turtle demos.
for lib in "$dest"/lib/python3.*; do
  [ -d "$lib" ] || continue
  rm -rf "$lib/test" "$lib/idlelib" "$lib/tkinter" "$lib/turtledemo" "$lib/turtle.py"
  rm -f "$lib"/lib-dynload/_tkinter*.so
done
rm -rf "$dest"/lib/tcl* "$dest"/lib/tk* "$dest"/lib/itcl* "$dest"/lib/thread* "$dest"/lib/libtcl* "$dest"/lib/libtk*
rm -rf "$dest/share"

"$dest/bin/python3" -I -c 'import sys; print("fetch-python:", sys.version.split()[0], sys.prefix)'
