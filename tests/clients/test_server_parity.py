"""Server-level parity: `muser up` at its defaults answers `POST /completion` and
`POST /v1/chat/completions` (greedy, `cache_prompt` false) with the text and token counts
llama-server b11434 gave at its defaults, recorded by scripts/server-goldens.py for the numerics
profile Muser computes (docs/exactness.md). Muser's profile is the same on every x86 host, so
these goldens hold on AVX2 and AVX512 CI machines alike."""

import json
import os

import pytest
import requests

PROFILE = "x86-avx512-fa-on"
GOLDEN = os.path.join(os.path.dirname(__file__), "..", "server-goldens", PROFILE + ".json")


def golden():
    with open(GOLDEN) as f:
        return json.load(f)


G = golden()


@pytest.mark.parametrize("case", G["completion"], ids=lambda c: c["prompt"][:24])
def test_completion_equals_llama_server(base_url, case):
    out = requests.post(f"{base_url}/completion", json={
        "prompt": case["prompt"], "n_predict": G["n_predict"], "temperature": 0,
        "cache_prompt": False}, timeout=120).json()
    assert out["content"] == case["content"]
    assert out["tokens_predicted"] == case["tokens_predicted"]
    assert out["tokens_evaluated"] == case["tokens_evaluated"]


@pytest.mark.parametrize("case", G["chat"], ids=lambda c: c["messages"][-1]["content"][:24])
def test_chat_equals_llama_server(base_url, model_id, case):
    out = requests.post(f"{base_url}/v1/chat/completions", json={
        "model": model_id, "messages": case["messages"], "max_tokens": G["n_predict"],
        "temperature": 0, "cache_prompt": False}, timeout=120).json()
    c = out["choices"][0]
    assert c["message"]["content"] == case["content"]
    assert c["finish_reason"] == case["finish_reason"]
    assert out["usage"]["prompt_tokens"] == case["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == case["completion_tokens"]
