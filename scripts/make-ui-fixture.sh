#!/usr/bin/env bash
# Regenerate tests/fixtures/ui-run: a run store recorded from a real `legorl run` on a tiny manifest
# (builtin://tiny-swe, 2 training tasks x groupSize 2 per step, 2 steps, 1 held-out task evaluated at the
# start and at the end), pruned to what the UI reads (no weight or checkpoint tensors; the tokenizer of
# the newest policy version is kept so trajectories decode to text). A few minutes of CPU.
# Usage: bash scripts/make-ui-fixture.sh [OUT]   (default tests/fixtures/ui-run)
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-tests/fixtures/ui-run}
LEGORL=${LEGORL:-.venv/bin/legorl}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

cat > "$WORK/ui-fixture.yaml" <<'YAML'
# The run recorded as the UI's test fixture (scripts/make-ui-fixture.sh).
apiVersion: legorl.dev/v1alpha1
kind: RLRun
metadata:
  name: ui-fixture
spec:
  policy:
    checkpoint:
      uri: builtin://tiny-swe
  fleet:
    replicas: 1
    parallelism:
      gpusPerNode: 0
    settings:
      dtype: float32
      routedExpertsCapture: Disabled
      toolCallParser: hermes
      maxModelLen: 2048
  pool:
    source:
      taskSet:
        uri: builtin://tiny-python
    deadlines:
      agentSeconds: 300
      verifySeconds: 120
  harness:
    kind: MiniSweAgent
    maxTurns: 4
  tasks:
    source:
      uri: builtin://tiny-python
    split:
      heldOutTaskIds: [tiny-python__stats-004]
    maxTasks: 4
    seed: 7
  algorithm:
    name: GRPO
    groupSize: 2
    tasksPerStep: 2
    learningRate: "3e-4"
    sampling:
      maxTokensPerTurn: 128
  schedule:
    mode: Sync
    maxConcurrentTrials: 4
  trainer:
    parallelism:
      gpusPerNode: 0
    dtype: float32
  stop:
    maxSteps: 2
  evaluation:
    intervalSteps: 2
    trialsPerTask: 1
YAML

"$LEGORL" validate "$WORK/ui-fixture.yaml"
"$LEGORL" run "$WORK/ui-fixture.yaml" --dir "$WORK/run"

STORE="$WORK/run/store"
rm -rf "$STORE/checkpoints"
newest=$(ls -d "$STORE"/weights/v* | sort -V | tail -n 1)
# Keep each version's PUBLISHED.json marker, and the newest version's tokenizer; drop the tensors.
find "$STORE/weights" -type f ! -name PUBLISHED.json ! -path "$newest/tokenizer.json" -delete
find "$STORE" -name '.*.tmp' -delete

rm -rf "$OUT"
mkdir -p "$OUT"
cp -r "$STORE" "$OUT/store"
cp "$WORK/ui-fixture.yaml" "$OUT/manifest.yaml"
du -sh "$OUT"
echo "wrote $OUT (run store of a real legorl run; regenerate with $0)"
