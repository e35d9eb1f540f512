#!/usr/bin/env bash
# Regenerate muser-model's parity goldens from the comparator (llama.cpp b11434's libllama).
#
# Builds scripts/goldens/golden.c against libllama, then for each model greedily decodes 128
# tokens from prompts given as token ids and records the ids and the top-1 logit of every step
# (plus every logit of the first step for one prompt per model) under
# crates/muser-model/tests/golden/. Context settings: llama.cpp's defaults (flash_attn auto,
# F16 K/V, n_batch 2048, n_ubatch 512, no weight repacking) with n_ctx 1024 and 2 threads.
#
#   scripts/goldens.sh            # SmolLM2 + synthetic muse models
#   GGML_CPU_LIB=DIR scripts/goldens.sh   # use the libggml-cpu.so in DIR (see below)
#   LLAMA_BIN=DIR scripts/goldens.sh      # comparator bin dir (default: scripts/comparator.sh)
#   GOLDEN_PROFILE=x86-avx2/fa-off scripts/goldens.sh   # another numerics profile (see
#       docs/exactness.md): x86-avx512|x86-avx2 (the comparator's build, LLAMA_ISA) and
#       fa-on|fa-off; the default x86-avx512/fa-on (flash attention auto) writes tests/golden/,
#       the others tests/golden/<order>-<fa>/. The AVX2 build runs on any x86-64 host.
#   GOLDEN_MODELS=smollm2 scripts/goldens.sh   # SmolLM2 only (skip the synthetic models)
#
# The synthetic models are not committed: they are rebuilt with `muser synth` from the preset,
# type and seed recorded in each golden, whose SHA-256 the tests check.
# On CPUs without AVX-VNNI (e.g. AMD Zen 4) a comparator built with -DGGML_AVX_VNNI=ON dies
# with SIGILL; build ggml-cpu once more without it and point GGML_CPU_LIB at that bin dir.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
profile="${GOLDEN_PROFILE:-x86-avx512/fa-on}"
case "$profile" in
  x86-avx512/fa-on) isa=avx512 fa=auto sub="" ;;
  x86-avx512/fa-off) isa=avx512 fa=off sub=x86-avx512-fa-off ;;
  x86-avx2/fa-on) isa=avx2 fa=auto sub=x86-avx2-fa-on ;;
  x86-avx2/fa-off) isa=avx2 fa=off sub=x86-avx2-fa-off ;;
  *) echo "goldens: unknown GOLDEN_PROFILE $profile" >&2; exit 2 ;;
esac
bin="${LLAMA_BIN:-$(LLAMA_ISA=$isa "$root/scripts/comparator.sh" | tail -n1)}"
src=$(cd "$bin/../.." && pwd)
out="$root/crates/muser-model/tests/golden${sub:+/$sub}"
models="${MUSER_MODELS:-$HOME/.cache/muser/models}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

cc -O2 -o "$work/golden" "$root/scripts/goldens/golden.c" -I"$src/include" -I"$src/ggml/include" \
  -L"$bin" -lllama -Wl,-rpath,"$bin"
libpath="$bin"
[ -n "${GGML_CPU_LIB:-}" ] && libpath="$GGML_CPU_LIB:$bin"
# Passive OpenMP waiting: the numbers do not depend on it, and a busy machine slows spinning.
golden() { OMP_WAIT_POLICY=passive LD_LIBRARY_PATH="$libpath" "$work/golden" "$@"; }

# One golden file: MODEL NAME EXTRA_JSON, then on stdin one case per line: "CHUNK IDS", where
# CHUNK is the prefill schedule (0 = the whole prompt in one llama_decode, N = calls of N tokens).
record() {
  local model=$1 name=$2 extra=$3 i=0
  : > "$work/cases"
  while read -r chunk ids; do
    local full=()
    [ $i = 0 ] && full=(--full-logits)
    golden "$model" --tokens "$ids" --n-predict 128 --n-ctx 1024 --threads 2 --chunk "$chunk" --flash-attn "$fa" "${full[@]}" >> "$work/cases"
    i=$((i + 1))
  done
  python3 "$root/scripts/goldens/assemble.py" "$model" "$extra" < "$work/cases" > "$out/$name.json"
  echo "goldens: $out/$name.json ($i prompts)" >&2
}

# SmolLM2-135M-Instruct Q4_1: eight prompts tokenized by llama.cpp itself.
smol="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$smol" ] || { echo "goldens: $smol is missing (run scripts/fetch-models.sh)" >&2; exit 1; }
prompts=(
  "The capital of France is"
  "Once upon a time, in a small village by the sea,"
  "def fibonacci(n):"
  "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n"
  "List three primary colors:"
  "In 1969, the first humans landed on"
  "The quick brown fox jumps over the lazy dog. The quick brown fox"
  "Translate to French: Good morning, how are you?"
  "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable metal type, oil-based inks and a wooden press adapted from those used to make wine. Within a few decades presses had spread to more than two hundred cities across Europe, and the number of books in circulation grew from thousands to millions. Scholars argue about which consequences mattered most:"
)
for p in "${prompts[@]}"; do
  echo "0 $(golden "$smol" --tokenize "$(printf '%b' "$p")" | tr -d '[] ')"
done | record "$smol" smollm2-135m-q4_1 '{"source":"file","file":"SmolLM2-135M-Instruct.Q4_1.gguf"}'

[ "${GOLDEN_MODELS:-all}" = smollm2 ] && exit 0

# Synthetic Muse Glimmer models (windows 32 and 16): prompts of 80-200 random ids, longer than
# the window, prefilled in one batch, plus the first prompt again in chunks of 20 and token by
# token (llama.cpp's numbers differ between those schedules; Muser must match each).
(cd "$root" && cargo build --release -q -p muser-model --example synth_file)
synth="${CARGO_TARGET_DIR:-$root/target}/release/examples/synth_file"
for preset in tiny tiny-array; do
  for ty in q4_k q8_0 nvfp4 f16; do
    seed=7
    m="$work/$preset-$ty.gguf"
    "$synth" "$preset" "$ty" "$seed" "$m"
    python3 "$root/scripts/goldens/prompts.py" "$m" 3 "$preset$ty" > "$work/prompts"
    { sed 's/^/0 /' "$work/prompts"; head -n1 "$work/prompts" | sed 's/^/20 /'; head -n1 "$work/prompts" | sed 's/^/1 /'; } |
      record "$m" "muse-$preset-$ty" "{\"source\":\"synth\",\"preset\":\"$preset\",\"type\":\"$ty\",\"seed\":$seed}"
  done
done
