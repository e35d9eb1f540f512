#!/usr/bin/env python3
"""End-to-end check of `muser up` on one device: greedy completions alone and four at once.

    serve-check.py MUSER MODEL.gguf [--device cuda] [--slots 4] [--port 8097] [--tokens 48]
                   [--json OUT]

Starts `MUSER up -m MODEL --device D --slots N`, waits for /health, then:
- `solo`: each of four prompts of different lengths alone (temperature 0, /v1/completions),
  with each request's decode rate from the server's timings;
- `concurrent`: the same four at once: the engine batches their decode steps (and a prompt
  chunk beside them). On `--device cuda` (the fused forward: every batch size sums in the same
  order, prompt chunks run apart from decode rows) each text must equal its solo text; on the
  CPU (llama.cpp's numerics, where a batch's composition changes the rounding) the equality is
  reported only;
- `again`: the first prompt once more, after the others: the same text;
- `stream`: one chat completion streamed (SSE chunks, then [DONE]), text non-empty.
Prints one line per check and the aggregate decode rate of the concurrent round; exits 1 when a
check fails. Uses the Python standard library only.
"""
import argparse, json, sys, threading, time

from serve_util import PROMPTS, post, server


def complete(port, prompt, n):
    t = time.time()
    # No prefix reuse: every request computes its whole prompt, so its text depends only on
    # the prompt (a reused prefix would turn the last prompt token's prefill into a decode step,
    # whose rounding differs).
    r = post(port, "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0,
                                       "cache_prompt": False})
    gen = r.get("timings", {}).get("predicted_per_second")
    return r["choices"][0]["text"], r["usage"]["completion_tokens"], time.time() - t, gen


def checks(a, report):
    """The checks against a running server (each reported through `report`)."""
    solo = [complete(a.port, p, a.tokens) for p in PROMPTS]
    rates = [round(g, 1) for *_, g in solo if g]
    report("solo", all(n > 0 for _, n, *_ in solo),
           f"{[n for _, n, *_ in solo]} tokens at {rates} tok/s (server timings); "
           f"first text {solo[0][0][:60]!r}")
    got = [None] * len(PROMPTS)
    t0 = time.time()
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, complete(a.port, PROMPTS[i], a.tokens)))
               for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - t0
    same = [g is not None and g[0] == s[0] for g, s in zip(got, solo)]
    n_tok = sum(g[1] for g in got if g)
    strict = a.device == "cuda"
    report("concurrent", all(same) or not strict,
           f"texts equal to solo: {same}{'' if strict else ' (not required here)'}; {n_tok} tokens in {wall:.2f} s, {n_tok / wall:.1f} tok/s aggregate")
    again = complete(a.port, PROMPTS[0], a.tokens)
    report("again", again[0] == solo[0][0], f"first prompt once more: equal {again[0] == solo[0][0]}")
    lines = post(a.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hello."}],
                                                   "max_tokens": 16, "temperature": 0, "stream": True}, stream=True)
    text = "".join(json.loads(l[5:])["choices"][0]["delta"].get("content") or ""
                   for l in lines if l.startswith("data:") and l != "data: [DONE]")
    report("stream", lines[-1] == "data: [DONE]" and len(text) > 0, f"{len(lines)} events, text {text[:40]!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("muser")
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--port", type=int, default=8097)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json")
    a = ap.parse_args()
    log = open("serve-check.log", "w")
    cmd = [a.muser, "up", "-m", a.model, "--device", a.device, "--slots", str(a.slots), "--port", str(a.port),
           "-c", str(4096 * a.slots)]
    results, ok = [], True

    def report(name, passed, detail):
        nonlocal ok
        ok &= passed
        print(f"{name}: {'ok' if passed else 'FAILED'} ({detail})", flush=True)
        results.append({"check": name, "pass": passed, "detail": detail})

    try:
        with server("muser up", cmd, a.port, log):
            checks(a, report)
    except Exception as e:
        report("run", False, repr(e))
    finally:
        log.close()
    print("serve checks:", "all passed" if ok else "FAILED")
    print("server log (last lines):")
    print("".join(open("serve-check.log").readlines()[-8:]))
    if a.json:
        json.dump({"device": a.device, "model": a.model, "pass": ok, "checks": results}, open(a.json, "w"), indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
