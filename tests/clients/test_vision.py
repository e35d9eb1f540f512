"""Image chats through the official `openai`, `anthropic` and `ollama` clients, on a second `muser up`
serving a synthetic Muse Glimmer (`muser synth --preset tiny`, SmolLM2's vocabulary with Muse's
special tokens) with the synthetic `vision-tiny` projector (`--mmproj`)."""

import base64
import os
import pathlib
import subprocess
import tempfile

import anthropic
import ollama
import openai
import pytest

from conftest import spawn_muser

IMAGE = pathlib.Path(__file__).parents[2] / "crates/muser-vision/tests/data/rgb-37x23.png"
# rgb-37x23 takes 6 rows (mtmd's grid on a 16-pixel cell), wrapped in <|image_start|> and
# <|image_end|>
IMAGE_TOKENS = 6 + 2


@pytest.fixture(scope="module")
def vision_url():
    bin_ = os.environ["MUSER_BIN"]
    with tempfile.TemporaryDirectory() as d:
        text = os.path.join(d, "glimmer-tiny.gguf")
        mmproj = os.path.join(d, "mmproj.gguf")
        subprocess.run([bin_, "synth", "--preset", "tiny", "--type", "f16", "--seed", "7",
                        "--vocab-from", os.environ["MUSER_MODEL"], "-o", text],
                       check=True, capture_output=True)
        subprocess.run([bin_, "synth", "--preset", "vision-tiny", "--type", "f16", "--seed", "7",
                        "-o", mmproj], check=True, capture_output=True)
        with spawn_muser("--mmproj", mmproj, "--max-images", "2",
                         env_extra={"MUSER_MODEL": text}) as url:
            yield url


@pytest.fixture(scope="module")
def png_b64():
    return base64.b64encode(IMAGE.read_bytes()).decode()


def test_openai_image_chat(vision_url, png_b64):
    client = openai.OpenAI(base_url=f"{vision_url}/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(content):
        return client.chat.completions.create(
            model="glimmer-tiny", max_tokens=6, temperature=0,
            messages=[{"role": "user", "content": content}])

    text_only = ask("What is in the picture?")
    parts = [{"type": "text", "text": "What is in the picture?"},
             {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_b64}"}}]
    r = ask(parts)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == text_only.usage.prompt_tokens + IMAGE_TOKENS
    assert 0 < r.usage.completion_tokens <= 6
    assert ask(parts).choices[0].message.content == r.choices[0].message.content

    with pytest.raises(openai.BadRequestError) as e:
        ask([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}])
    assert "not fetched" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        ask([{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_b64[:200]}"}}])
    assert "image 0" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        ask([parts[1]] * 3)
    assert "at most 2" in str(e.value)


def test_anthropic_image_message(vision_url, png_b64):
    client = anthropic.Anthropic(api_key="unused", base_url=vision_url, max_retries=0, timeout=120)

    def ask(content):
        return client.messages.create(model="glimmer-tiny", max_tokens=6, extra_body={"temperature": 0},
                                      messages=[{"role": "user", "content": content}])

    text_only = ask("What is in the picture?")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png_b64}}
    r = ask([image, {"type": "text", "text": "What is in the picture?"}])
    assert r.stop_reason == "max_tokens" and r.content[0].type == "text"
    assert r.usage.input_tokens == text_only.usage.input_tokens + IMAGE_TOKENS
    with pytest.raises(anthropic.BadRequestError) as e:
        ask([{"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}])
    assert "not fetched" in str(e.value)


def test_ollama_image_chat_and_generate(vision_url, png_b64):
    client = ollama.Client(host=vision_url, timeout=120)
    options = {"temperature": 0, "num_predict": 6}
    text_only = client.chat(model="glimmer-tiny", options=options,
                            messages=[{"role": "user", "content": "What is this?"}])
    r = client.chat(model="glimmer-tiny", options=options,
                    messages=[{"role": "user", "content": "What is this?", "images": [png_b64]}])
    assert r.done and r.message.role == "assistant"
    assert r.prompt_eval_count == text_only.prompt_eval_count + IMAGE_TOKENS
    # the client also takes image bytes and encodes them itself
    g = client.generate(model="glimmer-tiny", prompt="What is this?", images=[IMAGE.read_bytes()],
                        options=options)
    assert g.done and g.prompt_eval_count == r.prompt_eval_count
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="glimmer-tiny", prompt="x", images=[base64.b64encode(b"GIF89a").decode()],
                        options=options)
    assert e.value.status_code == 400
