"""Vision-encoder-decoder captioners (a ViT encoder, a GPT-2 decoder that cross-attends): images
preprocessed as ViTImageProcessor, through the encoder; the decoder prompted with
decoder_start_token_id."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..runtime.encoders import EncoderOutputs, encode_pixels
from ..runtime.hooks import Hooks
from ..runtime.model import preprocessor_config
from . import Prepared
from .images import vit_pixels
from .seq2seq import decoder_start

KIND = "encoder-decoder"
HOOKS = Hooks()  # its encoder's outputs join as EncoderOutputs (the default)


def detect(config: dict, files: list[str]) -> bool:
    return config.get("model_type") == "vision-encoder-decoder"


def pixels(ctx, images) -> np.ndarray:
    """pixel_values [n, 3, H, W] of images as `images.load_image` takes them (str: a file path)."""
    if not isinstance(images, (list, tuple)) or not images:
        raise ValueError("images must be a non-empty list of images")
    if ctx.model.encoder is None or not ctx.model.encoder.takes_images:
        raise ValueError(f"{ctx.model.folder} has no image encoder (a vision-encoder-decoder's encoder_model.onnx "
                         "taking pixel_values): it takes no images")
    return vit_pixels([Path(i) if isinstance(i, str) else i for i in images], preprocessor_config(ctx.model))


def encode(model, pixel_values: np.ndarray) -> EncoderOutputs:
    """The ViT encoder over pixel_values [n, 3, H, W]."""
    return encode_pixels(model, pixel_values)


def prepare(ctx, images, run_encoder=None) -> Prepared:
    """Each image through the encoder (or `run_encoder`, a server's own deployment); each row's
    prompt the decoder start token."""
    if run_encoder is not None and not callable(run_encoder):
        raise ValueError(f"encode must be a function of pixel_values, not {run_encoder!r}")
    encoder = (run_encoder or (lambda p: encode(ctx.model, p)))(pixels(ctx, images))
    return Prepared([[decoder_start(ctx)] for _ in range(len(images))], encoder)
