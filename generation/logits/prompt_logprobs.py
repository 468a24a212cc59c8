"""The log-probability of each prompt token given the tokens before it (vLLM's prompt_logprobs,
what OpenAI's completions return with `echo` and `logprobs`).

The prompts run once more through the decoder with an empty past, together (padded; the
scheduler passes every job it admits at once), in pieces, so the logits of every position never
sit in memory together (a 4096-token prompt over a 32000-token vocabulary would be 0.5 GB); each
piece's log-softmax of the raw logits is read at the next prompt token. The same pass serves
prompt-only jobs (max_new_tokens 0): it keeps their KV rows in the prefix store, so a later
prompt that starts with one runs only its rest. Decoder-only text models.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cache.prefill import run_rows
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
    return prompt_passes(ctx, [prompt], [top])[0]


LOGITS_BYTES = 256 * 2**20  # the most all-position logits a run of prompt_passes holds at once


def prompt_passes(ctx, prompts: list[list[int]], tops: list[int | None], store=None) -> list[PromptLogprobs | None]:
    """Prompts that need no new token, run together (padded, in pieces of PIECE): each prompt's
    log-probabilities where `tops[i]` is not None (as `prompt_logprobs` gives them, with that
    many alternatives), and, with a PrefixStore `store`, its KV rows kept there (so a later
    prompt that starts with it runs only its rest). The rows go in groups small enough that a
    piece's logits stay within LOGITS_BYTES."""
    model = ctx.model
    if model.is_seq2seq or model.graph.has_inputs_embeds:
        raise ValueError("prompt log-probabilities are given for decoder-only text models")
    out: list[PromptLogprobs | None] = [None] * len(prompts)
    graph, rows = model.graph, max(1, LOGITS_BYTES // (PIECE * model.vocab_size * 4))
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths pad less
    # GroupQueryAttention reads each row's length off the mask, which a row that ended in an
    # earlier piece leaves with holes; without position_ids a graph counts positions off the
    # past: there prompts of one piece go together, longer ones alone (as cache.prefill runs them)
    split = graph.has_group_query_attention or not graph.has_position_ids
    alone = [i for i in order if split and len(prompts[i]) > PIECE]
    together = [i for i in order if not (split and len(prompts[i]) > PIECE)]
    for group in [together[k:k + rows] for k in range(0, len(together), rows)] + [[i] for i in alone]:
        _pass_group(ctx, [prompts[i] for i in group], [tops[i] for i in group], store, out, group)
    return out


def _empty(n: int, top: int) -> PromptLogprobs:
    out = PromptLogprobs(np.zeros(max(n - 1, 0), np.float32))
    if top:
        out.top_ids, out.top = np.zeros((max(n - 1, 0), top), np.int64), np.zeros((max(n - 1, 0), top), np.float32)
    return out


def _pass_group(ctx, prompts, tops, store, out, where) -> None:
    model = ctx.model
    longest = max(len(p) for p in prompts)
    got = [None if top is None else _empty(len(prompt), top) for prompt, top in zip(prompts, tops)]
    for b, found in enumerate(got):
        out[where[b]] = found
    if longest < 2 and store is None:  # nothing to predict, nothing to keep
        return

    def read(logits: np.ndarray, offset: int) -> None:
        for b, (prompt, top, found) in enumerate(zip(prompts, tops, got)):
            width = min(logits.shape[1], len(prompt) - 1 - offset)
            if found is None or width <= 0:
                continue
            lp = logprobs(logits[b, :width], np.asarray(prompt[offset + 1:offset + 1 + width]), top)
            found.logprob[offset:offset + width] = lp.token
            if top:
                found.top_ids[offset:offset + width], found.top[offset:offset + width] = lp.top_ids, lp.top

    widths = [min(PIECE, longest - start) for start in range(0, longest, PIECE)]
    _, past = run_rows(model.session, model.graph, [list(p) for p in prompts], widths, ctx.settings.pad_token_id,
                        ctx.max_position, on_logits=read)
    if store is not None:
        for b, prompt in enumerate(prompts):
            store.store(prompt, {name: array[b, :, :len(prompt)] for name, array in past.items()})
