# Sourced by the quant scripts: compiles ggml's x86 dot kernels (ggml-cpu/arch/x86/quants.c)
# into "$work/x86_quants.o" with the comparator's CPU flags (ANCHORS.md) minus -mavxvnni. GCC
# encodes 256-bit vpdpbusd as AVX-VNNI (VEX) when allowed, which AVX512-VNNI-only hosts lack
# (the comparator's own libggml-cpu dies with SIGILL in these kernels there); the integer
# results are the same either way. Needs $src (llama.cpp tree) and $work.
flags=(-DGGML_AVX -DGGML_AVX2 -DGGML_AVX512 -DGGML_AVX512_BF16 -DGGML_AVX512_VNNI -DGGML_BMI2
       -DGGML_F16C -DGGML_FMA -DGGML_SSE42 -D_GNU_SOURCE -O3 -std=gnu11 -msse4.2 -mf16c -mfma -mbmi2
       -mavx -mavx2 -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw -mavx512vnni -mavx512bf16)
# QUANT_ISA=avx2: ggml's kernels as its AVX2 build compiles them (no AVX512 at all).
[ "${QUANT_ISA:-avx512}" = avx2 ] && flags=(-DGGML_AVX -DGGML_AVX2 -DGGML_BMI2 -DGGML_F16C -DGGML_FMA
  -DGGML_SSE42 -D_GNU_SOURCE -O3 -std=gnu11 -msse4.2 -mf16c -mfma -mbmi2 -mavx -mavx2)
cc "${flags[@]}" -I"$src/ggml/src" -I"$src/ggml/src/ggml-cpu" -I"$src/ggml/include" \
    -c "$src/ggml/src/ggml-cpu/arch/x86/quants.c" -o "$work/x86_quants.o"
