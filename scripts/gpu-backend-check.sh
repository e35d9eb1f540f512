#!/usr/bin/env bash
# The per-op CUDA backend (muser-cuda's implementation of muser-model's Backend trait) against
# the CPU backend, on a GPU machine. Run from the repository root:
#   scripts/gpu-backend-check.sh [MODEL.gguf ...]
# 1. muser-backend-check: small synthetic muse-glimmer models in every weight type (exact and
#    fast precision) and the given GGUF files (exact): logits, 128 greedy tokens, KV export and
#    import, a mixed batch (see its header);
# 2. with a model given: `muser run --device cuda` against `--device cpu` (128 greedy tokens on
#    each of four prompts), and `muser up --device cuda` answering one chat completion.
# A model file too large to carry at once may come in pieces: with PARTS_SHA256 set, the first
# argument's "$1.part*" files are joined into it and checked against that digest first.
# Needs in $CARRY (default .carry/): muser-backend-check (cargo build --release -p muser-cuda
# --features cuda) and muser-cuda-cli (cargo build --release -p muser-cli --features cuda,
# renamed). Writes JSON and logs to $OUT (default gpu-out/).
set -uo pipefail
carry=${CARRY:-.carry}
out=${OUT:-gpu-out}
work=${GPU_WORK:-target/gpu-work}
mkdir -p "$out" "$work"
export MUSER_CACHE=$work/cache
if [ -n "${PARTS_SHA256:-}" ] && [ -n "${1:-}" ]; then
  cat "$1".part* >"$1" && echo "$PARTS_SHA256  $1" | sha256sum -c - >/dev/null ||
    { echo "the pieces of $1 do not join into the expected file"; exit 1; }
fi
"$carry/muser-backend-check" --synth "$work/backend-check" "$@" --json "$out/backend-check.json"
first=${1:-}
[ -n "$first" ] || exit 0
# Greedy continuations through the product binary, several prompts: cpu against cuda.
prompts=(
  "The history of the printing press begins in the fifteenth century, when"
  "def fibonacci(n):"
  "Q: What is the capital of France? A:"
  "Once upon a time, in a small village by the sea,"
)
same=0
for i in "${!prompts[@]}"; do
  for d in cuda cpu; do
    "$carry/muser-cuda-cli" run -m "$first" -p "${prompts[$i]}" -n 128 --temp 0 --device "$d" \
      >"$out/run-$d-$i.txt" 2>"$out/run-$d-$i.err"
  done
  [ "$i" = 0 ] && tail -n 2 "$out/run-cuda-0.err"
  if cmp -s "$out/run-cuda-$i.txt" "$out/run-cpu-$i.txt"; then
    same=$((same + 1))
    echo "muser run, prompt $i: 128 greedy tokens, --device cuda output equals --device cpu"
  else
    echo "muser run, prompt $i: --device cuda and --device cpu differ"
    diff <(fold -w 80 "$out/run-cpu-$i.txt") <(fold -w 80 "$out/run-cuda-$i.txt") | head -n 8
  fi
done
echo "muser run: $same of ${#prompts[@]} prompts give the same 128 greedy tokens on cuda and cpu"
"$carry/muser-cuda-cli" up -m "$first" --port 8093 --device cuda >"$out/up.log" 2>&1 &
pid=$!
for _ in $(seq 1 90); do curl -sf localhost:8093/health >/dev/null && break; sleep 1; done
curl -s localhost:8093/v1/chat/completions -H 'content-type: application/json' \
  -d '{"messages":[{"role":"user","content":"Name three colors."}],"max_tokens":32,"temperature":0}' \
  >"$out/up-chat.json"
kill "$pid"
wait "$pid" 2>/dev/null
echo "muser up --device cuda, one chat completion:"
head -c 700 "$out/up-chat.json"
echo
tail -n 2 "$out/up.log"
