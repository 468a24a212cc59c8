"""Images in: decoding (Pillow) and preprocessing in numpy, equal to transformers 4.57's slow
(PIL-resizing) image processors within 1e-5: `Qwen2VLImageProcessor` (`qwen2vl_pixels`) and
`ViTImageProcessor` (`vit_pixels`, the encoder of a vision-encoder-decoder); Idefics3's is in
idefics3.py.

    pixels, grid_thw = qwen2vl_pixels([image, ...], preprocessor_config)
    # pixels [sum(t*h*w), C * temporal_patch * patch * patch], grid_thw [n, 3]

`load_image` keeps an image as it was given (a PIL image of any mode, an array of any layout and
dtype, checked) because each processor reads modes its own way, in its own order:

                       Qwen2VLImageProcessor, ViTImageProcessor   Idefics3ImageProcessor
    PIL image          convert("RGB") first if do_convert_rgb      np.array(image), unconverted:
                       (Qwen2-VL: yes; ViT: unset, so non-RGB      2-D modes (L, P, I;16, 1) and LA
                       modes raise); RGBA drops its alpha          raise; RGBA, CMYK are 4 channels
    array layout       [H, W, C] or [C, H, W], C in (1, 3);        C in (1, 3, 4)
                       both ends possible: channels first
    channels           3 only (their 3-value mean)                 1, 3 or 4, made RGB after the
                                                                   resizes, on white (alpha)
    floats in [0, 1]   x255 to uint8 (truncating) for PIL's        x255 to uint8 for PIL's resize,
                       resize, /255 back, and rescaled again       then rescaled once
                       by do_rescale (transformers' warning)

An image is resized (Qwen2-VL: `smart_resize`, both sides multiples of patch * merge, the area
within [min_pixels, max_pixels], the aspect ratio kept as near as that allows; bicubic, as PIL),
scaled to [0, 1], normalised by the mean and std, repeated to the temporal patch size (a still
image is a clip of one frame), and cut into patches laid out merge block by merge block, as the
vision encoder reads them.
"""

from __future__ import annotations

import io
import math
import os

import numpy as np

# transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD (Qwen2-VL's defaults)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def load_image(image, name: str = "image"):
    """`image` as the families' preprocessing takes it: a PIL image as it is (any mode: each
    processor converts modes its own way), an array as it is once checked (`check_array`), or
    encoded bytes (PNG, JPEG, ...) or a file path decoded to an RGB uint8 array [H, W, 3] (as
    transformers' `load_image`: convert("RGB")). ValueError naming `name` for anything else, or
    bytes that do not decode. Idempotent: its output is its input again."""
    if isinstance(image, np.ndarray):
        return check_array(image, name)
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ValueError("images need Pillow: pip install 'raymuter[vision]'") from None
    if isinstance(image, (bytes, bytearray, str, os.PathLike)):
        source = io.BytesIO(image) if isinstance(image, (bytes, bytearray)) else image
        try:
            with Image.open(source) as opened:
                opened.load()
                return np.asarray(opened.convert("RGB") if opened.mode != "RGB" else opened)
        except FileNotFoundError:
            raise ValueError(f"{name}: no such image file {image!r}") from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
            raise ValueError(f"{name} is not a readable image: {type(e).__name__}: {e}") from None
    if not isinstance(image, Image.Image):
        raise ValueError(f"{name} must be a PIL image, an [H, W, C] or [C, H, W] array, encoded bytes or a path, "
                         f"not {type(image).__name__}")
    if 0 in image.size:
        raise ValueError(f"{name} is an empty PIL image (size {image.size})")
    return image


def check_array(image: np.ndarray, name: str) -> np.ndarray:
    """`image` if some processor reads it: 3-D, with 1, 3 or 4 channels at one end, integers or
    floats that transformers' PIL conversion (`_rescale_for_pil_conversion`) takes: floats in
    [0, 1], or whole numbers in [0, 255]. ValueError naming `name` otherwise (a 2-D array raises
    in every processor)."""
    if image.ndim != 3 or 0 in image.shape or image.dtype.kind not in "uif":
        raise ValueError(f"{name}: an image array must be [height, width, channels] or [channels, height, width] "
                         f"of integers or floats, not {image.dtype} of shape {image.shape}")
    if channel_layout(image.shape, (1, 3, 4)) is None:
        raise ValueError(f"{name}: an image array needs 1, 3 or 4 channels first or last, not shape {image.shape}")
    if image.dtype != np.uint8:
        high = 255 if _whole(image) else 1
        if not (np.all(image >= 0) and np.all(image <= high)):
            what = "whole numbers in [0, 255]" if high == 255 else "floats in [0, 1] (or whole numbers in [0, 255])"
            raise ValueError(f"{name}: an image array of {image.dtype} must hold {what}, "
                             f"not values in [{image.min()}, {image.max()}]")
    return image


def _whole(image: np.ndarray) -> bool:
    """Whether transformers' `_rescale_for_pil_conversion` takes `image` for whole numbers."""
    with np.errstate(invalid="ignore"):
        return bool(np.allclose(image, image.astype(int)))


def channel_layout(shape: tuple[int, ...], channels: tuple[int, ...]) -> str | None:
    """"first" ([C, H, W]) or "last" ([H, W, C]) for a 3-D image of `shape`, as transformers'
    `infer_channel_dimension_format(image, num_channels=channels)`: first when both ends could
    be channels ([3, 20, 3] is 3 channels of 20 x 3), None when neither can."""
    if shape[0] in channels:
        return "first"
    return "last" if shape[-1] in channels else None


def describe(image) -> str:
    """What an image is, for errors: "a PIL image of mode 'LA'", "an array float32 [20, 30, 4]"."""
    if isinstance(image, np.ndarray):
        return f"an array {image.dtype} {list(image.shape)}"
    return f"a PIL image of mode {image.mode!r}"


def rgb_array(image, name: str, convert_rgb, processor: str) -> np.ndarray:
    """[H, W, 3] (its dtype kept) of `image` (anything `load_image` takes) as Qwen2VLImageProcessor
    and ViTImageProcessor read it: a PIL image through convert("RGB") where `convert_rgb`
    (do_convert_rgb) says, then np.array; an array channels first or last by
    `channel_layout(..., (1, 3))`. What is not then 3 channels raises (transformers raises too:
    "Unable to infer channel dimension format", or its 3-value mean on other channel counts)."""
    image = load_image(image, name)
    array = image
    if not isinstance(image, np.ndarray):
        if convert_rgb and image.mode != "RGB":
            array = image.convert("RGB")
        array = np.asarray(array)
    layout = channel_layout(array.shape, (1, 3)) if array.ndim == 3 else None
    if layout is None or array.shape[0 if layout == "first" else -1] != 3:
        unset = "" if convert_rgb or isinstance(image, np.ndarray) else (
            " (preprocessor_config.json leaves do_convert_rgb unset, so the processor takes PIL images as they are): "
            "convert it to RGB first")
        raise ValueError(f"{name} is {describe(image)}: {processor} takes images of 3 channels{unset}")
    return array.transpose(1, 2, 0) if layout == "first" else array


def pil_uint8(image: np.ndarray) -> tuple[np.ndarray, bool]:
    """(the uint8 array PIL resizes, whether it was scaled by 255) of a `check_array` image, as
    transformers' `to_pil_image`: floats in [0, 1] x255 in float32, truncated; whole numbers cast."""
    if image.dtype == np.uint8:
        return image, False
    if _whole(image):
        return image.astype(np.uint8), False
    return (image.astype(np.float64) * 255).astype(np.float32).astype(np.uint8), True


def pil_resize(image: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """[H, W, 3] -> [height, width, 3] as transformers' `image_transforms.resize`: through a uint8
    PIL image (`pil_uint8`), and back /255 in float32 where it was scaled."""
    from PIL import Image

    pixels, scaled = pil_uint8(image)
    out = np.asarray(Image.fromarray(pixels).resize((width, height), resample))
    return (out.astype(np.float64) * (1 / 255)).astype(np.float32) if scaled else out


def rescale_normalize(image: np.ndarray, factor, mean, std) -> np.ndarray:
    """[H, W, C] float32: x * factor (factor None: no rescale) in float64, then (x - mean) / std in
    float32 (mean None: none), as transformers' `rescale` and `normalize`."""
    x = (image.astype(np.float64) * factor).astype(np.float32) if factor is not None else image.astype(np.float32)
    return (x - mean) / std if mean is not None else x


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize target, as transformers 4.57 `smart_resize`: both sides multiples of
    `factor`, the area within [min_pixels, max_pixels], the aspect ratio nearly kept.

    >>> smart_resize(13, 21, 4, 64, 576)
    (12, 20)
    >>> smart_resize(100, 50, 4, 64, 576)
    (32, 16)
    """
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen2VLPixels:
    """Qwen2-VL's preprocessing settings from preprocessor_config.json, read as transformers
    4.57 `Qwen2VLImageProcessor.__init__` reads them: min_pixels / max_pixels where given, else
    56*56 and 28*28*1280 (its `size` is replaced by those defaults whatever it says: a 4.57
    quirk kept here), patch 14, temporal patch 2, merge 2, CLIP mean and std, do_convert_rgb on."""

    def __init__(self, config: dict):
        self.min_pixels = config.get("min_pixels") or 56 * 56
        self.max_pixels = config.get("max_pixels") or 28 * 28 * 1280
        self.patch = config.get("patch_size", 14)
        self.temporal = config.get("temporal_patch_size", 2)
        self.merge = config.get("merge_size", 2)
        self.do_resize, self.do_rescale = config.get("do_resize", True), config.get("do_rescale", True)
        self.do_normalize = config.get("do_normalize", True)
        self.convert_rgb = config.get("do_convert_rgb", True)
        self.rescale_factor = config.get("rescale_factor", 1 / 255)
        self.mean = np.array(config.get("image_mean") or CLIP_MEAN, np.float32)
        self.std = np.array(config.get("image_std") or CLIP_STD, np.float32)
        resample = config.get("resample", 3)
        if resample != 3:
            raise ValueError(f"preprocessor_config.json: resample={resample} is not implemented (3, bicubic, is)")
        for key in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
            value = config.get(key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"preprocessor_config.json: {key} must be a positive integer, not {value!r}")

    def frames(self, frames: list[np.ndarray]) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Patches [t*h*w, C*T*P*P] and grid (t, h, w) of one image (one frame) or one video
        (its frames, all of one size), each [H, W, 3] (uint8, or floats as `rgb_array` gives
        them), as transformers' `_preprocess`."""
        height, width = frames[0].shape[:2]
        factor = self.patch * self.merge
        if self.do_resize:
            height, width = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        processed = []
        for frame in frames:
            if self.do_resize:
                frame = pil_resize(frame, height, width, 3)
            x = rescale_normalize(frame, self.rescale_factor if self.do_rescale else None,
                                  self.mean if self.do_normalize else None, self.std)
            processed.append(x.transpose(2, 0, 1))
        patches = np.stack(processed)  # [frames, C, H, W]
        if len(patches) % self.temporal:
            patches = np.concatenate([patches] + [patches[-1:]] * (self.temporal - len(patches) % self.temporal))
        channels = patches.shape[1]
        t, h, w = len(patches) // self.temporal, height // self.patch, width // self.patch
        patches = patches.reshape(t, self.temporal, channels, h // self.merge, self.merge, self.patch,
                                  w // self.merge, self.merge, self.patch)
        patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return patches.reshape(t * h * w, channels * self.temporal * self.patch * self.patch), (t, h, w)


def qwen2vl_pixels(images, config: dict) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values [sum(t*h*w), C*T*P*P] float32, image_grid_thw [n, 3] int64) of `images`
    (anything `load_image` takes), as transformers' Qwen2VLImageProcessor(images=...), which
    preprocesses each image alone."""
    pixels = Qwen2VLPixels(config)
    out, grids = [], []
    for i, image in enumerate(images):
        patches, grid = pixels.frames([rgb_array(image, f"images[{i}]", pixels.convert_rgb, "Qwen2VLImageProcessor")])
        out.append(patches)
        grids.append(grid)
    width = 3 * pixels.temporal * pixels.patch ** 2
    return (np.concatenate(out) if out else np.zeros((0, width), np.float32)), np.array(grids, np.int64).reshape(-1, 3)


def qwen2vl_video_pixels(videos, config: dict, name: str = "videos") -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values_videos [sum(t*h*w), C*T*P*P] float32, video_grid_thw [n, 3] int64) of
    `videos`, each a [frames, H, W, 3] uint8 array, as transformers 4.57
    Qwen2VLImageProcessor(videos=...): every frame resized to the first's smart_resize size, the
    frames padded with copies of the last to a multiple of the temporal patch."""
    pixels = Qwen2VLPixels(config)
    out, grids = [], []
    for i, video in enumerate(videos):
        video = np.asarray(video)
        if video.ndim != 4 or video.shape[-1] != 3 or video.dtype != np.uint8 or not video.shape[0]:
            raise ValueError(f"{name}[{i}] must be a [frames, height, width, 3] uint8 array with at least one frame, "
                             f"not {video.dtype} of shape {video.shape}")
        patches, grid = pixels.frames(list(video))
        out.append(patches)
        grids.append(grid)
    width = 3 * pixels.temporal * pixels.patch ** 2
    return (np.concatenate(out) if out else np.zeros((0, width), np.float32)), np.array(grids, np.int64).reshape(-1, 3)


def vit_pixels(images, config: dict) -> np.ndarray:
    """pixel_values [n, 3, height, width] float32 of `images` (anything `load_image` takes), as
    transformers 4.57 ViTImageProcessor: PIL images converted to RGB only where do_convert_rgb
    says (unset by default: an RGBA or grayscale PIL image raises, as there), resize to `size`
    (bilinear unless `resample` says), scale to [0, 1], normalise (mean and std 0.5 by default).
    Each array's channel layout is its own (transformers takes the first image's for the batch)."""
    size = config.get("size") or {"height": 224, "width": 224}
    if not (isinstance(size, dict) and isinstance(size.get("height"), int) and isinstance(size.get("width"), int)):
        raise ValueError(f"preprocessor_config.json: size must be {{'height': int, 'width': int}}, not {size!r}")
    mean = np.array(config.get("image_mean") or (0.5, 0.5, 0.5), np.float32)
    std = np.array(config.get("image_std") or (0.5, 0.5, 0.5), np.float32)
    factor = config.get("rescale_factor", 1 / 255) if config.get("do_rescale", True) else None
    out = []
    for i, image in enumerate(images):
        x = rgb_array(image, f"images[{i}]", config.get("do_convert_rgb"), "ViTImageProcessor")
        if config.get("do_resize", True):
            x = pil_resize(x, size["height"], size["width"], config.get("resample", 2))
        x = rescale_normalize(x, factor, mean if config.get("do_normalize", True) else None, std)
        out.append(x.transpose(2, 0, 1))
    return np.stack(out).astype(np.float32)
