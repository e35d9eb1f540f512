#!/usr/bin/env bash
# Cross-check `muser synth` and `muser inspect` against llama.cpp b11434 (the comparator):
#  - gguf-py (the comparator's own Python reader) reads every synthesized file and agrees with
#    `muser inspect` on the tensor table (name, type, dims, bytes), the geometry keys, the
#    tokenizer size and the parameter count; it dequantizes every matrix and checks the values
#    are finite with the expected spread;
#  - llama-bench loads each file, runs pp8/tg4 and reports the same parameter count;
#  - files with a vocabulary (--vocab-from SmolLM2) generate text with llama-completion.
# Models: tiny in every --type, tiny-array (bool-array pattern), bench-310m (no tokenizer).
# The 30B preset is not written here (80 GB); its parameter count is a unit test.
#   scripts/check-synth.sh
# Env: LLAMA_BIN (comparator bin dir, default scripts/comparator.sh), COMPARATOR_LIB_DIR
# (libraries to load first, e.g. a ggml-cpu built without AVX-VNNI on hosts that lack it;
# picked automatically from build-cpu-novnni when this CPU has no AVX-VNNI), MUSER (binary).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin="${LLAMA_BIN:-$(LLAMA_TARGETS="llama-bench llama-completion" "$root/scripts/comparator.sh" | tail -n1)}"
tree=$(cd "$bin/../.." && pwd)
lib="${COMPARATOR_LIB_DIR:-}"
if [ -z "$lib" ] && ! grep -qw avx_vnni /proc/cpuinfo && [ -f "$tree/build-cpu-novnni/bin/libggml-cpu.so" ]; then
  lib="$tree/build-cpu-novnni/bin"
fi
export LD_LIBRARY_PATH="${lib:+$lib:}$bin"
donor="${MUSER_MODELS:-$("$root/scripts/fetch-models.sh")}/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -z "${MUSER:-}" ]; then
  (cd "$root" && cargo build -q --release -p muser-cli)
  MUSER="${CARGO_TARGET_DIR:-$root/target}/release/muser"
fi
python3 -c 'import numpy, yaml' 2>/dev/null || python3 -m pip install -q numpy pyyaml >&2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# gguf-py's view of FILE against REPORT (`muser inspect FILE`). Prints the parameter count.
compare_py() {
  PYTHONPATH="$tree/gguf-py" python3 - "$1" "$2" <<'PY'
import re, sys
import numpy as np
import gguf
from gguf.quants import dequantize

path = sys.argv[1]
text = open(sys.argv[2]).read()
r = gguf.GGUFReader(path)
fail = []

rows = {}
for line in text.split("\ntensors")[1].split("\nby type")[0].splitlines()[2:]:
    m = re.match(r"\s+(\S+)\s+(\S+)\s+\[([\d, ]*)\]\s+([\d,]+)$", line)
    if m:
        rows[m[1]] = (m[2].lower(), [int(x) for x in m[3].split(",") if x.strip()], int(m[4].replace(",", "")))
if len(rows) != len(r.tensors):
    fail.append(f"tensor count: muser {len(rows)}, gguf-py {len(r.tensors)}")
params = 0
for t in r.tensors:
    params += int(t.n_elements)
    want = (t.tensor_type.name.lower(), [int(x) for x in t.shape], int(t.n_bytes))
    if rows.get(t.name) != want:
        fail.append(f"{t.name}: muser {rows.get(t.name)}, gguf-py {want}")
    if len(t.shape) == 2:
        v = dequantize(t.data, t.tensor_type).astype(np.float64)
        std, target = v.std(), (1.0 if t.name == "token_embd.weight" else (4.0 if t.name == "output.weight" else 1.0) / np.sqrt(int(t.shape[0])))
        if not np.isfinite(v).all() or not (0.5 * target < std < 1.5 * target):
            fail.append(f"{t.name}: std {std:.4g}, expected about {target:.4g}")
if f"parameters    {params:,}" not in text:
    fail.append(f"parameters: gguf-py {params:,} not in muser's report")

arch = r.fields["general.architecture"].contents()
geometry = dict(re.findall(r"^  (\S+)\s+(.+)$", text.split("\ngeometry\n")[1].split("\n\n")[0], re.M))
for key, field in r.fields.items():
    if not key.startswith(arch + "."):
        continue
    short, value = key[len(arch) + 1:], field.contents()
    got = geometry.get(short)
    if isinstance(value, list):
        ok = got == "[" + "".join("T" if x else "F" for x in value) + "] (bool)"
    elif isinstance(value, float):
        ok = got is not None and abs(float(got) - value) <= 1e-6 * abs(value)
    else:
        ok = got == str(value)
    if not ok:
        fail.append(f"{key}: muser {got!r}, gguf-py {value!r}")
if "tokenizer.ggml.tokens" in r.fields:
    n = len(r.fields["tokenizer.ggml.tokens"].data)
    if f", {n} tokens," not in text:
        fail.append(f"tokenizer: gguf-py has {n} tokens")
if fail:
    print("\n".join(fail), file=sys.stderr)
    sys.exit(1)
print(params)
PY
}

fails=0
report() { printf '%-26s %-8s %s\n' "$1" "$2" "$3"; [ "$2" = ok ] || fails=$((fails + 1)); }

check() {  # NAME PRESET TYPE [--vocab-from FILE]
  local name=$1 preset=$2 ty=$3; shift 3
  local f="$work/$name.gguf"
  "$MUSER" synth --preset "$preset" --type "$ty" --seed 7 -o "$f" "$@" 2>/dev/null
  "$MUSER" inspect "$f" > "$work/$name.txt"
  local params
  if ! params=$(compare_py "$f" "$work/$name.txt" 2> "$work/$name.py.err"); then
    report "$name" FAIL "gguf-py disagrees: $(head -c 300 "$work/$name.py.err")"; return
  fi
  local bench
  if ! bench=$("$bin/llama-bench" -m "$f" -p 8 -n 4 -r 1 -t 2 --repack 0 -o json 2> "$work/$name.bench.err"); then
    report "$name" FAIL "llama-bench failed: $(tail -c 300 "$work/$name.bench.err")"; return
  fi
  local lparams
  lparams=$(python3 -c 'import json,sys; d=json.load(sys.stdin); print(d[0]["model_n_params"])' <<< "$bench")
  if [ "$lparams" != "$params" ]; then
    report "$name" FAIL "params: muser $params, llama-bench $lparams"; return
  fi
  local text="(no vocabulary)"
  if [ $# -gt 0 ]; then
    if ! text=$("$bin/llama-completion" -m "$f" -p "The quick brown fox" -n 12 --temp 0 -t 2 \
        --no-repack -no-cnv --ignore-eos --no-warmup 2> "$work/$name.gen.err"); then
      report "$name" FAIL "llama-completion failed: $(tail -c 300 "$work/$name.gen.err")"; return
    fi
    text=${text#The quick brown fox}
    if [ -z "${text//[[:space:]]/}" ]; then
      report "$name" FAIL "llama-completion generated nothing (NaN logits?)"; return
    fi
  fi
  report "$name" ok "params $params = llama-bench; gguf-py agrees; generated: $(tr '\n' ' ' <<< "$text" | head -c 50)"
}

for ty in f32 f16 q8_0 q4_0 q4_k q6_k nvfp4 q4_k_m; do
  check "tiny-$ty" tiny "$ty" --vocab-from "$donor"
done
check tiny-array-q4_k_m tiny-array q4_k_m --vocab-from "$donor"
check tiny-array-nvfp4 tiny-array nvfp4
check bench-310m-q4_k bench-310m q4_k
[ "$fails" = 0 ] && echo "check-synth: all ok" || { echo "check-synth: $fails failed" >&2; exit 1; }
