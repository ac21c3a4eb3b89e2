#!/usr/bin/env bash
# Install the harness CLIs the end-to-end tests drive through the real launcher: Codex CLI, Claude
# Code and OpenCode from npm, at the versions the harness images pin (the ARG defaults of
# sandbox-images/harness/{codex,claude-code,opencode}/Dockerfile, read from there: one pin each),
# each cached in ${LEGORL_CACHE:-~/.cache/legorl}/npm/<name>-<version>. Then lays out
# .../npm/runtime the way the harness images lay out their runtime (libexec/claude,
# libexec/codex/{bin/codex,codex-path}, libexec/opencode, share/legorl-harness/codex-models.json,
# Codex's model catalog made by sandbox-images/harness/codex/model-catalog.mjs), as links into those
# installs; bin/legorl-harness is left to whoever uses it (the tests copy the working tree's).
# Idempotent: a second run checks stamps and links and takes well under a second.
# Prints the runtime folder on its last line.
# Usage: bash scripts/get-harnesses.sh   (needs node and npm: Debian's nodejs and npm, installed here as root)
set -euo pipefail
trap 'echo "get-harnesses.sh: failed at line $LINENO: $BASH_COMMAND" >&2' ERR
cd "$(dirname "$0")/.."
HARNESS=$PWD/sandbox-images/harness
CACHE="${LEGORL_CACHE:-$HOME/.cache/legorl}/npm"

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "get-harnesses.sh: node and npm are needed (Debian: apt-get install nodejs npm)" >&2
    exit 1
  fi
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi

# The platform folders the npm packages ship, as the Dockerfiles pick them (OpenCode's "baseline"
# amd64 build needs no AVX2).
case "$(uname -m)" in
  x86_64) platform=linux-x64 triple=x86_64-unknown-linux-musl opencode_platform=linux-x64-baseline ;;
  aarch64 | arm64) platform=linux-arm64 triple=aarch64-unknown-linux-musl opencode_platform=linux-arm64 ;;
  *)
    echo "get-harnesses.sh: no harness builds for $(uname -m)" >&2
    exit 1
    ;;
esac

pin() { # pin KIND ARG: the ARG's default in that harness's Dockerfile
  local value
  value=$(sed -n "s/^ARG $2=\([0-9][0-9.]*\)$/\1/p" "$HARNESS/$1/Dockerfile" | head -n 1)
  if [ -z "$value" ]; then
    echo "get-harnesses.sh: no 'ARG $2=VERSION' in $HARNESS/$1/Dockerfile" >&2
    exit 1
  fi
  echo "$value"
}

npm_install() { # npm_install FOLDER PACKAGE@VERSION: npm install into FOLDER unless its stamp says it is there
  local folder=$1 spec=$2
  if [ "$(cat "$folder/.legorl-installed" 2>/dev/null)" = "$spec" ]; then
    return 0
  fi
  echo "get-harnesses.sh: npm install $spec" >&2
  rm -rf "$folder.partial"
  mkdir -p "$folder.partial"
  # --ignore-scripts: each package's postinstall only links or copies its platform binary, which is
  # taken directly below (as the images do).
  npm install --prefix "$folder.partial" --no-audit --no-fund --ignore-scripts --loglevel=error "$spec" >&2
  echo "$spec" >"$folder.partial/.legorl-installed"
  rm -rf "$folder"
  mv "$folder.partial" "$folder"
}

codex_version=$(pin codex CODEX_VERSION)
claude_version=$(pin claude-code CLAUDE_CODE_VERSION)
opencode_version=$(pin opencode OPENCODE_VERSION)
codex_dir=$CACHE/codex-$codex_version
claude_dir=$CACHE/claude-code-$claude_version
opencode_dir=$CACHE/opencode-$opencode_version
npm_install "$codex_dir" "@openai/codex@$codex_version"
npm_install "$claude_dir" "@anthropic-ai/claude-code@$claude_version"
npm_install "$opencode_dir" "opencode-ai@$opencode_version"

codex_home=$codex_dir/node_modules/@openai/codex-$platform/vendor/$triple
claude=$claude_dir/node_modules/@anthropic-ai/claude-code-$platform/claude
opencode=$opencode_dir/node_modules/opencode-$opencode_platform/bin/opencode
for binary in "$codex_home/bin/codex" "$claude" "$opencode"; do
  if [ ! -x "$binary" ]; then
    echo "get-harnesses.sh: $binary is missing after npm install (remove its folder and run again)" >&2
    exit 1
  fi
done

# Codex's model catalog: made once per Codex version and catalog script (keyed by the script's hash).
key=$(sha256sum "$HARNESS/codex/model-catalog.mjs" | cut -c1-12)
catalog=$codex_dir/codex-models-$key.json
if [ ! -s "$catalog" ]; then
  node "$HARNESS/codex/model-catalog.mjs" "$codex_home/bin/codex" "$catalog.partial"
  mv "$catalog.partial" "$catalog"
fi

runtime=$CACHE/runtime
mkdir -p "$runtime/libexec" "$runtime/share/legorl-harness"
ln -sfn "$codex_home" "$runtime/libexec/codex"
ln -sfn "$claude" "$runtime/libexec/claude"
ln -sfn "$opencode" "$runtime/libexec/opencode"
ln -sfn "$catalog" "$runtime/share/legorl-harness/codex-models.json"
{
  echo 'LEGORL_HARNESS_KINDS="ClaudeCode Codex OpenCode"'
  echo "LEGORL_HARNESS_VERSION=\"claude-code=$claude_version codex=$codex_version opencode=$opencode_version\""
} >"$runtime/share/legorl-harness/runtime.env"
echo "get-harnesses.sh: Codex CLI $codex_version, Claude Code $claude_version, OpenCode $opencode_version" >&2
echo "$runtime"
