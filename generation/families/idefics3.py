"""Idefics3 (SmolVLM) images: preprocessing in numpy/Pillow equal to transformers 4.57's
`Idefics3ImageProcessor`, the `<image>` expansion of `Idefics3Processor`, and the vision encoder.

An image becomes frames of max_image_size x max_image_size pixels (`idefics3_frames`):

    read         a PIL image as np.array(image), unconverted: RGBA and CMYK are 4 channels, 2-D
                 modes (L, P, I;16, 1) and LA raise, as there; arrays of 1, 3 or 4 channels,
                 first or last; floats in [0, 1] x255 to uint8 (truncating) by the first resize
    resize       the longest edge to size["longest_edge"] (up or down; the other edge keeps the
                 aspect ratio, rounded up to even), LANCZOS (one channel last: NEAREST, as
                 transformers resizes it as a mode-P image)
    split        (do_image_splitting) resize both edges up to multiples of the frame size, cut
                 rows x cols frames row by row, then the whole image resized to one frame
                 (the global image) last; without splitting (or when it fits one frame) the
                 image is resized to one frame and rows = cols = 0
    RGB          (do_convert_rgb) each frame through RGBA, alpha-composited on white
    normalise    scale to [0, 1], (x - mean) / std

and in the prompt it becomes, for rows = 2, cols = 2 and image_seq_len N (`image_prompt`):

    <fake_token_around_image><row_1_col_1><image>*N<fake_token_around_image><row_1_col_2><image>*N\\n
    <fake_token_around_image><row_2_col_1><image>*N<fake_token_around_image><row_2_col_2><image>*N\\n
    \\n<fake_token_around_image><global-img><image>*N<fake_token_around_image>

(one line in fact: the \\n are the text's), tokenized by the model's tokenizer as the processor
tokenizes it. The vision encoder gives N features per frame, frames in the same order.

Every frame is whole (the processor pads only with empty frames, which the model drops), so the
vision encoder needs no pixel mask; its patch positions are transformers' bucketized ones
(0, 0, 1, ..., side - 2 on each axis: a 4.57 quirk that an export must keep).
"""

from __future__ import annotations

import math

import numpy as np

from ..runtime.model import preprocessor_config
from ..text.tokenizer import model_tokenizer
from . import has_vision_encoder
from .images import channel_layout, describe, load_image, pil_uint8, rescale_normalize
from .vision import PROMPT_IMAGES
from .vl_prompts import Images, folder_json, prepare_chat, prepare_parts

MAX_IMAGE_SIZE = 4096  # transformers' cap on either edge after the first resize
NEAREST, LANCZOS = 0, 1


class Idefics3Pixels:
    """The settings of preprocessor_config.json, read as transformers 4.57
    `Idefics3ImageProcessor.__init__` reads them (defaults: longest edge 4 * 364, frames of 364,
    splitting on, LANCZOS, do_convert_rgb on, mean and std 0.5)."""

    def __init__(self, config: dict):
        self.do_resize = config.get("do_resize", True)
        self.size = config.get("size") or {"longest_edge": 4 * 364}
        self.frame = (config.get("max_image_size") or {"longest_edge": 364}).get("longest_edge")
        self.split = config.get("do_image_splitting", True)
        self.resample = config.get("resample", LANCZOS)
        self.do_rescale, self.do_normalize = config.get("do_rescale", True), config.get("do_normalize", True)
        self.convert_rgb = config.get("do_convert_rgb", True)
        self.rescale_factor = config.get("rescale_factor", 1 / 255)
        self.mean = np.array(config.get("image_mean") or (0.5, 0.5, 0.5), np.float32)
        self.std = np.array(config.get("image_std") or (0.5, 0.5, 0.5), np.float32)
        if not isinstance(self.frame, int) or self.frame < 1:
            raise ValueError(f"preprocessor_config.json: max_image_size must be {{'longest_edge': positive int}}, "
                             f"not {config.get('max_image_size')!r}")
        size = self.size
        if not (isinstance(size, dict) and (isinstance(size.get("longest_edge"), int)
                                            or {"height", "width"} <= set(size))):
            raise ValueError(f"preprocessor_config.json: size must be {{'longest_edge': int}} or "
                             f"{{'height': int, 'width': int}}, not {size!r}")

    def frames(self, image: np.ndarray, channels_first: bool = False,
               name: str = "image") -> tuple[np.ndarray, int, int]:
        """(frames [n, 3, F, F] float32, rows, cols) of one uint8 image [H, W, C] as
        `idefics3_array` gives it (C 1, 3 or 4; channels_first: how it came, which picks the
        resampling of one channel)."""
        height, width = image.shape[:2]
        if self.do_resize:
            if "longest_edge" in self.size:
                height, width = _longest_edge(height, width, self.size["longest_edge"])
            else:
                height, width = self.size["height"], self.size["width"]
            image = self._resize(image, height, width, channels_first, name)
        rows = cols = 0
        if self.split:
            height, width = _multiples(height, width, self.frame)
            image = self._resize(image, height, width, channels_first, name)
            frames = []
            if height > self.frame or width > self.frame:
                rows, cols = math.ceil(height / self.frame), math.ceil(width / self.frame)
                step_h, step_w = math.ceil(height / rows), math.ceil(width / cols)
                frames = [image[r * step_h:min((r + 1) * step_h, height), c * step_w:min((c + 1) * step_w, width)]
                          for r in range(rows) for c in range(cols)]
                image = self._resize(image, self.frame, self.frame, channels_first, name)
            frames.append(image)
        else:
            frames = [self._resize(image, self.frame, self.frame, channels_first, name)]
        out = []
        for frame in frames:
            frame = _on_white(frame) if self.convert_rgb else frame
            x = rescale_normalize(frame, self.rescale_factor if self.do_rescale else None,
                                  self.mean if self.do_normalize else None, self.std)
            out.append(x.transpose(2, 0, 1))
        shapes = {f.shape for f in out}
        if len(shapes) != 1:  # (splitting always gives whole frames; do_resize=False with no splitting may not)
            raise ValueError(f"an image gave frames of shapes {sorted(shapes)}: the settings of "
                             "preprocessor_config.json must give frames of one size")
        return np.stack(out), rows, cols

    def _resize(self, image: np.ndarray, height: int, width: int, channels_first: bool, name: str) -> np.ndarray:
        """As transformers' `Idefics3ImageProcessor.resize`, which makes a mode-P PIL image (so
        NEAREST) of what has one channel in its last axis: a one-channel image channels last, or
        one channels first of width 1 (with more channels that fails there: "Invalid mode")."""
        last_axis_one = image.shape[2] == 1 if not channels_first else image.shape[1] == 1
        if last_axis_one and image.shape[2] > 1:
            raise ValueError(f"{name}: Idefics3ImageProcessor cannot resize a channels-first image of width 1 "
                             f"(shape [{image.shape[2]}, {image.shape[0]}, 1] on the way; it fails on 'Invalid mode')")
        if image.shape[:2] == (height, width):
            return image  # (PIL's resize to the same size is a copy, whatever the filter)
        from PIL import Image

        pil = Image.fromarray(image[..., 0] if image.shape[2] == 1 else image)  # L, RGB or RGBA
        resized = pil.resize((width, height), resample=NEAREST if last_axis_one else self.resample)
        return np.asarray(resized).reshape(height, width, -1)


def _longest_edge(height: int, width: int, longest: int) -> tuple[int, int]:
    """transformers' `_resize_output_size_rescale_to_max_len` then `..._scale_below_upper_bound`."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def _multiples(height: int, width: int, frame: int) -> tuple[int, int]:
    """transformers' `resize_for_vision_encoder` size: both edges up to multiples of the frame,
    the second from the first's new size and the old aspect ratio."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / frame) * frame
        height = math.ceil(int(width / aspect) / frame) * frame
    else:
        height = math.ceil(height / frame) * frame
        width = math.ceil(int(height * aspect) / frame) * frame
    return height, width


def _on_white(frame: np.ndarray) -> np.ndarray:
    """[F, F, 3] uint8 of a [F, F, C] uint8 frame as transformers' Idefics3 `convert_to_rgb`: as
    RGBA (one channel gray, three opaque), alpha-composited on white."""
    from PIL import Image

    rgba = Image.fromarray(frame[..., 0] if frame.shape[2] == 1 else frame).convert("RGBA")
    return np.asarray(Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255)), rgba).convert("RGB"))


def idefics3_array(image, name: str, convert_rgb) -> tuple[np.ndarray, bool]:
    """([H, W, C] uint8 with C 1, 3 or 4, whether it came channels first) of `image` (anything
    `load_image` takes) as Idefics3ImageProcessor reads it: a PIL image as np.array(image),
    unconverted (do_convert_rgb acts on the frames, after the resizes); an array channels first
    or last by `channel_layout(..., (1, 3, 4))`; floats to uint8 as its first resize makes them
    (`pil_uint8`; they are rescaled once after, unlike Qwen2-VL's). A 2-D image (PIL modes L, P,
    I;16, 1) or 2 channels (LA) raises, as there ("Unsupported number of image dimensions: 2",
    "Unable to infer channel dimension format"); without do_convert_rgb, any but 3 channels."""
    image = load_image(image, name)
    array = image if isinstance(image, np.ndarray) else np.asarray(image)
    layout = channel_layout(array.shape, (1, 3, 4)) if array.ndim == 3 else None
    channels = None if layout is None else array.shape[0 if layout == "first" else -1]
    if channels is None or (channels != 3 and not convert_rgb):
        read = "" if image is array else f", read as an array {list(array.shape)},"
        allowed = "1, 3 or 4 channels, first or last" if convert_rgb else (
            "3 channels (preprocessor_config.json turns do_convert_rgb off)")
        raise ValueError(f"{name} is {describe(image)}{read} which Idefics3ImageProcessor refuses: it takes images "
                         f"of {allowed}; convert it to RGB first")
    return pil_uint8(array.transpose(1, 2, 0) if layout == "first" else array)[0], layout == "first"


def idefics3_pixels(images, config: dict) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(pixel_values [frames, 3, F, F] float32, each image's (rows, cols)) of `images` (anything
    `load_image` takes), frames image after image, as Idefics3ImageProcessor's unpadded frames.
    Each image is read as that processor reads an image alone (it takes the channel layout, and
    raises, by the first image of a call, then reads the others as it read that one)."""
    pixels = Idefics3Pixels(config)
    out, grids = [], []
    for i, image in enumerate(images):
        name = f"images[{i}]"
        frames, rows, cols = pixels.frames(*idefics3_array(image, name, pixels.convert_rgb), name)
        out.append(frames)
        grids.append((rows, cols))
    if not out:
        return np.zeros((0, 3, pixels.frame, pixels.frame), np.float32), []
    return np.concatenate(out), grids


def image_seq_len(model, processor_config: dict) -> int:
    """The image tokens per frame: processor_config.json's image_seq_len (what the processor
    writes), else the vision tower's patches per frame / scale_factor^2."""
    value = processor_config.get("image_seq_len")
    if isinstance(value, int) and value > 0:
        return value
    vision = model.config.get("vision_config") or {}
    side = vision.get("image_size", 224) // vision.get("patch_size", 32)
    return int(side * side / model.config.get("scale_factor", 2) ** 2)


def image_prompt(rows: int, cols: int, seq_len: int) -> str:
    """An image's text in the prompt, as transformers 4.57 `get_image_prompt_string`."""
    image, fake, glob = "<image>" * seq_len, "<fake_token_around_image>", "<global-img>"
    if rows == 0 and cols == 0:
        return f"{fake}{glob}{image}{fake}"
    text = "".join("".join(f"{fake}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n"
                   for r in range(rows))
    return text + f"\n{fake}{glob}{image}{fake}"


def encode_frames(model, pixel_values: np.ndarray) -> np.ndarray:
    """The vision encoder's features [frames * image_seq_len, hidden] of `pixel_values`
    [frames, 3, F, F], in order. A vision encoder that declares pixel_values [B, N, 3, F, F]
    (and pixel_attention_mask, the onnx-community layout) gets them as one row of N images with
    every pixel real."""
    if model.vision_session is None:
        raise ValueError(f"{model.folder} has no vision encoder (vision_encoder.onnx): it takes no images")
    pixel_values = np.asarray(pixel_values, np.float32)
    if pixel_values.ndim != 4 or pixel_values.shape[1] != 3:
        raise ValueError(f"pixel_values has shape {pixel_values.shape}; expected [frames, 3, height, width]")
    if not len(pixel_values):
        return np.zeros((0, model.graph.hidden_size), np.float32)
    inputs = {i.name: i for i in model.vision_session.get_inputs()}
    feeds = {"pixel_values": pixel_values[None] if len(inputs["pixel_values"].shape) == 5 else pixel_values}
    if "pixel_attention_mask" in inputs:
        mask = np.ones(pixel_values.shape[:1] + pixel_values.shape[2:], np.bool_)
        feeds["pixel_attention_mask"] = mask[None] if len(inputs["pixel_attention_mask"].shape) == 4 else mask
    features = model.vision_session.run(None, feeds)[0]
    return features.reshape(-1, features.shape[-1])


# -- the family's contract (generation.families) -----------------------------------------------
KIND = "vision"
HOOKS = PROMPT_IMAGES  # image features in the prompt: vision.py


def detect(config: dict, files: list[str]) -> bool:
    return config.get("model_type") == "idefics3" and has_vision_encoder(files)


def prepare(ctx, prompts, encode=None):
    """Prompts of parts (texts, token ids, images): `vl_prompts.prepare_parts`."""
    return prepare_parts(ctx, prompts, encode)


def prepare_conversations(ctx, conversations, encode=None, add_generation_prompt: bool = True):
    """Chat conversations with image parts: `vl_prompts.prepare_chat`."""
    return prepare_chat(ctx, conversations, encode, add_generation_prompt)


encode = encode_frames


def preprocess(model, images: list, videos=()) -> Images:
    """Images as Idefics3ImageProcessor: frames, each image's (rows, cols), and each one's
    expansion, Idefics3Processor's frames text, tokenized."""
    folder = model.folder
    if len(videos):
        raise ValueError(f"{folder} is an Idefics3 model: it takes images, not videos")
    seq_len = image_seq_len(model, folder_json(folder / "processor_config.json"))
    pixel_values, grids = idefics3_pixels(images, preprocessor_config(model))
    texts = [image_prompt(rows, cols, seq_len) for rows, cols in grids]
    tokenizer = model_tokenizer(model)
    ids = [tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
    return Images("idefics3", pixel_values, grids, ids, texts, model.config["image_token_id"],
                  len(pixel_values) * seq_len)


def image_features(model, images: Images, encode_images=None, videos: bool = False) -> tuple[np.ndarray, str]:
    """The features of the batch's frames and what they were, for errors."""
    return (encode_images or (lambda p: encode(model, p)))(images.pixel_values), f"{len(images.pixel_values)} frames"


def positions(model, ids: list[list[int]], images: Images) -> list:
    """Each token at its index (no M-RoPE)."""
    return [None] * len(ids)


def join_grids(grids: list) -> list:
    """Several images' (rows, cols) as one list."""
    return [g for part in grids for g in part]
