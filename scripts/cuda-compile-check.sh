#!/usr/bin/env bash
# Compiles muser-cuda's kernels (kernels.cu, ops.cu and vision.cu, each after common.cuh) with NVRTC for
# sm_90 on a machine without a GPU, and checks that every kernel the Rust side loads is in the
# PTX: a syntax or name error shows here instead of on the GPU machine. scripts/test.sh runs it.
# NVRTC and the CUDA headers come from NVIDIA's Python wheels, installed once into
# ${MUSER_CACHE:-~/.cache/muser}/nvrtc (about 250 MB).
set -euo pipefail
cache=${MUSER_CACHE:-$HOME/.cache/muser}/nvrtc
if [ ! -e "$cache/nvidia/cu13/include/cuda_fp16.h" ]; then
  echo "installing NVRTC and the CUDA headers into $cache" >&2
  python3 -m pip install -q --no-deps --target "$cache" \
    nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
fi
root=$cache/nvidia/cu13
# Every unit test of muser-cuda built with the feature (layouts, tuning keys, kernel names,
# host emulations of the kernels' arithmetic), the NVRTC compilation among them.
MUSER_NVRTC_CHECK=1 CUDA_HOME=$root LD_LIBRARY_PATH=$root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
  cargo test --release --locked -p muser-cuda --features cuda --lib -- --nocapture
