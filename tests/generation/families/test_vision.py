"""Qwen2-VL image-text-to-text equals transformers 4.57 on the tiny random model
(tests/model_builders/vision.py): preprocessing equals Qwen2VLImageProcessor, M-RoPE positions equal
get_rope_index, the ONNX vision encoder takes any grid, and tokens equal `generate` for prompts
with 0, 1 and 2 images of different sizes through fewer slots than rows and through a caller's
encoder.  Greedy and beam tokens alone and in batches, whole or in power-of-two pieces that cut
through an image: test_vision_families.py, over these PROMPTS and `_hf_generate`."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

IMG, VID, VSTART, VEND = 990, 991, 992, 993
NEW = 10


@pytest.fixture(scope="module")
def paths(vision_paths):
    return vision_paths


@pytest.fixture(scope="module")
def hf(qwen2vl_hf):
    return qwen2vl_hf


@pytest.fixture(scope="module")
def model(paths, load_model):
    return load_model(paths["qwen2vl-onnx"])


def _images(seed, sizes):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]


def _hf_generate(hf, prompts, **kwargs) -> list[list[int]]:
    """transformers generate for each prompt alone (parts: id lists, images [H, W, 3], videos
    [T, H, W, 3]), the processor's pixels for both: the new tokens without a final eos."""
    import torch

    model, processor = hf
    out = []
    for parts in prompts:
        images = [p for p in parts if isinstance(p, np.ndarray) and p.ndim == 3]
        videos = [p for p in parts if isinstance(p, np.ndarray) and p.ndim == 4]
        inputs, counts = {}, {}
        if images:
            pixels = processor(images=images, return_tensors="pt")
            inputs.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
            counts[3] = iter((pixels["image_grid_thw"].prod(-1) // 4).tolist())
        if videos:
            pixels = processor(images=None, videos=videos, return_tensors="pt")
            inputs.update(pixel_values_videos=pixels["pixel_values_videos"], video_grid_thw=pixels["video_grid_thw"])
            counts[4] = iter((pixels["video_grid_thw"].prod(-1) // 4).tolist())
        ids = []
        for part in parts:
            if isinstance(part, np.ndarray):
                ids += [VSTART] + [IMG if part.ndim == 3 else VID] * next(counts[part.ndim]) + [VEND]
            else:
                ids += list(part)
        x = torch.tensor([ids])
        with torch.no_grad():
            new = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW,
                                 pad_token_id=0, **inputs, **kwargs)[0, len(ids):].tolist()
        out.append(new[:-1] if new and new[-1] == 2 else new)
    return out


# ---------------------------------------------------------------------------------------------
# preprocessing
# ---------------------------------------------------------------------------------------------
def test_smart_resize_equals_transformers():
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as reference

    from generation.families.images import smart_resize

    rng = np.random.default_rng(0)
    for _ in range(300):
        h, w = (int(x) for x in rng.integers(4, 3000, 2))
        factor = int(rng.choice([4, 28]))
        low, high = sorted(int(x) for x in rng.integers(16, 2_000_000, 2))
        assert smart_resize(h, w, factor, low, high) == reference(h, w, factor, low, high), (h, w, factor, low, high)


def test_pixels_equal_qwen2vl_image_processor(paths, hf):
    """Random images of odd sizes (small ones grow to min_pixels, large ones shrink to
    max_pixels), as arrays, PIL RGB, PIL grayscale and PNG bytes, one at a time and batched."""
    from PIL import Image

    from generation.families.images import qwen2vl_pixels

    processor = hf[1]
    config = json.loads((paths["qwen2vl-onnx"] / "preprocessor_config.json").read_text())
    rng = np.random.default_rng(1)
    batch = []
    for h, w in rng.integers(3, 80, (8, 2)).tolist():
        array = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        png = io.BytesIO()
        Image.fromarray(array).save(png, "PNG")
        for image, theirs in ((array, array), (Image.fromarray(array), array),
                              (Image.fromarray(array[..., 1]), Image.fromarray(array[..., 1])),
                              (png.getvalue(), array)):
            ref = processor(images=[theirs], return_tensors="np")
            got, grid = qwen2vl_pixels([image], config)
            np.testing.assert_array_equal(grid, ref["image_grid_thw"])
            np.testing.assert_allclose(got, ref["pixel_values"], atol=1e-5, rtol=0)
        batch.append(array)
    ref = processor(images=batch, return_tensors="np")
    got, grid = qwen2vl_pixels(batch, config)
    np.testing.assert_array_equal(grid, ref["image_grid_thw"])
    np.testing.assert_allclose(got, ref["pixel_values"], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# positions and the vision encoder
# ---------------------------------------------------------------------------------------------
def _span(grid, token=IMG):
    return [VSTART] + [token] * (int(np.prod(grid)) // 4) + [VEND]


ROPE_CASES = {
    "text only": ([[1, 5, 6, 7]], [], []),
    "one image": ([[1, 5] + _span((1, 6, 10)) + [7, 8]], [(1, 6, 10)], []),
    "two images": ([[1] + _span((1, 4, 4)) + [9] + _span((1, 8, 4)) + [3]], [(1, 4, 4), (1, 8, 4)], []),
    "image first and last": ([_span((1, 12, 2))], [(1, 12, 2)], []),
    "video": ([[1, 4] + _span((3, 4, 6), VID) + [5, 6]], [], [(3, 4, 6)]),
    "long video": ([[1] + _span((9, 2, 2), VID) + [5]], [], [(9, 2, 2)]),
    "video and image": ([[1] + _span((2, 4, 4), VID) + [7] + _span((1, 6, 4)) + [8]], [(1, 6, 4)], [(2, 4, 4)]),
    "batch": ([[1] + _span((1, 4, 4)) + [2, 3] + _span((1, 4, 8)), [5, 6, 7], [1, 1] + _span((1, 8, 8)) + [4]],
              [(1, 4, 4), (1, 4, 8), (1, 8, 8)], []),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_positions_equal_get_rope_index(hf, model, case):
    """Each row's positions and delta equal get_rope_index's on the left-padded batch (its
    padding dropped)."""
    import torch

    from generation.families.vision import VisionTokens, rope_positions

    prompts, images, videos = ROPE_CASES[case]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    ref, ref_delta = hf[0].model.get_rope_index(ids, torch.tensor(images) if images else None,
                                                torch.tensor(videos) if videos else None, mask)
    got, delta = rope_positions(prompts, VisionTokens.of(model.config), images, videos)
    for b, prompt in enumerate(prompts):
        np.testing.assert_array_equal(got[b], ref[:, b, width - len(prompt):].numpy())
        # transformers' delta counts the padding; a row's next position does not
        assert got[b].shape[1] + delta[b] == width + int(ref_delta[b])


def test_vision_encoder_takes_any_grid(hf, model):
    """The ONNX encoder with numpy's grid inputs equals the torch vision tower, one grid after
    another (images of any size, a video of 3 temporal patches)."""
    import torch

    from generation.families.vision import encode_images

    rng = np.random.default_rng(2)
    for grids in ([(1, 4, 4)], [(1, 6, 10)], [(1, 12, 2), (1, 4, 8)], [(3, 4, 6)]):
        pixels = rng.standard_normal((sum(int(np.prod(g)) for g in grids), 24)).astype(np.float32)
        with torch.no_grad():
            ref = hf[0].model.visual(torch.from_numpy(pixels), grid_thw=torch.tensor(grids)).numpy()
        np.testing.assert_allclose(encode_images(model, pixels, np.array(grids)), ref, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# generation against transformers
# ---------------------------------------------------------------------------------------------
IMAGES = _images(3, [(13, 21), (30, 17), (9, 40), (24, 24)])
PROMPTS = [
    [[1, 17, 23, 44]],  # no image
    [[1, 17, 23], IMAGES[0], [44, 55, 66]],  # one image (15 tokens)
    [[1, 5], IMAGES[1], [9, 8, 7], IMAGES[2], [4]],  # two images of different sizes
    [IMAGES[3], [300, 301]],  # image first
]


def _context(model, **kw):
    import generation

    return generation.context(model, max_new_tokens=NEW, **kw)


def test_more_rows_than_slots(hf, model):
    """Four prompts through two slots: later prompts are admitted with their own features."""
    import generation
    from generation.tasks import image_text_to_text

    ctx = generation.compile(_context(model), batch_size=2)
    out = image_text_to_text(ctx, PROMPTS, seeds=[0, 1, 2, 3])
    assert [r.tokens for r in out] == _hf_generate(hf, PROMPTS)


def test_separate_encoder_with_cached_features(hf, model):
    """The vision encoder as the caller's callable (a server's deployment caching features by
    image content): the same tokens, and each distinct image encoded once."""
    import hashlib

    from generation.families.images import qwen2vl_pixels
    from generation.tasks import image_text_to_text
    from generation.families.vision import encode_images

    cache, runs = {}, []

    def encode(pixel_values, grid_thw):
        out, start = [], 0
        for grid in grid_thw:
            size = int(np.prod(grid))
            patch = pixel_values[start:start + size]
            key = hashlib.sha256(patch.tobytes() + grid.tobytes()).hexdigest()
            if key not in cache:
                runs.append(key)
                cache[key] = encode_images(model, patch, grid[None])
            out.append(cache[key])
            start += size
        return np.concatenate(out)

    prompts = [[[1, 2], IMAGES[0], [3]], [IMAGES[0], [5], IMAGES[1]], [[7], IMAGES[1]]]
    out = image_text_to_text(_context(model), prompts, seeds=[0, 1, 2], encode=encode)
    assert len(runs) == 2
    assert [r.tokens for r in out] == _hf_generate(hf, prompts)
    config = json.loads((model.folder / "preprocessor_config.json").read_text())
    assert qwen2vl_pixels([IMAGES[0]], config)[0].shape == (60, 24)


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
def test_corrupt_image(model):
    from PIL import Image

    from generation.tasks import image_text_to_text

    png = io.BytesIO()
    Image.fromarray(IMAGES[0]).save(png, "PNG")
    for bad, words in ((png.getvalue()[:40], "prompts[0][1] is not a readable image"),
                       (b"not an image", "prompts[0][1] is not a readable image"),
                       (np.zeros((4, 4), np.uint8), "prompts[0][1]: an image array must be [height, width, channels]"),
                       (3.5, "prompts[0][1] must be a PIL image")):
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            image_text_to_text(_context(model), [[[1, 2], bad]])


def test_image_tokens_not_matching_features(model):
    import generation
    from generation.tasks import image_text_to_text
    from generation.families.vision import PromptImages, split_features

    with pytest.raises(ValueError, match="prompts hold 16 image tokens .* for 1 images of 15 features"):
        image_text_to_text(_context(model), [[[1, IMG], IMAGES[0]]])
    with pytest.raises(ValueError, match="the vision encoder gave 14 features for 15 image tokens"):
        image_text_to_text(_context(model), [[[1], IMAGES[0]]], encode=lambda p, g: np.zeros((14, 64), np.float32))
    with pytest.raises(ValueError, match=r"prompts\[0\] holds 2 image tokens \(id 990\) but no image features"):
        generation.generate(_context(model), [[1, IMG, IMG, 5]], seeds=[0])
    with pytest.raises(ValueError, match=r"prompts\[1\] holds 2 image tokens \(id 990\) but has features for 1"):
        images = PromptImages([np.zeros((1, 64), np.float32)] * 2, [None, None], IMG)
        generation.generate(_context(model), [[1, IMG, 5], [IMG, IMG]], seeds=[0, 1], encoder=images)
    with pytest.raises(ValueError, match="the prompts hold 3 image tokens .* but image features has 2 rows"):
        split_features([[IMG, 4], [IMG, IMG]], np.zeros((2, 64), np.float32), IMG)
    more = split_features([[IMG, 4], [5, IMG]], np.arange(5)[:, None] * np.ones((5, 64), np.float32), IMG)
    assert [f[:, 0].tolist() for f in more] == [[0.0], [1.0]]  # extra features are fine


def test_image_for_text_only_model(test_models, load_model):
    import generation
    from generation.tasks import image_text_to_text
    from generation.families.vision import PromptImages

    text_model = load_model(test_models["llama-optimum"])
    ctx = generation.context(text_model, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompts\[0\]\[1\] is an image, but .* is a text-only model"):
        image_text_to_text(ctx, [[[1, 2], IMAGES[0]]])
    images = PromptImages([np.zeros((0, 64), np.float32)], [None], IMG)
    with pytest.raises(ValueError, match="is a text-only model .*: it takes no images"):
        generation.generate(ctx, [[1, 2, 3]], seeds=[0], encoder=images)


# ---------------------------------------------------------------------------------------------
# image-to-text: a ViT + GPT-2 vision-encoder-decoder through the encoder-decoder path
# ---------------------------------------------------------------------------------------------
CAPTION_IMAGES = _images(4, [(13, 21), (40, 33), (32, 32), (7, 50)])


@pytest.fixture(scope="module")
def captioner(paths):
    import torch
    import transformers as tf

    torch.set_num_threads(2)
    model = tf.VisionEncoderDecoderModel.from_pretrained(paths["hf/vit-gpt2"], dtype=torch.float32).eval()
    return model, tf.ViTImageProcessor.from_pretrained(paths["hf/vit-gpt2"])


def test_vit_pixels_equal_vit_image_processor(paths, captioner):
    from PIL import Image

    from generation.families.images import vit_pixels

    config = json.loads((paths["vit-gpt2-optimum"] / "preprocessor_config.json").read_text())
    # (not grayscale: ViTImageProcessor with do_convert_rgb unset keeps one channel and fails
    # on the three-channel mean; here every image is RGB first)
    images = CAPTION_IMAGES + [Image.fromarray(CAPTION_IMAGES[1])]
    ref = captioner[1](images=images, return_tensors="np")["pixel_values"]
    np.testing.assert_allclose(vit_pixels(images, config), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("settings", [{}, {"no_repeat_ngram_size": 1}, {"num_beams": 3},
                                      {"num_beams": 3, "no_repeat_ngram_size": 1}])
def test_image_to_text_equals_transformers(paths, captioner, load_model, settings):
    """Captions of a batch of 4 images of different sizes equal generate(pixel_values): the
    tiny model repeats tokens, so no_repeat_ngram_size=1 walks down its ranking (image-dependent
    tokens all along)."""
    import torch

    import generation
    from generation.tasks import image_to_text

    model, processor = captioner
    pixels = processor(images=CAPTION_IMAGES, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        ref = model.generate(pixel_values=pixels, do_sample=False, max_new_tokens=NEW, **settings)
    expected = []
    for row in ref[:, 1:].tolist():  # without decoder_start
        row = row[:row.index(2)] if 2 in row else row
        expected.append(row)
    ctx = generation.context(load_model(paths["vit-gpt2-optimum"]), max_new_tokens=NEW, **settings)
    out = image_to_text(ctx, CAPTION_IMAGES, seeds=[0, 1, 2, 3])
    assert [r.tokens for r in out] == expected
    if settings == {"no_repeat_ngram_size": 1}:
        assert len({tuple(r) for r in expected}) == len(expected)


def test_image_to_text_errors(paths, model, load_model):
    import generation
    from generation.tasks import image_to_text

    ctx = generation.context(load_model(paths["vit-gpt2-optimum"]), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"images\[1\] is not a readable image"):
        image_to_text(ctx, [CAPTION_IMAGES[0], b"\x89PNG broken"])
    with pytest.raises(ValueError, match=r"images\[0\]: no such image file"):
        image_to_text(ctx, ["/nonexistent/photo.png"])
    with pytest.raises(ValueError, match=r"image_to_text takes a vision-encoder-decoder \(ViT \+ GPT-2\);.* is a qwen2_vl model"):
        image_to_text(_context(model), [CAPTION_IMAGES[0]])
