"""Vision-language chat through the server: the Vision deployment preprocesses and encodes each
image of a chat request (cached by content), the decoder renders the chat template with the
images' placeholders, places the features and batches the request with the others. Outputs
equal `generation.tasks.image_chat` (itself equal to transformers' processor + generate) for
Qwen2-VL and Idefics3; bad images get 400 naming the part."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import pytest

import generation
from generation.tasks import image_chat


@pytest.fixture(scope="module")
def qwen(serve_apps, load_model):
    return load_model(serve_apps.vl["qwen2vl-onnx"])


@pytest.fixture(scope="module")
def smol(serve_apps, load_model):
    return load_model(serve_apps.vl["idefics3-onnx"])


def png(height: int, width: int, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def expected(model, messages: list[dict], images: list[bytes], seed: int = 0, **settings) -> str:
    """image_chat on the same conversation, each image_url part as an image part."""
    images = iter(images)
    conversation = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else [
        p if p["type"] == "text" else {"type": "image", "image": next(images)} for p in m["content"]]}
        for m in messages]
    ctx = generation.context(model, **{"max_new_tokens": 10, **settings})
    return image_chat(ctx, [conversation], seeds=[seed])[0].text


def chat(url, messages, model="qwen", **fields):
    return httpx.post(url + "/v1/chat/completions", json=dict(model=model, messages=messages, **fields), timeout=120)


def test_chat_with_images_equals_image_text_to_text(serve_apps, qwen):
    one, two = png(23, 37, 0), png(40, 18, 1)
    cases = [
        [{"role": "user", "content": [{"type": "text", "text": "Describe "}, part(one), {"type": "text", "text": " now"}]}],
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [part(one), {"type": "text", "text": "and"}, part(two)]}],
        [{"role": "user", "content": "no image at all"}],
    ]
    images = [[one], [one, two], []]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(serve_apps.vision + "/v1/chat/completions",
                                                      json=dict(model="qwen", messages=m)) for m in cases))

    for messages, imgs, out in zip(cases, images, asyncio.run(run())):  # batched together in the decoder
        assert out.status_code == 200, out.text
        assert out.json()["choices"][0]["message"]["content"] == expected(qwen, messages, imgs)


def test_idefics3_chat_with_images_equals_image_chat(serve_apps, smol):
    one, two = png(40, 31, 2), png(17, 52, 3)
    messages = [{"role": "user", "content": [part(one), {"type": "text", "text": "Compare with"}, part(two)]}]
    out = chat(serve_apps.smolvlm, messages, model="smol")
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["message"]["content"] == expected(smol, messages, [one, two])
    plain = chat(serve_apps.smolvlm, [{"role": "user", "content": "just text"}], model="smol").json()
    assert plain["choices"][0]["message"]["content"] == expected(smol, [{"role": "user", "content": "just text"}], [])


def test_sampled_chat_with_an_image_equals_the_engine_with_its_seed(serve_apps, qwen):
    image = png(30, 30, 5)
    messages = [{"role": "user", "content": [part(image), {"type": "text", "text": "what"}]}]
    out = chat(serve_apps.vision, messages, seed=11, temperature=0.9, top_k=20).json()
    assert out["choices"][0]["message"]["content"] == expected(qwen, messages, [image], seed=11, do_sample=True,
                                                               temperature=0.9, top_k=20)


def test_a_repeated_image_is_encoded_once(serve_apps):
    from test_serve import metric

    image = png(26, 26, 7)
    messages = [{"role": "user", "content": [part(image), {"type": "text", "text": "x"}]}]
    before = httpx.get(serve_apps.vision + "/metrics").text
    outs = [chat(serve_apps.vision, messages).json()["choices"][0]["message"]["content"] for _ in range(3)]
    after = httpx.get(serve_apps.vision + "/metrics").text
    assert len(set(outs)) == 1
    assert metric(after, "raymuter:vision_cache_misses_total") - metric(before, "raymuter:vision_cache_misses_total") == 1
    assert metric(after, "raymuter:vision_cache_hits_total") - metric(before, "raymuter:vision_cache_hits_total") == 2
    assert metric(after, "raymuter:vision_latency_seconds_count") > metric(before, "raymuter:vision_latency_seconds_count")


@pytest.mark.parametrize("url, status, message", [
    ("data:image/png;base64,AAAA", 400, "not an image"),
    ("data:image/png;base64,***", 400, "does not decode"),
    ("data:image/png,rawbytes", 400, "must be base64"),
    ("https://example.com/cat.png", 400, "remote image URLs are off"),
    ("ftp://x/y.png", 400, "data: URL or http"),
])
def test_bad_images_name_the_part(serve_apps, url, status, message):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    out = chat(serve_apps.vision, messages)
    assert out.status_code == status and message in out.json()["error"]["message"]
    assert out.json()["error"]["param"] == "messages.0.content.1.image_url"
    assert chat(serve_apps.vision, [{"role": "user", "content": "still"}]).status_code == 200


def test_an_image_for_a_text_only_model_is_refused(serve_apps):
    out = httpx.post(serve_apps.real + "/v1/chat/completions", json=dict(
        model="tiny", messages=[{"role": "user", "content": [part(png(20, 20, 0))]}]), timeout=60)
    assert out.status_code == 400 and "takes no images" in out.json()["error"]["message"]
