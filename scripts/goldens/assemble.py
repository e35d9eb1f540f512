"""Combine golden.c outputs (one JSON object per line on stdin) into one golden file.

usage: assemble.py MODEL_FILE EXTRA_JSON  > golden.json
The file records the model's SHA-256, the context settings every case shares, and per case the
prompt ids, the greedy ids, the top-1 logits and (first case) the full first-step logits.
"""
import hashlib
import json
import sys

model, extra = sys.argv[1], json.loads(sys.argv[2])
h = hashlib.sha256()
with open(model, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
cases = [json.loads(line) for line in sys.stdin if line.strip()]
shared = ["n_ctx", "n_batch", "n_ubatch", "n_threads", "flash_attn", "type_k", "type_v", "n_vocab"]
settings = {k: cases[0][k] for k in shared}
for c in cases:
    assert {k: c[k] for k in shared} == settings, "cases differ in settings"
out = {
    "comparator": "llama.cpp b11434 libllama, scripts/goldens.sh",
    "model": extra,
    "sha256": h.hexdigest(),
    "settings": settings,
    "n_predict": len(cases[0]["tokens"]),
    "cases": [
        {k: c[k] for k in ("chunk", "prompt", "tokens", "top_logits", "first_logits") if k in c} for c in cases
    ],
}
json.dump(out, sys.stdout, separators=(",", ":"))
sys.stdout.write("\n")
