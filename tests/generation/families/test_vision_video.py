"""Qwen2-VL videos through image_text_to_text equal transformers 4.57 on the tiny random model: a
video part ([frames, H, W, 3] uint8) is preprocessed as Qwen2VLImageProcessor(videos=...), becomes
<|vision_start|> + its video tokens + <|vision_end|>, its features take the video tokens as the
second masked_scatter of Qwen2VLModel.forward places them (images' features take the image
tokens, whatever the order of the parts), at get_rope_index's positions."""
from __future__ import annotations

import json

import numpy as np
import pytest

from test_vision import IMG, NEW, VEND, VID, VSTART, _hf_generate  # noqa: F401  (the shared transformers reference)


@pytest.fixture(scope="module")
def paths(vision_paths):
    return vision_paths


@pytest.fixture(scope="module")
def hf(qwen2vl_hf):
    return qwen2vl_hf


@pytest.fixture(scope="module")
def model(paths, load_model):
    return load_model(paths["qwen2vl-onnx"])


def _video(seed, frames, height, width):
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def test_video_pixels_equal_qwen2vl_image_processor(paths, hf):
    """Videos of odd sizes and 1, 3, 4 and 5 frames (odd counts repeat the last frame), alone
    and batched."""
    from generation.families.images import qwen2vl_video_pixels

    processor = hf[1]
    config = json.loads((paths["qwen2vl-onnx"] / "preprocessor_config.json").read_text())
    videos = [_video(i, t, h, w) for i, (t, h, w) in enumerate([(4, 13, 21), (3, 30, 17), (1, 9, 40), (5, 70, 33)])]
    for video in videos:
        ref = processor(images=None, videos=[video], return_tensors="np")
        got, grid = qwen2vl_video_pixels([video], config)
        np.testing.assert_array_equal(grid, ref["video_grid_thw"])
        np.testing.assert_allclose(got, ref["pixel_values_videos"], atol=1e-5, rtol=0)
    ref = processor(images=None, videos=videos, return_tensors="np")
    got, grid = qwen2vl_video_pixels(videos, config)
    np.testing.assert_array_equal(grid, ref["video_grid_thw"])
    np.testing.assert_allclose(got, ref["pixel_values_videos"], atol=1e-5, rtol=0)


IMAGE = np.random.default_rng(7).integers(0, 256, (13, 21, 3), dtype=np.uint8)
VIDEOS = [_video(8, 4, 17, 25), _video(9, 3, 24, 12)]
PROMPTS = [
    [[5, 6, 7], VIDEOS[0], [8, 9]],  # one video
    [[5], IMAGE, [6, 7], VIDEOS[1], [8]],  # an image, then a video
    [VIDEOS[1], [11, 12], IMAGE, [13], VIDEOS[0], [14]],  # a video first: features by kind, not by order
    [[20, 21, 22]],  # text only
]


def _context(model, **kw):
    import generation

    return generation.context(model, max_new_tokens=NEW, **kw)


def test_video_greedy_alone_equals_transformers(hf, model):
    from generation.tasks import image_text_to_text

    ref = _hf_generate(hf, PROMPTS)
    assert len({tuple(r) for r in ref}) == len(ref)  # the videos change the output
    for prompt, expected in zip(PROMPTS, ref):
        assert image_text_to_text(_context(model), [prompt], seeds=[0])[0].tokens == expected


@pytest.mark.parametrize("steps", ["whole", "pieces"])
def test_video_batch_equals_transformers(hf, model, steps):
    """A batch of prompts with videos and images in different orders, one without either; a
    row's video features follow those of the rows before it; 'pieces' cuts through videos."""
    from generation.tasks import image_text_to_text

    ref = _hf_generate(hf, PROMPTS)
    order = [2, 3, 0, 1]
    out = image_text_to_text(_context(model, prompt_steps=steps), [PROMPTS[i] for i in order], seeds=[0, 1, 2, 3])
    assert [r.tokens for r in out] == [ref[i] for i in order]


def test_video_beam_search_equals_transformers(hf, model):
    from generation.tasks import image_text_to_text

    batch = [PROMPTS[1], PROMPTS[0]]
    out = image_text_to_text(_context(model, num_beams=3), batch, seeds=[0, 1])
    assert [r.tokens for r in out] == _hf_generate(hf, batch, num_beams=3)


def test_separate_encoder_runs_images_then_videos(hf, model):
    from generation.tasks import image_text_to_text
    from generation.families.vision import encode_images

    calls = []

    def encode(pixel_values, grid_thw):
        calls.append(np.asarray(grid_thw).tolist())
        return encode_images(model, pixel_values, grid_thw)

    out = image_text_to_text(_context(model), [PROMPTS[2]], seeds=[0], encode=encode)
    assert out[0].tokens == _hf_generate(hf, [PROMPTS[2]])[0]
    assert calls == [[[1, 6, 10]], [[2, 12, 6], [2, 8, 12]]]  # the image, then both videos in order


def test_bad_videos(model):
    from generation.tasks import image_text_to_text

    with pytest.raises(ValueError, match=r"videos\[0\] must be a \[frames, height, width, 3\] uint8 array"):
        image_text_to_text(_context(model), [[VIDEOS[0].astype(np.float32)]])
    with pytest.raises(ValueError, match=r"the vision encoder gave 3 features for 48 video tokens"):
        image_text_to_text(_context(model), [[VIDEOS[0]]], encode=lambda p, g: np.zeros((3, 64), np.float32))
    with pytest.raises(ValueError, match=r"prompts hold 49 video tokens \(id 991\) for 1 videos of 48"):
        image_text_to_text(_context(model), [[[VID], VIDEOS[0]]])
    with pytest.raises(ValueError, match=r"prompts\[0\] holds 1 video tokens \(id 991\) but no video features were "
                                         r"given \(encoder=PromptImages\)"):
        image_text_to_text(_context(model), [[[VSTART, VID, VEND]]])
    with pytest.raises(ValueError, match=r"prompts\[1\] holds 2 video tokens \(id 991\) but no video features were "
                                         r"given \(PromptImages.video_features\)"):
        image_text_to_text(_context(model), [[IMAGE], [IMAGE, [VID, VID]]])
