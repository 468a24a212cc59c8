"""The contract of a model family: what every module of generation.families answers.

`generation.families` asks a family module for these by name (`module(name)`); a server asks for
KIND; `generation.load` puts HOOKS on the loaded Model, through which the engine's layers below the
families (runtime, cache, logits, core, engine) reach what only the family knows, without naming it.

What each family answers:

    family    KIND             detect: a folder whose      prepare(ctx, inputs)        encode(model, ...)         HOOKS
    --------  ---------------  --------------------------  --------------------------  -------------------------  ---------------------------
    whisper   encoder-decoder  config model_type whisper   audio clips -> a            log-mel windows ->         timestamp_rules (the rule
                                                           speech.Speech (prompts,     EncoderOutputs             ids of a timestamped
                                                           first windows encoded)                                 window), timestamps (the
                                                                                                                  logits processor);
                                                                                                                  encoder outputs join
    vit_gpt2  encoder-decoder  config model_type           images -> Prepared          pixel values ->            encoder outputs join
                               vision-encoder-decoder      (decoder_start prompts,     EncoderOutputs             (Hooks())
                                                           EncoderOutputs)
    seq2seq   encoder-decoder  config is_encoder_decoder   source texts or ids ->      source ids ->              encoder outputs join
                                                           Prepared (decoder_start     EncoderOutputs             (Hooks())
                                                           prompts, EncoderOutputs)
    idefics3  vision           config model_type idefics3  prompts of parts (texts,    frames' pixel values ->    vision.PROMPT_IMAGES:
                               and a vision encoder        ids, images) -> Prepared    image features             PromptImages join, are
                                                           (prompts, PromptImages)                                checked (check_images),
                                                                                                                  name prefix-cache keys
    qwen2_vl  vision           any other folder with a     prompts of parts (texts,    patches and grids ->       vision.PROMPT_IMAGES (and
                               vision encoder              ids, images, videos) ->     image features             M-RoPE positions in the
                                                           Prepared (prompts,                                     PromptImages)
                                                           PromptImages)
    text      text             whatever no other family    texts or token ids ->       None (no encoder)          vision.PROMPT_IMAGES (a
                               claims                      Prepared (prompts, None)                               text model refuses images)

Detection runs in generation.families.FAMILIES' order; the first family whose `detect` claims a
folder is its family. The vision-language families also answer what vl_prompts.py asks of them
(`prepare_conversations`, `preprocess`, `image_features`, `positions`, `join_grids`, and VIDEOS
for Qwen2-VL); those stay between them and vl_prompts.py.
"""

from __future__ import annotations

from typing import Protocol

from ..runtime.hooks import Hooks


class Family(Protocol):
    """A module of generation.families (see the table above)."""

    KIND: str  # "text", "encoder-decoder" or "vision": what a server runs for the family
    HOOKS: Hooks  # what the family adds to the engine's layers below it (generation.runtime.hooks)

    @staticmethod
    def detect(config: dict, files: list[str]) -> bool:
        """Whether a folder of this config.json and these file names (relative, "/"-separated)
        is of the family."""

    @staticmethod
    def prepare(ctx, inputs, *args, **options):
        """A request's inputs into what the decoder runs: a families.Prepared (the decoder's
        prompts, and what `generate(encoder=...)` takes), or Whisper's speech.Speech."""

    # encode(model, inputs) -> the family's encoder over what its preprocessing gives (None for a
    # family with no encoder: `text`). Declared as an attribute, not a method: it may be None.
    encode: object
