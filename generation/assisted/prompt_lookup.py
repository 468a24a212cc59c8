"""Prompt lookup decoding's candidate generator: continue the row's last n-gram as it went on
earlier in the row (its prompt and its new tokens), with no draft model (transformers 4.57
`PromptLookupCandidateGenerator`, over a batch).

`lookup` is the algorithm, over the whole batch; `PromptLookup` holds its settings and speaks
the candidate generator contract of `assisted.py` (`propose`, `accepted`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..params import limits
from ..params.checks import check_integer


def lookup(tokens: np.ndarray, counts: np.ndarray, max_ngram, num_tokens: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """Each row's candidates: the tokens that followed the earliest earlier occurrence of its
    last n tokens, for the largest n from `max_ngram` down to 1 that has an occurrence with at
    least one token after it (as transformers: the largest n wins, then the leftmost match).

    tokens [B, W]: row b's tokens are tokens[b, :counts[b]]; num_tokens [B]: the most
    candidates each row may get (0: none); max_ngram: an int, or [B] per row. Returns candidates
    [B, max(num_tokens)] (-1 past a row's count) and their counts [B]. A continuation that
    reaches the row's end goes on as the row would if it repeats itself: from the match on
    again (transformers stops there; a model in a loop then gets one candidate where the
    loop's period allows K).

    >>> ids, n = lookup(np.array([[5, 6, 7, 8, 1, 5, 6, 0], [1, 2, 3, 1, 4, 2, 1, 0]]),
    ...                 np.array([7, 7]), 2, np.array([3, 3]))
    >>> ids.tolist(), n.tolist()
    ([[7, 8, 1], [2, 3, 1]], [3, 3])

    Row 0 ends with the bigram (5, 6), first seen at 0 and followed by 7, 8, 1. Row 1's bigram
    (2, 1) came nowhere before, so its last token 1 is looked up: it came at 0 and at 3, and
    the earliest wins (2, 3, 1 followed it). The last column (0) is past both rows' counts.

    >>> lookup(np.array([[4, 9, 8, 9]]), np.array([4]), 2, np.array([5]))[0].tolist()
    [[8, 9, 8, 9, 8]]

    The last token 9 first came at 1, followed by 8, 9 (the row's end): then 8, 9 again.
    """
    rows = tokens.shape[0]
    k = int(num_tokens.max()) if rows else 0
    out = np.full((rows, max(k, 1)), -1, np.int64)
    found = np.zeros(rows, np.int64)
    todo = np.flatnonzero((num_tokens > 0) & (counts >= 2))
    if k == 0 or not todo.size:
        return out[:, :k], found
    length = counts[todo]
    max_ngram = np.broadcast_to(max_ngram, counts.shape)[todo]
    block = tokens[todo, :int(length.max())]
    best = np.zeros(len(todo), np.int64)  # the first token after the chosen match (0: none)
    # alive[b, e]: the n tokens before e equal the row's last n (e < length: a token follows).
    # Narrowed from n = 1 up, one compare a token: O(max_ngram * W) at most, not O(max_ngram ** 2 * W)
    column, at = np.arange(block.shape[1]), np.arange(len(todo))
    alive = (column >= 1) & (column < length[:, None])
    for n in range(1, int(max_ngram.max()) + 1):
        alive[:, n - 1] = False
        alive[:, n:] &= block[:, :block.shape[1] - n] == block[at, np.maximum(length - n, 0)][:, None]
        alive[max_ngram < n] = False
        held = np.flatnonzero(alive.any(axis=1))
        if not held.size:
            break
        best[held] = alive[held].argmax(axis=1)  # the earliest match of the longest n so far
    hit = np.flatnonzero(best > 0)
    if hit.size:
        start, period = best[hit], length[hit] - best[hit]  # past the row's end, the row goes on repeating itself
        take = num_tokens[todo[hit]]
        at = np.arange(k)
        ids = block[hit[:, None], start[:, None] + at % period[:, None]]
        out[todo[hit]] = np.where(at < take[:, None], ids, -1)
        found[todo[hit]] = take
    return out, found


def forbidden_cut(candidates: np.ndarray, counts: np.ndarray, allowed) -> np.ndarray:
    """The counts cut before each row's first candidate that `allowed(j, rows)` forbids: it
    returns, for candidate column j of `rows`, whether the processors allow that token there.

    >>> forbidden_cut(np.array([[4, 5, 6]]), np.array([3]), lambda j, rows: np.array([j != 1])).tolist()
    [1]
    """
    counts = counts.copy()
    for j in range(int(counts.max(initial=0))):
        rows = np.flatnonzero(counts > j)
        if not rows.size:
            break
        ok = allowed(j, rows)
        counts[rows[~ok]] = j
    return counts


@dataclass
class PromptLookup:
    """Prompt lookup's settings: `num_tokens` candidates at most (prompt_lookup_num_tokens) after
    a match of up to `max_ngram` tokens (max_matching_ngram_size, 2 by default as transformers);
    num_tokens None reads both from each row's settings (rows without prompt_lookup_num_tokens
    get none), so rows of one batch may differ. A row's candidates stop before an eos token of
    the row, as transformers cuts them."""

    num_tokens: int | None = None
    max_ngram: int = 2

    def __post_init__(self):
        check_integer("prompt_lookup_num_tokens", self.num_tokens, 1, limits.MAX_LOOKUP_TOKENS, " (null: off)",
                      null=True)
        check_integer("max_matching_ngram_size", self.max_ngram, 1, limits.MAX_MATCHING_NGRAM_SIZE)

    def propose(self, state, rows: np.ndarray, room: np.ndarray, allowed=None) -> tuple[np.ndarray, np.ndarray, None]:
        """Candidates [n, K] and counts [n] of live `rows` (at most `room` each), none that the
        processors forbid (`allowed`, see assisted.py); no probabilities."""
        tokens = state.tokens[rows]
        count = state.lengths[rows] + 1
        if self.num_tokens is None:  # `rows` are the live rows: their settings are live_settings
            num_tokens, max_ngram = state.live_settings.lookup_tokens, state.live_settings.lookup_ngram
        else:
            num_tokens, max_ngram = self.num_tokens, self.max_ngram
        ids, counts = lookup(tokens, count, max_ngram, np.minimum(room, num_tokens))
        if counts.any():
            eos = state.eos[rows]
            is_eos = ((ids[:, :, None] == eos[:, None, :]) & (eos[:, None, :] >= 0)).any(axis=2)
            first = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1), ids.shape[1])
            counts = np.minimum(counts, first)
        return ids, self.cut(state, rows, ids, counts, allowed), None

    def cut(self, state, rows: np.ndarray, ids: np.ndarray, counts: np.ndarray, allowed) -> np.ndarray:
        """The counts cut before each row's first candidate the processors forbid (`allowed`,
        None: nothing is forbidden). Apart from `propose`, so that a wrapper that keeps fewer
        candidates (budget.CostAware) asks the processors only about those it keeps."""
        if allowed is None or not counts.any():
            return counts
        tokens, count = state.tokens[rows], state.lengths[rows] + 1
        r, j = np.nonzero(np.arange(ids.shape[1]) < counts[:, None])
        tokens[r, count[r] + j] = ids[r, j]  # each candidate is judged after the ones before it
        return forbidden_cut(ids, counts, lambda j, sub: allowed(tokens[sub], count[sub] + j, sub, ids[sub, j]))

    def accepted(self, rows: np.ndarray, accepted: np.ndarray, counts: np.ndarray) -> None:
        """Prompt lookup does not adapt."""
