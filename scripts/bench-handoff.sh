#!/usr/bin/env bash
# Handoff benchmark: TTFT with local against remote prefill, payload rate and the share of the
# remote TTFT outside the producer's prefill, per prompt size, with a JSON receipt under
# docs/receipts/. Producer and consumer on this machine (loopback).
# Usage: scripts/bench-handoff.sh [MODEL.gguf] [SIZES] [PRODUCER_DEVICE]
#   CPU (this 2-core machine): scripts/bench-handoff.sh
#   GPU producer: see scripts/gpu-bench-handoff.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${1:-$(scripts/fetch-models.sh)/SmolLM2-135M-Instruct.Q4_1.gguf}"
SIZES="${2:-512,1024,2048}"
DEVICE="${3:-cpu}"
MUSER="${MUSER:-target/release/muser}"
[ -n "${MUSER_SKIP_BUILD:-}" ] || cargo build --release -p muser-cli >&2
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
python3 scripts/disagg_run.py --muser "$MUSER" --model "$MODEL" --tokens "$SIZES" --reps "${REPS:-3}" \
  --producer-device "$DEVICE" --threads "${THREADS:-0}" \
  --receipt "docs/receipts/handoff-$DEVICE-$STAMP-$(basename "$MODEL" .gguf).json"
