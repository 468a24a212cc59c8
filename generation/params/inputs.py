"""A request's prompts and seeds, checked at the boundary: lists of ints, or SettingError naming them."""

from __future__ import annotations

import os

import numpy as np

from .limits import SEED_LIMIT
from .checks import SettingError, shown


def check_prompts(ctx, prompts) -> list[list[int]]:
    """The prompts as lists of ints, or SettingError ("prompt") naming the bad prompt and token;
    `ctx` is a generation Context (its model's vocabulary and context bound the tokens)."""
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if not isinstance(prompts, (list, tuple)):
        raise SettingError("prompt", f"prompts must be a list of token id lists, not {type(prompts).__name__}")
    vocab, context = ctx.model.vocab_size, ctx.model.max_context
    return [_prompt_ids(i, prompt, vocab, context) for i, prompt in enumerate(prompts)]


def _prompt_ids(i: int, prompt, vocab: int, context: int | None) -> list[int]:
    if not isinstance(prompt, (list, tuple, np.ndarray)):
        raise SettingError("prompt", f"prompts[{i}] must be a list of token ids, not {type(prompt).__name__}")
    if context and len(prompt) >= context:  # before looking at the tokens: a huge prompt costs nothing
        raise SettingError("prompt", f"prompts[{i}] has {len(prompt)} tokens; the model's context is {context} "
                                     "tokens, and at least one must be left for a new token")
    try:  # numpy checks the common case at once; anything odd (nested, ragged, huge ints) is read one by one
        ids = np.asarray(prompt)
        ok = ids.ndim == 1 and (not ids.size or ids.dtype.kind in "iu" and ids.min() >= 0 and ids.max() < vocab
                                and (isinstance(prompt, np.ndarray) or bool not in map(type, prompt)))
    except (ValueError, TypeError, OverflowError):
        ok = False
    if ok:
        return ids.tolist()
    for j, t in enumerate(prompt):
        if not isinstance(t, (int, np.integer)) or isinstance(t, (bool, np.bool_)) or not 0 <= t < vocab:
            raise SettingError("prompt", f"prompts[{i}][{j}] = {shown(t)} is not a token id of this model "
                                         f"(0 to {vocab - 1})")
    raise SettingError("prompt", f"prompts[{i}] must be a list of token ids, not {shown(prompt)}")


def check_seeds(seeds, count: int) -> list[int]:
    """One seed per prompt (random seeds when None), or SettingError ("seed") naming seeds."""
    if seeds is None:
        return [int.from_bytes(os.urandom(8), "little") for _ in range(count)]
    if isinstance(seeds, np.ndarray):
        seeds = seeds.tolist()
    if not isinstance(seeds, (list, tuple)) or len(seeds) != count:
        size = len(seeds) if isinstance(seeds, (list, tuple)) else type(seeds).__name__
        raise SettingError("seed", f"seeds must give one seed per prompt: got {size} for {count} prompts")
    for i, seed in enumerate(seeds):
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, (bool, np.bool_)) or not 0 <= seed < SEED_LIMIT:
            raise SettingError("seed", f"seeds[{i}] = {shown(seed)} must be an integer from 0 to 2**64 - 1")
    return [int(s) for s in seeds]
