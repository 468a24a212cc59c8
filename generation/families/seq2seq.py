"""Encoder-decoder text models (Marian, T5, BART): the source texts through the encoder, the
decoder prompted with decoder_start_token_id."""

from __future__ import annotations

from ..runtime.encoders import EncoderOutputs, encode_cached, encode_text
from ..runtime.hooks import Hooks
from ..text.tokenizer import model_tokenizer
from . import Prepared

KIND = "encoder-decoder"
HOOKS = Hooks()  # its encoder's outputs join as EncoderOutputs (the default)


def detect(config: dict, files: list[str]) -> bool:
    return bool(config.get("is_encoder_decoder"))


def decoder_start(ctx) -> int:
    """The decoder's first token: generation_config.json, else config.json."""
    model = ctx.model
    for source in (model.generation_config, model.config):
        value = source.get("decoder_start_token_id")
        if isinstance(value, int):
            return value
    raise ValueError(f"{model.folder}: neither generation_config.json nor config.json gives decoder_start_token_id")


def source_ids(ctx, sources) -> list[list[int]]:
    """Texts (tokenized with the model's tokenizer, special tokens added as transformers'
    tokenizer does) or token id lists, checked: a source longer than the encoder's positions is
    an error naming it."""
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
    return ids


def encode(model, ids: list[list[int]]) -> EncoderOutputs:
    """The encoder over source token ids."""
    return encode_text(model, ids)


def encode_sources(ctx, sources) -> EncoderOutputs:
    """Texts or token id lists (`source_ids`) through the encoder."""
    return encode(ctx.model, source_ids(ctx, sources))


def encode_sources_cached(ctx, sources: list, lookup, store) -> tuple[EncoderOutputs, int]:
    """`encode_sources` through `runtime.encoders.encode_cached`: a source's content is the
    source as given (text or ids), its value its (hidden states, source ids). Returns the outputs
    and how many sources ran through the encoder."""
    def run(rows):
        out = encode_sources(ctx, [sources[i] for i in rows])
        return [((h, ids), h.nbytes) for h, ids in zip(out.hidden, out.source_ids)]

    values, computed = encode_cached(list(sources), lookup, store, run)
    return EncoderOutputs([h for h, _ in values], [list(ids) for _, ids in values]), computed


def prepare(ctx, sources) -> Prepared:
    """Each source through the encoder; each row's prompt the decoder start token."""
    encoder = encode_sources(ctx, sources)
    return Prepared([[decoder_start(ctx)] for _ in range(len(encoder))], encoder)
