"""A draft model's candidate generator: a small decoder with the target's tokenizer proposes
each row's next tokens greedily, from a decode state of its own (one slot per target slot, any
cache mode), as transformers 4.57 `AssistedCandidateGenerator` does for one row.

The draft's cache of a slot holds a prefix of the target row's tokens. Each proposal first
brings it up to the row's last token (a fresh or changed row enters by `admit`, a known one runs
its missing tokens through `cache.verify`), then decodes K - 1 more; after the target's verdict
it keeps only the tokens the target kept (`cache.rewind`). K per row follows
`num_assistant_tokens` and its schedule: "constant", or "heuristic" (+2 after a step whose
candidates were all kept, -1 otherwise, never below 1, as transformers).
"""

from __future__ import annotations

import numpy as np

from ..logits.constraints import constrain

SCHEDULES = ("constant", "heuristic")


def next_k(k: np.ndarray, accepted: np.ndarray, counts: np.ndarray, schedule: str) -> np.ndarray:
    """The rows' next candidate counts under `schedule` (rows that had no candidate keep theirs).

    >>> next_k(np.array([5., 5., 1.]), np.array([5, 2, 0]), np.array([5, 5, 1]), "heuristic").tolist()
    [7.0, 4.0, 1.0]
    """
    if schedule == "constant":
        return k
    moved = np.where(accepted == counts, k + 2, np.maximum(1.0, k - 1))
    return np.where(counts > 0, moved, k)


def common_prefix(a: np.ndarray, b: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Per row, how many of the first `length[i]` tokens of a[i] and b[i] agree.

    >>> common_prefix(np.array([[1, 2, 3], [1, 2, 3]]), np.array([[1, 2, 4], [1, 2, 3]]), np.array([3, 2])).tolist()
    [2, 2]
    """
    differ = (a != b) | (np.arange(a.shape[1]) >= length[:, None])
    return np.where(differ.any(axis=1), differ.argmax(axis=1), a.shape[1]).clip(max=length)


class Draft:
    """Candidates from a draft model: `ctx` is the draft's Context (greedy, no processors, no
    eos: its tokens only propose). `num_tokens` is num_assistant_tokens, `schedule` one of
    SCHEDULES. `speculative`: sampling rows draw their candidates and verify them by the
    speculative sampling rule; without it (a context that reports log-probabilities, which
    are those of the target's own draws) they propose greedily and keep a candidate only where
    the target's own seeded draw equals it, so they equal plain sampling token for token."""

    def __init__(self, ctx, num_tokens: int = 20, schedule: str = "constant", speculative: bool = True):
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
            raise ValueError(f"num_assistant_tokens must be an integer >= 1, not {num_tokens!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"num_assistant_tokens_schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}")
        if ctx.model.is_seq2seq:
            raise ValueError("draft: the draft model must be a decoder-only model")
        self.ctx, self.num_tokens, self.schedule, self.speculative = ctx, num_tokens, schedule, speculative
        self.state = None
        self.k = None  # [slots] float: each slot's candidate count
        self._run = None  # (rows, lengths, K) of the last proposal

    def _fit(self, target) -> None:
        from ..core.state import new_state

        if self.state is None or self.state.slots != target.slots or self.state.capacity != target.capacity:
            self.state = new_state(self.ctx, target.slots, target.capacity)
            self.k = np.full(target.slots, float(self.num_tokens))

    def propose(self, state, rows: np.ndarray, room: np.ndarray, allowed=None):
        """Draft tokens [n, K] of live `rows`, K = the largest of the rows' counts: greedy, or
        for sampling rows drawn from the draft's probabilities under the row's warpers (a
        stream of the row's seed of its own), which come back as probs [n, K, V] for the
        speculative sampling rule (None when no row samples)."""
        from ..core.insert import admit
        from ..core.state import release

        self._fit(state)
        draft, ctx = self.state, self.ctx
        lengths = state.lengths[rows]
        # every row decodes the batch's K: it must fit past the longest row (as assisted.verify)
        counts = np.clip(np.minimum(room, self.k[rows].astype(np.int64)), 0, draft.capacity - 1 - int(lengths.max()))
        width = int(counts.max(initial=0))
        if width == 0:
            return np.zeros((len(rows), 0), np.int64), counts, None
        have = np.where(draft.used[rows], common_prefix(draft.tokens[rows], state.tokens[rows],
                                                        np.minimum(draft.lengths[rows], lengths)), 0)
        fresh = np.flatnonzero(have < 1)
        if fresh.size:  # new rows (or rows that share nothing with what the slot held): the draft prefills them
            slots = rows[fresh]
            for slot in slots.tolist():
                if draft.used[slot]:
                    release(ctx, draft, slot)
                self.k[slot] = self.num_tokens
            prompts = [state.tokens[b, :state.lengths[b]].tolist() for b in slots.tolist()]
            admit(ctx, draft, slots, prompts, [0] * len(slots), max_new=[draft.capacity - len(p) for p in prompts])
            have[fresh] = lengths[fresh]
        missing = lengths + 1 - have  # every row runs its missing tokens, up to its last
        feed = np.zeros((draft.slots, int(missing.max())), np.int64)
        for i, b in enumerate(rows.tolist()):
            feed[b, :missing[i]] = state.tokens[b, have[i]:lengths[i] + 1]
        widths = np.ones(draft.slots, np.int64)
        widths[rows] = missing
        draft.lengths[rows] = have
        draft.cache.rewind(draft.lengths)  # a slot may hold more than the prefix it shares (grow crops it)
        logits = draft.cache.verify(draft.lengths, feed, rows, widths)[np.arange(len(rows)), missing - 1]
        draft.lengths[rows] = lengths + 1
        draft.tokens[rows, :] = state.tokens[rows, :]
        draft.cache.rewind(draft.lengths)
        pick = _picker(state, rows, self.speculative)
        ids = np.zeros((len(rows), width), np.int64)
        probs = [] if pick.sampling.size else None
        shaped = [state.settings.constraints[b] for b in rows.tolist()]
        history = state.tokens[rows].copy() if any(shaped) else None
        for j in range(width):  # the row's j-th candidate follows its (j-1)-th
            if j:
                draft.cache.token_input[rows] = ids[:, j - 1]
                logits = draft.cache.decode(draft.lengths)[rows]
                draft.lengths[rows] += 1
            if history is not None:  # structured_outputs: the draft proposes only what the grammar allows
                logits = constrain(np.array(logits, np.float32), shaped, history, lengths + 1 + j)
            ids[:, j], q = pick(logits, j)
            if history is not None:
                history[np.arange(len(rows)), np.minimum(lengths + 1 + j, history.shape[1] - 1)] = ids[:, j]
            if probs is not None:
                probs.append(q)
        draft.tokens[rows[:, None], (lengths + 1)[:, None] + np.arange(width)] = ids
        if history is not None:  # a constrained row's candidates end at its eos (nothing follows the end)
            eos = state.settings.eos[rows]
            is_eos = (ids[:, :, None] == eos[:, None, :]).any(axis=2)  # (eos pads are -1: never an id)
            first = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1) + 1, width)
            counts = np.minimum(counts, first)
        self._run = (rows, lengths, width)
        return ids, counts, None if probs is None else np.stack(probs, axis=1)

    def accepted(self, rows: np.ndarray, accepted: np.ndarray, counts: np.ndarray) -> None:
        """The draft keeps the tokens the target kept (those it had in its cache); K moves."""
        if self._run is None or not np.array_equal(self._run[0], rows):
            return
        _, lengths, width = self._run
        self.state.lengths[rows] = lengths + 1 + np.minimum(accepted, max(width - 1, 0))
        self.state.cache.rewind(self.state.lengths)
        self.k[rows] = next_k(self.k[rows], accepted, counts, self.schedule)
        self._run = None


class _picker:
    """The draft's choice at candidate j of live `rows` of the target `state`: argmax for
    greedy rows; for sampling rows a draw from softmax of the draft's logits under the row's
    warpers, with uniforms of stream 2 of the row's seed at the candidate's token index.
    Returns (tokens [n], probabilities [n, V] float64, zero on greedy rows; None if none samples)."""

    def __init__(self, state, rows, speculative: bool = True):
        from ..logits.selection import SamplingRows

        self.sampling = np.flatnonzero(state.settings.do_sample[rows] & speculative)
        self.rows = SamplingRows.of(state.live_settings)
        self.seeds = state.seeds[rows[self.sampling]]
        self.draws = state.draws[rows[self.sampling]]

    def __call__(self, logits: np.ndarray, j: int):
        from ..logits.rng import derived_seeds, uniforms
        from ..logits.selection import final_scores, softmax

        if not self.sampling.size:
            return logits.argmax(axis=1), None
        final = final_scores(logits.astype(np.float32), self.rows)
        tokens = final.argmax(axis=1)
        q = np.zeros(final.shape, np.float64)
        q[self.sampling] = softmax(final[self.sampling].astype(np.float64))
        u = uniforms(derived_seeds(self.seeds, 2), self.draws + np.uint64(j))
        cdf = np.cumsum(q[self.sampling], axis=1)
        tokens[self.sampling] = np.minimum((cdf < (u * cdf[:, -1])[:, None]).sum(axis=1), final.shape[1] - 1)
        return tokens, q
