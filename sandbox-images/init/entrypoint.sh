#!/bin/sh
# Entrypoint of ghcr.io/legorl/sandbox-init.
#
#   install --into=DIR   copy the self-contained tool (python/, lib/legorl-sandbox.pyz,
#                        bin/legorl-sandbox) into DIR; the trial pod's `tools` init container
#                        does this into an emptyDir that later stages mount at /legorl
#   egress-lock ...      |
#   setup ... / verify ... / any other subcommand: run `legorl-sandbox SUBCOMMAND ...`
#
# LEGORL_SANDBOX_HOME names the staged tool (default /opt/legorl/sandbox, where the image keeps it;
# not /legorl, which the pod's volume would hide).
set -eu

home=${LEGORL_SANDBOX_HOME:-/opt/legorl/sandbox}

die() {
  echo "sandbox-init: $*" >&2
  exit 2
}

usage() {
  cat <<USAGE
usage: install --into=DIR
       egress-lock [ARGS...] | setup [ARGS...] | verify [ARGS...] | ...   (legorl-sandbox)
USAGE
}

install_into() {
  into=""
  while [ "$#" -gt 0 ]; do
    case $1 in
      --into=*) into=${1#--into=} ;;
      --into)
        [ "$#" -ge 2 ] || die "--into needs a folder"
        into=$2
        shift
        ;;
      -h | --help)
        usage
        return 0
        ;;
      *) die "install: unknown argument $1" ;;
    esac
    shift
  done
  [ -n "$into" ] || die "install needs --into=DIR"
  for part in python/bin/python3 lib/legorl-sandbox.pyz bin/legorl-sandbox; do
    [ -e "$home/$part" ] || die "image is incomplete: $home/$part is missing"
  done
  mkdir -p "$into/bin" "$into/lib"
  # Replace, never merge: a restarted init container must not leave a mix of two copies.
  rm -rf "$into/python" "$into/lib/legorl-sandbox.pyz" "$into/bin/legorl-sandbox"
  cp -R "$home/python" "$into/python"
  cp "$home/lib/legorl-sandbox.pyz" "$into/lib/legorl-sandbox.pyz"
  cp "$home/bin/legorl-sandbox" "$into/bin/legorl-sandbox"
  chmod 0755 "$into/bin/legorl-sandbox"
  chmod -R a+rX "$into/python" "$into/lib" "$into/bin"
  # Prove the copy runs from its new place before the pod moves on.
  "$into/bin/legorl-sandbox" --help >/dev/null || die "the installed tool in $into does not start"
  echo "sandbox-init: installed legorl-sandbox into $into"
}

case ${1:-} in
  install)
    shift
    install_into "$@"
    ;;
  "" | -h | --help)
    usage
    ;;
  *) exec "$home/bin/legorl-sandbox" "$@" ;;
esac
