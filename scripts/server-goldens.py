#!/usr/bin/env python3
"""Record llama-server's answers for the server-level parity test (tests/clients/test_server_parity.py).

    server-goldens.py MODEL.gguf --llama-server BIN --profile x86-avx512/fa-on [--threads 2]

Starts the comparator's llama-server on MODEL with its defaults (only host, port and threads
given; flash attention on its default, auto), then for each case of CASES posts one request
(greedy: temperature 0; `cache_prompt` false) to `POST /completion` and to
`POST /v1/chat/completions`, and writes what a client sees (text, token counts, finish
reason) to tests/server-goldens/<order>-<fa>.json. The profile names the comparator build
(`LLAMA_ISA=avx2 scripts/comparator.sh` for x86-avx2; see docs/exactness.md); the test
compares `muser up` at its defaults against the goldens of the profile Muser computes.
Uses the Python standard library only.
"""
import argparse, json, os, subprocess, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_util import free_port, post, server  # noqa: E402

N_PREDICT = 32
COMPLETIONS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "List three primary colors:",
    "The history of the printing press begins in the fifteenth century, when",
]
CHATS = [
    [{"role": "user", "content": "What is the boiling point of water?"}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Name a prime number larger than 10."},
     {"role": "assistant", "content": "11 is a prime number larger than 10."},
     {"role": "user", "content": "And one larger than 100?"}],
]


def completion(port, prompt):
    out = post(port, "/completion", {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0,
                                     "cache_prompt": False})
    return {"prompt": prompt, "content": out["content"], "tokens_predicted": out["tokens_predicted"],
            "tokens_evaluated": out["tokens_evaluated"], "stop_type": out.get("stop_type")}


def chat(port, messages):
    out = post(port, "/v1/chat/completions", {"messages": messages, "max_tokens": N_PREDICT,
                                              "temperature": 0, "cache_prompt": False})
    c = out["choices"][0]
    return {"messages": messages, "content": c["message"]["content"],
            "finish_reason": c["finish_reason"], "prompt_tokens": out["usage"]["prompt_tokens"],
            "completion_tokens": out["usage"]["completion_tokens"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--profile", required=True, choices=["x86-avx512/fa-on", "x86-avx2/fa-on"])
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_path = os.path.join(root, "tests", "server-goldens", a.profile.replace("/", "-") + ".json")
    port = free_port()
    cmd = [a.llama_server, "-m", a.model, "--host", "127.0.0.1", "--port", str(port), "-t", str(a.threads)]
    os.environ["LD_LIBRARY_PATH"] = os.path.dirname(a.llama_server)  # its shared libraries
    with open(os.devnull, "w") as log:
        with server("llama-server", cmd, port, log):
            golden = {
                "profile": a.profile,
                "comparator": "llama-server b11434, default settings (flash attention auto)",
                "model": os.path.basename(a.model),
                "n_predict": N_PREDICT,
                "completion": [completion(port, p) for p in COMPLETIONS],
                "chat": [chat(port, m) for m in CHATS],
            }
    with open(out_path, "w") as f:
        json.dump(golden, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"server-goldens: {out_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
