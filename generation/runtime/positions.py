"""Where a decoder graph without position_ids takes a token's position from, and so whether rows of
different lengths can share an append buffer (the `append` cache mode) or need exact-length caches
(`grow`: every step copies the whole cache).

The append buffer holds each slot's cache rows in one buffer as wide as its longest row; a run's new
token lands at the buffer's width for every slot, and the attention mask hides each slot's columns
that are not its own. With position_ids every token gets its own position whatever its column. A
graph without them places a token by one of three things, read here from config.json as
transformers 4.57's modeling code computes it for the family:

    the attention mask     BLOOM: its ALiBi bias of a key is slope * (cumsum(mask) - 1) at the key,
                           which the hidden columns do not count: a row's keys keep their own
                           positions wherever they sit (`append`, rows at the buffer's start).
    the columns' distance  MPT: its ALiBi bias of key column j is slope * (j - the last column), the
                           same for every row: exact where a row's keys end where its new token
                           lands, the layout of cache/windowed.py (`append`, rows at the buffer's
                           end, as transformers lays out a left-padded batch).
    the cache's width      every other family exported without position_ids (Gemma 2 / 3, gpt-oss,
                           Nemotron: transformers takes `cache_position`, the past's length): a
                           shorter row's new token would take the longest row's position while its
                           keys were rotated at their own, so rows of one length share a run
                           (`grow`).

Example (MPT, slope s; slot a holds 4 rows, slot b 2; the new tokens at column 4):

    column             0 1 2 3  4
    rows at the start  a a a a  a     b's new token sees its keys at distances 4 and 3 (alone: 2, 1)
                       b b - -  b
    rows at the end    a a a a  a
                       - - b b  b     distances 2 and 1, as alone
"""

from __future__ import annotations

#: model_type -> why its graph runs `append` with each row's keys at the buffer's start
FROM_MASK = {
    "bloom": "its ALiBi positions are the attention mask's running count, which skips the columns it hides",
}
#: model_type -> why its graph runs `append` with each row's keys ending at the buffer's width
FROM_COLUMN_DISTANCE = {
    "mpt": "its ALiBi bias is the distance between buffer columns, so each row's keys end where its new token "
           "lands (the layout of a left-padded batch)",
}


def append_layout(config: dict) -> tuple[str | None, str]:
    """How a decoder graph of `config` that takes no position_ids (and counts no rows of its own,
    as GroupQueryAttention does) runs: ('start' or 'end': `append` with each row's keys at the
    buffer's start or ending at its width, or None: `grow`) and why, for the log."""
    kind = config.get("model_type")
    if kind in FROM_MASK:
        return "start", FROM_MASK[kind]
    if kind in FROM_COLUMN_DISTANCE:
        return "end", FROM_COLUMN_DISTANCE[kind]
    return None, (f"model_type '{kind}' takes a token's position from the cache's length (its graph has no "
                  "position_ids input): in a shared buffer a shorter row's token would take the longest row's "
                  "position, so rows of one length share a run, each step copying the cache")
