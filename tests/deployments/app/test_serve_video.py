"""Videos in chat through the server, with the `openai` client: a video_url part (a video file as a
data URL, decoded with PyAV in the Vision deployment) and a video part (its frames as image data
URLs), beside images and text-only requests in the decoder's one batch; the Vision deployment
caches a video's features by its content. Outputs equal `generation.tasks.image_chat` on the same
conversation (itself equal to transformers' processor + generate, tests/generation/families/
test_vision_video_chat.py) with the file's frames as PyAV decodes them; bad videos, too many
frames and models that take no videos get a 400 naming the part."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import openai
import pytest
from test_vision_video_chat import encoded_video

import generation
from generation.families.videos import load_video
from generation.tasks import image_chat


@pytest.fixture(scope="module")
def qwen(serve_apps, load_model):
    return load_model(serve_apps.vl["qwen2vl-onnx"])


def _frames(seed, t, h, w):
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


def png(frame: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def video_file(data: bytes) -> dict:
    return {"type": "video_url", "video_url": {"url": data_url(data, "video/mp4")}}


def video_frames(frames: list[bytes]) -> dict:
    return {"type": "video", "video": [data_url(f, "image/png") for f in frames]}


def image(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data, "image/png")}}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def expected(model, messages: list[dict], seed: int = 0) -> str:
    """image_chat on the same conversation: an image_url part as the image's bytes, a video_url
    part as the file's frames (PyAV, `load_video`), a video part as its frames' bytes."""
    def data(url):
        return base64.b64decode(url.partition(",")[2])

    def part(p):
        if p["type"] == "image_url":
            return {"type": "image", "image": data(p["image_url"]["url"])}
        if p["type"] == "video_url" or p["type"] == "video" and isinstance(p["video"], str):
            return {"type": "video", "video": load_video(data(p.get("video_url", {}).get("url") or p.get("video")))}
        if p["type"] == "video":
            return {"type": "video", "video": [data(u) for u in p["video"]]}
        return p

    conversation = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                     [part(p) for p in m["content"]]} for m in messages]
    return image_chat(generation.context(model, max_new_tokens=10), [conversation], seeds=[seed])[0].text


def client(url: str, asynchronous: bool = False):
    kind = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return kind(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


FRAMES = [png(f) for f in _frames(0, 4, 28, 28)]
CLIP = encoded_video(_frames(1, 5, 32, 24))  # mp4 (mpeg4)
OTHER_FRAMES = [png(f) for f in _frames(2, 3, 17, 25)]
IMAGE = png(_frames(3, 1, 23, 37)[0])


def test_videos_in_the_batch_equal_image_chat(serve_apps, qwen):
    """Five requests at once, batched together in the decoder: a frames video, a video file, an
    image with a video over two turns, an image alone, text alone."""
    cases = [
        [{"role": "user", "content": [text("What happens in "), video_frames(FRAMES)]}],
        [{"role": "user", "content": [video_file(CLIP), text("describe the clip")]}],
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [image(IMAGE), text("then"), video_frames(OTHER_FRAMES)]},
         {"role": "assistant", "content": "a cat"},
         {"role": "user", "content": [{"type": "video", "video": data_url(CLIP, "video/mp4")}, text("and?")]}],
        [{"role": "user", "content": [image(IMAGE), text("an image")]}],
        [{"role": "user", "content": "no video at all"}],
    ]

    async def run():
        chat = client(serve_apps.vision, asynchronous=True).chat.completions
        return await asyncio.gather(*(chat.create(model="qwen", messages=m) for m in cases))

    outs = [o.choices[0].message.content for o in asyncio.run(run())]
    assert outs == [expected(qwen, m) for m in cases]
    assert len(set(outs)) == len(outs)  # the videos change the output


def test_a_streamed_sampled_video_chat_equals_the_engine_with_its_seed(serve_apps, qwen):
    messages = [{"role": "user", "content": [video_file(CLIP), text("what")]}]
    stream = client(serve_apps.vision).chat.completions.create(model="qwen", messages=messages, seed=5,
                                                               temperature=0.8, stream=True)
    got = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    conversation = [{"role": "user", "content": [{"type": "video", "video": load_video(CLIP)}, text("what")]}]
    ctx = generation.context(qwen, max_new_tokens=10, do_sample=True, temperature=0.8)
    assert got == image_chat(ctx, [conversation], seeds=[5])[0].text


@pytest.mark.parametrize("part", [video_file(encoded_video(_frames(4, 4, 20, 20))),
                                  video_frames([png(f) for f in _frames(5, 2, 20, 20)])], ids=["file", "frames"])
def test_a_repeated_video_is_encoded_once(serve_apps, part):
    import httpx
    from test_serve import metric

    messages = [{"role": "user", "content": [part, text("x")]}]
    before = httpx.get(serve_apps.vision + "/metrics").text
    chat = client(serve_apps.vision).chat.completions
    outs = [chat.create(model="qwen", messages=messages).choices[0].message.content for _ in range(3)]
    after = httpx.get(serve_apps.vision + "/metrics").text
    assert len(set(outs)) == 1
    assert metric(after, "raymuter:vision_cache_misses_total") - metric(before, "raymuter:vision_cache_misses_total") == 1
    assert metric(after, "raymuter:vision_cache_hits_total") - metric(before, "raymuter:vision_cache_hits_total") == 2


def _refused(url: str, part: dict, model: str = "qwen") -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as raised:
        client(url).chat.completions.create(model=model, messages=[{"role": "user", "content": [text("a"), part]}])
    return raised.value


@pytest.mark.parametrize("part, param, message", [
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,***"}}, "video_url", "does not decode"),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4,rawbytes"}}, "video_url", "must be base64"),
    ({"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}, "video_url",
     "remote video URLs are off"),
    (video_file(b"not a video" * 30), "video_url", "is not a video file this server decodes"),
    (video_file(png(_frames(6, 1, 8, 8)[0])), "video_url", "is not a video file this server decodes"),
    (video_file(encoded_video(_frames(7, 769, 8, 8), fps=30)), "video_url", "a video has at most 768 frames"),
    ({"type": "video", "video": [data_url(FRAMES[0], "image/png")] * 769}, "video",
     "List should have at most 768 items"),
    ({"type": "video", "video": [data_url(FRAMES[0], "image/png"), "data:image/png;base64,***"]}, "video.1",
     "does not decode"),
    (video_frames([FRAMES[0], OTHER_FRAMES[0]]), "video", "the frames of a video must be of one size"),
    (video_frames([FRAMES[0], b"junk"]), "video", "is not a readable image"),
    ({"type": "video"}, "", "a video part needs its video"),
], ids=["bad-base64", "not-base64", "remote", "junk-file", "an-image-file", "769-frames-file", "769-frames-list",
        "bad-frame-url", "frames-of-two-sizes", "junk-frame", "no-video"])
def test_bad_videos_name_the_part(serve_apps, part, param, message):
    error = _refused(serve_apps.vision, part)
    assert error.status_code == 400 and message in error.message, error.message
    assert error.param == "messages.0.content.1" + (f".{param}" if param else "")
    chat = client(serve_apps.vision).chat.completions
    assert chat.create(model="qwen", messages=[{"role": "user", "content": "still"}]).choices[0].message.content


@pytest.mark.parametrize("app, model, message", [("smolvlm", "smol", "takes images, not videos"),
                                                 ("real", "tiny", "this model takes no videos")])
def test_a_model_that_takes_no_videos_refuses_them(serve_apps, app, model, message):
    for part, param in ((video_file(CLIP), "video_url"), (video_frames(FRAMES), "video")):
        error = _refused(getattr(serve_apps, app), part, model)
        assert error.status_code == 400 and message in error.message, error.message
        assert error.param == f"messages.0.content.1.{param}"


def test_tokenize_takes_no_videos(serve_apps):
    import httpx

    out = httpx.post(serve_apps.vision + "/tokenize", json=dict(
        model="qwen", messages=[{"role": "user", "content": [video_frames(FRAMES)]}]), timeout=60)
    assert out.status_code == 400 and "video's tokens depend on its size" in out.json()["error"]["message"]


def test_the_vision_service_caches_videos_and_refuses_one_past_the_context(vision_paths):
    """VisionService alone: a file and the same frames as images are two entries, each found
    again by its bytes; a video of more tokens than the model's context is refused before its
    encoder runs, naming the part."""
    from deployments.errors import RequestError
    from deployments.services.vision import VisionService

    from generation.front import EngineOptions

    service = VisionService(vision_paths["qwen2vl-onnx"], options=EngineOptions(threads=1))
    first, again = service.encode_video(CLIP, "v"), service.encode_video(CLIP, "v")
    frames = service.encode_video(FRAMES, "v")
    assert again is first and service.encode_video(list(FRAMES), "v") is frames and len(service.cache) == 2
    # 5 frames of 32x24 (6 with the last again), resized to 24x20 (max_pixels 576), patch 2, merge 2
    assert first.images.video_grids.tolist() == [[3, 12, 10]] and len(first.features) == 3 * 12 * 10 // 4
    service.encoder.model.config["max_position_embeddings"] = 71
    with pytest.raises(RequestError, match=r"^m.0: the video makes 72 video tokens; the model's context holds 71$") \
            as raised:
        service.encode_video(encoded_video(_frames(8, 4, 28, 28)), "m.0")  # grid (2, 12, 12)
    assert raised.value.field == "m.0" and len(service.cache) == 2
