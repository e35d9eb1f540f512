#!/usr/bin/env bash
# The handoff benchmark on a GPU machine (one call): producer `muser up --device cuda` on the
# synthetic exact-geometry Muse Glimmer 30B (SmolLM2's tokenizer), consumer a second process on
# the same box, also on the GPU (same engine ABI: the greedy tokens must be identical); then,
# with CPU_CONSUMER=1, a consumer on the CPU accepting the fused forward's ABI (slow: it
# computes each prompt's last chunk of the 30B model on the CPU). Per prompt size: TTFT with
# local and with remote prefill, payload GB/s, the handoff's share of the remote TTFT, and its
# phases (the producer's export and seal, the body's arrival, the consumer's verifier time:
# `phases_ms` and `body_gb_s` in the receipt, columns in the printed table).
# Needs in $CARRY (default .carry/, git-ignored), as for scripts/gpu-check-bench.sh:
#   muser             cargo build --release -p muser-cli --features cuda
#   muse-vocab.gguf   muser synth --preset bench-310m --vocab-from SMOLLM2.gguf --vocab-only
#                       -o .carry/muse-vocab.gguf
# Writes the receipts to $OUT (default gpu-out/). Sizes: $SIZES (default 2048,8192,32768).
set -euo pipefail
root=$(pwd)
carry=${CARRY:-$root/.carry}
out=${OUT:-$root/gpu-out}
work=${GPU_WORK:-$root/target/gpu-work}
sizes=${SIZES:-2048,8192,32768}
mkdir -p "$out" "$work"
export MUSER_CACHE=$work/cache
m30=$work/muse-glimmer-30b-text.gguf
[ -f "$m30" ] || "$carry/muser" synth --preset muse-glimmer-30b --vocab-from "$carry/muse-vocab.gguf" \
  --seed 7 -o "$m30" 2>&1 | tail -n 1
python3 "$root/scripts/disagg_run.py" --muser "$carry/muser" --model "$m30" --tokens "$sizes" --reps 3 \
  --producer-device cuda --consumer-device cuda --receipt "$out/handoff-h200-30b-gpu-consumer.json"
if [ -n "${CPU_CONSUMER:-}" ]; then
  python3 "$root/scripts/disagg_run.py" --muser "$carry/muser" --model "$m30" --tokens 2048 --reps 1 \
    --producer-device cuda --consumer-device cpu --accept-abi muser-cuda-fused-f16-v1 \
    --receipt "$out/handoff-h200-30b-cpu-consumer.json"
fi
