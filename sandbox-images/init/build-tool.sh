#!/bin/sh
# build-tool.sh PYTHON SRC OUT: build the legorl-sandbox zipapp.
#
#   PYTHON  interpreter to build with (and to smoke-test the result with)
#   SRC     folder holding the package tree legorl/sandbox/ (in this repository: sandbox-images)
#   OUT     the .pyz to write
#
# The zipapp holds the standard-library-only package `legorl.sandbox` and starts
# `legorl.sandbox.cli:run` (main's status as the exit status); bin/legorl-sandbox runs it with the interpreter shipped next to it.
set -eu

die() {
  echo "build-tool: $*" >&2
  exit 1
}

[ "$#" -eq 3 ] || die "usage: build-tool.sh PYTHON SRC OUT"
python=$1
src=$2
out=$3
[ -f "$src/legorl/sandbox/cli.py" ] || die "$src/legorl/sandbox/cli.py not found"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT INT TERM
mkdir -p "$stage/legorl"
cp -R "$src/legorl/sandbox" "$stage/legorl/sandbox"
# Sources only: byte-code caches belong to whichever Python built them and only bloat the archive.
find "$stage" -name __pycache__ -type d -prune -exec rm -rf {} +
find "$stage" -type f \( -name '*.pyc' -o -name '*.pyo' \) -exec rm -f {} +
# The bundled task generator and its templates hold every tiny-python task's gold fix and hidden
# tests. No pod stage needs them (`legorl-sandbox tasks` runs on a workstation), and the verify pod
# mounts this tool where the code under test runs: leave them out.
rm -rf "$stage/legorl/sandbox/bundled.py" "$stage/legorl/sandbox/tiny-python"

mkdir -p "$(dirname "$out")"
"$python" -I -m zipapp "$stage" --main 'legorl.sandbox.cli:run' --compress --output "$out"
# The tool must start from the archive alone (isolated mode: no PYTHONPATH, no user site).
"$python" -I "$out" --help >/dev/null || die "$out does not start (legorl-sandbox --help failed)"
echo "build-tool: wrote $out"
