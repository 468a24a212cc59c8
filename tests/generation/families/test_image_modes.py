"""Images of every mode, preprocessed as each family's transformers 4.57 processor does: the
slow processors the fixtures' folders load (Qwen2VLImageProcessor, Idefics3ImageProcessor,
ViTImageProcessor; no torchvision, no fast ones). The modes: PIL RGB, RGBA with partial
transparency, LA, L, P without and with a transparency entry (an index, an alpha table), CMYK,
I;16 and 1; arrays of 1, 3 and 4 channels, channels last and first, uint8 and floats in [0, 1]
(and a 2-D array). Per family and mode: the pixels (and grids) within 1e-5 of the processor's,
or, where the processor raises, a ValueError naming the input; where a plausible wrong
conversion exists (alpha dropped or composited, rounding for truncation, the other resampling),
the processor's pixels differ from it, so a wrong conversion fails here; and per family the
tokens of prompts holding every mode it takes (a few a prompt) equal transformers generate."""
from __future__ import annotations

import json
import re
import zlib

import numpy as np
import pytest

NEW = 8
H, W = 20, 30
IMG, VSTART, VEND = 990, 992, 993

PIL_MODES = ["RGB", "RGBA", "LA", "L", "P", "P-trns-index", "P-trns-alpha", "CMYK", "I;16", "1"]
ARRAY_MODES = [f"{dtype}-{layout}" for dtype in ("uint8", "float")  # hw3: [H, W, 3]; 3hw: [3, H, W]
               for layout in ("hw1", "1hw", "hw3", "3hw", "hw4", "4hw")]
MODES = [f"pil-{m}" for m in PIL_MODES] + ARRAY_MODES + ["uint8-hw"]
_ODD_CHANNELS = {m for m in ARRAY_MODES if m.split("-")[1].strip("hw") in ("1", "4")} | {"uint8-hw"}
REFUSED = {  # what transformers raises on: "Unable to infer channel dimension format", its 3-value mean, 2-D arrays
    "qwen2vl": _ODD_CHANNELS,
    "idefics3": {"pil-LA", "pil-L", "pil-P", "pil-P-trns-index", "pil-P-trns-alpha", "pil-I;16", "pil-1", "uint8-hw"},
    "vit": {f"pil-{m}" for m in PIL_MODES if m != "RGB"} | _ODD_CHANNELS,  # do_convert_rgb unset
}
FAMILIES = ["qwen2vl", "idefics3", "vit"]
# (Pillow's, on convert("RGB") of the P image with an alpha table: transformers and ours alike)
pytestmark = pytest.mark.filterwarnings("ignore:Palette images with Transparency expressed in bytes")
CASES = [(family, mode) for family in FAMILIES for mode in MODES]


# ---------------------------------------------------------------------------------------------
# the images
# ---------------------------------------------------------------------------------------------
_BUILT: dict = {}


def _image(mode: str):
    """The image of `mode`, [20, 30] pixels, its content its own (so tokens differ by mode),
    the same each call."""
    if mode not in _BUILT:
        _BUILT[mode] = _build(mode)
    return _BUILT[mode]


def _build(mode: str):
    from PIL import Image

    rng = np.random.default_rng(zlib.crc32(mode.encode()))
    rgb = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
    alpha = rng.integers(0, 256, (H, W), dtype=np.uint8)
    alpha[0, :4], alpha[1, :4] = 0, 255  # clear and opaque pixels among the partly transparent
    if mode.startswith("pil-"):
        mode = mode[4:]
        if mode == "RGB":
            return Image.fromarray(rgb)
        if mode == "RGBA":
            return Image.fromarray(np.dstack([rgb, alpha]))
        if mode == "LA":
            return Image.merge("LA", [Image.fromarray(rgb[..., 0]), Image.fromarray(alpha)])
        if mode == "L":
            return Image.fromarray(rgb[..., 1])
        if mode.startswith("P"):
            image = Image.fromarray(rgb).quantize(16)
            if mode == "P-trns-index":
                image.info["transparency"] = int(np.bincount(np.asarray(image).ravel()).argmax())
            elif mode == "P-trns-alpha":
                image.info["transparency"] = bytes(range(0, 256, 16))
            return image
        if mode == "CMYK":
            return Image.frombytes("CMYK", (W, H), rng.integers(0, 256, (H, W, 4), dtype=np.uint8).tobytes())
        if mode == "I;16":
            return Image.fromarray(rng.integers(0, 65536, (H, W)).astype(np.uint16))
        if mode == "1":
            return Image.fromarray(rng.integers(0, 2, (H, W)).astype(bool))
        raise AssertionError(mode)
    dtype, layout = mode.split("-")
    if layout == "hw":
        return rgb[..., 0]
    channels = int(layout.strip("hw"))
    x = np.dstack([rgb, alpha])[..., :channels] if dtype == "uint8" else rng.random((H, W, channels)).astype(np.float32)
    return x.transpose(2, 0, 1) if layout[0] != "h" else x


def test_images_are_of_their_modes():
    """Each PIL image has its mode, the RGBA image pixels clear, opaque and between, the P
    images' transparency entries pixels that use them, the I;16 image values past 255."""
    for mode in PIL_MODES:
        assert _image(f"pil-{mode}").mode == mode.split("-")[0]
    alpha = np.asarray(_image("pil-RGBA"))[..., 3]
    assert ((alpha > 0) & (alpha < 255)).mean() > 0.9 and (alpha == 0).any() and (alpha == 255).any()
    for mode in ("P-trns-index", "P-trns-alpha"):
        image = _image(f"pil-{mode}")
        assert (np.asarray(image.convert("RGBA"))[..., 3] < 255).any()
    assert np.asarray(_image("pil-I;16")).max() > 255
    assert _image("float-hw3").dtype == np.float32 and 0 <= _image("float-hw3").min() < _image("float-hw3").max() <= 1


# ---------------------------------------------------------------------------------------------
# what a wrong conversion would give (each case's reference must differ from it)
# ---------------------------------------------------------------------------------------------
def _on_white(image):
    from PIL import Image

    rgba = image.convert("RGBA")
    return np.asarray(Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255)), rgba).convert("RGB"))


def _drop_alpha(image):
    if isinstance(image, np.ndarray):
        return image[:3] if image.shape[0] == 4 else image[..., :3]
    return np.asarray(image.convert("RGB"))


def _rounded(image):
    return np.round(image * 255).astype(np.uint8)


def _gray(values):
    return np.repeat(values.astype(np.uint8)[..., None], 3, axis=-1)


def _other_layout(image):
    return image.transpose(1, 2, 0) if image.shape[0] == 1 else image.transpose(2, 0, 1)


WRONG = {
    "qwen2vl": {  # convert("RGB") first: alpha and transparency dropped, PIL's own CMYK, I;16 and 1
        "pil-RGBA": _on_white, "pil-LA": _on_white, "pil-P-trns-index": _on_white, "pil-P-trns-alpha": _on_white,
        "pil-CMYK": lambda im: np.asarray(im)[..., :3], "pil-I;16": lambda im: _gray(np.asarray(im) >> 8),
        "pil-1": lambda im: _gray(np.asarray(im)), "float-hw3": _rounded, "float-3hw": _rounded,
    },
    "idefics3": {  # RGB after the resizes, on white; one channel last resized NEAREST; floats truncated
        "pil-RGBA": _drop_alpha, "pil-CMYK": _drop_alpha, "uint8-hw4": _drop_alpha, "uint8-4hw": _drop_alpha,
        "float-hw4": _drop_alpha, "float-4hw": _drop_alpha, "uint8-hw1": _other_layout, "uint8-1hw": _other_layout,
        "float-hw1": _other_layout, "float-1hw": _other_layout, "float-hw3": _rounded, "float-3hw": _rounded,
    },
    "vit": {"float-hw3": _rounded, "float-3hw": _rounded},  # floats rescaled twice, as there
}


# ---------------------------------------------------------------------------------------------
# the processors and ours
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def captioner(vision_paths):
    import torch
    import transformers as tf

    torch.set_num_threads(2)
    model = tf.VisionEncoderDecoderModel.from_pretrained(vision_paths["hf/vit-gpt2"], dtype=torch.float32).eval()
    return model, tf.ViTImageProcessor.from_pretrained(vision_paths["hf/vit-gpt2"])


@pytest.fixture(scope="module")
def processors(qwen2vl_hf, idefics3_hf, captioner):
    out = {"qwen2vl": qwen2vl_hf[1], "idefics3": idefics3_hf[1].image_processor, "vit": captioner[1]}
    assert {f: type(p).__name__ for f, p in out.items()} == {
        "qwen2vl": "Qwen2VLImageProcessor", "idefics3": "Idefics3ImageProcessor", "vit": "ViTImageProcessor"}
    return out


@pytest.fixture(scope="module")
def configs(vision_paths):
    folders = {"qwen2vl": "qwen2vl-onnx", "idefics3": "idefics3-onnx", "vit": "vit-gpt2-optimum"}
    return {f: json.loads((vision_paths[d] / "preprocessor_config.json").read_text()) for f, d in folders.items()}


def _reference(family, processor, image):
    """(pixels, grids) of one image by the transformers processor."""
    if family == "qwen2vl":
        out = processor(images=[image], return_tensors="np")
        return out["pixel_values"], out["image_grid_thw"].tolist()
    if family == "idefics3":
        out = processor(images=[[image]], return_tensors="np", return_row_col_info=True)
        return out["pixel_values"][0], [(out["rows"][0][0], out["cols"][0][0])]
    return processor(images=[image], return_tensors="np")["pixel_values"], None


def _ours(family, config, image):
    from generation.families.idefics3 import idefics3_pixels
    from generation.families.images import qwen2vl_pixels, vit_pixels

    if family == "qwen2vl":
        pixels, grids = qwen2vl_pixels([image], config)
        return pixels, grids.tolist()
    if family == "idefics3":
        return idefics3_pixels([image], config)
    return vit_pixels([image], config), None


# ---------------------------------------------------------------------------------------------
# pixels
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,mode", CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_pixels_equal_the_processor(processors, configs, family, mode):
    image = _image(mode)
    if mode in REFUSED[family]:
        with pytest.raises(ValueError):
            _reference(family, processors[family], image)
        words = rf"mode '{re.escape(mode[4:].split('-')[0])}'" if mode.startswith("pil-") else ""
        with pytest.raises(ValueError, match=rf"^images\[0\].*{words}"):
            _ours(family, configs[family], image)
        return
    ref, ref_grids = _reference(family, processors[family], image)
    got, grids = _ours(family, configs[family], image)
    assert grids == ref_grids
    assert got.dtype == np.float32 and got.shape == ref.shape
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    wrong = WRONG[family].get(mode)
    if wrong is not None:
        other = _reference(family, processors[family], wrong(image))[0]
        assert other.shape != ref.shape or np.abs(other - ref).max() > 1e-3, "the case tells no conversions apart"


def test_every_wrong_conversion_names_a_case_taken():
    for family, wrong in WRONG.items():
        assert set(wrong) <= set(MODES) - REFUSED[family], family


def test_a_batch_of_modes_is_each_image_alone(processors, configs):
    """Several modes in one call give each image's pixels as alone, in order (Qwen2-VL's
    processor runs image by image; Idefics3's and ViT's take the channel layout of a call's
    first image for all, so ours are checked against a call per image)."""
    from generation.families.idefics3 import idefics3_pixels
    from generation.families.images import qwen2vl_pixels, vit_pixels

    batches = {"qwen2vl": ["pil-RGBA", "float-3hw", "pil-P-trns-index", "uint8-hw3"],
               "idefics3": ["float-1hw", "pil-RGBA", "uint8-hw1", "float-hw4"],
               "vit": ["float-3hw", "pil-RGB", "uint8-hw3"]}
    run = {"qwen2vl": lambda ims, c: qwen2vl_pixels(ims, c)[0], "idefics3": lambda ims, c: idefics3_pixels(ims, c)[0],
           "vit": vit_pixels}
    for family, modes in batches.items():
        got = run[family]([_image(m) for m in modes], configs[family])
        ref = np.concatenate([_reference(family, processors[family], _image(m))[0] for m in modes])
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)


def test_load_image_keeps_what_the_processors_read():
    """load_image gives a PIL image back as it is (mode, palette, transparency), an array as it
    is (dtype, layout), encoded bytes as RGB uint8, and takes its own output again; it refuses
    arrays no processor reads, naming the input."""
    import io

    from generation.families.images import load_image

    for mode in ("pil-P-trns-index", "pil-RGBA", "pil-I;16"):
        image = _image(mode)
        assert load_image(image) is image and load_image(load_image(image)) is image
    for mode in ("float-4hw", "uint8-hw1"):
        assert load_image(_image(mode)) is _image(mode)
    png = io.BytesIO()
    _image("pil-RGBA").save(png, "PNG")
    decoded = load_image(png.getvalue())
    assert decoded.dtype == np.uint8 and decoded.shape == (H, W, 3)
    np.testing.assert_array_equal(decoded, np.asarray(_image("pil-RGBA").convert("RGB")))
    for bad, words in ((np.zeros((5, 6, 2), np.uint8), "1, 3 or 4 channels"),
                       (np.full((4, 5, 3), 1.5, np.float32), r"floats in \[0, 1\]"),
                       (np.full((4, 5, 3), 256.0), r"whole numbers in \[0, 255\]"),
                       (np.zeros((4, 5, 3), bool), "of integers or floats"),
                       (np.zeros((0, 5, 3), np.uint8), "of integers or floats")):
        with pytest.raises(ValueError, match=rf"^part\[2\]: an image array .*{words}"):
            load_image(bad, "part[2]")


# ---------------------------------------------------------------------------------------------
# tokens against transformers generate
# ---------------------------------------------------------------------------------------------
def _taken(family):
    return [m for m in MODES if m not in REFUSED[family]]


def _groups(family, size=5):
    """The modes `family` takes, in prompts of up to `size` images (transformers generate runs
    once a prompt; ours once for them all). Idefics3's processor reads every image of a call in
    the first's channel layout, so its groups keep to one layout."""
    taken = _taken(family)
    layouts = [[m for m in taken if not m.endswith("hw")], [m for m in taken if m.endswith("hw")]]  # last, first
    if family != "idefics3":
        layouts = [taken]
    return [modes[i:i + size] for modes in layouts for i in range(0, len(modes), size)]


def _context(load_model, folder, **settings):
    import generation

    return generation.context(load_model(folder), max_new_tokens=NEW, **settings)


def _strip_eos(row):
    return row[:row.index(2)] if 2 in row else row


def test_qwen2vl_tokens_per_mode(qwen2vl_hf, vision_paths, load_model):
    import torch

    from generation.tasks import image_text_to_text

    model, processor = qwen2vl_hf
    groups = _groups("qwen2vl")
    assert sum(map(len, groups)) == 14
    expected, prompts = [], []
    for modes in groups:
        pixels = processor(images=[_image(m) for m in modes], return_tensors="pt")
        counts = (pixels["image_grid_thw"].prod(-1) // 4).tolist()
        ids = [1, 17] + [t for k, n in enumerate(counts) for t in [VSTART] + [IMG] * n + [VEND, 30 + k]] + [44]
        ids = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW, pad_token_id=0, pixel_values=pixels["pixel_values"],
                                 image_grid_thw=pixels["image_grid_thw"])
        expected.append(_strip_eos(out[0, ids.shape[1]:].tolist()))
        prompts.append([[1, 17]] + [p for k, m in enumerate(modes) for p in (_image(m), [30 + k])] + [[44]])
    ctx = _context(load_model, vision_paths["qwen2vl-onnx"])
    out = image_text_to_text(ctx, prompts, seeds=list(range(len(prompts))))
    assert [r.tokens for r in out] == expected
    assert len({tuple(e) for e in expected}) == len(expected)  # the images change the output


def test_idefics3_tokens_per_mode(idefics3_hf, vision_paths, load_model):
    import torch

    from generation.tasks import image_text_to_text

    model, processor = idefics3_hf
    groups = _groups("idefics3")
    assert sum(map(len, groups)) == 15
    expected, prompts = [], []
    for modes in groups:
        parts = ["look at "] + [p for k, m in enumerate(modes) for p in (_image(m), f" and {k} ")]
        parts[-1] = parts[-1].rstrip()
        text = "".join(p if isinstance(p, str) else "<image>" for p in parts)
        inputs = processor(text=[text], images=[[_image(m) for m in modes]], add_special_tokens=False,
                           return_tensors="pt")
        inputs.pop("token_type_ids", None)
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=NEW)
        expected.append(_strip_eos(out[0, inputs["input_ids"].shape[1]:].tolist()))
        prompts.append(parts)
    ctx = _context(load_model, vision_paths["idefics3-onnx"])
    out = image_text_to_text(ctx, prompts, seeds=list(range(len(prompts))))
    assert [r.tokens for r in out] == expected
    assert len({tuple(e) for e in expected}) == len(expected)


def test_vit_tokens_per_mode(captioner, vision_paths, load_model):
    """One batch of every mode ViT takes (the processor's pixels image by image: over a batch it
    reads every image in the first's channel layout), no_repeat_ngram_size=1 as test_vision's."""
    import torch

    from generation.tasks import image_to_text

    model, processor = captioner
    modes = _taken("vit")
    assert len(modes) == 5
    pixels = torch.cat([processor(images=[_image(m)], return_tensors="pt")["pixel_values"] for m in modes])
    with torch.no_grad():
        ref = model.generate(pixel_values=pixels, do_sample=False, max_new_tokens=NEW, no_repeat_ngram_size=1)
    expected = [_strip_eos(row) for row in ref[:, 1:].tolist()]
    ctx = _context(load_model, vision_paths["vit-gpt2-optimum"], no_repeat_ngram_size=1)
    out = image_to_text(ctx, [_image(m) for m in modes], seeds=list(range(len(modes))))
    assert {m: r.tokens for m, r in zip(modes, out)} == dict(zip(modes, expected))
    assert len({tuple(e) for e in expected}) >= 4  # (the two float images, rescaled twice, are all but black)


@pytest.mark.parametrize("folder,task,mode", [("qwen2vl-onnx", "image_text_to_text", "uint8-hw4"),
                                              ("idefics3-onnx", "image_text_to_text", "pil-L"),
                                              ("vit-gpt2-optimum", "image_to_text", "pil-RGBA")])
def test_a_refused_mode_stops_the_request(vision_paths, load_model, folder, task, mode):
    from generation import tasks

    ctx = _context(load_model, vision_paths[folder])
    image = _image(mode)
    words = re.escape(f"mode '{mode[4:]}'" if mode.startswith("pil-") else str(list(image.shape)))
    with pytest.raises(ValueError, match=rf"images\[1\] is .*{words}"):
        if task == "image_to_text":
            tasks.image_to_text(ctx, [_image("pil-RGB"), image])
        else:
            tasks.image_text_to_text(ctx, [[[1, 2], _image("pil-RGB")], [[1, 2], image]])
