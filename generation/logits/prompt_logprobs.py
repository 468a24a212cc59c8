"""The log-probability of each prompt token given the tokens before it (vLLM's prompt_logprobs,
what OpenAI's completions return with `echo` and `logprobs`).

The prompt runs once more through the decoder with an empty past, in pieces, so the logits of
every position never sit in memory together (a 4096-token prompt over a 32000-token vocabulary
would be 0.5 GB); each piece's log-softmax of the raw logits is read at the next prompt token.
Decoder-only text models.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cache.prefill import _run_rows
from .selection import logprobs

PIECE = 128  # prompt positions per run


@dataclass
class PromptLogprobs:
    """For a prompt of n tokens: `logprob[i]` of token i + 1 after tokens 0..i ([n - 1]); with
    `top` k, `top_ids` / `top` [n - 1, k], the k most likely tokens at each position, best first."""

    logprob: np.ndarray
    top_ids: np.ndarray | None = None
    top: np.ndarray | None = None


def from_lists(logprob: list[float], top_ids: list[list[int]] | None = None,
               top: list[list[float]] | None = None) -> PromptLogprobs:
    """A PromptLogprobs from plain lists (a fake engine's, a test's), as the arrays and dtypes
    `prompt_logprobs` gives: [n - 1] and [n - 1, k]."""
    n, k = len(logprob), len(top_ids[0]) if top_ids else 0
    return PromptLogprobs(np.asarray(logprob, np.float32),
                          None if top_ids is None else np.asarray(top_ids, np.int64).reshape(n, k),
                          None if top is None else np.asarray(top, np.float32).reshape(n, k))


def prompt_logprobs(ctx, prompt: list[int], top: int = 0) -> PromptLogprobs:
    """The prompt tokens' log-probabilities (the raw logits' log-softmax: no processor runs on
    a prompt), and the `top` best tokens at each position: for a prompt [a, b, c], logprob is
    [log p(b | a), log p(c | a b)]."""
    model = ctx.model
    if model.is_seq2seq or model.graph.has_inputs_embeds:
        raise ValueError("prompt log-probabilities are given for decoder-only text models")
    n = len(prompt)
    out = PromptLogprobs(np.zeros(max(n - 1, 0), np.float32))
    if top:
        out.top_ids, out.top = np.zeros((max(n - 1, 0), top), np.int64), np.zeros((max(n - 1, 0), top), np.float32)
    if n < 2:
        return out

    def read(logits: np.ndarray, offset: int) -> None:
        # position offset + j predicts token offset + j + 1; the last position predicts nothing
        width = min(logits.shape[1], n - 1 - offset)
        if width <= 0:
            return
        got = logprobs(logits[0, :width], np.asarray(prompt[offset + 1:offset + 1 + width]), top)
        out.logprob[offset:offset + width] = got.token
        if top:
            out.top_ids[offset:offset + width], out.top[offset:offset + width] = got.top_ids, got.top

    widths = [min(PIECE, n - start) for start in range(0, n, PIECE)]
    _run_rows(model.session, model.graph, [list(prompt)], widths, ctx.settings.pad_token_id, ctx.max_position,
              on_logits=read)
    return out
