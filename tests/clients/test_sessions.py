"""Sessions across processes: a conversation saved on the server under test, exported as a
bundle, imported and restored by a second `muser up` process (same model, same operator
key), continues with the same tokens as the first server's uninterrupted run, from the
restored cache. A tampered bundle is refused by the second process."""

import os
import tempfile
import time

import pytest
import requests
from conftest import spawn_muser

SLOT = 3  # the server under test has 4 slots; the tests here keep to the last one


def chat(url, messages, slot):
    r = requests.post(
        f"{url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 24, "temperature": 0, "id_slot": slot},
        timeout=120,
    )
    r.raise_for_status()
    v = r.json()
    return v["choices"][0]["message"]["content"], v["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture
def second_server():
    if not os.environ.get("MUSER_KV_KEY"):
        pytest.fail("MUSER_KV_KEY is not set: run these tests through scripts/test-clients.sh")
    with tempfile.TemporaryDirectory() as work:
        with spawn_muser("--kv-key-file", os.environ["MUSER_KV_KEY"],
                         "--session-dir", os.path.join(work, "sessions")) as url:
            yield url


def test_session_continues_on_a_second_process(base_url, second_server):
    q1 = {"role": "user", "content": "Give me two fruits."}
    a1, _ = chat(base_url, [q1], SLOT)
    turn1 = [q1, {"role": "assistant", "content": a1}]
    sid = f"proc-{int(time.time() * 1000)}"
    r = requests.post(f"{base_url}/v1/sessions", json={"id": sid, "slot": SLOT, "messages": turn1}, timeout=60)
    assert r.status_code == 201, r.text
    n_tokens = r.json()["n_tokens"]
    bundle = requests.get(f"{base_url}/v1/sessions/{sid}/bundle", timeout=60).content

    turn2 = turn1 + [{"role": "user", "content": "One more?"}]
    uninterrupted, _ = chat(base_url, turn2, SLOT)

    tampered = bytearray(bundle)
    tampered[-5] ^= 0x40
    octet = {"Content-Type": "application/octet-stream"}
    r = requests.post(f"{second_server}/v1/sessions/import", data=bytes(tampered), headers=octet, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_bundle", r.text
    assert requests.get(f"{second_server}/v1/sessions", timeout=10).json()["data"] == []

    r = requests.post(f"{second_server}/v1/sessions/import", data=bundle, headers=octet, timeout=60)
    assert r.status_code == 201, r.text
    r = requests.post(f"{second_server}/v1/sessions/{sid}/restore", json={"slot": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["n_restored"] == n_tokens
    resumed, cached = chat(second_server, turn2, 0)
    assert resumed == uninterrupted
    assert cached + 8 >= n_tokens, f"only {cached} of {n_tokens} prompt tokens came from the restored cache"
