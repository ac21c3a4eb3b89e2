#!/usr/bin/env bash
# Install what the UI's browser tests drive: Debian's Chromium (as root; Playwright's own browser
# download does not work here) and the Playwright Python package in .venv. Idempotent.
# Usage: bash scripts/get-browser.sh
set -euo pipefail
cd "$(dirname "$0")/.."

CHROMIUM=${LEGORL_CHROMIUM:-/usr/bin/chromium}
if [ -x "$CHROMIUM" ]; then
  echo "chromium already present: $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"
elif [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
  echo "installed $("$CHROMIUM" --version)"
else
  echo "warning: no $CHROMIUM and not root: install Chromium (apt-get install chromium) or set LEGORL_CHROMIUM;" \
       "the browser tests skip without it" >&2
fi

PY=.venv/bin/python
[ -x "$PY" ] || PY=${PYTHON:-python3}
if "$PY" -c 'import playwright' 2>/dev/null; then
  echo "playwright already present: $("$PY" -m pip show playwright 2>/dev/null | sed -n 's/^Version: //p')"
else
  "$PY" -m pip install --quiet --disable-pip-version-check 'playwright>=1.45'
  echo "installed playwright $("$PY" -m pip show playwright | sed -n 's/^Version: //p')"
fi
