"""Server-level parity: `muser up` answers `POST /completion` and `POST /v1/chat/completions`
(greedy, `cache_prompt` false) with the text and token counts llama-server b11434 gave at its
defaults, recorded by scripts/server-goldens.py per numerics profile
(tests/server-goldens/<order>-<fa>.json, docs/exactness.md).

Every recorded profile is checked on every host with AVX2 (each kernel family computes every
order): the server under test at its defaults (`--numerics host`) against the goldens of the
profile it reports (its engine ABI in `/props`), and a second `muser up` for each other profile:
`--numerics host` with `MUSER_ISA=avx2` computes the `x86-avx2` order, as on an AVX2-only host
(where llama.cpp built natively is that build)."""

import glob
import json
import os
import re

import pytest
import requests

from conftest import spawn_muser

GOLDENS = os.path.join(os.path.dirname(__file__), "..", "server-goldens")
PROFILES = sorted(os.path.basename(p)[:-len(".json")]
                  for p in glob.glob(os.path.join(GOLDENS, "*.json")))


def golden(profile):
    with open(os.path.join(GOLDENS, profile + ".json")) as f:
        return json.load(f)


def served_profile(url):
    """The numerics profile a server computes, from the engine ABI in `/props`
    (`muser-cpu:ggml-b11434/<order>/<fa>-f16-v1`), as a golden file name."""
    props = requests.get(f"{url}/props", timeout=10).json()
    abi = props["prefill_lane"]["engine_abi"] or ""
    m = re.search(r"ggml-b11434/(x86-[a-z0-9]+)/(fa-on|fa-off)", abi)
    assert m, f"no numerics profile in the engine ABI {abi!r}"
    return f"{m.group(1)}-{m.group(2)}"


def server_args(profile):
    """`muser up` flags and environment that compute `profile`."""
    order, fa = re.fullmatch(r"(x86-avx512|x86-avx2)-fa-(on|off)", profile).groups()
    args = ["--flash-attn", fa]
    if order == "x86-avx2":
        return args + ["--numerics", "host"], {"MUSER_ISA": "avx2"}
    return args + ["--numerics", "portable"], {}


@pytest.fixture(scope="module", params=PROFILES)
def profile_url(request, base_url):
    """(profile, URL of a server computing it): the server under test when it computes the
    profile, otherwise a second server started for it."""
    profile = request.param
    if served_profile(base_url) == profile:
        yield profile, base_url
        return
    args, env = server_args(profile)
    with spawn_muser(*args, env_extra=env) as url:
        yield profile, url


def test_the_server_at_its_defaults_has_goldens(base_url):
    assert served_profile(base_url) in PROFILES


def test_completion_equals_llama_server(profile_url):
    profile, url = profile_url
    g = golden(profile)
    for case in g["completion"]:
        out = requests.post(f"{url}/completion", json={
            "prompt": case["prompt"], "n_predict": g["n_predict"], "temperature": 0,
            "cache_prompt": False}, timeout=120).json()
        got = (out["content"], out["tokens_predicted"], out["tokens_evaluated"])
        want = (case["content"], case["tokens_predicted"], case["tokens_evaluated"])
        assert got == want, f"{profile}: {case['prompt'][:24]!r}"


def test_chat_equals_llama_server(profile_url, model_id):
    profile, url = profile_url
    g = golden(profile)
    for case in g["chat"]:
        out = requests.post(f"{url}/v1/chat/completions", json={
            "model": model_id, "messages": case["messages"], "max_tokens": g["n_predict"],
            "temperature": 0, "cache_prompt": False}, timeout=120).json()
        c = out["choices"][0]
        got = (c["message"]["content"], c["finish_reason"], out["usage"]["prompt_tokens"],
               out["usage"]["completion_tokens"])
        want = (case["content"], case["finish_reason"], case["prompt_tokens"],
                case["completion_tokens"])
        assert got == want, f"{profile}: {case['messages'][-1]['content'][:24]!r}"
