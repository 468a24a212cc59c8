"""What a model's family adds to the engine's layers: the hooks a loaded Model carries.

The layers below `generation.families` (runtime, cache, logits, core, engine) name no family. What
only a family knows reaches them by injection: each family module gives a `Hooks` value (its
`HOOKS`; the table of what each family answers is in generation/families/contract.py), and
`generation.load`, which sits above the families, puts it on the loaded Model (`model.hooks`).
The layers call it where they need it:

    join(encoders)                      engine/jobs.py: the jobs' encoder inputs as one
                                        batch's (an encoder-decoder's EncoderOutputs, a
                                        vision-language model's PromptImages; a None entry: a job
                                        without any, never all of them)
    prompt_inputs(model, prompts, encoder)
                                        core/rows.py: the checked inputs a decoder-only batch's
                                        prompts run with beside their ids (PromptImages: features
                                        in the embeddings, M-RoPE positions), None for none, or
                                        ValueError naming what is wrong
    prompt_types                        core/insert.py: the types of those inputs a prefix store
                                        may name (by their `prefix_key`); () for none
    timestamp_rules(model)              engine/jobs.py: a timestamped row's
                                        Settings.timestamp_rules; None: the family decodes none
    timestamps(scores, rules, history, length, prompt_length)
                                        logits/processors.py: the processor of the rows whose
                                        timestamp rules are on (rules [n, 3]), in place on
                                        scores [n, V]; None: the family has none

A model loaded without its family (`runtime.model.load` alone) carries `Hooks()`: encoder outputs
join, prompts take no inputs beside their ids, no timestamps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .encoders import join_outputs


def no_prompt_inputs(model, prompts: list[list[int]], encoder) -> None:
    """The prompt inputs of a family that takes none: None, or ValueError when some are given."""
    if encoder is not None:
        raise ValueError(f"{model.folder}: its prompts take no inputs beside their token ids, not "
                         f"{type(encoder).__name__} (encoder=)")
    return None


@dataclass(frozen=True)
class Hooks:
    """A family's answers to the engine's layers (see the module docstring)."""

    join: Callable[[list], object] = join_outputs
    prompt_inputs: Callable[[object, list, object], object] = no_prompt_inputs
    prompt_types: tuple[type, ...] = ()
    timestamp_rules: Callable[[object], tuple[int, int, int]] | None = None
    timestamps: Callable | None = None
