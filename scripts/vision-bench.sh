#!/usr/bin/env bash
# Image encode time, Muser beside llama.cpp's mtmd, on one 1024x1024 image with the synthetic
# projector of the real geometry (`muser synth --preset vision-glimmer --type f16`, ~3 GB), on
# the CPU with THREADS threads (default: all cores). Writes the receipt
# docs/receipts/vision-encode-<host>-<threads>t.json (command, commit, machine, numbers).
#
#   scripts/vision-bench.sh                 # every core, 3 encodes each
#   THREADS=2 REPEAT=2 scripts/vision-bench.sh
#   LLAMA_BIN=DIR MUSER_BIN=FILE scripts/vision-bench.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
threads="${THREADS:-$(nproc)}"
repeat="${REPEAT:-3}"
preset="${PRESET:-vision-glimmer}"
bin="${LLAMA_BIN:-$(LLAMA_TARGETS=llama-mtmd-cli "$root/scripts/comparator.sh" | tail -n1)}"
src=$(cd "$bin/../.." && pwd)
models="${MUSER_MODELS:-$HOME/.cache/muser/models}"
work="${VISION_BENCH_DIR:-$(mktemp -d)}"
mkdir -p "$work"

cc -O2 -o "$work/mtmd_golden" "$root/scripts/vision/mtmd_golden.c" \
  -I"$src/include" -I"$src/ggml/include" -I"$src/tools/mtmd" -L"$bin" -lmtmd -lllama -lggml-base -Wl,-rpath,"$bin"
(cd "$root" && cargo build --release -q -p muser-vision --example encode)
encode="${CARGO_TARGET_DIR:-$root/target}/release/examples/encode"
muser="${MUSER_BIN:-}"
if [ -z "$muser" ]; then
  (cd "$root" && cargo build --release -q -p muser-cli)
  muser="${CARGO_TARGET_DIR:-$root/target}/release/muser"
fi
text=$(case "$preset" in vision-glimmer) echo muse-glimmer-30b ;; *) echo tiny ;; esac)
width=$(case "$preset" in vision-glimmer) echo 6656 ;; *) echo 256 ;; esac)
[ -f "$work/$preset.gguf" ] || "$muser" synth --preset "$preset" --type f16 --seed 7 -o "$work/$preset.gguf"
# the text model only gives mtmd its width: a vocabulary-only file of that preset
[ -f "$work/$text-vocab.gguf" ] || "$muser" synth --preset "$text" --vocab-only --seed 7 \
  --vocab-from "$models/SmolLM2-135M-Instruct.Q4_1.gguf" -o "$work/$text-vocab.gguf"
python3 "$root/scripts/vision/images.py" --bench "$work/bench-1024.png"

llama=$(OMP_WAIT_POLICY=passive "$work/mtmd_golden" "$work/$text-vocab.gguf" "$work/$preset.gguf" \
  "$work/bench-1024.png" "$work/llama.f32" --threads "$threads" --n-predict 0 --repeat "$repeat" --vocab-only 1 --width "$width")
ours=$("$encode" "$work/$preset.gguf" "$work/bench-1024.png" --threads "$threads" --repeat "$repeat")
host=$(hostname -s)
out="$root/docs/receipts/vision-encode-$host-${threads}t.json"
python3 - "$llama" "$ours" "$out" "$threads" "$repeat" "$preset" <<'PY'
import json, platform, subprocess, sys, datetime
llama, ours, out, threads, repeat, preset = sys.argv[1:7]
l = json.loads(llama); m = json.loads(ours)
img = next(c["image"] for c in l["chunks"] if "image" in c)
cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), platform.machine())
best_l, best_m = min(img["encode_ms"]), min(m["encode_ms"])
doc = {
    "command": f"THREADS={threads} REPEAT={repeat} PRESET={preset} scripts/vision-bench.sh",
    "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "machine": {"cpu": cpu, "threads": int(threads)},
    "image": "1024x1024 RGB PNG (scripts/vision/images.py --bench)",
    "projector": f"muser synth --preset {preset} --type f16 --seed 7",
    "tokens": img["n_tokens"],
    "llama_cpp_mtmd": {"encode_ms": img["encode_ms"], "clip_flash_attn": l["clip_flash_attn"]},
    "muser": {"encode_ms": m["encode_ms"], "preprocess_ms": m["preprocess_ms"]},
    "ratio_muser_over_llama_best": best_m / best_l,
}
json.dump(doc, open(out, "w"), indent=1)
print(f"vision-bench: {img['n_tokens']} tokens; llama.cpp {best_l:.0f} ms, muser {best_m:.0f} ms (x{best_m/best_l:.2f}) -> {out}")
PY
