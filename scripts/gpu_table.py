#!/usr/bin/env python3
"""The table of a `scripts/gpu-check-bench.sh` run: Muser beside llama.cpp, from the JSON the
stages wrote into OUT.

    gpu_table.py OUT [--bw 4.3e12] [--flops 790e12] [--json FILE]

Reads what is there and skips what is not:
- gpu-model-30b.json, gpu-model-30b-d8192.json, gpu-model-30b-nvfp4.json (muser-cuda-bench);
- llama-bench.json, llama-bench-d8192.json, llama-bench-nvfp4.json (llama-bench -o json);
- muser-bench-engine-30b*.json (`muser bench --device cuda`, the engine's path);
- serve-compare.json (scripts/serve-compare.py).
Prints one markdown table per file pair with the ratio to llama.cpp and the share of the floor:
decode reads the model file once per token at --bw bytes/s; prefill costs 2 FLOP per parameter
per token at --flops (at depth the KV cache reads and the attention FLOPs are left out, so
there the share is slightly understated). Then the issue's bars (tg128 >= 185 tok/s, pp2048 >= 6000 tok/s, at
depth 0 and 8192) against what was measured. Standard library only.
"""
import argparse, glob, json, os

BARS = {"tg128": 185.0, "pp2048": 6000.0}


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def muser_rates(doc):
    """{test: tok/s} of a muser-cuda-bench model run."""
    out = {}
    if not doc:
        return out
    tg = doc.get("tg") or {}
    if tg.get("test"):
        out[tg["test"]] = tg["tok_per_s"]
    for p in doc.get("pp") or []:
        out[p["test"]] = p["tok_per_s"]
    slots = doc.get("slots") or {}
    if slots.get("aggregate_tok_per_s"):
        out[f"{slots['sequences']} sequences, tg aggregate"] = slots["aggregate_tok_per_s"]
    return out


def llama_rates(rows):
    """({test: tok/s}, model bytes, parameters) of a llama-bench JSON array."""
    out, size, params = {}, None, None
    for r in rows if isinstance(rows, list) else []:
        if not isinstance(r, dict) or "avg_ts" not in r:
            continue
        test = f"pp{r['n_prompt']}" if r.get("n_gen", 0) == 0 else f"tg{r['n_gen']}"
        out[test] = r["avg_ts"]
        size, params = r.get("model_size", size), r.get("model_n_params", params)
    return out, size, params


def table(title, mine, theirs, size, params, bw, flops):
    rows = []
    print(f"\n{title}\n")
    print("| test | Muser | llama.cpp | ratio | share of the floor |")
    print("|---|---:|---:|---:|---:|")
    for test, v in mine.items():
        other = theirs.get(test)
        floor = None
        if test.startswith("tg") and size:
            floor = bw / size
        elif test.startswith("pp") and params:
            floor = flops / (2.0 * params)
        elif "aggregate" in test and size:
            floor = int(test.split()[0]) * bw / size
        base = f"{other:.1f}" if other else "—"
        ratio = f"{v / other:.2f}x" if other else "—"
        share = f"{v / floor:.0%}" if floor else "—"
        print(f"| {test} | {v:.1f} | {base} | {ratio} | {share} |")
        rows.append({"test": test, "muser": v, "llama_cpp": other, "ratio": v / other if other else None,
                     "share_of_floor": v / floor if floor else None})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--bw", type=float, default=4.3e12, help="memory bandwidth floor, bytes/s")
    ap.add_argument("--flops", type=float, default=790e12, help="dense bf16 rate, FLOP/s")
    ap.add_argument("--json")
    a = ap.parse_args()
    j = lambda name: load(os.path.join(a.out, name))
    report = {"tables": {}, "bars": {}}
    pairs = [
        ("Q4_K, depth 0", "gpu-model-30b.json", "llama-bench.json"),
        ("Q4_K, depth 8192", "gpu-model-30b-d8192.json", "llama-bench-d8192.json"),
        ("NVFP4, depth 0", "gpu-model-30b-nvfp4.json", "llama-bench-nvfp4.json"),
    ]
    measured = {}
    for title, mine_f, theirs_f in pairs:
        mine = muser_rates(j(mine_f))
        if not mine:
            continue
        theirs, size, params = llama_rates(j(theirs_f))
        report["tables"][title] = table(title, mine, theirs, size, params, a.bw, a.flops)
        measured[title] = mine
    engine = {}
    for f in sorted(glob.glob(os.path.join(a.out, "muser-bench-engine-30b*.json"))):
        for r in (load(f) or {}).get("results", []):
            engine[r["test"]] = r["avg_ts"]
    if engine:
        print("\n`muser bench --device cuda` (the engine's path), Q4_K: " +
              ", ".join(f"{t} {v:.1f}" for t, v in engine.items()))
        report["engine"] = engine
    sc = j("serve-compare.json")
    if sc and "results" in sc:
        m, l = sc["results"].get("muser", {}), sc["results"].get("llama-server", {})
        print("\n| servers, 128 tokens | muser up | llama-server | ratio |\n|---|---:|---:|---:|")
        for key, name in (("solo_mean", "one request"), ("four_aggregate", "four at once")):
            if m.get(key) and l.get(key):
                print(f"| {name} | {m[key]:.1f} | {l[key]:.1f} | {m[key] / l[key]:.2f}x |")
        report["servers"] = {"muser": m, "llama_server": l}
    print("\nBars (Q4_K):")
    for title in ("Q4_K, depth 0", "Q4_K, depth 8192"):
        for test, bar in BARS.items():
            v = measured.get(title, {}).get(test)
            if v is None:
                continue
            ok = v >= bar
            report["bars"][f"{test} {title}"] = {"measured": v, "bar": bar, "met": ok}
            print(f"  {test} >= {bar:.0f} at {title.split(', ')[1]}: {'met' if ok else 'NOT met'} ({v:.1f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
