#!/usr/bin/env python3
"""`muser up` beside `llama-server` on one model file and one device, one after the other.

    serve-compare.py MODEL.gguf --muser BIN --llama-server BIN [--device cuda] [--slots 4]
                     [--ctx 4096] [--tokens 128] [--streams 16,64] [--json OUT]

For each server alone: start it (muser: `up --device D --slots N -c CTX`; llama-server:
`-ngl 99 -np N -c N*CTX`, flash attention on its default), wait for /health, warm up with one
short completion, then through llama.cpp's native `POST /completion` (temperature 0,
`cache_prompt` false, `ignore_eos`, `n_predict` tokens, both servers take the same body):
- `solo`: four prompts one at a time; the decode rate is each answer's
  `timings.predicted_per_second` (the server's own clock), averaged;
- `four`: the same four at once; tokens generated over the wall time (aggregate);
- with `--streams N,...` (each server then has max(N, --slots) slots): N streaming clients at
  once (`"stream": true`, a different prompt each), per N: aggregate tokens over the wall time
  from the first request to the last answer, and the percentiles (p50, p99) of the time to
  first token and of the inter-token latency (the gaps between one stream's consecutive token
  events, all streams pooled): what a user of a loaded server sees.
Prints a table with the ratios and writes JSON. Uses the Python standard library only.
"""
import argparse, json, threading, time

from serve_util import PROMPTS, free_port, post, post_timed_stream, server


def complete(port, prompt, n):
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": False, "ignore_eos": True}
    out = post(port, "/completion", body)
    t = out.get("timings", {})
    return out.get("tokens_predicted", t.get("predicted_n", 0)), t.get("predicted_per_second")


def percentile(xs, q):
    """The q-th percentile (0-100) of `xs`, nearest rank; None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs) + 0.5) - 1))]


def streams(port, clients, n):
    """`clients` streaming completions at once; aggregate tok/s and TTFT/ITL percentiles (ms)."""
    got = [None] * clients

    def one(i):
        body = {"prompt": f"{PROMPTS[i % len(PROMPTS)]} (story {i})", "n_predict": n, "temperature": 0,
                "cache_prompt": False, "ignore_eos": True, "stream": True}
        got[i] = post_timed_stream(port, "/completion", body)

    t0 = time.time()
    th = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    wall = time.time() - t0
    tokens, ttft, gaps = 0, [], []
    for events in got:
        final = [ev for _, ev in events if ev.get("stop")]
        tokens += final[-1].get("tokens_predicted", 0) if final else 0
        times = [t for t, ev in events if not ev.get("stop")]
        if times:
            ttft.append(times[0])
            gaps += [b - a for a, b in zip(times, times[1:])]
    ms = lambda v: None if v is None else round(v * 1e3, 2)
    return {"clients": clients, "tokens": tokens, "wall_s": round(wall, 3), "aggregate": tokens / wall,
            "ttft_ms_p50": ms(percentile(ttft, 50)), "ttft_ms_p99": ms(percentile(ttft, 99)),
            "itl_ms_p50": ms(percentile(gaps, 50)), "itl_ms_p99": ms(percentile(gaps, 99))}


def measure(name, cmd, port, n, log, stream_counts):
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
        loaded = [streams(port, c, n) for c in stream_counts]
    rates = [r for _, r in solo if r]
    return {"solo_tokens": [k for k, _ in solo], "solo_tok_per_s": rates,
            "solo_mean": sum(rates) / len(rates) if rates else None,
            "four_tokens": sum(g[0] for g in got if g), "four_wall_s": wall,
            "four_aggregate": sum(g[0] for g in got if g) / wall, "streams": loaded}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--muser", required=True)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--streams", default="", help="comma-separated counts of concurrent streaming clients")
    ap.add_argument("--json")
    a = ap.parse_args()
    counts = [int(c) for c in a.streams.split(",") if c.strip()]
    slots = max([a.slots] + counts)
    res = {}
    with open("serve-compare.log", "w") as log:
        p = free_port()
        res["muser"] = measure("muser", [a.muser, "up", "-m", a.model, "--device", a.device, "--slots",
                                         str(slots), "-c", str(slots * a.ctx), "--port", str(p)], p, a.tokens,
                               log, counts)
        p = free_port()
        res["llama-server"] = measure("llama-server", [a.llama_server, "-m", a.model, "-ngl", "99", "-np",
                                                       str(slots), "-c", str(slots * a.ctx), "--port",
                                                       str(p), "--no-webui"], p, a.tokens, log, counts)
    m, l = res["muser"], res["llama-server"]
    print(f"| {a.tokens} tokens, temperature 0 | muser up | llama-server | ratio |")
    print("|---|---:|---:|---:|")
    for key, label in [("solo_mean", "one request (server timing, tok/s)"),
                       ("four_aggregate", f"{len(PROMPTS)} at once (aggregate tok/s)")]:
        ratio = m[key] / l[key] if m[key] and l[key] else float("nan")
        print(f"| {label} | {m[key]:.1f} | {l[key]:.1f} | {ratio:.2f}x |")
    for ms, ls in zip(m["streams"], l["streams"]):
        print(f"| {ms['clients']} streaming (aggregate tok/s) | {ms['aggregate']:.1f} | {ls['aggregate']:.1f} | "
              f"{ms['aggregate'] / ls['aggregate']:.2f}x |")
        for key in ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99"):
            print(f"| {ms['clients']} streaming, {key.replace('_ms_', ' ms ')} | {ms[key]} | {ls[key]} | |")
    if a.json:
        json.dump({"model": a.model, "device": a.device, "slots": slots, "ctx_per_slot": a.ctx,
                   "tokens": a.tokens, "results": res}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
