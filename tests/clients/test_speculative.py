"""Speculative decoding over HTTP: llama-server's per-request `speculative.*` fields, the
`draft_n`/`draft_n_accepted` timings, and the counters, acceptance and row cost in /props and
/metrics (a second server started with `--spec ngram`)."""

import requests

from conftest import spawn_muser

CODE = ("Rename the function add to sum and return the code:\n"
        "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\nprint(add(3, 4))\n")


def completion(url, **extra):
    body = {"prompt": CODE, "n_predict": 40, "temperature": 0, "cache_prompt": False, **extra}
    r = requests.post(f"{url}/completion", json=body, timeout=120)
    return r


def test_per_request_speculative_fields_timings_and_counters():
    with spawn_muser("--spec", "ngram", "--draft-max", "8") as url:
        spec = completion(url).json()
        t = spec["timings"]
        assert t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"], t

        # off for one request (both spellings): the same text, nothing drafted
        for off in [{"speculative.n_max": 0}, {"speculative.type": "none"}]:
            plain = completion(url, **off).json()
            assert plain["content"] == spec["content"]
            assert plain["timings"]["draft_n"] == 0, off

        # resized, and on the OpenAI route too
        small = completion(url, **{"speculative.n_max": 2, "speculative.n_min": 1,
                                   "speculative.p_min": 0.5}).json()
        assert small["content"] == spec["content"]
        assert small["timings"]["draft_n"] > 0
        chat = requests.post(f"{url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": CODE}], "max_tokens": 24,
            "temperature": 0, "speculative.type": "none"}, timeout=120).json()
        assert chat["timings"]["draft_n"] == 0

        for bad in [{"speculative.n_max": 99}, {"speculative.n_min": -1},
                    {"speculative.p_min": 2}, {"speculative.type": "ngram-cache"},
                    {"speculative.n_max": 2, "speculative.n_min": 3}]:
            r = completion(url, **bad)
            assert r.status_code == 400, (bad, r.text)
            assert "speculative" in r.text, r.text

        props = requests.get(f"{url}/props", timeout=10).json()["speculative"]
        assert props["default"] == {"type": "ngram", "n_max": 8, "n_min": 0}
        assert props["draft_n_total"] >= t["draft_n"] + small["timings"]["draft_n"]
        assert 0 < props["draft_n_accepted_total"] <= props["draft_n_total"]
        assert props["verifications_total"] > 0
        assert props["acceptance"] == props["draft_n_accepted_total"] / props["draft_n_total"]
        # measured on this server's decode batches (1 row, then verifications of more)
        assert 0 <= props["row_cost"] <= 1
        metrics = requests.get(f"{url}/metrics", timeout=10).text
        assert f"muser_draft_tokens_total {props['draft_n_total']}" in metrics
        assert f"muser_draft_verifications_total {props['verifications_total']}" in metrics
        gauges = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                  if line.startswith(("muser_draft_row_cost ", "muser_draft_acceptance_ratio "))}
        assert abs(gauges["muser_draft_acceptance_ratio"] - props["acceptance"]) < 1e-9
        assert abs(gauges["muser_draft_row_cost"] - props["row_cost"]) < 1e-6


def test_a_request_turns_speculation_on_where_the_server_does_not(base_url):
    plain = completion(base_url).json()
    assert plain["timings"]["draft_n"] == 0
    spec = completion(base_url, **{"speculative.type": "ngram-simple"}).json()
    assert spec["content"] == plain["content"]
    assert spec["timings"]["draft_n"] > 0
