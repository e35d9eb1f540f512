#!/usr/bin/env bash
# Regenerate muser-text's golden data (crates/muser-text/tests/golden/) from the comparator,
# llama.cpp b11434: tokenizations of a >= 200-string corpus for SmolLM2, Gemma 3 270M and three
# synthetic muse-glimmer GGUFs (built here with the comparator's gguf-py; recipe in
# scripts/text/goldens.py), and chat-template renders from llama-server's /apply-template.
# llama-server listens on 127.0.0.1 at a random high port and is stopped afterwards.
#   scripts/text-goldens.sh
# Env: MUSER_CACHE (default ~/.cache/muser), COMPARATOR_LIB_DIR (libraries to load instead of the
# build's own, e.g. a ggml-cpu built without AVX-VNNI on hosts that lack it).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache="${MUSER_CACHE:-$HOME/.cache/muser}"
bin=$(LLAMA_TARGETS="llama-tokenize llama-server" "$root/scripts/comparator.sh" | tail -n1)
tree=$(cd "$bin/../.." && pwd)
models=$("$root/scripts/fetch-models.sh" >/dev/null; echo "$cache/models")
lib="${COMPARATOR_LIB_DIR:-}"
if [ -z "$lib" ] && ! grep -qw avx_vnni /proc/cpuinfo && [ -f "$tree/build-cpu-novnni/bin/libggml-cpu.so" ]; then
  lib="$tree/build-cpu-novnni/bin"   # this host has no AVX-VNNI: use the ggml-cpu built without it
fi
venv="$cache/venv-text-goldens"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q numpy pyyaml jinja2
fi
PYTHONPATH="$tree/gguf-py" "$venv/bin/python" "$root/scripts/text/goldens.py" \
  --bin "$bin" --lib-dir "$lib" --tree "$tree" --models "$models" --out "$root/crates/muser-text/tests/golden"
