"""Finished rows' answers kept for the next turn (a part of the Scheduler, engine/scheduler.py;
core/keep.py says why two ways): with float activations a row's decoded rows go into the prefix
store as it ends; with quantized ones its tokens wait in `answers`, and `tidy`, which the
batcher's loop calls when no job waits or runs, runs them again as a prompt's rest runs, at most
RECOMPUTE_TOKENS a call, so a request that arrives meanwhile waits for one such run at most. A
busy engine keeps the newest ANSWERS_KEPT waiting and computes none: a next turn that finds its
answer not kept runs it as a cold server would, and its tokens are the same either way."""

from __future__ import annotations

import logging
from collections import deque

from ..core.keep import answer_tokens, keep_decoded, recompute_answer

log = logging.getLogger(__name__)

# a call's prompt run: 64 tokens of SmolLM2-135M int8 after a 64-token prefix took 80-130 ms on 2
# busy cores (128: 200-240 ms), what a request arriving meanwhile may wait
RECOMPUTE_TOKENS = 64
ANSWERS_KEPT = 64


class KeptAnswers:
    """`answers`: the finished rows' tokens whose blocks wait to be recomputed."""

    def _answers_init(self) -> None:
        self.answers: deque = deque(maxlen=ANSWERS_KEPT)

    def _keep_answer(self, slot: int) -> None:
        """Before `slot`'s row leaves its slot: its answer's blocks kept, or queued for `tidy`."""
        tokens = answer_tokens(self.ctx, self.state, slot)
        if tokens is None:
            return
        if not self.ctx.model.graph.quantized_activations:
            keep_decoded(self.state, slot, tokens)
        else:
            self.answers.append(tokens)

    def tidy(self) -> bool:
        """One piece of idle work: the oldest waiting answer's next RECOMPUTE_TOKENS tokens run
        into the prefix store. Whether there was any (False: nothing to do)."""
        answers = self.answers
        if not answers or self.prefix is None:
            return False
        try:
            if recompute_answer(self.ctx, self.prefix, answers[0], RECOMPUTE_TOKENS):
                answers.popleft()
        except Exception:  # noqa: BLE001 - upkeep: the answer is dropped, the next turn computes it
            log.exception("recomputing a finished row's answer for the prefix store failed")
            answers.popleft()
        self._trim_prefix()
        return True
