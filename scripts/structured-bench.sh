#!/usr/bin/env bash
# Cost of grammar-constrained sampling (response_format json_object) on SmolLM2's vocabulary:
# wall times and end-to-end ms/token (docs/receipts/structured-output.json, from the example),
# then instruction counts per sampler step under callgrind, which load on the machine does not
# disturb (docs/receipts/structured-output-callgrind.json).
set -euo pipefail
cd "$(dirname "$0")/.."
models="${MUSER_MODELS:-$HOME/.cache/muser/models}"
model="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$model" ] || { echo "structured-bench: missing $model (run scripts/fetch-models.sh)" >&2; exit 1; }
cargo build --release --locked -q -p muser-server --example structured_bench >&2
bin="${CARGO_TARGET_DIR:-target}/release/examples/structured_bench"
"$bin" "$model"

command -v valgrind >/dev/null || { echo "structured-bench: no valgrind, instruction counts skipped" >&2; exit 0; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for case in free fast probe mask; do
  toggle='*Sampler*sample*'
  [ "$case" = mask ] && toggle='*fill_mask*'
  valgrind --tool=callgrind --callgrind-out-file="$work/cg.$case" --toggle-collect="$toggle" \
    "$bin" --micro "$case" "$model" > "$work/out.$case" 2> "$work/err.$case"
  calls=$(grep -o '^[a-z]*: [0-9]* calls' "$work/out.$case" | grep -o '[0-9]*')
  ir=$(grep -o 'Collected : [0-9]*' "$work/err.$case" | grep -o '[0-9]*$')
  echo "$case $calls $ir" >> "$work/counts"
done
python3 - "$work/counts" <<'EOF'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    case, calls, ir = line.split()
    rows[case] = int(ir) / int(calls)
names = {
    "free": "unconstrained greedy step",
    "fast": "json_object greedy step, best token allowed",
    "probe": "json_object greedy step, best refused (one pass over the 32 best)",
    "mask": "whole-vocabulary mask, cold cache (mean over the object's prefixes)",
}
print("| SmolLM2 (49,152 tokens) | instructions per call |")
print("|---|---:|")
for k in ["free", "fast", "probe", "mask"]:
    print(f"| {names[k]} | {rows[k]:,.0f} |")
receipt = {
    "what": "instructions per sampler call under callgrind, SmolLM2-135M-Instruct Q4_1 vocabulary, replaying the tokens of a JSON object",
    "instructions_per_call": {names[k]: round(rows[k]) for k in rows},
    "constraint_overhead_per_token_when_allowed": round(rows["fast"] - rows["free"]),
}
with open("docs/receipts/structured-output-callgrind.json", "w") as f:
    json.dump(receipt, f, indent=2)
    f.write("\n")
print("receipt: docs/receipts/structured-output-callgrind.json")
EOF
