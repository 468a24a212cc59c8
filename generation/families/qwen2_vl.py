"""Qwen2-VL, a model family: a vision encoder beside the decoder, images and videos as patches
(Qwen2VLImageProcessor, `images.py`; videos with the video processor's settings, `videos.py`),
their features in the prompt's embeddings and M-RoPE positions (`vision.py`). Prompts from parts
or chats are vl_prompts.py's, shared with Idefics3; this module gives what is Qwen2-VL's own."""

from __future__ import annotations

import numpy as np

from ..runtime.model import preprocessor_config
from ..text.tokenizer import model_tokenizer
from . import has_vision_encoder
from .images import qwen2vl_pixels, qwen2vl_video_pixels
from .videos import video_processor_config
from .vision import PROMPT_IMAGES, VisionTokens, encode_images, rope_positions
from .vl_prompts import Images, prepare_chat, prepare_parts

KIND = "vision"
HOOKS = PROMPT_IMAGES  # image (and video) features in the prompt, M-RoPE positions: vision.py
VIDEOS = True  # takes videos (videos.takes_videos)


def detect(config: dict, files: list[str]) -> bool:
    """Any decoder with a vision encoder beside it that no other vision family claims."""
    return has_vision_encoder(files)


def prepare(ctx, prompts, encode=None):
    """Prompts of parts (texts, token ids, images, videos): `vl_prompts.prepare_parts`."""
    return prepare_parts(ctx, prompts, encode)


def prepare_conversations(ctx, conversations, encode=None, add_generation_prompt: bool = True):
    """Chat conversations with image parts: `vl_prompts.prepare_chat`."""
    return prepare_chat(ctx, conversations, encode, add_generation_prompt)


def encode(model, pixel_values: np.ndarray, grid_thw: np.ndarray) -> np.ndarray:
    """The vision encoder: patches [patches, C*T*P*P] and grids [n, 3] -> features [tokens, hidden]."""
    return encode_images(model, pixel_values, grid_thw)


def preprocess(model, images: list[np.ndarray], videos=()) -> Images:
    """Images (and [frames, H, W, 3] videos) as Qwen2VLImageProcessor (videos with the settings of
    Qwen2VLVideoProcessor: `videos.video_processor_config`): patches, grids, and each one's
    expansion, vision_start + one image (video) token per feature + vision_end (as text: the
    image (video) pad token per feature, what Qwen2VLProcessor makes of the chat's placeholder)."""
    tokens = VisionTokens.of(model.config)
    config = preprocessor_config(model)
    pixel_values, grids = qwen2vl_pixels(images, config)
    counts = (grids.prod(axis=1) // tokens.merge ** 2).tolist()
    pad = model_tokenizer(model).id_to_token(tokens.image) if model.tokenizer_path else ""
    ids = [[tokens.vision_start] + [tokens.image] * n + [tokens.vision_end] for n in counts]
    out = Images("qwen2_vl", pixel_values, grids, ids, [pad * n for n in counts], tokens.image, sum(counts))
    if len(videos):
        out.video_pixels, out.video_grids = qwen2vl_video_pixels(videos, video_processor_config(model.folder))
        counts = (out.video_grids.prod(axis=1) // tokens.merge ** 2).tolist()
        out.video_ids = [[tokens.vision_start] + [tokens.video] * n + [tokens.vision_end] for n in counts]
        pad = model_tokenizer(model).id_to_token(tokens.video) if model.tokenizer_path else ""
        out.video_texts = [pad * n for n in counts]
        out.video_token, out.video_features = tokens.video, sum(counts)
    return out


def image_features(model, images: Images, encode_images=None, videos: bool = False) -> tuple[np.ndarray, str]:
    """The features of the batch's images (videos: its videos) and what they were, for errors."""
    run = encode_images or (lambda p, g: encode(model, p, g))
    if videos:
        return run(images.video_pixels, images.video_grids), f"videos of grids {np.asarray(images.video_grids).tolist()}"
    return run(images.pixel_values, images.grids), f"images of grids {np.asarray(images.grids).tolist()}"


def positions(model, ids: list[list[int]], images: Images) -> list:
    """Each prompt's M-RoPE positions [3, L]."""
    out, _ = rope_positions(ids, VisionTokens.of(model.config), image_grids=images.grids,
                            video_grids=images.video_grids if images.video_ids else ())
    return out


def join_grids(grids: list) -> np.ndarray:
    """Several images' grids as one image_grid_thw."""
    return np.concatenate([np.asarray(g) for g in grids])
