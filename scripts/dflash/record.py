#!/usr/bin/env python3
"""Record the comparator's DFlash drafts (scripts/dflash-goldens.sh runs this).

    record.py TARGET.gguf DRAFTER.gguf --llama-server BIN --out FILE.json --meta JSON

Starts llama-server with the drafter (`-md`, `--spec-type draft-dflash`) and its debug log on,
posts each prompt of PROMPTS to `POST /completion` (greedy, `cache_prompt` false), and reads
from the log what the draft-dflash path proposed at every step (the top candidate of each
block position, `draft candidate   0` lines of common/speculative.cpp). Writes, per prompt, the
prompt's token ids, the generated ids and the list of drafts. Python standard library only.
"""
import argparse, json, os, re, sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from serve_util import free_port, post, server  # noqa: E402

N_PREDICT = 12
N_DRAFT = 4
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea,",
]
CAND = re.compile(r"draft candidate +0, pos +(\d+): +(\d+) ")


def drafts(log_text):
    """The drafts of each step: runs of `pos 0, 1, ...` top candidates."""
    steps = []
    for m in CAND.finditer(log_text):
        pos, tok = int(m.group(1)), int(m.group(2))
        if pos == 0:
            steps.append([])
        steps[-1].append(tok)
    return steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("drafter")
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--meta", required=True)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    port = free_port()
    log_path = a.out + ".log"
    cmd = [a.llama_server, "-m", a.target, "-md", a.drafter, "--spec-type", "draft-dflash",
           "--spec-draft-n-max", str(N_DRAFT), "-c", "1024", "-np", "1", "-t", str(a.threads),
           "--host", "127.0.0.1", "--port", str(port), "-v", "--no-webui"]
    cases = []
    with open(log_path, "w") as log, server("llama-server", cmd, port, log):
        for prompt in PROMPTS:
            start = os.path.getsize(log_path)
            ids = post(port, "/tokenize", {"content": prompt, "add_special": True})["tokens"]
            out = post(port, "/completion", {"prompt": ids, "n_predict": N_PREDICT, "temperature": 0,
                                             "cache_prompt": False, "return_tokens": True})
            log.flush()
            with open(log_path) as f:
                f.seek(start)
                steps = drafts(f.read())
            cases.append({"prompt": prompt, "prompt_ids": ids, "output_ids": out["tokens"],
                          "drafts": steps})
    golden = {"meta": json.loads(a.meta), "n_draft": N_DRAFT, "n_predict": N_PREDICT, "cases": cases}
    with open(a.out, "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")
    os.remove(log_path)
    print(f"dflash goldens: {a.out} ({len(cases)} prompts, "
          f"{sum(len(c['drafts']) for c in cases)} drafting steps)", file=sys.stderr)


if __name__ == "__main__":
    main()
