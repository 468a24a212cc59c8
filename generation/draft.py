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
    SCHEDULES."""

    def __init__(self, ctx, num_tokens: int = 20, schedule: str = "constant"):
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
            raise ValueError(f"num_assistant_tokens must be an integer >= 1, not {num_tokens!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"num_assistant_tokens_schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}")
        if ctx.model.is_seq2seq:
            raise ValueError("draft: the draft model must be a decoder-only model")
        self.ctx, self.num_tokens, self.schedule = ctx, num_tokens, schedule
        self.state = None
        self.k = None  # [slots] float: each slot's candidate count
        self._run = None  # (rows, lengths, K) of the last proposal

    def _fit(self, target) -> None:
        from .state import new_state

        if self.state is None or self.state.slots != target.slots or self.state.capacity != target.capacity:
            self.state = new_state(self.ctx, target.slots, target.capacity)
            self.k = np.full(target.slots, float(self.num_tokens))

    def propose(self, state, rows: np.ndarray, room: np.ndarray, allowed=None):
        """Greedy draft tokens [n, K] of live `rows`, K = the largest of the rows' counts."""
        from .state import admit, release

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
        fresh = rows[have < 1]
        ids = np.zeros((len(rows), width), np.int64)
        if fresh.size:  # new rows (or rows that share nothing with what the slot held): the draft prefills them
            for slot in fresh.tolist():
                if draft.used[slot]:
                    release(ctx, draft, slot)
                self.k[slot] = self.num_tokens
            prompts = [state.tokens[b, :state.lengths[b] + 1].tolist() for b in fresh.tolist()]
            _, first = admit(ctx, draft, fresh, prompts, [0] * len(fresh),
                             max_new=[draft.capacity - len(p) for p in prompts])
            ids[np.searchsorted(rows, fresh), 0] = first.token
        known = np.flatnonzero(have >= 1)
        if known.size:  # the missing tokens of known rows, up to their last
            slots = rows[known]
            missing = lengths[known] + 1 - have[known]
            feed = np.zeros((draft.slots, int(missing.max())), np.int64)
            for i, b in enumerate(slots.tolist()):
                feed[b, :missing[i]] = state.tokens[b, have[known][i]:lengths[known][i] + 1]
            widths = np.ones(draft.slots, np.int64)
            widths[slots] = missing
            draft.lengths[slots] = have[known]
            logits = draft.cache.verify(draft.lengths, feed, slots, widths)
            ids[known, 0] = logits[np.arange(len(slots)), missing - 1].argmax(axis=1)
        draft.lengths[rows] = lengths + 1
        draft.tokens[rows, :] = state.tokens[rows, :]
        draft.cache.rewind(draft.lengths)
        for j in range(1, width):  # the row's j-th candidate follows its (j-1)-th
            draft.cache.token_input[rows] = ids[:, j - 1]
            logits = draft.cache.decode(draft.lengths)
            ids[:, j] = logits[rows].argmax(axis=1)
            draft.lengths[rows] += 1
        draft.tokens[rows[:, None], (lengths + 1)[:, None] + np.arange(width)] = ids
        self._run = (rows, lengths, width)
        return ids, counts, None

    def accepted(self, rows: np.ndarray, accepted: np.ndarray, counts: np.ndarray) -> None:
        """The draft keeps the tokens the target kept (those it had in its cache); K moves."""
        if self._run is None or not np.array_equal(self._run[0], rows):
            return
        _, lengths, width = self._run
        self.state.lengths[rows] = lengths + 1 + np.minimum(accepted, max(width - 1, 0))
        self.state.cache.rewind(self.state.lengths)
        self.k[rows] = next_k(self.k[rows], accepted, counts, self.schedule)
        self._run = None
