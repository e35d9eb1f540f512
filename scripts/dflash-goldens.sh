#!/usr/bin/env bash
# Regenerate the DFlash drafter's parity goldens from the comparator's draft-dflash path.
#
# Writes a synthetic drafter for SmolLM2-135M-Instruct Q4_1 (`muser synth --preset dflash-tiny
# --type f32 --seed 7 --target ...`), runs llama-server with it (scripts/dflash/record.py) and
# records, for a few prompts, the greedy output and every block the drafter proposed, in
# crates/muser-model/tests/dflash-golden/dflash-tiny.json. The test (crates/muser-model/tests/dflash.rs)
# rebuilds the same drafter from preset, type and seed and replays the steps.
#
#   scripts/dflash-goldens.sh
#   LLAMA_BIN=DIR scripts/dflash-goldens.sh   # comparator bin dir (default: scripts/comparator.sh)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin="${LLAMA_BIN:-$(LLAMA_TARGETS=llama-server "$root/scripts/comparator.sh" | tail -n1)}"
models="${MUSER_MODELS:-$HOME/.cache/muser/models}"
smol="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$smol" ] || { echo "dflash-goldens: $smol is missing (run scripts/fetch-models.sh)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$root" && cargo build --release -q -p muser-cli)
muser="${CARGO_TARGET_DIR:-$root/target}/release/muser"
seed=7
mkdir -p "$root/crates/muser-model/tests/dflash-golden"
"$muser" synth --preset dflash-tiny --type f32 --seed $seed --target "$smol" -o "$work/dflash.gguf"
OMP_WAIT_POLICY=passive python3 "$root/scripts/dflash/record.py" "$smol" "$work/dflash.gguf" \
  --llama-server "$bin/llama-server" --out "$root/crates/muser-model/tests/dflash-golden/dflash-tiny.json" \
  --meta "{\"target\":\"SmolLM2-135M-Instruct.Q4_1.gguf\",\"preset\":\"dflash-tiny\",\"type\":\"f32\",\"seed\":$seed}"
