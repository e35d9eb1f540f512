"""Telemetry: /metrics parsed by prometheus_client's own parser (the histograms' buckets move
under load), /v1/telemetry's tagged snapshot, and its server-sent event stream."""

import json
import threading

import requests
from prometheus_client.parser import text_string_to_metric_families

LOCAL = {"lane": "local", "device": "cpu"}


def histograms(base_url):
    """{family: {le: count}} of the local lane's histograms, plus `_count`."""
    text = requests.get(f"{base_url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            if family.name != "muser_request_duration_seconds" and labels != LOCAL:
                continue
            h = out.setdefault(family.name, {})
            if s.name.endswith("_bucket"):
                h[s.labels["le"]] = s.value
            elif s.name.endswith("_count"):
                h["count"] = s.value
    return out


def test_histogram_buckets_move_under_load(base_url):
    before = histograms(base_url)
    for name in [
        "muser_time_to_first_token_seconds",
        "muser_inter_token_seconds",
        "muser_queue_wait_seconds",
        "muser_prefill_tokens_per_second",
        "muser_decode_tokens_per_second",
    ]:
        assert name in before, f"{name} missing from /metrics"

    def load(i):
        requests.post(
            f"{base_url}/v1/completions",
            json={"prompt": f"Load {i}: the sky is", "max_tokens": 8, "temperature": 0},
            timeout=120,
        ).raise_for_status()

    threads = [threading.Thread(target=load, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = histograms(base_url)
    for name in ["muser_time_to_first_token_seconds", "muser_queue_wait_seconds", "muser_prefill_tokens_per_second"]:
        assert after[name]["count"] >= before[name]["count"] + 6, name
    assert after["muser_inter_token_seconds"]["count"] >= before["muser_inter_token_seconds"]["count"] + 6 * 7
    assert after["muser_decode_tokens_per_second"]["count"] >= before["muser_decode_tokens_per_second"]["count"] + 6
    for name, h in after.items():
        buckets = sorted(((float(le), v) for le, v in h.items() if le != "count"))
        counts = [v for _, v in buckets]
        assert counts == sorted(counts), f"{name}: buckets are not cumulative"
        assert buckets[-1][0] == float("inf") and buckets[-1][1] == h["count"], name
    moved = [le for le, v in after["muser_time_to_first_token_seconds"].items() if v > before["muser_time_to_first_token_seconds"].get(le, 0)]
    assert "+Inf" in moved


def tagged_values(node, path=""):
    if isinstance(node, dict):
        if "tag" in node and "value" in node:
            yield path, node
        for k, v in node.items():
            yield from tagged_values(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from tagged_values(v, f"{path}[{i}]")


def test_snapshot_values_are_tagged_and_measured(base_url):
    requests.post(f"{base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60).raise_for_status()
    snap = requests.get(f"{base_url}/v1/telemetry", timeout=10).json()
    assert snap["schema"] == "muser.telemetry.v1"
    values = list(tagged_values(snap))
    assert len(values) > 20
    tags = {v["tag"] for _, v in values}
    assert tags == {"measured"}, tags  # this server reports no targets and never mock data
    for path, v in values:
        assert isinstance(v["value"], (int, float)) and v["unit"], path
    lane = snap["lanes"]["local"]
    assert lane["ttft_ms"]["p50"]["value"] > 0
    assert snap["slots"]["total"]["value"] == len(snap["slots"]["list"])
    assert 0 <= snap["kv"]["occupancy"]["value"] <= 1


def test_stream_sends_a_snapshot_every_second(base_url):
    with requests.get(f"{base_url}/v1/telemetry/stream", stream=True, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = []
        name = None
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                assert name == "snapshot"
                events.append(json.loads(line[5:]))
                if len(events) == 2:
                    break
    assert events[1]["uptime_s"]["value"] > events[0]["uptime_s"]["value"]
