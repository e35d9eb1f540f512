#!/usr/bin/env python3
"""Does an image request stall the other slots' decoding? One server, two slots: a stream
decodes while a second request arrives, once with a text prompt and once with an image whose
rows number about the same; the stream's inter-token gaps before and while each request runs.

    vision-stall.py --muser BIN --model TEXT.gguf --mmproj PROJECTOR.gguf [--device cuda]
                    [--side 1024] [--ctx 4096] [--json OUT]

The server is `muser up --slots 2 --mmproj ...`. For each kind (text, image), a streaming
`/completion` (greedy, `ignore_eos`, 400 tokens) starts; once it has 40 tokens the second
request goes to `/completion` (`n_predict` 1): the image as llama.cpp's `multimodal_data`
(a SIDE x SIDE PNG gradient), or a text prompt of as many tokens as the image gives rows (its
`tokens_evaluated`). Reported per kind: the stream's median gap before the request, and while
the request runs (from its send to its answer) the largest gap, the sum of the gaps over the
median (the time the stream lost) and the request's own time. If the image's encode stalled
the engine, the image row would lose more than the text row of the same length (whose
prefill chunks share steps with the stream either way). Python standard library only.
"""
import argparse, base64, json, statistics, struct, threading, time, zlib

from serve_util import free_port, post, post_timed_stream, server


def png_gradient(side):
    """A side x side RGB PNG (a smooth gradient: small to send, any content encodes alike)."""
    rows = b"".join(b"\0" + bytes((x * 255 // side, y * 255 // side, (x + y) * 127 // side)[c]
                                  for x in range(side) for c in range(3)) for y in range(side))

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    head = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


def measure(port, body, warm_tokens=40):
    """Runs the stream and, once it has `warm_tokens` tokens, `body`; returns the statistics."""
    origin = time.perf_counter()
    times, warm = [], threading.Event()

    def on_event(t, ev):
        if not ev.get("stop"):
            times.append(t)
            if len(times) >= warm_tokens:
                warm.set()

    def stream():
        req = {"prompt": "Once upon a time", "n_predict": 400, "temperature": 0, "ignore_eos": True,
               "cache_prompt": False, "stream": True}
        try:
            post_timed_stream(port, "/completion", req, origin=origin, on_event=on_event)
        finally:
            warm.set()  # a stream shorter than warm_tokens must not leave the wait hanging

    th = threading.Thread(target=stream)
    th.start()
    warm.wait()
    t_send = time.perf_counter() - origin
    answer = post(port, "/completion", body)
    t_done = time.perf_counter() - origin
    th.join()
    gaps = [(b, b - a) for a, b in zip(times, times[1:])]
    before = [g for t, g in gaps if t <= t_send]
    during = [g for t, g in gaps if t_send < t <= t_done]
    median = statistics.median(before)
    ms = lambda v: round(v * 1e3, 1)
    return {"tokens_evaluated": answer.get("tokens_evaluated"), "request_ms": ms(t_done - t_send),
            "gap_median_before_ms": ms(median), "gaps_during": len(during),
            "gap_max_during_ms": ms(max(during)) if during else None,
            "stream_lost_ms": ms(sum(max(0.0, g - median) for g in during))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--muser", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--mmproj", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--ctx", type=int, default=4096, help="context per slot")
    ap.add_argument("--json")
    a = ap.parse_args()
    png = base64.b64encode(png_gradient(a.side)).decode()
    image = {"prompt": {"prompt_string": "<__media__>\nDescribe it.", "multimodal_data": [png]},
             "n_predict": 1, "temperature": 0, "cache_prompt": False}
    port = free_port()
    res = {}
    with open("vision-stall.log", "w") as log, server("muser", [
            a.muser, "up", "-m", a.model, "--mmproj", a.mmproj, "--device", a.device, "--slots", "2",
            "-c", str(2 * a.ctx), "--port", str(port)], port, log):
        rows = post(port, "/completion", image)["tokens_evaluated"]  # warm-up; the image's rows
        text = {"prompt": "word " * max(1, rows - 1), "n_predict": 1, "temperature": 0, "cache_prompt": False}
        res["text"] = measure(port, text)
        res["image"] = measure(port, image)
        res["image_again"] = measure(port, image)
    print(f"| second request ({a.side}x{a.side} image: {rows} prompt tokens) | prompt tokens | request ms | "
          "stream gap median before ms | largest gap during ms | stream time lost ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, v in res.items():
        print(f"| {k} | {v['tokens_evaluated']} | {v['request_ms']} | {v['gap_median_before_ms']} | "
              f"{v['gap_max_during_ms']} | {v['stream_lost_ms']} |")
    if a.json:
        json.dump({"model": a.model, "mmproj": a.mmproj, "device": a.device, "side": a.side,
                   "results": res}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
