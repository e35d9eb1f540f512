#!/usr/bin/env bash
# llama.cpp b11434's two benchmark tools beside `muser bench` on this machine's CPU, one after
# the other on SmolLM2-135M-Instruct Q4_1, with the same sizes:
#   llama-bench -p $PP -n $TG -d $DEPTH -r $REPS      and  muser bench (the same lists)
#   llama-batched-bench -npp $NPP -ntg $NTG -npl $NPL  and  muser bench --batched (the same)
# Both take $THREADS threads (default 2), llama.cpp without weight repacking (`--repack 0`,
# `--no-repack`: the layout Muser computes in) and flash attention on (both tools' default on
# the CPU, as Muser's). One receipt, docs/receipts/cpu-batched-STAMP.json (command, commit,
# machine and its load average, the four tools' rows), and a table of ratios at the end.
#
#   scripts/bench-batched.sh
#   NPL=1,2,4,8,16,32 NPP=128 NTG=128 scripts/bench-batched.sh
#   LLAMA_BIN=DIR scripts/bench-batched.sh      # an existing llama.cpp build's bin directory
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin="${LLAMA_BIN:-$(LLAMA_TARGETS="llama-bench llama-batched-bench" "$root/scripts/comparator.sh" | tail -n1)}"
models="${MUSER_MODELS:-$HOME/.cache/muser/models}"
model="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
receipts="$root/docs/receipts"
target="${CARGO_TARGET_DIR:-$root/target}"
threads=${THREADS:-2} reps=${REPS:-3}
pp=${PP:-128,256} tg=${TG:-32} depth=${DEPTH:-0,512}
npp=${NPP:-64} ntg=${NTG:-32} npl=${NPL:-1,2,4,8,16}
mkdir -p "$receipts"
(cd "$root" && cargo build --release -q -p muser-cli)
muser="$target/release/muser"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
load_start=$(cat /proc/loadavg)

echo "== llama-bench" >&2
LD_LIBRARY_PATH="$bin" "$bin/llama-bench" -m "$model" -r "$reps" --repack 0 -t "$threads" \
  -p "$pp" -n "$tg" -d "$depth" -o json > "$work/llama-bench.json"
echo "== muser bench" >&2
"$muser" bench -m "$model" -r "$reps" -t "$threads" -p "$pp" -n "$tg" -d "$depth" \
  --numerics host -o json --receipt "$work/muser-bench.json" > /dev/null
# n_kv_max: every row's sequences fit (llama.cpp splits it evenly between the sequences)
maxpl=$(tr , '\n' <<< "$npl" | sort -n | tail -n1)
maxpp=$(tr , '\n' <<< "$npp" | sort -n | tail -n1)
maxtg=$(tr , '\n' <<< "$ntg" | sort -n | tail -n1)
ctx=$((maxpl * (maxpp + maxtg)))
echo "== llama-batched-bench" >&2
LD_LIBRARY_PATH="$bin" "$bin/llama-batched-bench" -m "$model" -t "$threads" --no-repack \
  -c "$ctx" -b 2048 -ub 512 -npp "$npp" -ntg "$ntg" -npl "$npl" --output-format jsonl 2>&1 \
  | grep '^{' > "$work/llama-batched-bench.jsonl"
echo "== muser bench --batched" >&2
"$muser" bench -m "$model" -t "$threads" --numerics host --batched -npp "$npp" -ntg "$ntg" \
  -npl "$npl" -o jsonl --receipt "$work/muser-batched.json" > /dev/null

stamp=$(date -u +%Y%m%dT%H%M%SZ)
command="THREADS=$threads REPS=$reps PP=$pp TG=$tg DEPTH=$depth NPP=$npp NTG=$ntg NPL=$npl scripts/bench-batched.sh"
python3 - "$work" "$receipts/cpu-batched-$stamp.json" "$load_start" "$(cat /proc/loadavg)" \
  "$(cd "$root" && git rev-parse HEAD)" "$models/" "$root/" "$command" <<'PY'
import json, sys
work, path, load_start, load_end, commit, models, root, command = sys.argv[1:9]
def load(name):
    return json.load(open(f"{work}/{name}"))
lb = load("llama-bench.json")
mb = load("muser-bench.json")
lbb = [json.loads(l) for l in open(f"{work}/llama-batched-bench.jsonl")]
mbb = load("muser-batched.json")
receipt = {
    "tool": "scripts/bench-batched.sh",
    "command": command,
    "git_commit": commit,
    "machine": dict(mb["machine"], load_average_at_start=load_start, load_average_at_end=load_end,
                    note="may be shared: the load averages say how busy the machine was; the "
                         "tools ran one after the other"),
    "model": mb["model"],
    "llama_bench": lb,
    "muser_bench": mb,
    "llama_batched_bench": lbb,
    "muser_bench_batched": mbb,
}
# Receipts name no machine paths.
text = json.dumps(receipt, indent=1).replace(models, "$MUSER_MODELS/").replace(root, "")
text = text.replace(work + "/", "")
open(path, "w").write(text + "\n")

def name(r):
    t = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else (f"tg{r['n_gen']}" if r["n_prompt"] == 0
                                                     else f"pp{r['n_prompt']}+tg{r['n_gen']}")
    return t + (f" @ d{r['n_depth']}" if r.get("n_depth") else "")
ref = {name(r): r for r in lb}
print("| test | llama-bench t/s | muser bench t/s | muser / llama.cpp |")
print("| --- | ---: | ---: | ---: |")
for r in mb["results"]:
    a = ref.get(r["test"])
    if a:
        print(f"| {r['test']} | {a['avg_ts']:.1f} ± {a['stddev_ts']:.1f} | "
              f"{r['avg_ts']:.1f} ± {r['stddev_ts']:.1f} | {r['avg_ts'] / a['avg_ts']:.2f}x |")
print()
ref = {(r["pp"], r["tg"], r["pl"]): r for r in lbb}
print("| PP | TG | B | llama S_PP | muser S_PP | ratio | llama S_TG | muser S_TG | ratio | llama S | muser S | ratio |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for r in mbb["results"]:
    a = ref.get((r["pp"], r["tg"], r["pl"]))
    if not a or "speed" not in r:
        print(f"| {r['pp']} | {r['tg']} | {r['pl']} | {r.get('error') or r.get('unsupported')} |")
        continue
    cells = []
    for k in ("speed_pp", "speed_tg", "speed"):
        cells += [f"{a[k]:.1f}", f"{r[k]:.1f}", f"{r[k] / a[k]:.2f}x"]
    print(f"| {r['pp']} | {r['tg']} | {r['pl']} | " + " | ".join(cells) + " |")
print(f"\nreceipt: {path}", file=sys.stderr)
PY
