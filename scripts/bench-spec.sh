#!/usr/bin/env bash
# Speculative decoding benchmark beside llama-server (llama.cpp b11434), same model, same
# machine, same run: greedy /completion on code-edit, summarization, RAG-style and free-text
# prompts, each server without speculation and with its n-gram drafter (muser `--spec ngram`,
# llama-server `--spec-type ngram-simple`), one slot. Reports generation tokens/s, drafted and
# accepted tokens, and checks that each server's speculative text equals its plain text.
# Writes docs/receipts/cpu-spec-ngram-<UTC time>.json and prints a markdown table.
# Usage: scripts/bench-spec.sh [N_PREDICT (default 192)] [DRAFT_MAX (default 8)]
# Env: ENGINES="muser llama-server" (default both; `muser` alone skips the comparator),
#      THREADS (default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
n_predict="${1:-192}"
draft_max="${2:-8}"
cache="${MUSER_CACHE:-$HOME/.cache/muser}"
models="${MUSER_MODELS:-$(scripts/fetch-models.sh)}"
model="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
llama_bin="${LLAMA_BIN:-$cache/llama.cpp-11434/build-cpu/bin}"
[ -x "$llama_bin/llama-server" ] || { echo "bench-spec: no llama-server in $llama_bin (scripts/comparator.sh)" >&2; exit 1; }
libs="$llama_bin"
if ! grep -qw avx_vnni /proc/cpuinfo && [ -d "$llama_bin/../../build-cpu-novnni/bin" ]; then
  libs="$(cd "$llama_bin/../../build-cpu-novnni/bin" && pwd):$llama_bin"
fi
python="$cache/venv-clients/bin/python"
[ -x "$python" ] || { echo "bench-spec: run scripts/test-clients.sh once to create the client venv" >&2; exit 1; }

cargo build --release --locked -q -p muser-cli >&2
muser="${CARGO_TARGET_DIR:-target}/release/muser"
threads="${THREADS:-$(nproc)}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

engines="${ENGINES:-muser llama-server}"
"$python" - "$muser" "$llama_bin/llama-server" "$libs" "$model" "$n_predict" "$draft_max" "$threads" "$work" "$engines" <<'PY'
import datetime, json, os, platform, socket, subprocess, sys, time
import requests

muser, llama, libs, model, n_predict, draft_max, threads, work, engines = sys.argv[1:]
engines = engines.split()
n_predict, draft_max, threads = int(n_predict), int(draft_max), int(threads)

CODE = """def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, email = line.strip().split(",")
            users.append({"name": name, "age": int(age), "email": email})
    return users


def adults(users):
    result = []
    for user in users:
        if user["age"] >= 18:
            result.append(user)
    return result


def emails(users):
    result = []
    for user in users:
        result.append(user["email"])
    return result
"""
ARTICLE = """The city council met on Tuesday to discuss the new bicycle lanes on Main Street. The \
lanes were built last spring after a two-year study found that most accidents on Main Street \
involved cyclists. Since the lanes opened, the number of accidents involving cyclists has fallen \
by forty percent, according to the city's transport office. Shop owners on Main Street had \
worried that the loss of parking spaces would hurt their business, but a survey by the chamber \
of commerce found that sales rose by six percent over the same period. The council voted to \
extend the bicycle lanes to Oak Avenue and River Road next year, at a cost of two million \
dollars, paid from the transport budget."""
DOCS = """[1] The Orion-7 battery lasts 14 hours of video playback and charges to 80% in 35 minutes \
with the 65 W charger.
[2] The Orion-7 weighs 1.2 kg, has a 14-inch 2880x1800 screen, and two USB-C ports that both \
support charging.
[3] The Orion-7 warranty covers two years of parts and labour; the battery is covered for one \
year or 500 charge cycles, whichever comes first."""
PROMPTS = {
    "code-edit": "Rename the variable `users` to `people` everywhere in this code and return "
                 "the whole code:\n\n" + CODE,
    "summarize": "Summarize this article in three sentences, reusing its wording:\n\n" + ARTICLE,
    "rag": "Answer using only the documents, quoting them, and cite each document you use "
           "like [1].\n\n" + DOCS + "\n\nQuestion: How long does the Orion-7 battery last, "
           "how fast does it charge, and what does the warranty cover for the battery?",
    "free-text": "Write a short story about a dragon who learns to bake bread.",
}

def chat(text):
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def start(name, cmd, env=None):
    port = free_port()
    cmd = [c.replace("PORT", str(port)) for c in cmd]
    log = open(os.path.join(work, name + ".log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(900):
        if proc.poll() is not None:
            sys.exit(f"bench-spec: {name} exited; see its log:\n" + open(log.name).read()[-2000:])
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit(f"bench-spec: {name} not ready")

def complete(url, prompt):
    body = {"prompt": chat(prompt), "n_predict": n_predict, "temperature": 0.0,
            "cache_prompt": False, "stream": False}
    r = requests.post(url + "/completion", json=body, timeout=600)
    r.raise_for_status()
    j = r.json()
    t = j["timings"]
    return {"text": j["content"], "predicted_n": t["predicted_n"],
            "predicted_ms": t["predicted_ms"],
            "tokens_per_second": t["predicted_n"] * 1e3 / max(t["predicted_ms"], 1e-9),
            "draft_n": t.get("draft_n", 0), "draft_n_accepted": t.get("draft_n_accepted", 0)}

common_muser = [muser, "up", "--model", model, "--port", "PORT", "--slots", "1", "-c", "4096",
                "-t", str(threads)]
common_llama = [llama, "-m", model, "--host", "127.0.0.1", "--port", "PORT", "-np", "1",
                "-c", "4096", "-t", str(threads), "--no-repack", "--no-webui"]
llama_env = dict(os.environ, LD_LIBRARY_PATH=libs)
configs = [
    ("muser", "plain", common_muser, None),
    ("muser", "ngram", common_muser + ["--spec", "ngram", "--draft-max", str(draft_max)], None),
    ("llama-server", "plain", common_llama, llama_env),
    ("llama-server", "ngram", common_llama + ["--spec-type", "ngram-simple",
                                              "--spec-draft-n-max", str(draft_max)], llama_env),
]
configs = [c for c in configs if c[0] in engines]
results = {}
for engine, mode, cmd, env in configs:
    proc, url = start(f"{engine}-{mode}", cmd, env)
    try:
        complete(url, "Say hi.")  # warm-up
        for name, prompt in PROMPTS.items():
            runs = [complete(url, prompt) for _ in range(2)]
            best = max(runs, key=lambda r: r["tokens_per_second"])
            results[(engine, mode, name)] = best
    finally:
        proc.terminate(); proc.wait()

rows = []
for engine in engines:
    for name in PROMPTS:
        plain, spec = results[(engine, "plain", name)], results[(engine, "ngram", name)]
        acc = spec["draft_n_accepted"] / spec["draft_n"] if spec["draft_n"] else None
        rows.append({"engine": engine, "prompt": name,
                     "plain_tps": round(plain["tokens_per_second"], 2),
                     "ngram_tps": round(spec["tokens_per_second"], 2),
                     "speedup": round(spec["tokens_per_second"] / plain["tokens_per_second"], 3),
                     "draft_n": spec["draft_n"], "draft_n_accepted": spec["draft_n_accepted"],
                     "acceptance": None if acc is None else round(acc, 3),
                     "generated": spec["predicted_n"],
                     "same_text_as_plain": spec["text"] == plain["text"]})

print(f"| engine | prompt | plain t/s | ngram t/s | speedup | drafted | accepted | same text |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['engine']} | {r['prompt']} | {r['plain_tps']} | {r['ngram_tps']} | "
          f"{r['speedup']}x | {r['draft_n']} | {r['draft_n_accepted']} | {r['same_text_as_plain']} |")

def sh(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return None
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
receipt = {
    "command": f"ENGINES='{' '.join(engines)}' scripts/bench-spec.sh {n_predict} {draft_max}",
    "commit": sh(["git", "rev-parse", "HEAD"]),
    "dirty": bool(sh(["git", "status", "--porcelain", "--untracked-files=no"])),
    "machine": {"cpu": cpu, "threads": threads, "nproc": os.cpu_count()},
    "model": os.path.basename(model),
    "n_predict": n_predict, "draft_max": draft_max,
    "comparator": "llama.cpp b11434 llama-server --spec-type ngram-simple"
                  if "llama-server" in engines else None,
    "load_average": os.getloadavg(),
    "results": rows,
}
path = f"docs/receipts/cpu-spec-ngram-{stamp}.json"
with open(path, "w") as f:
    json.dump(receipt, f, indent=1)
print(f"receipt: {path}")
PY
