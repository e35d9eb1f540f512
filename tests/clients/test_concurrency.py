"""16 clients on 4 slots: each greedy output equals its sequential run."""

from concurrent.futures import ThreadPoolExecutor

import requests

PROMPTS = [f"Write one sentence about the number {i}." for i in range(16)]


def complete(base_url, prompt):
    r = requests.post(
        f"{base_url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 24, "temperature": 0},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_concurrent_greedy_equals_sequential(base_url):
    sequential = [complete(base_url, p) for p in PROMPTS]
    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(lambda p: complete(base_url, p), PROMPTS))
    mismatches = [i for i, (a, b) in enumerate(zip(sequential, concurrent)) if a != b]
    assert not mismatches, f"outputs differ for prompts {mismatches}"
    assert len(set(sequential)) > 1
