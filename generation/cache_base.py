"""The base every KV cache mode builds on, apart from the modes themselves so that the
encoder-decoder cache (seq2seq.py) and the decoder-only ones (cache.py) both extend it without
importing each other."""

from __future__ import annotations

import numpy as np

# The cache contract: what the decode-state verbs and the scheduler call on every cache
# (admission, each step, a beam search's row moves, a row leaving), and what verifying
# candidates calls besides (assisted decoding). A mode missing a verb is refused when it is made.
STEP_VERBS = ("insert", "decode", "decode_steps", "copy_rows", "release")
VERIFY_VERBS = ("verify", "rewind")


def missing_verbs(cache, verbs=STEP_VERBS) -> list[str]:
    """The verbs of the contract that `cache` (a cache or its class) does not implement."""
    return [verb for verb in verbs if not callable(getattr(cache, verb, None))]


def moves_by_group(groups: list[dict], dst, src, join) -> list[tuple[dict, list[int], list[int]]]:
    """The copies dst <- src between slots of grouped caches (grow, seq2seq: each group is
    {"slots": [slot or -1], ...}), per group holding a source: (group, rows to write, rows to
    read). A dst slot new to its source's group joins it first through `join(group, [(dst, src)])`."""
    out = []
    for group in groups:
        where = {slot: i for i, slot in enumerate(group["slots"]) if slot >= 0}
        moves = [(int(d), int(s)) for d, s in zip(dst, src) if int(s) in where]
        if not moves:
            continue
        joining = [(d, s) for d, s in moves if d not in where]
        if joining:
            join(group, joining)
            where = {slot: i for i, slot in enumerate(group["slots"]) if slot >= 0}
        out.append((group, [where[d] for d, _ in moves], [where[s] for _, s in moves]))
    return out


class BaseCache:
    """What every cache mode shares (cache.py's modes, seq2seq.py's Seq2SeqCache)."""

    def decode_steps(self, lengths: np.ndarray, count: int):
        """Up to `count` decodes, the k-th (from 0) at `lengths + k`, yielding each step's logits;
        the caller writes each step's tokens into `token_input` before asking for the next, and
        advances its lengths by the steps it took. `lengths` is not changed."""
        for k in range(count):
            yield self.decode(lengths + k)
