#!/usr/bin/env bash
# Regenerate muser-vision's goldens from the comparator's libmtmd (llama.cpp b11434).
#
# Builds scripts/vision/mtmd_golden.c against libmtmd + libllama, writes a synthetic text model
# (`muser synth --preset tiny --type f16 --vocab-from SmolLM2`) and projector
# (`muser synth --preset vision-tiny --type f16`), then for each image of
# crates/muser-vision/tests/data/ records llama.cpp's image embeddings (2 threads, flash
# attention off) and the greedy tokens after the image, and how far the embeddings move with
# 1 thread and with flash attention on (the tolerance llama.cpp's own CPU backend shows).
# Output: crates/muser-vision/tests/golden/{NAME.f32, goldens.json}.
#
#   scripts/vision-goldens.sh
#   LLAMA_BIN=DIR scripts/vision-goldens.sh   # comparator bin dir (default: scripts/comparator.sh)
#   MUSER_BIN=target/release/muser scripts/vision-goldens.sh   # skip building muser
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin="${LLAMA_BIN:-$(LLAMA_TARGETS=llama-mtmd-cli "$root/scripts/comparator.sh" | tail -n1)}"
src=$(cd "$bin/../.." && pwd)
models="${MUSER_MODELS:-$HOME/.cache/muser/models}"
out="$root/crates/muser-vision/tests/golden"
data="$root/crates/muser-vision/tests/data"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

cc -O2 -o "$work/mtmd_golden" "$root/scripts/vision/mtmd_golden.c" \
  -I"$src/include" -I"$src/ggml/include" -I"$src/tools/mtmd" -L"$bin" -lmtmd -lllama -lggml-base -Wl,-rpath,"$bin"
golden() { OMP_WAIT_POLICY=passive LD_LIBRARY_PATH="$bin" "$work/mtmd_golden" "$@"; }

muser="${MUSER_BIN:-}"   # a built `muser` (default: cargo build --release -p muser-cli)
if [ -z "$muser" ]; then
  (cd "$root" && cargo build --release -q -p muser-cli)
  muser="${CARGO_TARGET_DIR:-$root/target}/release/muser"
fi
seed=7
"$muser" synth --preset tiny --type f16 --seed $seed --vocab-from "$models/SmolLM2-135M-Instruct.Q4_1.gguf" -o "$work/text.gguf"
"$muser" synth --preset vision-tiny --type f16 --seed $seed -o "$work/mmproj.gguf"

python3 "$root/scripts/vision/images.py" "$data"
: > "$work/runs"
for img in "$data"/*.png; do
  name=$(basename "$img" .png)
  golden "$work/text.gguf" "$work/mmproj.gguf" "$img" "$out/$name.f32" --threads 2 > "$work/$name.json"
  golden "$work/text.gguf" "$work/mmproj.gguf" "$img" "$work/$name-t1.f32" --threads 1 --n-predict 0 > /dev/null
  golden "$work/text.gguf" "$work/mmproj.gguf" "$img" "$work/$name-fa.f32" --threads 2 --flash-attn on --n-predict 0 > /dev/null
  echo "$name" >> "$work/runs"
done
python3 - "$work" "$out" "$seed" "$(sha256sum "$work/mmproj.gguf" | cut -d' ' -f1)" "$(sha256sum "$work/text.gguf" | cut -d' ' -f1)" <<'EOF'
import json, struct, sys
work, out, seed, proj_sha, text_sha = sys.argv[1:6]
def floats(p):
    b = open(p, "rb").read()
    return struct.unpack(f"<{len(b)//4}f", b)
def max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b))
images = []
for name in open(f"{work}/runs").read().split():
    run = json.load(open(f"{work}/{name}.json"))
    ref = floats(f"{out}/{name}.f32")
    images.append({
        "name": name,
        "file": f"{name}.png",
        "embeddings": f"{name}.f32",
        "run": run,
        "max_abs_1_thread": max_diff(ref, floats(f"{work}/{name}-t1.f32")),
        "max_abs_flash_attn": max_diff(ref, floats(f"{work}/{name}-fa.f32")),
        "max_abs_value": max(abs(x) for x in ref),
    })
doc = {
    "source": "llama.cpp b11434 libmtmd (scripts/vision-goldens.sh)",
    "projector": {"preset": "vision-tiny", "type": "f16", "seed": int(seed), "sha256": proj_sha},
    "text": {"preset": "tiny", "type": "f16", "seed": int(seed), "vocab_from": "SmolLM2-135M-Instruct.Q4_1.gguf", "sha256": text_sha},
    "images": images,
}
json.dump(doc, open(f"{out}/goldens.json", "w"), indent=1)
for i in images:
    print(f"vision-goldens: {i['name']}: {i['run']['chunks'][1]['image']['n_tokens']} tokens, 1-thread {i['max_abs_1_thread']:.3g} fa {i['max_abs_flash_attn']:.3g} max {i['max_abs_value']:.3g}", file=sys.stderr)
EOF
