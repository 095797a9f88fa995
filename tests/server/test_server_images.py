"""Images over HTTP on a random LLaVA folder: `image_data` in /generate and `image_url` content parts
through the official OpenAI client give what the Engine gives for the same image; bad images (corrupt
bytes, a URL to fetch, too many) are 400s that say why."""

from __future__ import annotations

import base64

import pytest
import requests
from conftest import http_server_in_thread
from helpers.vlm_folders import make_llava_folder, png_bytes, random_image
from plait.runtime import Engine
from plait.runtime.multimodal.prompt_images import MAX_IMAGES_PER_REQUEST

GREEDY = {"temperature": 0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine(make_llava_folder(tmp_path_factory.mktemp("llava")), device="cpu")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    with http_server_in_thread(engine) as base:
        yield base


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def test_generate_image_data_equals_the_engine(engine, url):
    image = random_image(7)
    prompt = "the quick <image> fox"
    want = engine.generate(prompt, GREEDY, image_data=image)["output_ids"]
    b64 = base64.b64encode(png_bytes(image)).decode()
    for sent in (b64, data_url(image), [b64]):
        r = requests.post(url + "/generate", json={"text": prompt, "sampling_params": GREEDY, "image_data": sent})
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want
    # a batch: images per prompt
    other = random_image(8)
    body = {
        "text": [prompt, "hello <image> there <image>"],
        "sampling_params": GREEDY,
        "image_data": [b64, [data_url(other), b64]],
    }
    r = requests.post(url + "/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()[0]["output_ids"] == want
    assert (
        r.json()[1]["output_ids"]
        == engine.generate("hello <image> there <image>", GREEDY, image_data=[other, image])["output_ids"]
    )


def test_openai_image_url_parts_with_the_official_client(engine, url):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    image = random_image(9)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is "},
                {"type": "image_url", "image_url": {"url": data_url(image)}},
            ],
        }
    ]
    out = client.chat.completions.create(model=engine.model_path, messages=messages, temperature=0, max_tokens=8)
    rendered = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "what is <image>"}], tokenize=False, add_generation_prompt=True
    )
    want = engine.generate(rendered, GREEDY, image_data=image)["text"]
    assert out.choices[0].message.content == want
    assert out.usage.prompt_tokens > 16  # the image's 16 tokens are in the prompt


@pytest.mark.parametrize(
    "content, needle",
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "no network"),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"junk").decode()}},
            "not a readable image",
        ),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "'input_audio' are not supported"),
    ],
)
def test_chat_bad_images_are_400s(url, content, needle):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, content]}], "max_tokens": 4}
    r = requests.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_generate_bad_images_are_400s(url):
    image = base64.b64encode(png_bytes(random_image(1))).decode()
    cases = [
        ({"text": "a <image> b", "image_data": base64.b64encode(b"\x89PNG broken").decode()}, "not a readable image"),
        ({"text": "a <image> b", "image_data": "http://example.com/x.png"}, "no network"),
        ({"text": "a <image> b", "image_data": [image, image]}, "1 image token(s)"),
        (
            {"text": "<image>" * (MAX_IMAGES_PER_REQUEST + 1), "image_data": [image] * (MAX_IMAGES_PER_REQUEST + 1)},
            f"at most {MAX_IMAGES_PER_REQUEST}",
        ),
    ]
    for body, needle in cases:
        r = requests.post(url + "/generate", json={**body, "sampling_params": GREEDY})
        assert r.status_code == 400, (body.get("image_data", "")[:20], r.text)
        assert needle in r.json()["error"]["message"]
