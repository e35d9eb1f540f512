#!/usr/bin/env bash
# Server benchmark beside llama-server (llama.cpp b11434, --no-repack), same model, same machine,
# same run: aggregate generation tok/s at 1, 4 and 8 concurrent streams and time to first token,
# plus a check that greedy completions over HTTP are equal on the same prompts.
# Writes docs/receipts/server-bench.json and prints a markdown table.
# Usage: scripts/bench-server.sh [N_PREDICT (default 128)]
set -euo pipefail
cd "$(dirname "$0")/.."
n_predict="${1:-128}"
cache="${MUSER_CACHE:-$HOME/.cache/muser}"
models="${MUSER_MODELS:-$(scripts/fetch-models.sh)}"
model="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
llama_bin="$cache/llama.cpp-11434/build-cpu/bin"
[ -x "$llama_bin/llama-server" ] || { echo "bench-server: no llama-server in $llama_bin (scripts/comparator.sh)" >&2; exit 1; }
# A comparator built with AVX-VNNI dies with SIGILL on hosts without it (AVX512-VNNI only):
# load the ggml-cpu built without it first when this CPU lacks avx_vnni.
libs="$llama_bin"
if ! grep -qw avx_vnni /proc/cpuinfo && [ -d "$llama_bin/../../build-cpu-novnni/bin" ]; then
  libs="$(cd "$llama_bin/../../build-cpu-novnni/bin" && pwd):$llama_bin"
fi
python="$cache/venv-clients/bin/python"
[ -x "$python" ] || { echo "bench-server: run scripts/test-clients.sh once to create the client venv" >&2; exit 1; }

cargo build --release --locked -q -p muser-cli >&2
muser="${CARGO_TARGET_DIR:-target}/release/muser"
threads=$(nproc)
slots=8
ctx=2048
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
p_muser=$(free_port); p_llama=$(free_port)
work=$(mktemp -d)
"$muser" up --model "$model" --port "$p_muser" --slots "$slots" -c $((slots * ctx)) -t "$threads" >"$work/muser.out" 2>"$work/muser.err" &
pid_muser=$!
LD_LIBRARY_PATH="$libs" "$llama_bin/llama-server" -m "$model" --host 127.0.0.1 --port "$p_llama" \
  -np "$slots" -c $((slots * ctx)) -t "$threads" --no-repack --no-webui >"$work/llama.out" 2>"$work/llama.err" &
pid_llama=$!
trap 'kill $pid_muser $pid_llama 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

"$python" - "$p_muser" "$p_llama" "$n_predict" "$model" "$threads" "$slots" "$ctx" <<'PY'
import json, os, platform, statistics, subprocess, sys, threading, time
import requests

p_muser, p_llama, n_predict, model, threads, slots, ctx = sys.argv[1:]
n_predict, threads, slots, ctx = int(n_predict), int(threads), int(slots), int(ctx)
servers = {"muser": f"http://127.0.0.1:{p_muser}", "llama-server": f"http://127.0.0.1:{p_llama}"}

def wait_ready(url):
    for _ in range(600):
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    sys.exit(f"bench-server: {url} not ready")

for url in servers.values():
    wait_ready(url)

TOPICS = ["the sea", "a mountain", "computers", "music", "a city at night", "rain", "bread", "trains",
          "the moon", "a library", "coffee", "winter", "birds", "a bridge", "gardens", "clocks"]

def prompt(i):
    return f"Write a short story about {TOPICS[i % len(TOPICS)]}. Once upon a time"

def stream_one(url, i):
    body = {"prompt": prompt(i), "n_predict": n_predict, "temperature": 0, "stream": True,
            "ignore_eos": True, "cache_prompt": False}
    t0 = time.perf_counter()
    ttft, n = None, 0
    with requests.post(f"{url}/completion", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            ev = json.loads(line[6:])
            if ev.get("content") and ttft is None:
                ttft = time.perf_counter() - t0
            if ev.get("stop"):
                n = ev.get("tokens_predicted") or ev.get("timings", {}).get("predicted_n", 0)
    return ttft, n

def round_trip(url, conc, per_stream=2):
    ttfts, counts = [], []
    lock = threading.Lock()
    def worker(k):
        for j in range(per_stream):
            ttft, n = stream_one(url, k * per_stream + j)
            with lock:
                ttfts.append(ttft)
                counts.append(n)
    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(conc)]
    for t in ts: t.start()
    for t in ts: t.join()
    wall = time.perf_counter() - t0
    return {"concurrency": conc, "requests": len(counts), "tokens": sum(counts), "wall_s": round(wall, 3),
            "tok_s": round(sum(counts) / wall, 2), "ttft_ms_median": round(statistics.median(ttfts) * 1e3, 1)}

results = {name: [] for name in servers}
for name, url in servers.items():
    stream_one(url, 99)  # warm-up
for conc in (1, 4, 8):
    for name, url in servers.items():  # interleaved, same run
        results[name].append(round_trip(url, conc))

def greedy(url, i):
    body = {"prompt": prompt(i), "n_predict": 32, "temperature": 0, "cache_prompt": False}
    return requests.post(f"{url}/completion", json=body, timeout=600).json()["content"]

equal, mismatches = 0, []
for i in range(16):
    a, b = greedy(servers["muser"], i), greedy(servers["llama-server"], i)
    if a == b:
        equal += 1
    else:
        mismatches.append({"prompt": prompt(i), "muser": a, "llama-server": b})

commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
receipt = {
    "bench": "server", "command": f"scripts/bench-server.sh {n_predict}", "commit": commit,
    "machine": {"cpu": cpu, "cores": os.cpu_count()}, "model": os.path.basename(model),
    "settings": {"slots": slots, "ctx_per_slot": ctx, "threads": threads, "n_predict": n_predict,
                 "endpoint": "/completion stream, temperature 0, ignore_eos", "llama_server_flags": "--no-repack"},
    "results": results,
    "greedy_equal": {"equal": equal, "total": 16, "n_predict": 32, "mismatches": mismatches},
}
os.makedirs("docs/receipts", exist_ok=True)
with open("docs/receipts/server-bench.json", "w") as f:
    json.dump(receipt, f, indent=2)
print("| streams | muser tok/s | llama-server tok/s | ratio | muser TTFT ms | llama-server TTFT ms |")
print("|---:|---:|---:|---:|---:|---:|")
for m, l in zip(results["muser"], results["llama-server"]):
    print(f"| {m['concurrency']} | {m['tok_s']} | {l['tok_s']} | {m['tok_s'] / l['tok_s']:.2f} | "
          f"{m['ttft_ms_median']} | {l['ttft_ms_median']} |")
print(f"greedy completions equal: {equal}/16")
PY
