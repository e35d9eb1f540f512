#!/usr/bin/env python3
"""The disaggregated prefill lane on loopback: a CA and two node certificates from `muser tls`,
a producer and a consumer (`muser up --role producer` / `--prefill auto`), then, per prompt
size, one prompt prefilled locally and one prefilled on the producer. Prints TTFT both ways (and
remote again for the same prompt, which the producer's slot then holds),
the handoff's K/V bytes and rate, the share of the remote TTFT spent on the handoff itself
(export, seal, stream, verify: outside the producer's prefill and the consumer's last
chunk) with its phases (the producer's export and seal, the body's arrival and the
consumer's verification), and whether the greedy tokens are identical; with --receipt, writes a JSON receipt.
Used by scripts/disagg-demo.sh and scripts/bench-handoff.sh. Python standard library only."""
import argparse, json, os, platform, subprocess, sys, tempfile, time, urllib.request

from serve_util import free_port, post


def ready(cmd, log):
    """Starts `cmd`; returns the process once it printed its ready line."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    line = p.stdout.readline()
    if "ready" not in line:
        p.kill()
        sys.exit(f"failed to start: {' '.join(cmd)} (see {log.name})")
    return p


def get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as r:
        return json.load(r)


def prompt_ids(port, n, variant):
    """`n` token ids; each `variant` differs from the first token on, so no cache holds it."""
    base = post(port, "/tokenize", {"content": f"Archive {variant}: the harbour master wrote one "
                                    "letter for each ship, in the order they sailed. "})["tokens"]
    return (base * (n // len(base) + 1))[:n]


def run_once(port, ids, remote, n_predict):
    post(port, "/slots/0?action=erase", {})
    r = post(port, "/completion", {"prompt": ids, "n_predict": n_predict, "temperature": 0,
                                   "return_tokens": True, "cache_prompt": remote})
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--muser", default="target/release/muser")
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", default="2048", help="prompt sizes, comma-separated")
    ap.add_argument("--reps", type=int, default=1, help="counted runs per size (after a warm-up)")
    ap.add_argument("--threads", type=int, default=0, help="compute threads per process (0: all)")
    ap.add_argument("--producer-device", default="cpu")
    ap.add_argument("--consumer-device", default="cpu")
    ap.add_argument("--accept-abi", action="append", default=[],
                    help="an engine ABI the consumer accepts besides its own (another device's)")
    ap.add_argument("--receipt", help="write a JSON receipt here")
    ap.add_argument("--logs", help="keep the producer's and consumer's logs in this directory")
    a = ap.parse_args()
    sizes = [int(s) for s in a.tokens.split(",")]
    ctx = max(sizes) + 64
    tmp = tempfile.mkdtemp(prefix="muser-disagg-")
    cfg, key = os.path.join(tmp, "cfg"), os.path.join(tmp, "kv.key")
    with open(key, "wb") as f:
        f.write(os.urandom(32))
    # 1. the CA and the two nodes' certificates
    for args in (["init"], ["issue", "prod"], ["issue", "cons"]):
        subprocess.run([a.muser, "tls", *args, "--config-dir", cfg], check=True, stdout=subprocess.DEVNULL)
    common = ["-m", a.model, "-c", str(ctx), "--slots", "1", "--config-dir", cfg, "--kv-key-file", key]
    if a.threads:
        common += ["-t", str(a.threads)]
    pp, cp = free_port(), free_port()
    logdir = a.logs or tmp
    os.makedirs(logdir, exist_ok=True)
    logs = [open(os.path.join(logdir, n), "w") for n in ("producer.log", "consumer.log")]
    procs = []
    try:
        # 2. the producer
        procs.append(ready([a.muser, "up", "--role", "producer", "--name", "prod", "--consumer", "cons",
                            "--port", str(pp), "--device", a.producer_device, *common], logs[0]))
        # 3. the consumer
        accept = [x for abi in a.accept_abi for x in ("--accept-abi", abi)]
        procs.append(ready([a.muser, "up", "--name", "cons", "--prefill", "auto", "--remote-min-tokens", "1",
                            "--producer", f"prod=https://127.0.0.1:{pp}", "--port", str(cp),
                            "--device", a.consumer_device, *accept, *common], logs[1]))
        rows = []
        for n in sizes:
            run_once(cp, prompt_ids(cp, n, 0), True, 4)  # warm-up (discarded)
            for rep in range(a.reps):
                # a prompt neither side has seen: the producer prefills it cold
                ids = prompt_ids(cp, n, rep + 1)
                local = run_once(cp, ids, False, 16)
                remote = run_once(cp, ids, True, 16)
                assert remote["timings"]["prefill_lane"] == "remote", remote["timings"]
                h = get(cp, "/props")["prefill_lane"]["producers"][0]["last_handoff"]
                # the same prompt again: the producer's slot holds it and computes one block
                repeat = run_once(cp, ids, True, 16)
                # the handoff: everything after the producer's prefill (export, seal, stream,
                # verify); its phases as the producer reported them and the consumer timed them
                wire_ms = max(h["ms"] - h["producer_prefill_ms"], 1e-9)
                rows.append({
                    "prompt_tokens": n,
                    "handed_off_tokens": h["tokens"],
                    # requests the handoff was cut into (each piece's transfer overlaps the
                    # producer's prefill of the next one)
                    "pieces": h.get("pieces", 1),
                    "ttft_local_ms": local["timings"]["prompt_ms"],
                    "ttft_remote_ms": remote["timings"]["prompt_ms"],
                    "producer_prefill_ms": h["producer_prefill_ms"],
                    "phases_ms": {
                        "producer_export": h["producer_export_ms"],
                        "producer_seal": h["producer_seal_ms"],
                        # request sent to the answer's head (prefill, export and seal included)
                        "head": h["head_ms"],
                        # the answer's head to its last byte verified
                        "body": h["body_ms"],
                        # the verifier's busy time within the body (SHA-256, copies, checks)
                        "verify": h["verify_ms"],
                        # the last piece's seal (its head to its first byte)
                        "last_seal": h.get("last_seal_ms"),
                        # after the last byte: the verifier's tail (last digests, ledger record)
                        "join": h.get("join_ms"),
                    },
                    # bytes over the time the body took to arrive and verify
                    "body_gb_s": h["kv_bytes"] / max(h["body_ms"], 1e-9) / 1e6,
                    "handoff_ms": h["ms"],
                    "kv_bytes": h["kv_bytes"],
                    # installed K/V bytes over the handoff time not overlapped with the
                    # producer's prefill (the time the handoff adds to the TTFT)
                    "payload_gb_s": h["kv_bytes"] / wire_ms / 1e6,
                    # seal, stream, verify, install: the handoff's own cost
                    "handoff_overhead_ms": wire_ms,
                    "handoff_share_of_ttft": wire_ms / remote["timings"]["prompt_ms"],
                    # the last chunk, computed on the consumer as a local prefill would
                    "consumer_tail_ms": remote["timings"]["prompt_ms"] - h["ms"],
                    "ttft_remote_repeat_ms": repeat["timings"]["prompt_ms"],
                    "tokens_identical": local["tokens"] == remote["tokens"] == repeat["tokens"],
                })
    finally:
        for p in procs:
            p.terminate()
            p.wait()
    print(f"{'tokens':>7} {'TTFT local ms':>14} {'TTFT remote ms':>15} {'repeat ms':>10} {'KV MB':>8} {'GB/s':>6} "
          f"{'handoff share':>14} {'pieces':>6} {'export':>7} {'seal':>7} {'body':>7} {'verify':>7} {'body GB/s':>9}  identical")
    for r in rows:
        ph = r["phases_ms"]
        print(f"{r['prompt_tokens']:>7} {r['ttft_local_ms']:>14.1f} {r['ttft_remote_ms']:>15.1f} "
              f"{r['ttft_remote_repeat_ms']:>10.1f} "
              f"{r['kv_bytes'] / 1e6:>8.1f} {r['payload_gb_s']:>6.2f} {r['handoff_share_of_ttft']:>13.1%} {r['pieces']:>6} "
              f"{ph['producer_export']:>7.1f} {ph['producer_seal']:>7.1f} {ph['body']:>7.1f} {ph['verify']:>7.1f} "
              f"{r['body_gb_s']:>9.2f}  {'yes' if r['tokens_identical'] else 'no'}")
    print(f"tokens identical: {'yes' if all(r['tokens_identical'] for r in rows) else 'no'}")
    if a.receipt:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        receipt = {
            # receipts name no machine paths: an absolute path is recorded by its file name
            "command": " ".join(os.path.basename(x) if os.path.isabs(x) else x for x in sys.argv),
            "commit": commit,
            "machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                        "cores": os.cpu_count(), "os": platform.platform()},
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model": os.path.basename(a.model),
            "producer_device": a.producer_device,
            "consumer_device": a.consumer_device,
            "runs": rows,
        }
        with open(a.receipt, "w") as f:
            json.dump(receipt, f, indent=2)
        print(f"receipt: {a.receipt}")


if __name__ == "__main__":
    main()
