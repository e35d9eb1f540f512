"""The official `ollama` client against muser's Ollama routes."""

import ollama
import pytest


@pytest.fixture(scope="module")
def client(base_url):
    return ollama.Client(host=base_url, timeout=120)


OPTIONS = {"temperature": 0, "num_predict": 12}


def test_generate(client, model_id):
    r = client.generate(model=model_id, prompt="Name a color.", options=OPTIONS)
    assert r.done and r.response
    assert r.done_reason in ("stop", "length")
    assert 0 < r.eval_count <= 12 and r.prompt_eval_count > 0
    assert r.context and len(r.context) == r.prompt_eval_count + r.eval_count


def test_generate_stream_matches(client, model_id):
    full = client.generate(model=model_id, prompt="Name a color.", options=OPTIONS)
    parts = list(client.generate(model=model_id, prompt="Name a color.", options=OPTIONS, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.response for p in parts) == full.response


def test_chat_and_stream(client, model_id):
    messages = [{"role": "user", "content": "Say hello."}]
    full = client.chat(model=model_id, messages=messages, options=OPTIONS)
    assert full.message.role == "assistant" and full.message.content
    parts = list(client.chat(model=model_id, messages=messages, options=OPTIONS, stream=True))
    assert parts[-1].done
    assert "".join(p.message.content or "" for p in parts) == full.message.content


def test_unknown_option_is_rejected(client, model_id):
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=model_id, prompt="x", options={"temprature": 0})
    assert e.value.status_code == 400 and "temprature" in str(e.value)


def test_list_show_version(client, base_url, model_id):
    assert [m.model for m in client.list().models] == [model_id]
    show = client.show(model_id)
    assert show.details.format == "gguf"
    import requests

    assert requests.get(f"{base_url}/api/version", timeout=10).json()["version"]
