#!/usr/bin/env bash
# The whole test suite: fetches the test models (cached), runs every Rust test, compiles the
# CUDA kernels with NVRTC (scripts/cuda-compile-check.sh), the GPU table script's tests, then the
# client tests, llama.cpp's server test-suite (its comparable part), then the hostile-client suite.
# Golden data under tests/golden comes from the comparator through scripts/goldens.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export MUSER_MODELS="$(scripts/fetch-models.sh)"
cargo test --workspace --release --locked
# The CUDA kernels compiled by NVRTC (no GPU needed) and muser-cuda's tests with the feature.
scripts/cuda-compile-check.sh
# The GPU run's summary table (scripts/gpu_table.py) on made-up bench outputs.
python3 scripts/test_gpu_table.py
scripts/test-clients.sh
# llama.cpp's own server test-suite: the tests llama-server passes with SmolLM2, each expected to
# pass here too but for a fixed list with reasons (scripts/test-llama-suite.sh).
scripts/test-llama-suite.sh
# Hostile clients against a live server (bounded: about a minute).
scripts/test-hostile.sh
