"""Idefics3 (SmolVLM) image-text-to-text equals transformers 4.57 on the tiny random model
(tests/model_builders/vision.py: frames of 32 pixels, 16 image tokens a frame, images split into up to
2 x 2 frames + the global one): preprocessing and the `<image>` expansion equal
Idefics3Processor, the ONNX vision encoder equals get_image_features (and onnx-community's 5-D
layout of it), and tokens equal `generate` for prompts with 0, 1 and 2 images of different sizes
through either encoder layout and through a caller's encoder.  Greedy and beam tokens alone and
in batches of 3 holding different numbers of images, whole or in power-of-two pieces:
test_vision_families.py, over these PROMPTS and `_hf_generate`."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

NEW = 10


@pytest.fixture(scope="module")
def paths(vision_paths):
    return vision_paths


@pytest.fixture(scope="module")
def hf(idefics3_hf):
    return idefics3_hf


@pytest.fixture(scope="module")
def model(paths, load_model):
    return load_model(paths["idefics3-onnx"])


@pytest.fixture(scope="module")
def model5d(paths, load_model):
    """The same model with onnx-community's vision encoder layout (pixel_values [B, N, 3, F, F],
    pixel_attention_mask [B, N, F, F])."""
    return load_model(paths["idefics3-onnx5d"])


def _images(seed, sizes):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]


def _processor_inputs(processor, parts):
    """processor(text with <image> where each image is, images) for one prompt of parts."""
    images = [p for p in parts if isinstance(p, np.ndarray)]
    text = "".join("<image>" if isinstance(p, np.ndarray) else p for p in parts)
    inputs = processor(text=[text], images=[images] if images else None, add_special_tokens=False,
                       return_tensors="pt")
    inputs.pop("token_type_ids", None)  # (4.57's processor returns them; generate refuses them)
    return inputs


_REFERENCE: dict = {}


def _hf_generate(hf, prompts, **kwargs) -> list[list[int]]:
    """transformers generate for each prompt alone, its processor's inputs: the new tokens
    without a final eos (cached: several tests share the references)."""
    import torch

    model, processor = hf
    out = []
    for parts in prompts:
        key = (tuple(p.tobytes() if isinstance(p, np.ndarray) else p for p in parts), repr(sorted(kwargs.items())))
        if key not in _REFERENCE:
            inputs = _processor_inputs(processor, parts)
            with torch.no_grad():
                ids = model.generate(**inputs, do_sample=False, max_new_tokens=NEW, **kwargs)
            new = ids[0, inputs["input_ids"].shape[1]:].tolist()
            _REFERENCE[key] = new[:-1] if new and new[-1] == 2 else new
        out.append(_REFERENCE[key])
    return out


# ---------------------------------------------------------------------------------------------
# preprocessing and the prompt
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("split", [True, False])
def test_pixels_equal_idefics3_image_processor(paths, split):
    """Random images of odd sizes (small ones grow to the longest edge, wide, tall and square
    ones, some one frame exactly), as arrays, PIL RGB and PNG bytes: the frames, and each
    image's rows and columns."""
    import transformers as tf
    from PIL import Image

    from generation.families.idefics3 import idefics3_pixels

    config = json.loads((paths["idefics3-onnx"] / "preprocessor_config.json").read_text())
    config["do_image_splitting"] = split
    processor = tf.Idefics3ImageProcessor(**{k: v for k, v in config.items() if not k.endswith(("_type", "_class"))})
    rng = np.random.default_rng(0)
    sizes = rng.integers(3, 150, (10, 2)).tolist() + [[32, 32], [20, 32], [64, 64], [33, 31], [7, 90]]
    arrays = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    for i, array in enumerate(arrays):
        png = io.BytesIO()
        Image.fromarray(array).save(png, "PNG")
        ref = processor(images=[[array]], return_tensors="np", return_row_col_info=True)
        for image in (array, Image.fromarray(array), png.getvalue()):
            got, grids = idefics3_pixels([image], config)
            assert grids == [(ref["rows"][0][0], ref["cols"][0][0])], sizes[i]
            np.testing.assert_allclose(got, ref["pixel_values"][0], atol=1e-5, rtol=0)
    ref = processor(images=[arrays[:4]], return_tensors="np", return_row_col_info=True)
    got, grids = idefics3_pixels(arrays[:4], config)
    assert grids == list(zip(ref["rows"][0], ref["cols"][0]))
    assert len(set(grids)) == (2 if split else 1)  # (2, 2) and (2, 1) frames; or (0, 0)
    np.testing.assert_allclose(got, ref["pixel_values"][0], atol=1e-5, rtol=0)


def test_prompt_ids_equal_idefics3_processor(hf, model):
    """The token ids of prompts with 0, 1 and 2 images (row / column tokens, the global image,
    the newlines between rows) equal the processor's."""
    from generation.families.idefics3 import idefics3_pixels, image_prompt
    from generation.text.tokenizer import model_tokenizer

    processor = hf[1]
    tokenizer = model_tokenizer(model)
    config = json.loads((model.folder / "preprocessor_config.json").read_text())
    for prompt in PROMPTS:
        images = [p for p in prompt if isinstance(p, np.ndarray)]
        grids = idefics3_pixels(images, config)[1]
        ids, index = [], 0
        for part in prompt:
            if isinstance(part, str):
                ids += tokenizer.encode(part, add_special_tokens=False).ids
            else:
                ids += tokenizer.encode(image_prompt(*grids[index], 16), add_special_tokens=False).ids
                index += 1
        assert ids == _processor_inputs(processor, prompt)["input_ids"][0].tolist()


def test_vision_encoder_equals_get_image_features(hf, model):
    import torch

    from generation.families.idefics3 import encode_frames

    processor = hf[1]
    inputs = processor(text=["<image><image>"], images=[IMAGES[:2]], return_tensors="pt")
    with torch.no_grad():
        ref = hf[0].model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"])
    frames = inputs["pixel_values"][0].numpy()
    got = encode_frames(model, frames)
    assert got.shape == (ref.shape[0] * 16, 64)
    np.testing.assert_allclose(got, ref.reshape(-1, 64).numpy(), atol=1e-4, rtol=0)


def test_onnx_community_vision_layout(hf, model, model5d):
    """The 5-D vision encoder (onnx-community's SmolVLM layout) is get_image_features on a padded
    batch (padding frames dropped) and on partial pixel masks; encode_frames feeds it one row of
    whole frames and gets the 4-D encoder's features."""
    import torch

    from generation.families.idefics3 import encode_frames

    inputs = model5d.vision_session.get_inputs()
    assert [(i.name, len(i.shape)) for i in inputs] == [("pixel_values", 5), ("pixel_attention_mask", 4)]
    processor = hf[1]
    batch = processor(text=["<image><image>", "<image>"], images=[IMAGES[:2], IMAGES[2:3]], padding=True,
                      return_tensors="pt")
    pixels, mask = batch["pixel_values"], batch["pixel_attention_mask"].bool()
    assert not mask[1, 3:].any()  # the second row's 3 frames, then padding
    partial = torch.zeros(2, 2, 32, 32, dtype=torch.bool)
    partial[0, 0, :24, :16] = partial[0, 1, :, :20] = partial[1, 0, :8] = partial[1, 1] = True
    for pv, pm in ((pixels, mask), (pixels[:, :2].contiguous(), partial)):
        with torch.no_grad():
            ref = hf[0].model.get_image_features(pv, pm).numpy()
        got = model5d.vision_session.run(None, {"pixel_values": pv.numpy(), "pixel_attention_mask": pm.numpy()})[0]
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    frames = pixels[0].numpy()
    with torch.no_grad():
        ref = hf[0].model.get_image_features(pixels[:1], mask[:1]).reshape(-1, 64).numpy()
    got = encode_frames(model5d, frames)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    np.testing.assert_allclose(got, encode_frames(model, frames), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# generation against transformers
# ---------------------------------------------------------------------------------------------
IMAGES = _images(5, [(13, 21), (30, 17), (40, 9), (24, 24)])
PROMPTS = [
    ["the cat sat on"],  # no image
    ["look at ", IMAGES[0], " and say"],  # one image, 2 x 2 frames + global
    ["one ", IMAGES[1], " two ", IMAGES[2], " now"],  # two images of different splits (2 x 2, 2 x 1)
    [IMAGES[3], "what"],  # image first
]


def _context(model, **kw):
    import generation

    return generation.context(model, max_new_tokens=NEW, **kw)


def test_onnx_community_layout_greedy_equals_transformers(hf, model5d):
    """The folder with the 5-D vision encoder: a batch of prompts with 2, 0 and 1 images."""
    from generation.tasks import image_text_to_text

    ref = _hf_generate(hf, PROMPTS)
    order = [2, 0, 1, 3]
    out = image_text_to_text(_context(model5d), [PROMPTS[i] for i in order], seeds=[0, 1, 2, 3])
    assert [r.tokens for r in out] == [ref[i] for i in order]


def test_separate_encoder(hf, model):
    """The vision encoder as the caller's callable, run once for the batch's frames in order."""
    from generation.families.idefics3 import encode_frames
    from generation.tasks import image_text_to_text

    calls = []

    def encode(pixel_values):
        calls.append(pixel_values.shape)
        return encode_frames(model, pixel_values)

    batch = [PROMPTS[1], PROMPTS[2]]
    out = image_text_to_text(_context(model), batch, seeds=[0, 1], encode=encode)
    assert [r.tokens for r in out] == _hf_generate(hf, batch)
    assert calls == [(5 + 5 + 3, 3, 32, 32)]  # 2 x 2 + 1, 2 x 2 + 1 and 2 x 1 + 1 frames


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
def test_bad_input(model):
    from generation.tasks import image_text_to_text

    image_token = model.config["image_token_id"]
    with pytest.raises(ValueError, match=r"prompts\[0\]\[1\] is not a readable image"):
        image_text_to_text(_context(model), [["a", b"not an image"]])
    with pytest.raises(ValueError, match=f"prompts hold 81 image tokens \\(id {image_token}\\) for 1 images of 80"):
        image_text_to_text(_context(model), [[[1, image_token], IMAGES[0]]])
    with pytest.raises(ValueError, match="the vision encoder gave 79 features for 80 image tokens"):
        image_text_to_text(_context(model), [[IMAGES[0]]], encode=lambda p: np.zeros((79, 64), np.float32))
    with pytest.raises(ValueError, match=r"pixel_values has shape \(2, 32, 32\)"):
        from generation.families.idefics3 import encode_frames
        encode_frames(model, np.zeros((2, 32, 32), np.float32))
    with pytest.raises(ValueError, match="max_image_size must be"):
        from generation.families.idefics3 import idefics3_pixels
        idefics3_pixels([IMAGES[0]], {"max_image_size": {"height": 32}})
