#!/usr/bin/env bash
# Image encode time, Muser beside llama.cpp's mtmd, on one SIDExSIDE image (default 1024) with
# the synthetic projector of the real geometry (`muser synth --preset vision-glimmer --type f16`,
# ~3 GB).
# Writes the receipt docs/receipts/vision-encode-<host>-<threads>t.json (CPU) or
# docs/receipts/vision-encode-<host>-cuda.json (command, commit, machine, load, numbers).
#
# DEVICE=cpu (default): both on the CPU with THREADS threads (default: all cores).
# DEVICE=cuda: Muser's device-resident GPU encoder (`encode --device cuda --stages`: the
#   receipt also has one more encode's device time by stage, and the encoder's start with its
#   weight upload) beside libmtmd with the projector on the GPU (llama.cpp's CUDA build), and a check that the
#   GPU's embeddings equal Muser's CPU embeddings of the same image within TOL (default 1e-2)
#   of their largest |value|; the receipt puts libmtmd's GPU embeddings against the same CPU
#   embeddings beside it (llama.cpp's own GPU-to-CPU difference). The CPU encode takes a
#   minute or two; CHECK=0 skips it.
#
#   scripts/vision-bench.sh                 # every core, 3 encodes each
#   THREADS=2 REPEAT=2 scripts/vision-bench.sh
#   LLAMA_BIN=DIR MUSER_BIN=FILE ENCODE_BIN=FILE VOCAB=FILE scripts/vision-bench.sh
#
# LLAMA_BIN: a llama.cpp bin directory with libmtmd (default: scripts/comparator.sh builds
# llama-mtmd-cli; LLAMA_CUDA=1 is set for DEVICE=cuda). MUSER_BIN, ENCODE_BIN: prebuilt `muser`
# and muser-vision's `encode` example (built with `--features cuda` for DEVICE=cuda); default:
# cargo builds them. VOCAB: a vocabulary-only file of the muse-glimmer-30b preset (default:
# synthesized from SmolLM2 in $MUSER_MODELS). LLAMA_RESULT: the JSON line of an earlier libmtmd
# run of the same projector, image, threads and device (its embeddings in $VISION_BENCH_DIR/
# llama.f32), taken instead of running libmtmd again (the comparator's side does not change
# between Muser commits; on two shared cores it takes tens of minutes at 1024). MUSER_RESULT:
# the same for Muser's encode (`encode ... --out $VISION_BENCH_DIR/muser.f32`'s JSON line), so
# that on two shared cores both engines can run at the same time under the same load.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
device="${DEVICE:-cpu}"
case "$device" in cpu|cuda) ;; *) echo "vision-bench: DEVICE must be cpu or cuda" >&2; exit 2;; esac
threads="${THREADS:-$(nproc)}"
repeat="${REPEAT:-3}"
side="${SIDE:-1024}"
preset="${PRESET:-vision-glimmer}"
tol="${TOL:-1e-2}"
cuda_build=0; [ "$device" = cuda ] && cuda_build=1
[ "$device" = cuda ] && export PATH=/usr/local/cuda/bin:$PATH
bin="${LLAMA_BIN:-$(LLAMA_CUDA=$cuda_build LLAMA_TARGETS=llama-mtmd-cli "$root/scripts/comparator.sh" | tail -n1)}"
bin=$(cd "$bin" && pwd)
src=$(cd "$bin/../.." && pwd)
models="${MUSER_MODELS:-$HOME/.cache/muser/models}"
work="${VISION_BENCH_DIR:-$(mktemp -d)}"
mkdir -p "$work"

cc -O2 -o "$work/mtmd_golden" "$root/scripts/vision/mtmd_golden.c" \
  -I"$src/include" -I"$src/ggml/include" -I"$src/tools/mtmd" -L"$bin" -lmtmd -lllama -lggml-base -Wl,-rpath,"$bin"
encode="${ENCODE_BIN:-}"
if [ -z "$encode" ]; then
  features=""; [ "$device" = cuda ] && features="--features cuda"
  # shellcheck disable=SC2086
  (cd "$root" && cargo build --release -q -p muser-vision $features --example encode)
  encode="${CARGO_TARGET_DIR:-$root/target}/release/examples/encode"
fi
muser="${MUSER_BIN:-}"
if [ -z "$muser" ]; then
  (cd "$root" && cargo build --release -q -p muser-cli)
  muser="${CARGO_TARGET_DIR:-$root/target}/release/muser"
fi
text=$(case "$preset" in vision-glimmer) echo muse-glimmer-30b ;; *) echo tiny ;; esac)
width=$(case "$preset" in vision-glimmer) echo 6656 ;; *) echo 256 ;; esac)
[ -f "$work/$preset.gguf" ] || "$muser" synth --preset "$preset" --type f16 --seed 7 -o "$work/$preset.gguf"
# the text model only gives mtmd its width: a vocabulary-only file of that preset
vocab="${VOCAB:-$work/$text-vocab.gguf}"
[ -f "$vocab" ] || "$muser" synth --preset "$text" --vocab-only --seed 7 \
  --vocab-from "$models/SmolLM2-135M-Instruct.Q4_1.gguf" -o "$vocab"
img="$work/bench-$side.png"
python3 "$root/scripts/vision/images.py" --bench "$img" "$side"

gpu=0; [ "$device" = cuda ] && gpu=1
load_before=${LOAD_BEFORE:-$(cut -d' ' -f1-3 /proc/loadavg)}  # LOAD_*: those of the *_RESULT runs
if [ -n "${LLAMA_RESULT:-}" ]; then
  llama=$(cat "$LLAMA_RESULT")
else
  llama=$(OMP_WAIT_POLICY=passive "$work/mtmd_golden" "$vocab" "$work/$preset.gguf" \
    "$img" "$work/llama.f32" --threads "$threads" --n-predict 0 --repeat "$repeat" \
    --vocab-only 1 --width "$width" --gpu "$gpu")
fi
if [ -n "${MUSER_RESULT:-}" ]; then
  ours=$(cat "$MUSER_RESULT")
else
  stages=""; [ "$device" = cuda ] && stages=--stages
  ours=$("$encode" "$work/$preset.gguf" "$img" --threads "$threads" --repeat "$repeat" \
    --device "$device" --out "$work/muser.f32" $stages)
fi
check="{}"
if [ "$device" = cuda ] && [ "${CHECK:-1}" = 1 ]; then
  check=$("$encode" "$work/$preset.gguf" "$img" --threads "$threads" --repeat 1 \
    --device cpu --out "$work/muser-cpu.f32")
fi
load_after=${LOAD_AFTER:-$(cut -d' ' -f1-3 /proc/loadavg)}
host=$(hostname -s)
suffix="${threads}t"; [ "$device" = cuda ] && suffix=cuda
[ "$side" = 1024 ] || suffix="$suffix-$side"
out="$root/docs/receipts/vision-encode-$host-$suffix.json"
python3 - "$llama" "$ours" "$check" "$out" "$work" <<PY
import json, platform, subprocess, sys, datetime, struct
llama, ours, check, out, work = sys.argv[1:6]
device, threads, repeat, preset, tol, side = "$device", int("$threads"), int("$repeat"), "$preset", float("$tol"), int("$side")
l = json.loads(llama); m = json.loads(ours); c = json.loads(check)
img = next(ch["image"] for ch in l["chunks"] if "image" in ch)
cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), platform.machine())
def f32(name):
    raw = open(f"{work}/{name}", "rb").read()
    return struct.unpack(f"<{len(raw) // 4}f", raw)
def diff(a, b):
    assert len(a) == len(b), f"{len(a)} values against {len(b)}"
    peak = max(abs(v) for v in b)
    return {"max_abs_diff": max(abs(x - y) for x, y in zip(a, b)), "max_abs_value": peak}
best_l, best_m = min(img["encode_ms"]), min(m["encode_ms"])
machine = {"cpu": cpu, "threads": threads,
           "loadavg_1_5_15_before": "$load_before", "loadavg_1_5_15_after": "$load_after"}
if device == "cuda":
    machine["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip()
doc = {
    "command": ("LLAMA_RESULT=$(basename "${LLAMA_RESULT:-}") " if "${LLAMA_RESULT:-}" else "")
               + ("MUSER_RESULT=$(basename "${MUSER_RESULT:-}") " if "${MUSER_RESULT:-}" else "")
               + f"DEVICE={device} THREADS={threads} REPEAT={repeat} PRESET={preset} SIDE={side} scripts/vision-bench.sh",
    "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "machine": machine,
    "device": device,
    "image": f"{side}x{side} RGB PNG (scripts/vision/images.py --bench FILE {side})",
    "projector": f"muser synth --preset {preset} --type f16 --seed 7",
    "tokens": img["n_tokens"],
    "llama_cpp_mtmd": {"encode_ms": img["encode_ms"], "clip_flash_attn": l["clip_flash_attn"], "gpu": device == "cuda"},
    "muser": {k: m[k] for k in ("encode_ms", "preprocess_ms", "load_ms", "stages_ms") if k in m},
    "muser_vs_llama_cpp": diff(f32("muser.f32"), f32("llama.f32")),
    "ratio_muser_over_llama_best": best_m / best_l,
}
verdict = ""
if c:
    d = diff(f32("muser.f32"), f32("muser-cpu.f32"))
    d["tolerance_of_max"] = tol
    d["ok"] = d["max_abs_diff"] <= tol * d["max_abs_value"]
    d["cpu_encode_ms"] = c["encode_ms"]
    doc["gpu_vs_cpu"] = d
    doc["llama_cpp_gpu_vs_muser_cpu"] = diff(f32("llama.f32"), f32("muser-cpu.f32"))
    verdict = f"; GPU vs CPU max |d| {d['max_abs_diff']:.3g} of {d['max_abs_value']:.3g}: {'ok' if d['ok'] else 'FAILED'}"
json.dump(doc, open(out, "w"), indent=1)
if "stages_ms" in m:
    print(f"muser encode by stage (each step waited for): {m['stages_ms']}; start with weight upload {m['load_ms']:.0f} ms")
print(f"vision-bench ({device}): {img['n_tokens']} tokens; llama.cpp {best_l:.0f} ms, muser {best_m:.0f} ms "
      f"(x{best_m/best_l:.2f}){verdict} -> {out}")
if c and not doc["gpu_vs_cpu"]["ok"]:
    sys.exit(1)
PY
