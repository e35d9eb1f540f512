"""The official `openai` client against muser's OpenAI routes."""

import base64
import math
import struct

import openai
import pytest


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_chat(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=16, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10
    assert 0 < r.usage.completion_tokens <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_greedy_is_deterministic_and_seed_accepted(client, model_id):
    outs = {
        client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=12, temperature=0, seed=s)
        .choices[0]
        .message.content
        for s in (1, 2)
    }
    assert len(outs) == 1


def test_chat_stream_with_usage(client, model_id):
    full = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(
        model=model_id,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_chat_logprobs(client, model_id):
    r = client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, rel_tol=1e-5)


def test_chat_n_choices_and_any_model_name(client, model_id):
    # n > 1: that many choices (llama-server's behaviour); more than 16 is refused
    r = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=2, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=2, n=17)
    # with one model loaded, any name is that model (as llama-server answers; OpenAI examples
    # name "gpt-3.5-turbo")
    r = client.chat.completions.create(model="gpt-3.5-turbo", messages=MESSAGES, max_tokens=2)
    assert r.choices[0].message.content is not None
    assert r.usage.completion_tokens <= 2


def test_completions(client, model_id):
    r = client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text
    assert r.usage.completion_tokens <= 8
    stream = client.completions.create(
        model=model_id, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text


def test_embeddings(client, model_id):
    r = client.embeddings.create(model=model_id, input="hello world")
    v = r.data[0].embedding
    assert len(v) == 576  # SmolLM2-135M hidden size
    assert math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-4)
    same = client.embeddings.create(model=model_id, input="hello world").data[0].embedding
    other = client.embeddings.create(model=model_id, input="a completely different sentence").data[0].embedding
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
    assert math.isclose(dot(v, same), 1.0, rel_tol=1e-5)
    assert dot(v, other) < 0.9999
    # Asked for explicitly, base64 comes back as the raw string of little-endian f32s.
    b64 = client.embeddings.create(model=model_id, input="hello world", encoding_format="base64")
    raw = base64.b64decode(b64.data[0].embedding)
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == v


def test_models(client, model_id):
    assert [m.id for m in client.models.list()] == [model_id]
