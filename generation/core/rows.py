"""Each row's token: the processors, warpers and draw of the rows of a step, their stop strings
and ends (core/state.py holds the state they read; core/step.py and core/insert.py call them).
"""

from __future__ import annotations

import numpy as np

from ..logits.constraints import dead_ends
from ..logits.row_settings import RowSettings, apply
from ..logits.selection import LogProbs, SamplingRows, logprobs, pick, wanted
from ..params.settings import Settings
from .context import Context
from .stop_strings import StopMatcher
from .state import new_row_settings


def ends(tokens: np.ndarray, eos: np.ndarray, count: np.ndarray, limit: np.ndarray, stops: list,
          failed: dict | None = None):
    """Which rows a step's tokens end: (is_eos, finished) [n] bool for rows that now hold `count`
    tokens, the last being `tokens` [n] (eos [n, E] -1 padded, limit [n]: a row ends at an eos
    token or at its limit); `stops` are the rows' StopMatchers (or None), which see every token but an eos. A row in
    `failed` (index -> exception) is finished; a matcher that raises adds its row there (or
    raises, without `failed`)."""
    is_eos = (tokens[:, None] == eos).any(axis=1)
    finished = is_eos | (count >= limit)
    for i, matcher in enumerate(stops):  # empty when no row has stop strings
        if matcher is None or is_eos[i] or (failed and i in failed):
            continue
        try:
            if matcher.add(int(tokens[i])):
                finished[i] = True
        except Exception as e:  # noqa: BLE001 - the row's own text: it ends that row alone
            if failed is None:
                raise
            failed[i] = e
    if failed:
        finished[list(failed)] = True
    return is_eos, finished


def _select(ctx: Context, scores: np.ndarray, rows: RowSettings, processes: bool, history: np.ndarray,
            length: np.ndarray, prompt_length: np.ndarray, seeds: np.ndarray, draws: np.ndarray,
            keep_scores: bool = False) -> tuple[np.ndarray, LogProbs | None, dict]:
    """The next token of each row from its logits [n, V] (a copy the step owns: the processors
    work in it, unless `keep_scores`), and its log-probabilities when the context asks: the
    processors, the warpers of sampling rows, then greedy or a seeded draw. history [n, W] holds
    each row's `length` tokens (prompt first). Also the constrained rows whose processed scores
    hold no token ({index: DeadEnd}: their token is meaningless)."""
    processed = scores
    of_processed = ctx.token_logprobs and ctx.logprobs_of == "processed"
    if processes or ctx.processors:  # `scores` are this step's own copy; raw log-probabilities still read them
        processed = apply(scores, rows, history, length, ctx.processors, prompt_length,
                          inplace=not keep_scores and not (ctx.token_logprobs and not of_processed))
    dead = dead_ends(processed, rows.constraints) if processes else {}  # before the warpers write into them
    if dead:  # their token is dropped: drawn from zeros rather than from -inf everywhere (nan, warnings)
        processed = processed.copy() if processed is scores else processed
        processed[list(dead)] = 0
    tokens, lp = pick(processed, SamplingRows.of(rows), seeds, draws, of_processed, ctx.top_logprobs)
    if ctx.token_logprobs and not of_processed:
        lp = logprobs(scores, tokens, ctx.top_logprobs, wanted(rows.no_logprobs))
    return tokens, lp, dead


def select_rows(ctx: Context, scores: np.ndarray, rows: RowSettings, processes: bool, history: np.ndarray | None,
                length: np.ndarray, prompt_length: np.ndarray, seeds: np.ndarray, draws: np.ndarray
                ) -> tuple[np.ndarray, LogProbs | None, dict]:
    """`_select`, where a row's failure stays that row's: when the batch raises, each row is
    selected alone on the same logits (so the batch keeps its scores: one copy, where the
    processors would have written into them). Returns the tokens (the pad token for a failed
    row: it still runs as a padding row until released), the log-probabilities and the failed
    rows {index: exception}. A token outside the vocabulary (scores that left nothing to
    draw) fails its row too; a constrained row whose scores hold no token fails with DeadEnd
    (constraints.dead_ends: the scheduler ends it as a stop)."""
    try:
        tokens, lp, failed = _select(ctx, scores, rows, processes, history, length, prompt_length, seeds, draws,
                                     keep_scores=True)
    except Exception:  # noqa: BLE001 - redone row by row below, and only the culprits fail
        tokens, lp, failed = _select_alone(ctx, scores, rows, processes, history, length, prompt_length, seeds, draws)
    for i in np.flatnonzero((tokens < 0) | (tokens >= scores.shape[1])).tolist():
        failed.setdefault(i, RuntimeError("the processed scores left no token to choose (nan or -inf everywhere)"))
    if failed:
        tokens[list(failed)] = ctx.settings.pad_token_id
    return tokens, lp, failed


def _select_alone(ctx: Context, scores, rows: RowSettings, processes, history, length, prompt_length, seeds, draws):
    """select_rows' fallback: each row on its own."""
    n = len(scores)
    tokens = np.full(n, ctx.settings.pad_token_id, np.int64)
    lp = None
    if ctx.token_logprobs:
        lp = LogProbs(np.full(n, np.nan, np.float32))
        if ctx.top_logprobs:
            lp.top_ids = np.full((n, ctx.top_logprobs), -1, np.int64)
            lp.top = np.full((n, ctx.top_logprobs), np.nan, np.float32)
    failed = {}
    for i in range(n):
        one = slice(i, i + 1)
        try:
            token, row_lp, dead = _select(ctx, scores[one], rows.take(np.array([i])), processes,
                                          None if history is None else history[one], length[one], prompt_length[one],
                                          seeds[one], draws[one], keep_scores=True)
        except Exception as e:  # noqa: BLE001 - this row's own failure
            failed[i] = e
            continue
        if dead:
            failed[i] = dead[0]
            continue
        tokens[i] = token[0]
        if lp is not None:
            lp.token[i] = row_lp.token[0]
            if lp.top is not None:
                width = row_lp.top.shape[1]
                lp.top_ids[i, :width], lp.top[i, :width] = row_lp.top_ids[0], row_lp.top[0]
    return tokens, lp, failed


def row_settings_of(ctx: Context, prompts, settings: list[Settings], limit: np.ndarray, encoder_ids) -> RowSettings:
    rows = new_row_settings(ctx, len(prompts))
    for j, (prompt, s) in enumerate(zip(prompts, settings)):
        rows.set_row(j, s, len(prompt), int(limit[j]), encoder_ids=encoder_ids[j])
    return rows


def encoder_ids_of(ctx: Context, prompts, encoder) -> list:
    """What transformers passes its encoder_ processors: a decoder-only model's prompt, a text
    encoder's source ids, nothing for audio."""
    if not ctx.model.is_seq2seq:
        return list(prompts)
    if encoder is None:
        raise ValueError("an encoder-decoder model needs the encoder's outputs: pass encoder= "
                         "(generation.runtime.encoders.encode_text / encode_audio)")
    if len(encoder) != len(prompts):
        raise ValueError(f"encoder outputs have {len(encoder)} rows for {len(prompts)} prompts")
    return encoder.source_ids if encoder.source_ids is not None else [[] for _ in prompts]


def prompt_inputs(model, prompts, encoder) -> tuple:
    """(embed, images) for run_prompts: a vision-language decoder's embedding and the checked
    prompt inputs of its prompts, as its family's hooks check them (`hooks.prompt_inputs`: a
    vision-language family's PromptImages); (None, None) for a model that takes input_ids."""
    if not model.graph.has_inputs_embeds and encoder is None:
        return None, None
    return model.embed if model.graph.has_inputs_embeds else None, model.hooks.prompt_inputs(model, prompts, encoder)


def stop_matchers_of(ctx: Context, prompts, settings: list[Settings], failed: dict) -> list:
    """Each row's StopMatcher (None without stop strings); a row whose matcher cannot be built
    goes into `failed`."""
    stops = [None] * len(prompts)
    if not any(s.stop_strings for s in settings):
        return stops
    from ..text.tokenizer import model_tokenizer

    tokenizer = model_tokenizer(ctx.model)
    for j, (prompt, s) in enumerate(zip(prompts, settings)):
        if s.stop_strings and j not in failed:
            try:
                stops[j] = StopMatcher(tokenizer, s.stop_strings, prompt)
            except Exception as e:  # noqa: BLE001 - this row's prompt or strings
                failed[j] = e
    return stops
