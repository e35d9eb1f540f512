#!/usr/bin/env bash
# CPU engine throughput, Muser beside llama.cpp b11434, in one run on this machine:
# llama-bench (-r 3 --repack 0 -t 2 -p 512 -n 64; b11434 spells --no-repack that way) and `muser bench` (same sizes) on
# SmolLM2-135M-Instruct Q4_1 and the bench-310m synthetic Muse Glimmer Q4_K model.
# Receipts (JSON) land in docs/receipts/; a summary table is printed at the end.
#
#   scripts/bench-cpu.sh
#   LLAMA_BIN=DIR GGML_CPU_LIB=DIR scripts/bench-cpu.sh   # see scripts/goldens.sh about AVX-VNNI
#   BENCH_ISA=avx2 scripts/bench-cpu.sh   # an AVX2 host on any x86 machine: the comparator built
#                                         # without AVX512, Muser's dispatch capped (MUSER_ISA)
# Muser runs `--numerics host`: the order of the comparator build it is measured beside.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
isa="${BENCH_ISA:-native}"
case "$isa" in
  native) comparator="$root/scripts/comparator.sh" ;;
  avx2) comparator="env LLAMA_ISA=avx2 $root/scripts/comparator.sh"; export MUSER_ISA=avx2 ;;
  *) echo "bench-cpu: BENCH_ISA must be native or avx2" >&2; exit 2 ;;
esac
bin="${LLAMA_BIN:-$(LLAMA_TARGETS=llama-bench $comparator | tail -n1)}"
libpath="$bin"
[ -n "${GGML_CPU_LIB:-}" ] && libpath="$GGML_CPU_LIB:$bin"
models="${MUSER_MODELS:-$HOME/.cache/muser/models}"
receipts="$root/docs/receipts"
target="${CARGO_TARGET_DIR:-$root/target}"
threads=2 reps=3 pp=512 tg=64
mkdir -p "$receipts"

(cd "$root" && cargo build --release -q -p muser-cli)
muser="$target/release/muser"
bench310="$models/muse-bench-310m-q4_k.gguf"
[ -f "$bench310" ] || "$muser" synth --preset bench-310m --type q4_k --seed 42 -o "$bench310"

stamp=$isa-$(date -u +%Y%m%dT%H%M%SZ)
for m in "$models/SmolLM2-135M-Instruct.Q4_1.gguf" "$bench310"; do
  name=$(basename "$m" .gguf)
  echo "== $name: llama-bench" >&2
  LD_LIBRARY_PATH="$libpath" "$bin/llama-bench" -m "$m" -r $reps --repack 0 -t $threads -p $pp -n $tg -o json \
    > "$receipts/cpu-$stamp-$name-llama-bench.json"
  echo "== $name: muser bench" >&2
  /usr/bin/time -v "$muser" bench -m "$m" -r $reps -t $threads -p $pp -n $tg --numerics host \
    --receipt "$receipts/cpu-$stamp-$name-muser.json" 2> "$receipts/.time-$name.txt"
  grep -E "Maximum resident" "$receipts/.time-$name.txt" >&2 || true
  rm -f "$receipts/.time-$name.txt"
done

python3 - "$receipts" "$stamp" "$root/" "$models/" <<'PY'
import glob, json, os, sys
d, stamp, root, models = sys.argv[1:5]
# Receipts name no machine paths: the repository root and the model directory become relative.
for f in glob.glob(f"{d}/cpu-{stamp}-*.json"):
    text = open(f).read().replace(models, "$MUSER_MODELS/").replace(root, "")
    open(f, "w").write(text)
print("| model | test | llama.cpp t/s | muser t/s | muser / llama.cpp |")
print("| --- | --- | ---: | ---: | ---: |")
for lb in sorted(glob.glob(f"{d}/cpu-{stamp}-*-llama-bench.json")):
    name = os.path.basename(lb)[len(f"cpu-{stamp}-"):-len("-llama-bench.json")]
    ref = {}
    for r in json.load(open(lb)):
        t = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        ref[t] = (r["avg_ts"], r["stddev_ts"])
    mu = json.load(open(f"{d}/cpu-{stamp}-{name}-muser.json"))
    for r in mu["results"]:
        a, sa = ref.get(r["test"], (float("nan"), 0))
        print(f"| {name} | {r['test']} | {a:.1f} ± {sa:.1f} | {r['avg_ts']:.1f} ± {r['stddev_ts']:.1f} | {r['avg_ts'] / a:.2f} |")
    print(f"| {name} | peak RSS | | {mu['peak_rss_bytes'] / 2**20:.0f} MiB | file {mu['model']['file_bytes'] / 2**20:.0f} MiB |")
PY
