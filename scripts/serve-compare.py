#!/usr/bin/env python3
"""`muser up` beside `llama-server` on one model file and one device, one after the other.

    serve-compare.py MODEL.gguf --muser BIN --llama-server BIN [--device cuda] [--slots 4]
                     [--ctx 4096] [--tokens 128] [--json OUT]

For each server alone: start it (muser: `up --device D --slots N -c CTX`; llama-server:
`-ngl 99 -np N -c N*CTX`, flash attention on its default), wait for /health, warm up with one
short completion, then through llama.cpp's native `POST /completion` (temperature 0,
`cache_prompt` false, `ignore_eos`, `n_predict` tokens, both servers take the same body):
- `solo`: four prompts one at a time; the decode rate is each answer's
  `timings.predicted_per_second` (the server's own clock), averaged;
- `four`: the same four at once; tokens generated over the wall time (aggregate).
Prints a table with the ratios and writes JSON. Uses the Python standard library only.
"""
import argparse, json, threading, time

from serve_util import PROMPTS, free_port, post, server


def complete(port, prompt, n):
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": False, "ignore_eos": True}
    out = post(port, "/completion", body)
    t = out.get("timings", {})
    return out.get("tokens_predicted", t.get("predicted_n", 0)), t.get("predicted_per_second")


def measure(name, cmd, port, n, log):
    with server(name, cmd, port, log):
        complete(port, "Warm up", 8)
        solo = [complete(port, p, n) for p in PROMPTS]
        got = [None] * len(PROMPTS)
        t0 = time.time()
        th = [threading.Thread(target=lambda i=i: got.__setitem__(i, complete(port, PROMPTS[i], n)))
              for i in range(len(PROMPTS))]
        for t in th:
            t.start()
        for t in th:
            t.join()
        wall = time.time() - t0
    rates = [r for _, r in solo if r]
    return {"solo_tokens": [k for k, _ in solo], "solo_tok_per_s": rates,
            "solo_mean": sum(rates) / len(rates) if rates else None,
            "four_tokens": sum(g[0] for g in got if g), "four_wall_s": wall,
            "four_aggregate": sum(g[0] for g in got if g) / wall}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--muser", required=True)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json")
    a = ap.parse_args()
    res = {}
    with open("serve-compare.log", "w") as log:
        p = free_port()
        res["muser"] = measure("muser", [a.muser, "up", "-m", a.model, "--device", a.device, "--slots",
                                         str(a.slots), "-c", str(a.slots * a.ctx), "--port", str(p)], p, a.tokens, log)
        p = free_port()
        res["llama-server"] = measure("llama-server", [a.llama_server, "-m", a.model, "-ngl", "99", "-np",
                                                       str(a.slots), "-c", str(a.slots * a.ctx), "--port",
                                                       str(p), "--no-webui"], p, a.tokens, log)
    m, l = res["muser"], res["llama-server"]
    print(f"| {a.tokens} tokens, temperature 0 | muser up | llama-server | ratio |")
    print("|---|---:|---:|---:|")
    for key, label in [("solo_mean", "one request (server timing, tok/s)"),
                       ("four_aggregate", f"{len(PROMPTS)} at once (aggregate tok/s)")]:
        ratio = m[key] / l[key] if m[key] and l[key] else float("nan")
        print(f"| {label} | {m[key]:.1f} | {l[key]:.1f} | {ratio:.2f}x |")
    if a.json:
        json.dump({"model": a.model, "device": a.device, "slots": a.slots, "ctx_per_slot": a.ctx,
                   "tokens": a.tokens, "results": res}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
