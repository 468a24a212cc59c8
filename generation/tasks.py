"""Tasks over encoder-decoder models: text in or audio in, text out.

    ctx = generation.context(generation.load("marian-folder"), max_new_tokens=64)
    out = text_to_text(ctx, ["How are you?", "Good morning"])   # [TaskResult(text, tokens, ...)]

Each task tokenizes or featurizes its batch, runs the encoder once (`generation.seq2seq`; a
server can run that step in its own deployment), and generates from the decoder's prompt
(decoder_start_token_id) with every setting of the context, beam search included.
"""

from __future__ import annotations

from dataclasses import dataclass

from .context import Context
from .generate import Generated, generate
from .seq2seq import EncoderOutputs, encode_text
from .text import model_tokenizer


@dataclass
class TaskResult:
    """One source's output: its text, its tokens (without the decoder prompt and the final eos),
    and each token's log-probability when the context has token_logprobs."""

    text: str
    tokens: list[int]
    logprobs: list[float] | None = None


def decoder_start(ctx: Context) -> int:
    """The decoder's first token: generation_config.json, else config.json."""
    model = ctx.model
    for source in (model.generation_config, model.config):
        value = source.get("decoder_start_token_id")
        if isinstance(value, int):
            return value
    raise ValueError(f"{model.folder}: neither generation_config.json nor config.json gives decoder_start_token_id")


def encode_sources(ctx: Context, sources) -> EncoderOutputs:
    """Texts (tokenized with the model's tokenizer, special tokens added as transformers'
    tokenizer does) or token id lists, through the encoder. A source longer than the encoder's
    positions is an error naming it."""
    model = ctx.model
    if not isinstance(sources, (list, tuple)) or not sources:
        raise ValueError("sources must be a non-empty list of texts or token id lists")
    ids = []
    tokenizer = None
    for i, source in enumerate(sources):
        if isinstance(source, str):
            tokenizer = tokenizer or model_tokenizer(model)
            ids.append(tokenizer.encode(source).ids)
        elif isinstance(source, (list, tuple)) and all(isinstance(t, int) and 0 <= t < model.vocab_size for t in source):
            ids.append(list(source))
        else:
            raise ValueError(f"sources[{i}] must be a text or a list of token ids of this model, not {source!r:.60}")
        if not ids[-1]:
            raise ValueError(f"sources[{i}] is empty")
        limit = model.config.get("max_position_embeddings")
        if isinstance(limit, int) and len(ids[-1]) > limit:
            raise ValueError(f"sources[{i}] has {len(ids[-1])} tokens; the encoder takes at most {limit}")
    return encode_text(model, ids)


def text_to_text(ctx: Context, sources, seeds=None) -> list[TaskResult]:
    """Translate / summarise / rewrite each source: its text, tokens and log-probabilities."""
    encoder = encode_sources(ctx, sources)
    prompts = [[decoder_start(ctx)]] * len(encoder)
    rows = generate(ctx, prompts, seeds=seeds, encoder=encoder)
    return [_result(ctx, row) for row in rows]


def _result(ctx: Context, row) -> TaskResult:
    tokens, logprobs = (row.tokens, row.logprobs) if isinstance(row, Generated) else (row, None)
    text = model_tokenizer(ctx.model).decode(tokens, skip_special_tokens=True) if ctx.model.tokenizer_path else ""
    return TaskResult(text, tokens, logprobs)
