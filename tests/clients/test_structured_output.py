"""Structured output through the official `openai` client: response_format json_object and
json_schema (the client's `parse` helper with a Pydantic model), and forced tool calls."""

import json

import openai
import pydantic
import pytest


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a timezone",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
        },
    },
]


@pytest.mark.parametrize(
    "prompt",
    ["What is 2 + 2?", "Tell me a joke.", "Hi!"],
)
def test_json_object_content_parses(client, model_id, prompt):
    r = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": prompt}],
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


def test_json_object_streamed(client, model_id):
    kwargs = dict(
        model=model_id,
        messages=[
            {"role": "user", "content": "Give me a JSON object describing a cat with its name and age."}
        ],
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == whole
    assert finish == "stop", text
    assert isinstance(json.loads(text), dict)


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_json_schema_with_the_parse_helper(client, model_id):
    r = client.chat.completions.parse(
        model=model_id,
        messages=[{"role": "user", "content": "Ann is 31 years old. Describe her."}],
        response_format=Person,
        max_tokens=80,
        temperature=0,
    )
    person = r.choices[0].message.parsed
    assert isinstance(person, Person)
    assert isinstance(person.age, int)


def test_unsupported_schema_is_400(client, model_id):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model_id,
            messages=[{"role": "user", "content": "Hi"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 3}},
            },
            max_tokens=8,
        )
    assert "minLength" in str(e.value)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_gives_a_tool_call(client, model_id, stream):
    kwargs = dict(
        model=model_id,
        messages=[{"role": "user", "content": "What's the weather in Rome?"}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=96,
        temperature=0,
    )
    if stream:
        calls, finish = {}, None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for tc in c.delta.tool_calls or []:
                    calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    calls[tc.index]["name"] += tc.function.name or ""
                    calls[tc.index]["arguments"] += tc.function.arguments or ""
        assert finish == "tool_calls"
        call = calls[0]
        name, arguments = call["name"], call["arguments"]
    else:
        r = client.chat.completions.create(**kwargs)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        call = choice.message.tool_calls[0]
        name, arguments = call.function.name, call.function.arguments
    assert name in ("get_weather", "get_time")
    assert isinstance(json.loads(arguments), dict)


def test_named_tool_choice_forces_that_function(client, model_id):
    r = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "What's the weather in Rome?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=96,
        temperature=0,
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time"
    assert isinstance(json.loads(call.function.arguments), dict)
