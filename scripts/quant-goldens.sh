#!/usr/bin/env bash
# Regenerates crates/muser-quant/tests/data from the comparator (llama.cpp b11434):
# builds scripts/quant/goldens.c against its headers and libggml-base/libggml-cpu, runs it, and
# cross-checks the dequantization goldens with the comparator's gguf-py (numpy).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
src="${LLAMA_CPP_DIR:-$HOME/.cache/muser/llama.cpp-11434}"
bin="$src/build-cpu/bin"
out="$root/crates/muser-quant/tests/data"
for lib in libggml-base.so libggml-cpu.so; do
    [ -f "$bin/$lib" ] || { echo "missing $bin/$lib: build the comparator first (scripts/comparator.sh)" >&2; exit 1; }
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
. "$root/scripts/quant/ggml-x86.sh"
cc -O2 -std=c11 -o "$work/goldens" "$root/scripts/quant/goldens.c" "$work/x86_quants.o" \
    -I"$src/ggml/include" -L"$bin" -lggml-base -lggml-cpu -lm -Wl,-rpath,"$bin"
mkdir -p "$out"
rm -f "$out"/*.bin "$out"/*.f32
"$work/goldens" "$out"
python3 -c 'import numpy' 2>/dev/null || python3 -m pip install --quiet numpy
PYTHONPATH="$src/gguf-py" python3 "$root/scripts/quant/check_gguf_py.py" "$out"
du -sh "$out"
