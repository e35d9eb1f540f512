"""llama.cpp-server routes and the strictness rules, over raw HTTP."""

import json

import requests

PROMPT = "The quick brown fox"


def post(base_url, path, body, **kw):
    return requests.post(f"{base_url}{path}", json=body, timeout=120, **kw)


def test_completion_and_timings(base_url):
    r = post(base_url, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "return_tokens": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stop"] is True and body["tokens_predicted"] == len(body["tokens"]) <= 8
    assert body["timings"]["predicted_n"] == body["tokens_predicted"]
    assert body["timings"]["prompt_ms"] > 0
    # llama-server's timings are all numbers; Muser adds issue #24's two lane fields
    lane = {"prefill_lane": body["timings"].pop("prefill_lane"), "producer": body["timings"].pop("producer")}
    assert lane == {"prefill_lane": "local", "producer": None}
    for key, value in body["timings"].items():
        assert isinstance(value, (int, float)) and value >= 0, (key, value)
    # Token-id prompts give the same result as the text they tokenize to.
    ids = post(base_url, "/tokenize", {"content": PROMPT}).json()["tokens"]
    again = post(base_url, "/completion", {"prompt": ids, "n_predict": 8, "temperature": 0}).json()
    assert again["content"] == body["content"]


def test_completion_stream(base_url):
    full = post(base_url, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0}).json()
    r = post(base_url, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "stream": True}, stream=True)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1]["stop"] is True and "timings" in events[-1]
    assert "".join(e["content"] for e in events) == full["content"]


def test_completion_probs(base_url):
    body = post(base_url, "/completion", {"prompt": PROMPT, "n_predict": 2, "temperature": 0, "n_probs": 2}).json()
    probs = body["completion_probabilities"]
    assert len(probs) == 2 and all(len(p["top_logprobs"]) == 2 for p in probs)


def test_tokenize_detokenize_roundtrip(base_url):
    ids = post(base_url, "/tokenize", {"content": "Hello, world!"}).json()["tokens"]
    assert ids and all(isinstance(i, int) for i in ids)
    assert post(base_url, "/detokenize", {"tokens": ids}).json()["content"] == "Hello, world!"
    pieces = post(base_url, "/tokenize", {"content": "Hello", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == "Hello"


def test_apply_template(base_url):
    r = post(base_url, "/apply-template", {"messages": [{"role": "user", "content": "Hi there"}]})
    assert r.status_code == 200 and "Hi there" in r.json()["prompt"]
    assert r.json()["prompt"].rstrip().endswith("assistant")


def test_embedding(base_url):
    body = post(base_url, "/embedding", {"content": "hello"}).json()
    assert len(body[0]["embedding"][0]) == 576


def test_props_slots_health_metrics(base_url):
    props = requests.get(f"{base_url}/props", timeout=10).json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] > 0
    slots = requests.get(f"{base_url}/slots", timeout=10).json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    assert requests.get(f"{base_url}/health", timeout=10).json() == {"status": "ok"}
    metrics = requests.get(f"{base_url}/metrics", timeout=10).text
    for name in ("muser_prompt_tokens_total", "muser_generated_tokens_total", "muser_slots_busy",
                 "muser_queue_depth", "muser_request_duration_seconds_bucket"):
        assert name in metrics


def test_strictness(base_url):
    r = post(base_url, "/completion", {"prompt": "x", "n_predict": 1, "bogus_field": 1})
    assert r.status_code == 400 and "bogus_field" in r.json()["error"]["message"]
    r = requests.post(f"{base_url}/completion", data="prompt=x", headers={"Content-Type": "text/plain"}, timeout=10)
    assert r.status_code == 415
    r = requests.post(f"{base_url}/completion", data="{not json", headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = post(base_url, "/completion", {"prompt": "x " * 5000, "n_predict": 1})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    r = post(base_url, "/slots/0?action=save", {"filename": "../escape"})
    assert r.status_code == 400
    r = post(base_url, "/detokenize", {"tokens": [10**9]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
