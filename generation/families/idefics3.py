"""Idefics3 (SmolVLM) images: preprocessing in numpy/Pillow equal to transformers 4.57's
`Idefics3ImageProcessor`, the `<image>` expansion of `Idefics3Processor`, and the vision encoder.

An image becomes frames of max_image_size x max_image_size pixels (`idefics3_frames`):

    resize       the longest edge to size["longest_edge"] (up or down; the other edge keeps the
                 aspect ratio, rounded up to even), LANCZOS
    split        (do_image_splitting) resize both edges up to multiples of the frame size, cut
                 rows x cols frames row by row, then the whole image resized to one frame
                 (the global image) last; without splitting (or when it fits one frame) the
                 image is resized to one frame and rows = cols = 0
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
from .images import load_image
from .vl_prompts import Images, folder_json, prepare_chat, prepare_parts

MAX_IMAGE_SIZE = 4096  # transformers' cap on either edge after the first resize
LANCZOS = 1


class Idefics3Pixels:
    """The settings of preprocessor_config.json, read as transformers 4.57
    `Idefics3ImageProcessor.__init__` reads them (defaults: longest edge 4 * 364, frames of 364,
    splitting on, LANCZOS, mean and std 0.5)."""

    def __init__(self, config: dict):
        self.do_resize = config.get("do_resize", True)
        self.size = config.get("size") or {"longest_edge": 4 * 364}
        self.frame = (config.get("max_image_size") or {"longest_edge": 364}).get("longest_edge")
        self.split = config.get("do_image_splitting", True)
        self.resample = config.get("resample", LANCZOS)
        self.do_rescale, self.do_normalize = config.get("do_rescale", True), config.get("do_normalize", True)
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

    def frames(self, image: np.ndarray) -> tuple[np.ndarray, int, int]:
        """(frames [n, 3, F, F] float32, rows, cols) of one RGB uint8 image [H, W, 3]."""
        height, width = image.shape[:2]
        if self.do_resize:
            if "longest_edge" in self.size:
                height, width = _longest_edge(height, width, self.size["longest_edge"])
            else:
                height, width = self.size["height"], self.size["width"]
            image = self._resize(image, height, width)
        rows = cols = 0
        if self.split:
            height, width = _multiples(height, width, self.frame)
            image = self._resize(image, height, width)
            frames = []
            if height > self.frame or width > self.frame:
                rows, cols = math.ceil(height / self.frame), math.ceil(width / self.frame)
                step_h, step_w = math.ceil(height / rows), math.ceil(width / cols)
                frames = [image[r * step_h:min((r + 1) * step_h, height), c * step_w:min((c + 1) * step_w, width)]
                          for r in range(rows) for c in range(cols)]
                image = self._resize(image, self.frame, self.frame)
            frames.append(image)
        else:
            frames = [self._resize(image, self.frame, self.frame)]
        out = []
        for frame in frames:
            x = (frame.astype(np.float64) * self.rescale_factor).astype(np.float32) if self.do_rescale else frame
            x = x.astype(np.float32)
            if self.do_normalize:
                x = (x - self.mean) / self.std
            out.append(x.transpose(2, 0, 1))
        shapes = {f.shape for f in out}
        if len(shapes) != 1:  # (splitting always gives whole frames; do_resize=False with no splitting may not)
            raise ValueError(f"an image gave frames of shapes {sorted(shapes)}: the settings of "
                             "preprocessor_config.json must give frames of one size")
        return np.stack(out), rows, cols

    def _resize(self, image: np.ndarray, height: int, width: int) -> np.ndarray:
        if image.shape[:2] == (height, width):
            return image  # (PIL's resize to the same size is a copy for LANCZOS too)
        from PIL import Image

        return np.asarray(Image.fromarray(image).resize((width, height), resample=self.resample))


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


def idefics3_pixels(images, config: dict) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(pixel_values [frames, 3, F, F] float32, each image's (rows, cols)) of `images` (anything
    `load_image` takes), frames image after image, as Idefics3ImageProcessor's unpadded frames."""
    pixels = Idefics3Pixels(config)
    out, grids = [], []
    for i, image in enumerate(images):
        frames, rows, cols = pixels.frames(load_image(image, f"images[{i}]"))
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


def detect(config: dict, files: list[str]) -> bool:
    return config.get("model_type") == "idefics3" and has_vision_encoder(files)


def prepare(ctx, prompts, encode=None):
    """Prompts of parts (texts, token ids, images): `vl_prompts.prepare_parts`."""
    return prepare_parts(ctx, prompts, encode)


def prepare_conversations(ctx, conversations, encode=None, add_generation_prompt: bool = True):
    """Chat conversations with image parts: `vl_prompts.prepare_chat`."""
    return prepare_chat(ctx, conversations, encode, add_generation_prompt)


encode = encode_frames


def preprocess(model, images: list[np.ndarray], videos=()) -> Images:
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
