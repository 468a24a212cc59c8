"""Chat conversations with videos (`generation.tasks.image_chat`, Qwen2-VL) equal transformers 4.57
`Qwen2VLProcessor.apply_chat_template(..., tokenize=True)` + `generate` on the tiny model: video
parts as arrays, lists of PIL frames and files (decoded with PyAV as transformers' load_video(backend=
"pyav")), beside images, in a batch. The processor's video processor (Qwen2VLVideoProcessor) needs
torchvision, which this environment lacks (PyPI's wheel links CUDA libraries the CPU torch has not):
a stand-in gives its pixels as Qwen2VLImageProcessor(videos=...), as generation.families.videos
says; everything else (the template, collecting the parts, expanding <|video_pad|>, tokenizing) is
the real processor's."""
from __future__ import annotations

import io

import numpy as np
import pytest

NEW = 8


def encoded_video(frames: np.ndarray, codec: str = "mpeg4", container: str = "mp4", fps: int = 4) -> bytes:
    """frames [T, H, W, 3] uint8 as a video file, encoded with PyAV (yuv420p: lossy)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
    return buffer.getvalue()


def _frames(seed, t, h, w):
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


IMAGE = _frames(1, 1, 20, 30)[0]
VIDEO = _frames(2, 4, 28, 28)
FRAMES = _frames(3, 3, 17, 25)  # given as a list of PIL frames
FILE_FRAMES = _frames(4, 5, 32, 24)


def _text(text):
    return {"type": "text", "text": text}


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """An mp4 file (mpeg4) of FILE_FRAMES: its path and bytes."""
    path = tmp_path_factory.mktemp("videos") / "clip.mp4"
    path.write_bytes(encoded_video(FILE_FRAMES))
    return path


@pytest.fixture(scope="module")
def conversations(clip):
    from PIL import Image

    pil = [Image.fromarray(f) for f in FRAMES]
    return [
        [{"role": "user", "content": [_text("What happens in "), {"type": "video", "video": VIDEO}]}],
        [{"role": "user", "content": [{"type": "image", "image": IMAGE}, _text("then"), {"type": "video", "video": pil}]},
         {"role": "assistant", "content": [_text("a dog")]},
         {"role": "user", "content": [{"type": "video", "video": VIDEO}, _text("and?")]}],  # image, 2 videos, 2 turns
        [{"role": "user", "content": [_text("hello")]}],  # neither
        [{"role": "user", "content": [{"type": "video", "path": str(clip)}, _text("the file")]}],
    ]


@pytest.fixture(scope="module")
def model(vision_paths, load_model):
    return load_model(vision_paths["qwen2vl-onnx"])


@pytest.fixture(scope="module")
def hf(vision_paths):
    """(transformers model, Qwen2VLProcessor with the stand-in video processor)."""
    import torch
    import transformers as tf
    from transformers.video_utils import load_video, make_batched_videos

    torch.set_num_threads(2)
    folder = vision_paths["hf/qwen2vl"]
    image_processor = tf.Qwen2VLImageProcessor.from_pretrained(folder)

    class PilVideoProcessor(tf.BaseVideoProcessor):  # (a stand-in: the real class needs torchvision)
        merge_size = image_processor.merge_size

        def __call__(self, videos, **kwargs):
            loaded = [load_video(v, backend="pyav")[0] if isinstance(v, str) else np.asarray(v)
                      for v in make_batched_videos(videos)]
            return image_processor(images=None, videos=loaded, return_tensors="pt")

    tokenizer = tf.Qwen2TokenizerFast.from_pretrained(folder)
    processor = tf.Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                    video_processor=object.__new__(PilVideoProcessor),
                                    chat_template=tokenizer.chat_template)
    return tf.Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval(), processor


def _reference(processor, conversation):
    return processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True,
                                         return_tensors="pt")


@pytest.mark.parametrize("codec, container, counted", [("mpeg4", "mp4", True), ("mpeg4", "avi", True),
                                                      ("libvpx", "webm", False), ("libx264", "matroska", False)])
def test_load_video_equals_transformers_pyav(tmp_path, codec, container, counted):
    """Every frame, as transformers' load_video(path, backend="pyav") decodes them, from the
    file's bytes or its path. Where the container does not count its frames (webm, mkv:
    stream.frames 0) transformers' default fails, and we equal it told to take them all."""
    from transformers.video_utils import load_video as reference

    from generation.families.videos import load_video

    path = tmp_path / f"clip.{container}"
    path.write_bytes(encoded_video(FILE_FRAMES, codec, container))
    if not counted:
        with pytest.raises(IndexError):
            reference(str(path), backend="pyav")
    every = (lambda metadata, **_: np.arange(len(FILE_FRAMES))) if not counted else None
    expected = reference(str(path), backend="pyav", sample_indices_fn=every)[0]
    assert expected.shape == FILE_FRAMES.shape
    for source in (path.read_bytes(), path, str(path)):
        got = load_video(source)
        assert got.dtype == np.uint8 and np.array_equal(got, expected)


def test_chat_ids_equal_apply_chat_template(hf, model, conversations):
    from generation.families.videos import video_frames
    from generation.families.vl_prompts import chat_ids, chat_media, preprocess

    for conversation in conversations:
        found = chat_media([conversation])[0]
        images = [value for kind, value, _ in found if kind == "image"]
        videos = [video_frames(value, where) for kind, value, where in found if kind == "video"]
        ids = chat_ids(model, [conversation], preprocess(model, images, videos))[0]
        ref = _reference(hf[1], conversation)
        assert ids == ref["input_ids"][0].tolist()
        assert (ids.count(991) > 0) == ("video_grid_thw" in ref)


def test_video_chat_equals_transformers(hf, model, conversations):
    """Greedy and beam tokens of the batch of conversations with videos, an image, neither."""
    import torch

    import generation
    from generation.tasks import image_chat

    for settings in ({}, {"num_beams": 2}):
        expected = []
        for conversation in conversations:
            inputs = _reference(hf[1], conversation)
            with torch.no_grad():
                out = hf[0].generate(**inputs, do_sample=False, max_new_tokens=NEW, pad_token_id=0, **settings)
            new = out[0, inputs["input_ids"].shape[1]:].tolist()
            expected.append(new[:-1] if new and new[-1] == 2 else new)
        assert len({tuple(e) for e in expected}) == len(expected)  # the videos change the output
        ctx = generation.context(model, max_new_tokens=NEW, **settings)
        assert [r.tokens for r in image_chat(ctx, conversations, seeds=[0, 1, 2, 3])] == expected


def test_videos_encoded_one_at_a_time_place_as_the_batch_does(model, conversations):
    """What a server's vision replica sends the decoder (each image and video encoded alone:
    encode_image / encode_video, then join_images and placed_images) gives the ids and inputs
    of the images and videos preprocessed and encoded together."""
    from generation.families import vl_prompts as vl
    from generation.families.videos import video_frames

    conversation = conversations[1]
    found = vl.chat_media([conversation])[0]
    assert [kind for kind, _, _ in found] == ["image", "video", "video"]
    together = vl.preprocess(model, [found[0][1]], [video_frames(v, w) for _, v, w in found[1:]])
    ids = vl.chat_ids(model, [conversation], together)[0]
    expected = vl.image_inputs(model, [ids], together)
    parts = [vl.encode_image(model, vl.preprocess(model, [found[0][1]]))]
    parts += [vl.encode_video(model, vl.preprocess(model, [], [video_frames(v, w)])) for _, v, w in found[1:]]
    assert all(p.images.pixel_values.size == 0 and (p.images.video_pixels is None or p.images.video_pixels.size == 0)
               for p in parts)  # the layout travels, not the pixels
    joined = vl.join_images(parts)
    assert vl.chat_ids(model, [conversation], joined)[0] == ids
    placed = vl.placed_images(model, ids, joined, parts)
    np.testing.assert_allclose(placed.features[0], expected.features[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(placed.video_features[0], expected.video_features[0], rtol=1e-5, atol=1e-6)
    assert placed.video_features[0].shape[0] == ids.count(991) > 0
    assert np.array_equal(placed.positions[0], expected.positions[0])


def test_video_processor_config(tmp_path):
    """Qwen2VLVideoProcessor's reading of a folder: its own file first, min/max_pixels over size,
    the class's defaults (not the image processor's) where neither is given."""
    import json

    from generation.families.images import qwen2vl_video_pixels
    from generation.families.videos import video_processor_config

    assert {k: video_processor_config(tmp_path)[k] for k in ("min_pixels", "max_pixels")} == \
        {"min_pixels": 128 * 28 * 28, "max_pixels": 28 * 28 * 768}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12845056,
                                                                   "patch_size": 14}))
    assert video_processor_config(tmp_path)["min_pixels"] == 3136
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 64, "longest_edge": 576}, "patch_size": 2, "do_sample_frames": False}))
    config = video_processor_config(tmp_path)
    assert (config["min_pixels"], config["max_pixels"], config["patch_size"]) == (64, 576, 2)
    # 100 x 100 -> 24 x 24 at the class's defaults: smart_resize(100, 100, 28, 100352, 602112) = 336 x 336
    _, grid = qwen2vl_video_pixels([_frames(0, 4, 100, 100)], {"min_pixels": 128 * 28 * 28,
                                                               "max_pixels": 28 * 28 * 768})
    assert grid.tolist() == [[2, 24, 24]]
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"do_sample_frames": True, "fps": 2}))
    with pytest.raises(ValueError, match=r"video_preprocessor_config.json: do_sample_frames is not implemented"):
        video_processor_config(tmp_path)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"size": {"height": 8, "width": 8}}))
    with pytest.raises(ValueError, match=r"size must hold shortest_edge and longest_edge"):
        video_processor_config(tmp_path)


def test_video_limits_and_bad_videos(tmp_path):
    from generation.families.videos import load_video, video_frames

    data = encoded_video(_frames(5, 6, 16, 16))
    assert video_frames(data).shape == (6, 16, 16, 3)
    with pytest.raises(ValueError, match=r"v: a video has at most 5 frames; this one has more"):
        video_frames(data, "v", max_frames=5)
    with pytest.raises(ValueError, match=r"v: a video's frames hold at most 3000 bytes as RGB .* first 4 hold 3072"):
        video_frames(data, "v", max_bytes=3000)
    with pytest.raises(ValueError, match=r"v: a video has at most 2 frames"):
        video_frames(list(FRAMES), "v", max_frames=2)
    with pytest.raises(ValueError, match=r"v: a video has at most 3 frames"):
        video_frames(VIDEO, "v", max_frames=3)
    with pytest.raises(ValueError, match=r"v is not a video file this server decodes .*InvalidDataError"):
        load_video(b"not a video at all" * 20, "v")
    png = io.BytesIO()
    from PIL import Image

    Image.fromarray(IMAGE).save(png, "PNG")  # an image demuxer is not among the video formats
    with pytest.raises(ValueError, match=r"v is not a video file this server decodes"):
        load_video(png.getvalue(), "v")
    secret = tmp_path / "secret.mp4"
    secret.write_bytes(data)
    playlist = f"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nfile://{secret}\n#EXT-X-ENDLIST\n".encode()
    with pytest.raises(ValueError, match=r"v is not a video file"):  # a playlist opens no other file
        load_video(playlist, "v")
    with pytest.raises(ValueError, match=r"v\[1\]: the frames of a video must be of one size; this one is 20x10"):
        video_frames([FRAMES[0], np.zeros((10, 20, 3), np.uint8)], "v")
    with pytest.raises(ValueError, match=r"v: a video array must be \[frames, height, width, 3\] uint8"):
        video_frames(VIDEO.astype(np.float32), "v")
    with pytest.raises(ValueError, match=r"v: no readable video file"):
        video_frames(str(tmp_path / "missing.mp4"), "v")
    with pytest.raises(ValueError, match=r"v must be a \[frames, H, W, 3\] uint8 array, a list of frames"):
        video_frames(3, "v")


def test_chat_video_errors(vision_paths, load_model, test_models, model):
    import generation
    from generation.tasks import image_chat

    video = [{"role": "user", "content": [_text("a"), {"type": "video", "video": VIDEO}]}]
    smol = generation.context(load_model(vision_paths["idefics3-onnx"]), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"conversations\[0\]\[0\].content\[1\] is a video, but .* idefics3 model: "
                                         r"it takes no videos"):
        image_chat(smol, [video])
    text_only = generation.context(load_model(test_models["llama-optimum"]), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"conversations\[0\]\[0\].content\[1\] is a video, but .* text-only"):
        image_chat(text_only, [video])
    ctx = generation.context(model, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"conversations\[0\]\[0\].content\[0\]: a video part holds the video under "
                                         r"'video' \(or a file under 'path'\); remote 'url's are not fetched"):
        image_chat(ctx, [[{"role": "user", "content": [{"type": "video", "url": "http://example.com/a.mp4"}]}]])
    with pytest.raises(ValueError, match=r"conversations\[0\]\[0\].content\[0\] is not a video file"):
        image_chat(ctx, [[{"role": "user", "content": [{"type": "video", "video": b"junk"}]}]])
    with pytest.raises(ValueError, match=r"conversations\[0\]\[0\].content\[0\]\[1\] is not a readable image"):
        image_chat(ctx, [[{"role": "user", "content": [{"type": "video", "video": [IMAGE, b"junk"]}]}]])
