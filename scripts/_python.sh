# Sourced by the set-up scripts: pick a Python >= 3.11 and make sure .venv exists.
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "error: legorl needs Python >= 3.11 ($PY is $("$PY" -V 2>&1)); set PYTHON=python3.11" >&2
  exit 2
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
