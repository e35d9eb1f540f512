"""llama-server drop-in: Anthropic Messages through the official `anthropic` client, OpenAI
Responses through the official `openai` client (whole, streamed, tools), and a second
`muser up` started with llama-server's flag spellings; GBNF grammars (`grammar`, `--grammar-file`)."""

import re

import anthropic
import openai
import pytest
import requests

from conftest import spawn_muser

WEATHER = {
    "type": "object",
    "properties": {"location": {"type": "string"}},
    "required": ["location"],
}


@pytest.fixture(scope="module")
def claude(base_url):
    return anthropic.Anthropic(api_key="unused", base_url=base_url, max_retries=0)


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(api_key="unused", base_url=f"{base_url}/v1", max_retries=0)


def test_anthropic_message_usage_and_stop_reason(claude):
    msg = claude.messages.create(
        model="claude-sonnet-4-5", max_tokens=6, system="Answer briefly.",
        messages=[{"role": "user", "content": "Say hello"}], extra_body={"temperature": 0},
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == 6 and msg.usage.input_tokens > 0


def test_anthropic_stream_equals_the_whole_answer(claude):
    kwargs = dict(model="any", max_tokens=8, extra_body={"temperature": 0},
                  messages=[{"role": "user", "content": "Name a colour"}])
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_anthropic_forced_tool_use_and_tool_result_round_trip(claude):
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
    msg = claude.messages.create(
        model="any", max_tokens=40, tools=tools, tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    )
    assert msg.stop_reason == "tool_use"
    call = next(b for b in msg.content if b.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input.get("location"), str)
    follow = claude.messages.create(
        model="any", max_tokens=4, tools=tools,
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up.", "signature": ""},
                                              call.model_dump(exclude_none=True)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}]},
        ],
    )
    assert follow.content[0].type == "text"
    n = claude.messages.count_tokens(model="any", messages=[{"role": "user", "content": "Hello world"}])
    assert n.input_tokens > 2


def test_anthropic_errors_are_clear(base_url):
    r = requests.post(f"{base_url}/v1/messages", json={"max_tokens": 5}, timeout=30)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = requests.post(f"{base_url}/v1/messages", timeout=30, json={
        "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]})
    # no projector here: the server's setup, a 500 as llama-server answers
    assert r.status_code == 500 and "image input is not supported" in r.json()["error"]["message"]


def test_responses_whole_and_streamed_agree(oai):
    kwargs = dict(model="gpt-4.1", instructions="Answer briefly.", input="Name a fruit",
                  max_output_tokens=8, temperature=0)
    whole = oai.responses.create(**kwargs)
    assert whole.id.startswith("resp_") and whole.output[0].id.startswith("msg_")
    assert whole.status == "incomplete" and whole.usage.output_tokens == 8
    deltas, final = "", None
    for event in oai.responses.create(stream=True, **kwargs):
        if event.type == "response.output_text.delta":
            deltas += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert deltas == final.output_text == whole.output_text


def test_responses_forced_function_call_and_its_output(oai):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    res = oai.responses.create(
        model="any", input="Weather in Oslo?", tools=tools, max_output_tokens=40,
        tool_choice={"type": "function", "name": "get_weather"},
    )
    call = next(o for o in res.output if o.type == "function_call")
    assert call.name == "get_weather" and "location" in call.arguments
    res = oai.responses.create(model="any", max_output_tokens=4, tools=tools, input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Rain"},
    ])
    assert res.output_text


def test_llama_server_flag_spellings():
    with spawn_muser("--alias", "zeta,tinyllama-2", "--tags", "small,chat", "--no-slots", "--n-predict", "3",
                     "-ngl", "99", "--temp", "0", "--rerank", "--chat-template", "llama3", "-fa", "on",
                     "--jinja") as url:
        model = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]
        # the id is the first alias in sorted order, as llama-server keeps them in a sorted set
        assert (model["id"], model["aliases"], model["tags"]) == ("tinyllama-2", ["tinyllama-2", "zeta"],
                                                                  ["chat", "small"])
        assert requests.get(f"{url}/slots", timeout=30).status_code == 501
        r = requests.post(f"{url}/completion", json={"prompt": "Once upon a time"}, timeout=60).json()
        assert r["tokens_predicted"] == 3  # --n-predict is the default limit
        assert r["model"] == "tinyllama-2"
        assert "<|start_header_id|>" in requests.get(f"{url}/props", timeout=30).json()["chat_template"]
        r = requests.post(f"{url}/api/generate", json={"model": "zeta", "prompt": "Hi", "stream": False},
                          timeout=60)
        assert r.status_code == 200
        docs = ["Paris is the capital of France.", "Cats sleep a lot."]
        r = requests.post(f"{url}/rerank", json={"query": "capital of France", "documents": docs,
                                                 "top_n": 1, "return_text": True}, timeout=60).json()
        assert len(r["results"]) == 1 and r["results"][0]["document"]["text"] in docs


def test_openai_client_several_prompts_choices_and_embeddings(oai):
    """Lists of prompts and `n` choices through the official client (llama-server's shapes)."""
    res = oai.completions.create(model="gpt-3.5-turbo-instruct", prompt=["The sky is", "Grass is"],
                                 n=2, max_tokens=2, temperature=0)
    assert [c.index for c in res.choices] == [0, 1, 2, 3]
    assert res.choices[0].text == res.choices[1].text  # greedy: one prompt's choices agree
    assert res.usage.completion_tokens == 8
    chat = oai.chat.completions.create(model="any", n=2, max_tokens=2,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert len(chat.choices) == 2 and all(c.message.role == "assistant" for c in chat.choices)
    emb = oai.embeddings.create(model="text-embedding-3-small", input=["hello", "world", "hello"])
    assert [d.index for d in emb.data] == [0, 1, 2]
    assert emb.data[0].embedding == emb.data[2].embedding != emb.data[1].embedding


def test_llama_shapes_logit_bias_text_and_metrics(base_url):
    r = requests.post(f"{base_url}/completion", json={"prompt": ["a", [1, 2]], "n_predict": 1},
                      timeout=60).json()
    assert [x["index"] for x in r] == [0, 1]
    free = requests.post(f"{base_url}/completion", json={"prompt": "The sky is", "n_predict": 1,
                                                         "temperature": 0}, timeout=60).json()
    banned = requests.post(f"{base_url}/completion", json={
        "prompt": "The sky is", "n_predict": 1, "temperature": 0,
        "logit_bias": [[free["content"], False]]}, timeout=60).json()
    assert banned["content"] != free["content"]
    m = requests.get(f"{base_url}/metrics", timeout=30)
    assert "Process-Start-Time-Unix" in m.headers
    assert "# TYPE llamacpp:tokens_predicted_total counter" in m.text


def test_cors_preflight_and_origin_rules(base_url):
    def preflight(url, origin):
        return requests.options(f"{url}/completions", timeout=30, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "Authorization"})
    ok = preflight(base_url, "http://localhost:5173")
    assert ok.status_code == 200 and ok.headers["Access-Control-Allow-Origin"] == "http://localhost:5173"
    assert ok.headers["Access-Control-Allow-Methods"] == "GET, POST, DELETE, OPTIONS"
    evil = preflight(base_url, "http://evil.com")
    assert evil.status_code == 200 and "Access-Control-Allow-Origin" not in evil.headers
    with spawn_muser("--cors-origins", "https://app.example") as url:
        assert preflight(url, "https://app.example").headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert "Access-Control-Allow-Origin" not in preflight(url, "http://localhost").headers


ANSWER_GBNF = r'''
# an answer, a number, then a parenthesised list (a rule that nests)
root   ::= answer " " [1-9] [0-9]{1,2} " " group "."
answer ::= "yes" | "no"
group  ::= "(" (group | [a-z]+) ")"
'''
ANSWER_RE = r"(yes|no) [1-9][0-9]{1,2} (\()+[a-z]+(\))+\."


def test_gbnf_grammar_shapes_greedy_output_on_every_route(base_url):
    """llama.cpp's `grammar` on /completion, /v1/completions and chat: the greedy output is a
    whole sentence of the grammar, then the end."""
    for path, body, text in [
        ("/completion", {"prompt": "Is the sky blue?", "n_predict": 24}, lambda r: r["content"]),
        ("/v1/completions", {"prompt": "Is the sky blue?", "max_tokens": 24},
         lambda r: r["choices"][0]["text"]),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Is the sky blue?"}],
                                  "max_tokens": 24}, lambda r: r["choices"][0]["message"]["content"]),
    ]:
        r = requests.post(f"{base_url}{path}", json={**body, "temperature": 0, "grammar": ANSWER_GBNF},
                          timeout=60)
        assert r.status_code == 200, r.text
        out = text(r.json())
        assert re.fullmatch(ANSWER_RE, out), f"{path}: {out!r}"
        assert out.count("(") == out.count(")"), out


def test_gbnf_bad_grammars_are_400_naming_the_problem(base_url):
    for grammar, want in [
        ("root ::= this is (not valid GBNF", "line 1"),
        ('root ::= root "a" | "b"', "left-recursive"),
        ('item ::= "a"', "root"),
        ('root ::= item', "item"),
    ]:
        r = requests.post(f"{base_url}/completion", json={"prompt": "x", "n_predict": 1, "grammar": grammar},
                          timeout=30)
        assert r.status_code == 400 and want in r.json()["error"]["message"], (grammar, r.text)
    r = requests.post(f"{base_url}/completion", json={"prompt": "x", "grammar": 'root ::= "a"',
                                                      "json_schema": {}}, timeout=30)
    assert r.status_code == 400


def test_grammar_file_flag_is_the_default_a_request_overrides(tmp_path):
    path = tmp_path / "digits.gbnf"
    path.write_text('root ::= [0-9]{3} "!"\n')
    with spawn_muser("--grammar-file", str(path)) as url:
        r = requests.post(f"{url}/completion", json={"prompt": "Count:", "n_predict": 8, "temperature": 0},
                          timeout=60).json()
        assert re.fullmatch(r"[0-9]{3}!", r["content"]), r["content"]
        r = requests.post(f"{url}/completion", json={"prompt": "Count:", "n_predict": 8, "temperature": 0,
                                                     "grammar": 'root ::= "ok"'}, timeout=60).json()
        assert r["content"] == "ok"


def test_chat_json_schema_field_and_json_object_schema(base_url):
    """llama.cpp's chat `json_schema` field and `response_format` `json_object` with a `schema`."""
    messages = [{"role": "user", "content": "Write an example"}]
    for extra in [{"json_schema": {"const": "42"}},
                  {"response_format": {"type": "json_object", "schema": {"const": "42"}}}]:
        r = requests.post(f"{base_url}/v1/chat/completions", timeout=60,
                          json={"messages": messages, "max_tokens": 6, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"].strip() == '"42"'
    r = requests.post(f"{base_url}/v1/chat/completions", timeout=60, json={
        "messages": messages, "json_schema": {"const": "42"}, "response_format": {"type": "json_object"}})
    assert r.status_code == 400
