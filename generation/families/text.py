"""Decoder-only text models (Llama, Qwen2, GPT-2, ...; onnxruntime-genai folders): prompts are
token ids, a text tokenized with the model's tokenizer; no encoder."""

from __future__ import annotations

from . import Prepared
from .vision import PROMPT_IMAGES

KIND = "text"
HOOKS = PROMPT_IMAGES  # a text model's prompts take no images; asked, it says so (vision.check_images)


def detect(config: dict, files: list[str]) -> bool:
    """Whatever no other family claims."""
    return True


def prepare(ctx, prompts) -> Prepared:
    """Texts (tokenized as transformers' tokenizer call does, special tokens added) or token id
    lists, as the decoder's prompts."""
    from ..params.inputs import check_prompts
    from ..text.tokenizer import model_tokenizer

    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of texts or token id lists")
    tokenizer = None
    ids = []
    for prompt in prompts:
        if isinstance(prompt, str):
            tokenizer = tokenizer or model_tokenizer(ctx.model)
            prompt = tokenizer.encode(prompt).ids
        ids.append(prompt)
    return Prepared(check_prompts(ctx, ids), None)


encode = None
