#!/usr/bin/env bash
# Speculative decoding benchmark beside llama-server (llama.cpp b11434), same model
# (SmolLM2-135M-Instruct Q4_1), same machine, same run: greedy /completion on three code edits
# (rename a variable, add a parameter, fix a bug; each "return the whole code"), a summary, a
# RAG-style answer, free text and a translation (the last two copy little: the off-switch's
# cases). Each engine runs a server without speculation and one with its n-gram drafter (muser
# `--spec ngram`, llama-server `--spec-type ngram-simple`), one slot each, one server at a time
# (two side by side differed by up to 10% with nothing drafted), alternating REPS times; the
# best run of each counts. Chat templates come from each server's /apply-template. Reports generation tokens/s,
# drafted and accepted tokens (for muser also verifications and the row cost from /props), and
# checks that each server's speculative text equals its plain text. Writes $RECEIPT_DIR/cpu-spec-ngram-<UTC time>.json and prints a markdown table.
# Usage: scripts/bench-spec.sh [N_PREDICT (default 192)] [DRAFT_MAX (default 8)]
# Env: ENGINES="muser llama-server" (default both; `muser` alone needs no comparator),
#      MUSER_MODELS (the model's directory), THREADS (default nproc), REPS (default 2), MUSER_BIN (a built muser: nothing is built), LLAMA_BIN (the directory
#      of llama-server), RECEIPT_DIR (default docs/receipts), COMMIT (where git is absent).
# Needs python3 alone (standard library).
set -euo pipefail
cd "$(dirname "$0")/.."
n_predict="${1:-192}"
draft_max="${2:-8}"
cache="${MUSER_CACHE:-$HOME/.cache/muser}"
model="${MUSER_MODELS:-$(scripts/fetch-models.sh)}/SmolLM2-135M-Instruct.Q4_1.gguf"
engines="${ENGINES:-muser llama-server}"
libs=""
llama_bin="${LLAMA_BIN:-$cache/llama.cpp-11434/build-cpu/bin}"
if [[ " $engines " == *" llama-server "* ]]; then
  [ -x "$llama_bin/llama-server" ] || { echo "bench-spec: no llama-server in $llama_bin (scripts/comparator.sh)" >&2; exit 1; }
  libs="$llama_bin"
  if ! grep -qw avx_vnni /proc/cpuinfo && [ -d "$llama_bin/../../build-cpu-novnni/bin" ]; then
    libs="$(cd "$llama_bin/../../build-cpu-novnni/bin" && pwd):$llama_bin"
  fi
fi
muser="${MUSER_BIN:-}"
if [ -z "$muser" ]; then
  cargo build --release --locked -q -p muser-cli >&2
  muser="${CARGO_TARGET_DIR:-target}/release/muser"
fi
receipts="${RECEIPT_DIR:-docs/receipts}"
mkdir -p "$receipts"
commit="${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

PYTHONUNBUFFERED=1 python3 - "$muser" "$llama_bin/llama-server" "$libs" "$model" "$n_predict" \
  "$draft_max" "${THREADS:-$(nproc)}" "${REPS:-2}" "$work" "$engines" "$receipts" "$commit" <<'PY'
import datetime, json, os, platform, socket, subprocess, sys, time, urllib.error, urllib.request

(muser, llama, libs, model, n_predict, draft_max, threads, reps, work, engines, receipts,
 commit) = sys.argv[1:]
engines = engines.split()
n_predict, draft_max, threads, reps = int(n_predict), int(draft_max), int(threads), int(reps)

USERS = """def load_users(path):
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
CONFIG = """pub fn parse_config(text: &str) -> Result<Config, ParseError> {
    let mut config = Config::default();
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .ok_or(ParseError::MissingEquals { line: number + 1 })?;
        match key.trim() {
            "name" => config.name = value.trim().to_string(),
            "port" => {
                config.port = value
                    .trim()
                    .parse()
                    .map_err(|_| ParseError::BadPort { line: number + 1 })?
            }
            other => {
                return Err(ParseError::UnknownKey {
                    line: number + 1,
                    key: other.to_string(),
                })
            }
        }
    }
    Ok(config)
}
"""
SEARCH = """def binary_search(items, target):
    \"\"\"Return the index of target in the sorted list items, or -1.\"\"\"
    low = 0
    high = len(items)
    while low <= high:
        mid = (low + high) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            low = mid
        else:
            high = mid - 1
    return -1
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
    "code-rename": "Rename the variable `users` to `people` everywhere in this code and return "
                   "the whole code:\n\n" + USERS,
    "code-param": "Add a parameter `strict: bool` to `parse_config`: when `strict` is false, "
                  "unknown keys are skipped instead of returning an error. Return the whole "
                  "function:\n\n" + CONFIG,
    "code-fix": "This function can loop forever and read past the end of the list. Fix the bugs "
                "and return the whole corrected function:\n\n" + SEARCH,
    "summarize": "Summarize this article in three sentences, reusing its wording:\n\n" + ARTICLE,
    "rag": "Answer using only the documents, quoting them, and cite each document you use "
           "like [1].\n\n" + DOCS + "\n\nQuestion: How long does the Orion-7 battery last, "
           "how fast does it charge, and what does the warranty cover for the battery?",
    "free-text": "Write a short story about a dragon who learns to bake bread.",
    "translate": "Translate into French: The morning was cold and grey. Anna took her bicycle, "
                 "rode to the market by the river and bought apples, bread and a small cheese "
                 "for her grandmother.",
}

def post(url, path, body, timeout=900):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def start(name, cmd, env=None):
    port = free_port()
    cmd = [c.replace("PORT", str(port)) for c in cmd]
    log = open(os.path.join(work, name + ".log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1500):
        if proc.poll() is not None:
            sys.exit(f"bench-spec: {name} exited; see its log:\n" + open(log.name).read()[-2000:])
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit(f"bench-spec: {name} not ready")

def spec_props(url):
    """muser's speculative counters and row cost in /props (absent on llama-server)."""
    with urllib.request.urlopen(url + "/props", timeout=30) as r:
        return json.loads(r.read()).get("speculative") or {}

def complete(url, prompt):
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0,
            "cache_prompt": False, "stream": False}
    before = spec_props(url)
    j = post(url, "/completion", body)
    after = spec_props(url)
    t = j["timings"]
    r = {"text": j["content"], "predicted_n": t["predicted_n"],
         "predicted_ms": t["predicted_ms"],
         "tokens_per_second": t["predicted_n"] * 1e3 / max(t["predicted_ms"], 1e-9),
         "draft_n": t.get("draft_n", 0), "draft_n_accepted": t.get("draft_n_accepted", 0)}
    if "verifications_total" in after:
        r["verifications"] = after["verifications_total"] - before["verifications_total"]
        r["row_cost"] = after.get("row_cost")
    return r

def commands(engine):
    if engine == "muser":
        base = [muser, "up", "--model", model, "--port", "PORT", "--slots", "1", "-c", "4096",
                "-t", str(threads)]
        return base, base + ["--spec", "ngram", "--draft-max", str(draft_max)], None
    base = [llama, "-m", model, "--host", "127.0.0.1", "--port", "PORT", "-np", "1",
            "-c", "4096", "-t", str(threads), "--no-repack", "--no-webui"]
    spec = base + ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(draft_max)]
    return base, spec, dict(os.environ, LD_LIBRARY_PATH=libs)

rows = []
for engine in engines:
    plain_cmd, spec_cmd, env = commands(engine)
    cmds = {"plain": plain_cmd, "ngram": spec_cmd}
    best, prompts = {}, {}
    for _ in range(reps):
        for mode, cmd in cmds.items():
            proc, url = start(f"{engine}-{mode}", cmd, env)
            try:
                complete(url, "Say hi.")  # warm-up
                for name, text in PROMPTS.items():
                    if name not in prompts:
                        msgs = {"messages": [{"role": "user", "content": text}]}
                        prompts[name] = post(url, "/apply-template", msgs)["prompt"]
                    r = complete(url, prompts[name])
                    b = best.get((mode, name))
                    if b is None or r["tokens_per_second"] > b["tokens_per_second"]:
                        best[(mode, name)] = r
            finally:
                proc.terminate(); proc.wait()
    for name in PROMPTS:
        p, s = best[("plain", name)], best[("ngram", name)]
        acc = s["draft_n_accepted"] / s["draft_n"] if s["draft_n"] else None
        row = {"engine": engine, "prompt": name,
               "plain_tps": round(p["tokens_per_second"], 2),
               "ngram_tps": round(s["tokens_per_second"], 2),
               "speedup": round(s["tokens_per_second"] / p["tokens_per_second"], 3),
               "draft_n": s["draft_n"], "draft_n_accepted": s["draft_n_accepted"],
               "acceptance": None if acc is None else round(acc, 3),
               "generated": s["predicted_n"],
               "same_text_as_plain": s["text"] == p["text"]}
        if "verifications" in s:
            # muser: verifications, accepted drafts per verification, and the row cost the
            # engine measured (a fraction of a decode step) when the request ended
            v = s["verifications"]
            row.update(verifications=v, row_cost=round(s["row_cost"], 3),
                       accepted_per_verification=round(s["draft_n_accepted"] / v, 2) if v else None)
        rows.append(row)
        print(f"bench-spec: {engine} {name}: {row['speedup']}x "
              f"({row['plain_tps']} -> {row['ngram_tps']} t/s, "
              f"{row['draft_n_accepted']}/{row['draft_n']} accepted)", file=sys.stderr)

print("| engine | prompt | plain t/s | ngram t/s | speedup | drafted | accepted | verifications | row cost | same text |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
for r in rows:
    print(f"| {r['engine']} | {r['prompt']} | {r['plain_tps']} | {r['ngram_tps']} | "
          f"{r['speedup']}x | {r['draft_n']} | {r['draft_n_accepted']} | "
          f"{r.get('verifications', '')} | {r.get('row_cost') or ''} | {r['same_text_as_plain']} |")

cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
           platform.processor())
stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
try:
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip() != ""
except OSError:
    dirty = None
receipt = {
    "command": f"ENGINES='{' '.join(engines)}' THREADS={threads} REPS={reps} "
               f"scripts/bench-spec.sh {n_predict} {draft_max}",
    "commit": commit,
    "dirty": dirty,
    "machine": {"cpu": cpu, "threads": threads, "nproc": os.cpu_count()},
    "model": os.path.basename(model),
    "n_predict": n_predict, "draft_max": draft_max, "reps": reps,
    "comparator": "llama.cpp b11434 llama-server --spec-type ngram-simple"
                  if "llama-server" in engines else None,
    "load_average": os.getloadavg(),
    "results": rows,
}
path = os.path.join(receipts, f"cpu-spec-ngram-{stamp}.json")
with open(path, "w") as f:
    json.dump(receipt, f, indent=1)
print(f"receipt: {path}")
PY
