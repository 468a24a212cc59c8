"""Images in: decoding (Pillow) and preprocessing in numpy, equal to transformers 4.57's slow
(PIL-resizing) image processors within 1e-5: `Qwen2VLImageProcessor` (`qwen2vl_pixels`) and
`ViTImageProcessor` (`vit_pixels`, the encoder of a vision-encoder-decoder).

    pixels, grid_thw = qwen2vl_pixels([image, ...], preprocessor_config)
    # pixels [sum(t*h*w), C * temporal_patch * patch * patch], grid_thw [n, 3]

An image is resized (`smart_resize`: both sides multiples of patch * merge, the area within
[min_pixels, max_pixels], the aspect ratio kept as near as that allows; bicubic, as PIL), scaled
to [0, 1], normalised by the mean and std, repeated to the temporal patch size (a still image is
a clip of one frame), and cut into patches laid out merge block by merge block, as the vision
encoder reads them.
"""

from __future__ import annotations

import io
import math
import os

import numpy as np

# transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD (Qwen2-VL's defaults)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def load_image(image, name: str = "image") -> np.ndarray:
    """An RGB uint8 array [H, W, 3] from a PIL image, an [H, W, 3] uint8 array, encoded bytes
    (PNG, JPEG, ...) or a file path; ValueError naming `name` for anything else, or bytes that
    do not decode."""
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8 or 0 in image.shape:
            raise ValueError(f"{name}: an image array must be [height, width, 3] uint8, not {image.shape} {image.dtype}")
        return image
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ValueError("images need Pillow: pip install 'raymuter[vision]'") from None
    if isinstance(image, (bytes, bytearray, str, os.PathLike)):
        source = io.BytesIO(image) if isinstance(image, (bytes, bytearray)) else image
        try:
            with Image.open(source) as opened:
                opened.load()
                image = opened.convert("RGB") if opened.mode != "RGB" else opened.copy()
        except FileNotFoundError:
            raise ValueError(f"{name}: no such image file {image!r}") from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
            raise ValueError(f"{name} is not a readable image: {type(e).__name__}: {e}") from None
    if not isinstance(image, Image.Image):
        raise ValueError(f"{name} must be a PIL image, an [H, W, 3] uint8 array, encoded bytes or a path, "
                         f"not {type(image).__name__}")
    if image.mode != "RGB":  # as transformers' convert_to_rgb
        image = image.convert("RGB")
    return np.asarray(image)


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
    quirk kept here), patch 14, temporal patch 2, merge 2, CLIP mean and std."""

    def __init__(self, config: dict):
        self.min_pixels = config.get("min_pixels") or 56 * 56
        self.max_pixels = config.get("max_pixels") or 28 * 28 * 1280
        self.patch = config.get("patch_size", 14)
        self.temporal = config.get("temporal_patch_size", 2)
        self.merge = config.get("merge_size", 2)
        self.do_resize, self.do_rescale = config.get("do_resize", True), config.get("do_rescale", True)
        self.do_normalize = config.get("do_normalize", True)
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
        (its frames, all of one size), as transformers' `_preprocess`."""
        height, width = frames[0].shape[:2]
        factor = self.patch * self.merge
        if self.do_resize:
            height, width = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        processed = []
        for frame in frames:
            if self.do_resize:
                frame = _resize_bicubic(frame, height, width)
            x = frame.astype(np.float64) * self.rescale_factor if self.do_rescale else frame
            x = x.astype(np.float32)
            if self.do_normalize:
                x = (x - self.mean) / self.std
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


def _resize_bicubic(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, 3] uint8 -> [height, width, 3] uint8 with PIL's bicubic filter (transformers' resize
    of uint8 images goes through PIL)."""
    from PIL import Image

    return np.asarray(Image.fromarray(image).resize((width, height), resample=Image.Resampling.BICUBIC))


def qwen2vl_pixels(images, config: dict) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values [sum(t*h*w), C*T*P*P] float32, image_grid_thw [n, 3] int64) of `images`
    (anything `load_image` takes), as transformers' Qwen2VLImageProcessor(images=...)."""
    pixels = Qwen2VLPixels(config)
    out, grids = [], []
    for i, image in enumerate(images):
        patches, grid = pixels.frames([load_image(image, f"images[{i}]")])
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
    transformers 4.57 ViTImageProcessor: resize to `size` (bilinear unless `resample` says), scale
    to [0, 1], normalise (mean and std 0.5 by default)."""
    from PIL import Image

    size = config.get("size") or {"height": 224, "width": 224}
    if not (isinstance(size, dict) and isinstance(size.get("height"), int) and isinstance(size.get("width"), int)):
        raise ValueError(f"preprocessor_config.json: size must be {{'height': int, 'width': int}}, not {size!r}")
    mean = np.array(config.get("image_mean") or (0.5, 0.5, 0.5), np.float32)
    std = np.array(config.get("image_std") or (0.5, 0.5, 0.5), np.float32)
    resample = config.get("resample", 2)
    out = []
    for i, image in enumerate(images):
        x = load_image(image, f"images[{i}]")
        if config.get("do_resize", True):
            x = np.asarray(Image.fromarray(x).resize((size["width"], size["height"]), resample=resample))
        if config.get("do_rescale", True):
            x = (x.astype(np.float64) * config.get("rescale_factor", 1 / 255)).astype(np.float32)
        if config.get("do_normalize", True):
            x = (x.astype(np.float32) - mean) / std
        out.append(x.transpose(2, 0, 1))
    return np.stack(out).astype(np.float32)
