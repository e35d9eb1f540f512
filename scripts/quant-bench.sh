#!/usr/bin/env bash
# Benchmarks muser-quant's kernels beside ggml's (llama.cpp b11434) on this machine and writes
# the receipt docs/receipts/quant-kernels.json: builds scripts/quant/bench_ggml.c against the
# comparator, times ggml's dot kernels, then runs `cargo bench -p muser-quant --bench kernels`,
# which reads those timings (MUSER_GGML_KERNELS) and reports muser/ggml ratios.
#
#   QUANT_ISA=avx2 scripts/quant-bench.sh   # both sides as on an AVX2-only host: ggml's kernels
#       compiled without AVX512 (against LLAMA_ISA=avx2 scripts/comparator.sh's libraries),
#       Muser's dispatch capped (MUSER_ISA=avx2); receipt quant-kernels-avx2.json
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
src="${LLAMA_CPP_DIR:-$HOME/.cache/muser/llama.cpp-11434}"
bin="$src/build-cpu/bin"
if [ "${QUANT_ISA:-avx512}" = avx2 ]; then bin="$src/build-cpu-avx2/bin"; export MUSER_ISA=avx2; fi
for lib in libggml-base.so libggml-cpu.so; do
    [ -f "$bin/$lib" ] || { echo "missing $bin/$lib: build the comparator first (scripts/comparator.sh)" >&2; exit 1; }
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
. "$root/scripts/quant/ggml-x86.sh"
cc -O2 -std=c11 -o "$work/bench_ggml" "$root/scripts/quant/bench_ggml.c" "$work/x86_quants.o" \
    -I"$src/ggml/include" -L"$bin" -lggml-base -lggml-cpu -lm -Wl,-rpath,"$bin"
"$work/bench_ggml" > "$work/ggml.json"
cat "$work/ggml.json"
cd "$root"
MUSER_GGML_KERNELS="$work/ggml.json" cargo bench -p muser-quant --bench kernels
