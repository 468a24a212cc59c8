"""The decode state and its verbs: prefill, insert, step, release.

As JetStream's engine (`prefill`, `insert(prefix, decode_state, slot)`,
`generate(params, decode_state) -> (decode_state, tokens)`), a step is a function of an explicit
state and returns the next state with the step's tokens. The state has a fixed number of slots;
each slot holds one row: its tokens so far, its cache, its selection settings and its random
state (seed and draw count). Buffers are reused in place from step to step.

    prefix = prefill(ctx, prompts, seeds)        # cache and first token of fresh rows
    state = insert(ctx, prefix, state, slots)    # into free slots of a running batch
    state, out = step(ctx, state)                # one token for every live slot
    state = release(ctx, state, slot)            # free a finished or cancelled slot

A beam search request holds num_beams slots as one group (`admit_beams`); `step` runs its rows
in the same model run as the others and moves them as transformers' `_beam_search` does.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from ..cache import new_cache
from ..cache.base import insert_prompts
from ..cache.cross import FirstStepStore, run_first_steps
from ..cache.prefill import PromptCache, run_from, run_prompts
from ..cache.prefix import PrefixStore
from ..logits.constraints import Grammars, dead_ends
from ..logits.processors import RowSettings, apply
from ..logits.selection import LogProbs, SamplingRows, logprobs, pick, wanted
from ..params.settings import SettingError, Settings
from ..runtime.encoders import EncoderOutputs
from ..search.beam import BeamGroup, advance_groups, beam_min_keep, new_group
from .context import Context
from .stop_strings import StopMatcher


@dataclass(slots=True)
class StepTokens:
    """What one step gave: per row, the new token (-1 where the row has none: no live row, or
    an eos token) and whether the row finished at this step. `failed` maps the rows (and the
    first slots of beam searches, which leave the state at once) whose own part of the step raised (their processors, warpers or draw, their stop strings) to the
    exception: such a row is finished, has no token, and the other rows went on as if it had
    not been there (a failure of the model's run raises instead: it is every row's)."""

    token: np.ndarray  # [B] int64
    finished: np.ndarray  # [B] bool
    any_finished: bool = False
    logprob: np.ndarray | None = None  # [B] float32, nan where no token (with token_logprobs)
    top_ids: np.ndarray | None = None  # [B, k] the step's k most likely tokens (with top_logprobs)
    top: np.ndarray | None = None  # [B, k] their log-probabilities
    failed: dict = field(default_factory=dict)  # row -> the exception that ended it
    beams: dict = field(default_factory=dict)  # first slot -> the BeamGroup of a beam search that stopped


@dataclass
class Prefix:
    """Prefilled rows, ready to insert: prompts, caches, first tokens, settings, random state.
    A row whose first token ended it (eos, or a one-token budget), or whose selection failed
    (`first.failed`), is `finished` and needs no slot."""

    prompts: list[list[int]]
    cache: PromptCache
    first: StepTokens
    settings: list[Settings]
    seeds: np.ndarray  # uint64
    limit: np.ndarray  # int64: tokens (prompt included) at which each row stops
    stops: list  # StopMatcher or None per row, having seen the first token
    encoder_ids: list  # per row: the "encoder input" of the encoder_ settings (the prompt, or the source)


@dataclass(frozen=True)
class LiveView:
    """What a step reads of the live rows, derived from the state's other fields: rebuilt in one
    place (`DecodeState.refresh`, when rows enter or leave or advance), so a step does no per-row
    Python work."""

    rows: np.ndarray  # flatnonzero(live)
    settings: RowSettings  # the state's settings.take(rows)
    settings_version: int  # the settings.version `settings` was taken at
    processes: bool  # a processor before the warpers is on for a live row
    greedy: bool  # no live row samples
    steps_to_limit: int  # steps before the first live row reaches its limit
    single_eos: int | None  # the one eos id every live row has, if so
    no_eos: bool  # no live row has an eos id
    any_stops: bool  # a live row has stop strings
    fast: bool  # every slot live, greedy, unprocessed, at most one eos id: the lean step applies


def _viewed(name: str) -> property:
    return property(lambda state: getattr(state.view, name), doc=f"`view.{name}` (LiveView)")


@dataclass
class DecodeState:
    """The rows of a running batch, one per slot.

    `tokens[b, :lengths[b] + 1]` is slot b's prompt and new tokens; the cache holds the first
    `lengths[b]`, and the last one is the next step's input. A row stops at an eos token or when
    it holds `limit[b]` tokens. `view` (a LiveView, also read as `live_rows`, `live_settings`,
    `processes`, `greedy`, `steps_to_limit`, `single_eos`, `no_eos`, `any_stops`, `fast`) is
    derived from the others and rebuilt by `refresh` when rows enter, leave or advance.
    """

    cache: object
    capacity: int  # tokens a row may hold, prompt included
    tokens: np.ndarray  # [B, capacity] int64
    lengths: np.ndarray  # [B] valid cache rows (0 for a free slot)
    prompt_length: np.ndarray  # [B]
    limit: np.ndarray  # [B]
    live: np.ndarray  # [B] bool: the slot holds an unfinished row
    used: np.ndarray  # [B] bool: the slot holds a row (finished rows stay until released)
    seeds: np.ndarray  # [B] uint64
    draws: np.ndarray  # [B] uint64: random numbers drawn so far
    settings: RowSettings  # every slot's selection settings and fixed masks
    next_input: np.ndarray  # [B] the last token of each row: the cache's bound token input
    stops: list  # [B] StopMatcher of a row with stop strings, else None
    logprob: np.ndarray | None = None  # [B, capacity] float32: each token's log-probability
    top_ids: np.ndarray | None = None  # [B, capacity, k]
    top: np.ndarray | None = None  # [B, capacity, k]
    view: LiveView | None = None  # the live rows as a step reads them (refresh)
    lean: bool = True  # the context allows the lean step (no log-probabilities, no custom processors)
    groups: dict = field(default_factory=dict)  # first slot -> BeamGroup: beam searches (their slots are used, not live)
    beam_settings: tuple | None = None  # (key, RowSettings) of the groups' rows, taken once per change
    # cached prompt prefixes (cache/prefix.py; an encoder-decoder's first steps, cache/cross.py), shared by the rows
    prefix: PrefixStore | FirstStepStore | None = None
    cached: np.ndarray = None  # [B] the prompt tokens of each slot's last admission that came from `prefix`

    live_rows = _viewed("rows")
    live_settings = _viewed("settings")
    processes = _viewed("processes")
    greedy = _viewed("greedy")
    steps_to_limit = _viewed("steps_to_limit")
    single_eos = _viewed("single_eos")
    no_eos = _viewed("no_eos")
    any_stops = _viewed("any_stops")
    fast = _viewed("fast")

    @property
    def eos(self) -> np.ndarray:
        """[B, E] int64, -1 padded."""
        return self.settings.eos

    @property
    def slots(self) -> int:
        return len(self.lengths)

    def free_slots(self) -> np.ndarray:
        return np.flatnonzero(~self.used)

    def refresh(self) -> None:
        """Rebuild `view` after rows entered, left or advanced (the one place it is built)."""
        rows, old = np.flatnonzero(self.live), self.view
        if (old is None or old.settings_version != self.settings.version
                or not np.array_equal(rows, old.rows)):  # a step that ended no row keeps them (and their tables)
            taken = self.settings.take(rows)
            processes = taken.processes()
        else:
            taken, processes = old.settings, old.processes
        greedy = not self.settings.do_sample[rows].any()
        eos = self.eos[rows]
        no_eos = bool((eos < 0).all())
        shared = rows.size and (eos == eos[:1]).all() and eos[0, 0] >= 0 and (eos[0, 1:] < 0).all()
        single_eos = int(eos[0, 0]) if shared else None
        any_stops = any(self.stops[r] is not None for r in rows.tolist())
        fast = (rows.size == self.slots and greedy and not processes and self.lean
                and (no_eos or single_eos is not None) and not any_stops)
        self.view = LiveView(
            rows=rows, settings=taken, settings_version=self.settings.version, processes=processes, greedy=greedy,
            steps_to_limit=int((self.limit[rows] - self.lengths[rows] - 1).min()) if rows.size else 0,
            single_eos=single_eos, no_eos=no_eos, any_stops=any_stops, fast=fast)


def new_state(ctx: Context, slots: int | None = None, capacity: int | None = None,
              prefix: PrefixStore | FirstStepStore | None = None, ledger=None) -> DecodeState:
    """An empty state of `slots` rows (default: the compiled batch size), each holding up to
    `capacity` tokens (default: the model's context). `prefix`: the store its prompts reuse and
    fill (a PrefixStore; an encoder-decoder's, a FirstStepStore; ignored when it is the other).
    ledger: the runtime.device.Ledger its cache counts in (a scheduler keeps one across states)."""
    slots = slots or ctx.batch_size
    if not slots:
        raise ValueError("slots: give the number of slots, or compile(ctx, batch_size) first")
    capacity = capacity or ctx.model.max_context
    if not capacity:
        raise ValueError("capacity: the model's config gives no context length; pass capacity")
    if ctx.model.max_context:  # positions (and GroupQueryAttention's rotary tables) end there
        capacity = min(capacity, ctx.model.max_context)
    cache = new_cache(ctx.model, ctx.cache_mode, slots, capacity, ctx.max_position, ctx.buffers, ledger)
    state = DecodeState(
        cache=cache, capacity=capacity,
        tokens=np.zeros((slots, capacity), np.int64), lengths=np.zeros(slots, np.int64),
        prompt_length=np.zeros(slots, np.int64), limit=np.zeros(slots, np.int64),
        live=np.zeros(slots, bool), used=np.zeros(slots, bool),
        seeds=np.zeros(slots, np.uint64), draws=np.zeros(slots, np.uint64),
        settings=_new_rows(ctx, slots), next_input=cache.token_input, stops=[None] * slots,
        lean=not (ctx.token_logprobs or ctx.processors), cached=np.zeros(slots, np.int64))
    if ctx.token_logprobs:
        state.logprob = np.full((slots, capacity), np.nan, np.float32)
        if ctx.top_logprobs:
            state.top_ids = np.zeros((slots, capacity, ctx.top_logprobs), np.int64)
            state.top = np.full((slots, capacity, ctx.top_logprobs), np.nan, np.float32)
    if prefix is not None and ctx.model.is_seq2seq == isinstance(prefix, FirstStepStore):
        state.prefix = prefix
    state.next_input[:] = ctx.settings.pad_token_id
    state.refresh()
    return state


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


def _new_rows(ctx: Context, n: int) -> RowSettings:
    """Empty settings of `n` rows for the context's model: its grammars, its family's timestamp
    processor (`model.hooks`)."""
    return RowSettings(n, ctx.model.vocab_size, Grammars.of(ctx), ctx.model.hooks.timestamps)


def _row_settings(ctx: Context, prompts, settings: list[Settings], limit: np.ndarray, encoder_ids) -> RowSettings:
    rows = _new_rows(ctx, len(prompts))
    for j, (prompt, s) in enumerate(zip(prompts, settings)):
        rows.set_row(j, s, len(prompt), int(limit[j]), encoder_ids=encoder_ids[j])
    return rows


def _encoder_ids(ctx: Context, prompts, encoder) -> list:
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


def _stop_matchers(ctx: Context, prompts, settings: list[Settings], failed: dict) -> list:
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


def with_logprobs(out: StepTokens, rows, size: int, lp: LogProbs | None) -> StepTokens:
    """`out` with the log-probabilities of `rows` spread over `size` rows (nan elsewhere)."""
    if lp is not None:
        out.logprob = np.full(size, np.nan, np.float32)
        out.logprob[rows] = lp.token
        if lp.top is not None:
            out.top_ids = np.full((size, lp.top.shape[1]), -1, np.int64)
            out.top = np.full((size, lp.top.shape[1]), np.nan, np.float32)
            out.top_ids[rows], out.top[rows] = lp.top_ids, lp.top
    return out


def _first_tokens(ctx: Context, prompts, seeds, settings, max_new, last_logits, encoder_ids) -> Prefix:
    """Each fresh row's first token from its prompt's last logits, and where it stops."""
    settings = settings or [ctx.settings] * len(prompts)
    if any(s.num_beams > 1 for s in settings):
        raise ValueError("num_beams > 1 runs through generation.beam_search (or generate), not the "
                         "decode-state verbs")
    lengths = np.array([len(p) for p in prompts], np.int64)
    if max_new is None:
        max_new = [s.new_tokens_for(len(p)) for s, p in zip(settings, prompts)]
    limit = np.minimum(lengths + np.array(max_new, np.int64), ctx.max_position)
    seeds = np.array(seeds, np.uint64)
    rows = _row_settings(ctx, prompts, settings, limit, encoder_ids)
    history = np.zeros((len(prompts), max(1, int(lengths.max()))), np.int64)
    for j, prompt in enumerate(prompts):
        history[j, :len(prompt)] = prompt
    tokens, lp, failed = select_rows(ctx, last_logits, rows, rows.processes(), history, lengths, lengths, seeds,
                                     np.zeros(len(prompts), np.uint64))
    stops = _stop_matchers(ctx, prompts, settings, failed)
    is_eos, finished = ends(tokens, rows.eos, lengths + 1, limit, stops, failed)
    first = StepTokens(np.where(is_eos, -1, tokens), finished, bool(finished.any()), failed=failed)
    first.token[list(failed)] = -1
    first = with_logprobs(first, np.arange(len(prompts)), len(prompts), lp)
    return Prefix(list(prompts), None, first, list(settings), seeds, limit, stops, list(encoder_ids))


def prefill(ctx: Context, prompts: list[list[int]], seeds, settings: list[Settings] | None = None,
            max_new: list[int] | None = None, encoder=None) -> Prefix:
    """Run non-empty `prompts` and choose each row's first token.

    seeds: one per prompt. settings: one per prompt (default: the context's). max_new: the new
    tokens each row may get (default: each row's settings by the max_new_tokens rule); a row
    never outgrows the model's context. encoder: an encoder-decoder model's EncoderOutputs, one
    row per prompt (the prompts are then the decoder's: decoder_start_token_id, ...), or a
    vision-language model's vision.PromptImages (each prompt's image features and positions).
    """
    encoder_ids = _encoder_ids(ctx, prompts, encoder)
    cache = _prompt_cache(ctx, prompts, encoder)
    prefix = _first_tokens(ctx, prompts, seeds, settings, max_new, cache.last_logits, encoder_ids)
    prefix.cache = cache
    return prefix


def _prompt_cache(ctx: Context, prompts: list[list[int]], encoder=None) -> PromptCache:
    """The prompts' caches and last logits, run apart from any state (an encoder-decoder's
    first decoder steps, or the decoder over the prompts)."""
    model = ctx.model
    if model.is_seq2seq:
        last, rows = run_first_steps(model, prompts, encoder)
        return PromptCache(rows, np.array([len(p) for p in prompts]), last)
    return run_prompts(model.session, model.graph, ctx.cache_mode, ctx.prompt_steps, prompts,
                       ctx.settings.pad_token_id, ctx.max_position, *prompt_inputs(model, prompts, encoder))


def _check_slots(state: DecodeState, prompts: list[list[int]], slots: list[int]) -> None:
    if len(slots) != len(prompts):
        raise ValueError(f"slots has {len(slots)} entries for {len(prompts)} prompts")
    for j, slot in enumerate(slots):
        if not 0 <= slot < state.slots or state.used[slot] or slot in slots[:j]:
            raise ValueError(f"slots[{j}] = {slot} is not a free slot of this state")
        if len(prompts[j]) + 1 > state.capacity:
            raise SettingError("prompt", f"prompt {j} has {len(prompts[j])} tokens; this state's rows hold "
                                         f"{state.capacity}")


def _occupy(state: DecodeState, slot: int, prefix: Prefix, j: int) -> None:
    """Slot `slot` takes row j of `prefix` (its cache is already in place)."""
    prompt, length = prefix.prompts[j], len(prefix.prompts[j])
    state.tokens[slot, :length] = prompt
    state.tokens[slot, length] = state.next_input[slot] = prefix.first.token[j]
    state.lengths[slot], state.prompt_length[slot] = length, length
    state.limit[slot] = min(prefix.limit[j], state.capacity)
    state.live[slot] = state.used[slot] = True
    state.seeds[slot], state.draws[slot] = prefix.seeds[j], 1
    state.settings.set_row(slot, prefix.settings[j], length, int(state.limit[slot]), encoder_ids=prefix.encoder_ids[j])
    state.stops[slot] = prefix.stops[j]
    if state.logprob is not None:
        state.logprob[slot] = np.nan
        state.logprob[slot, length] = prefix.first.logprob[j]
        if state.top is not None:
            state.top_ids[slot, length], state.top[slot, length] = prefix.first.top_ids[j], prefix.first.top[j]


def insert(ctx: Context, prefix: Prefix, state: DecodeState, slots) -> DecodeState:
    """Put the rows of `prefix` into free `slots` (one per prefix row; the slots of rows that
    finished at prefill stay free)."""
    slots = [int(s) for s in slots]
    _check_slots(state, prefix.prompts, slots)
    with _undone_on_error(ctx, state, slots):
        for j, slot in enumerate(slots):
            if not prefix.first.finished[j]:
                state.cache.insert(slot, prefix.cache.rows[j], len(prefix.prompts[j]))
                _occupy(state, slot, prefix, j)
    state.refresh()
    return state


@contextmanager
def _undone_on_error(ctx: Context, state: DecodeState, slots: list[int]):
    """Admission is all or nothing: when it raises, the `slots` (free before it) are freed again,
    whether the cache took their rows or not, and the rows already running are as they were."""
    try:
        yield
    except BaseException:
        for slot in slots:
            group = state.groups.get(slot)
            if group is not None:
                _free_group(ctx, state, group)
            elif state.used[slot]:
                _free(ctx, state, slot)
            else:
                state.cache.release(slot)
        state.refresh()
        raise


def admit(ctx: Context, state: DecodeState, slots, prompts: list[list[int]], seeds,
          settings: list[Settings] | None = None, max_new: list[int] | None = None, encoder=None
          ) -> tuple[DecodeState, StepTokens]:
    """Prefill `prompts` into free `slots` of a running batch: `insert(prefill(...))`, the
    prompts run by the cache's own `prefill` (an in_place cache takes them straight into its
    buffer, with no copy). Returns the state and the rows' first tokens (as `prefill` gives
    them)."""
    slots = [int(s) for s in slots]
    _check_slots(state, prompts, slots)
    encoder_ids = _encoder_ids(ctx, prompts, encoder)
    with _undone_on_error(ctx, state, slots):
        last = fill_prompts(ctx, state, slots, prompts, encoder)
        prefix = _first_tokens(ctx, prompts, seeds, settings, max_new, last, encoder_ids)
        for j, slot in enumerate(slots):
            if prefix.first.finished[j]:
                state.cache.release(slot)  # it ended at its first token (or failed): the slot stays free
            else:
                _occupy(state, slot, prefix, j)
    state.refresh()
    return state, prefix.first


def fill_prompts(ctx: Context, state: DecodeState, slots: list[int], prompts: list[list[int]], encoder=None
                 ) -> np.ndarray:
    """Run `prompts` into the caches of free `slots` and return their last logits [n, V]; no
    token is chosen (the caller's search does that). Sets `state.cached` of the slots."""
    if isinstance(state.prefix, FirstStepStore) and isinstance(encoder, EncoderOutputs):
        found = _cached_first_steps(ctx, state.prefix, prompts, encoder)
    elif isinstance(state.prefix, PrefixStore) and (encoder is None
                                                    or isinstance(encoder, ctx.model.hooks.prompt_types)):
        found = _cached_prompts(ctx, state.prefix, prompts, encoder)
    else:
        state.cached[slots] = 0
        return state.cache.prefill(slots, prompts, ctx.prompt_steps, ctx.settings.pad_token_id,
                                   lambda rows: _prompt_cache(ctx, rows, encoder))
    state.cached[slots] = found.cached
    return insert_prompts(state.cache, slots, prompts, found)


def _cached_first_steps(ctx: Context, store: FirstStepStore, prompts: list[list[int]],
                        encoder: EncoderOutputs) -> PromptCache:
    """`_prompt_cache` of encoder-decoder rows through `store`: a row whose hidden states and
    decoder prompt were seen takes that first step's cache and logits; the others run together."""
    keys = [store.key(hidden, prompt) for hidden, prompt in zip(encoder.hidden, prompts)]
    found = [store.lookup(key, len(prompt)) for key, prompt in zip(keys, prompts)]
    cold = [j for j, f in enumerate(found) if f is None]
    rows: list = [None] * len(prompts)
    last = np.zeros((len(prompts), ctx.model.vocab_size), np.float32)
    if cold:
        fresh = _prompt_cache(ctx, [prompts[j] for j in cold], encoder.take(cold))
        for i, j in enumerate(cold):
            rows[j], last[j] = fresh.rows[i], fresh.last_logits[i]
            store.store(keys[j], rows[j], last[j])
    for j, f in enumerate(found):
        if f is not None:
            rows[j], last[j] = f
    return PromptCache(rows, np.array([len(p) for p in prompts]), last,
                       cached=np.array([0 if f is None else len(p) for f, p in zip(found, prompts)], np.int64))


def _cached_prompts(ctx: Context, store: PrefixStore, prompts: list[list[int]], images=None) -> PromptCache:
    """`_prompt_cache` of decoder-only prompts through `store`: a prompt with a cached prefix runs
    only the rest of it from the prefix's rows (as a later piece of the prompt runs), the others
    run together as always; every prompt's full blocks are then kept. A vision-language prompt
    is named by its images too (`images`: its family's prompt inputs, one of `hooks.prompt_types`,
    by their `prefix_key`), and its rows keep its M-RoPE delta."""
    model = ctx.model
    keyed = prompts if images is None else [images.take([j]).prefix_key(p) for j, p in enumerate(prompts)]
    found = [store.lookup(k) for k in keyed]
    cold = [j for j, (length, _) in enumerate(found) if not length]
    rows: list = [None] * len(prompts)
    last = np.zeros((len(prompts), model.vocab_size), np.float32)
    if cold:
        fresh = _prompt_cache(ctx, [prompts[j] for j in cold], None if images is None else images.take(cold))
        for i, j in enumerate(cold):
            rows[j], last[j] = fresh.rows[i], fresh.last_logits[i]
    for j, (length, cached) in enumerate(found):
        if length:
            past = {name: np.ascontiguousarray(array[None]) for name, array in cached.items()}
            row_images = None if images is None else images.take([j])
            row_last, presents = run_from(model.session, model.graph, prompts[j], length, past, ctx.prompt_steps,
                                          ctx.settings.pad_token_id, ctx.max_position, *prompt_inputs(
                                              model, [prompts[j]], row_images))
            rows[j] = {name: array[0, :, :len(prompts[j])] for name, array in presents.items()}
            if row_images is not None and row_images.positions[0] is not None:
                rows[j]["position_delta"] = row_images.deltas([len(prompts[j])])[0]
            last[j] = row_last[0]
    for j, key in enumerate(keyed):
        store.store(key, rows[j])
    return PromptCache(rows, np.array([len(p) for p in prompts]), last,
                       cached=np.array([length for length, _ in found], np.int64))


def admit_beams(ctx: Context, state: DecodeState, slots, prompt: list[int], seed: int, settings: Settings,
                max_new: int, encoder=None) -> tuple[DecodeState, BeamGroup | None]:
    """Start a beam search of `settings.num_beams` beams over free `slots` (one per beam): the
    prompt runs once, its cache is copied into the other slots, and the search takes its first
    step on the prompt's last logits. Returns the state and the group when it stopped at that
    first step (its slots are free again; `group.hypotheses()` are its results), else None:
    the group then steps with every `step` until a step reports it in `StepTokens.beams`.
    encoder: the request's EncoderOutputs or PromptImages (one row)."""
    slots = [int(s) for s in slots]
    if len(slots) != settings.num_beams:
        raise ValueError(f"slots: a search of {settings.num_beams} beams needs as many slots, not {len(slots)}")
    _check_slots(state, [prompt] * len(slots), slots)
    length = len(prompt)
    limit = min(length + max_new, ctx.max_position, state.capacity)
    encoder_ids = _encoder_ids(ctx, [prompt], encoder)[0]
    with _undone_on_error(ctx, state, slots):
        last = fill_prompts(ctx, state, slots[:1], [prompt], encoder)
        if len(slots) > 1:
            state.cache.copy_rows(slots[1:], slots[:1] * (len(slots) - 1), length)
        for slot in slots:
            state.tokens[slot, :length] = prompt
            state.lengths[slot], state.prompt_length[slot], state.limit[slot] = length, length, limit
            state.used[slot] = True
            state.settings.set_row(slot, settings, length, limit, encoder_ids=encoder_ids)
            state.settings.min_keep[slot] = beam_min_keep(settings)
            if state.logprob is not None:
                state.logprob[slot] = np.nan
        group = new_group(slots, settings, length, limit, seed)
        state.groups[slots[0]] = group
        stopped, failed = advance_groups(ctx, state, [group], [np.repeat(last[:1], len(slots), axis=0)])
        if failed:
            raise failed[group]
        if stopped:
            _free_group(ctx, state, group)
    state.refresh()
    return state, group if stopped else None


def step(ctx: Context, state: DecodeState) -> tuple[DecodeState, StepTokens]:
    """One token for every live slot: run the decoder on each row's last token, choose the next.

    The returned StepTokens are over all slots; free and finished slots run as padding rows.
    """
    rows = state.live_rows
    if not rows.size and not state.groups:
        return state, StepTokens(np.full(state.slots, -1, np.int64), np.zeros(state.slots, bool))
    if state.fast:
        return _greedy_steps(state, 1)
    used = np.flatnonzero(state.used)  # rows past the last used slot are free: the run may leave them out
    logits = state.cache.decode(state.lengths, int(used[-1]) + 1 if used.size else None)
    stopped, lost = _step_groups(ctx, state, logits) if state.groups else ({}, {})
    if not rows.size:
        state.refresh()
        return state, StepTokens(np.full(state.slots, -1, np.int64), np.zeros(state.slots, bool), failed=lost,
                                 beams=stopped)
    scores = logits[rows]  # [n, V]
    position = state.lengths[rows] + 1  # the new token's index in the row
    history = state.tokens if rows.size == state.slots else state.tokens[rows]
    tokens, lp, failed = select_rows(ctx, scores, state.live_settings, state.processes, history, position,
                                     state.prompt_length[rows], state.seeds[rows], state.draws[rows])
    if not state.greedy:
        state.draws[rows] += np.uint64(1)
    state.tokens[rows, position] = tokens
    if lp is not None:
        state.logprob[rows, position] = lp.token
        if lp.top is not None:
            state.top_ids[rows, position], state.top[rows, position] = lp.top_ids, lp.top
    state.lengths[rows] = position
    if failed:  # a row whose own selection failed gains no token (as assisted verification's rows)
        state.lengths[rows[list(failed)]] -= 1
    state.next_input[rows] = tokens
    out = with_logprobs(_settle(state, rows, tokens, position, failed), rows, state.slots, lp)
    out.beams = stopped
    out.failed.update(lost)
    return state, out


def _step_groups(ctx: Context, state: DecodeState, logits: np.ndarray) -> tuple[dict, dict]:
    """The beam groups' step on their rows of this run's `logits` [B, V]. The groups that
    stopped, and those whose own part failed, leave the state (their slots are free): returns
    ({first slot: stopped group}, {first slot: exception})."""
    groups = list(state.groups.values())
    stopped, failed = advance_groups(ctx, state, groups, [logits[g.slots] for g in groups])
    for g in stopped + list(failed):
        _free_group(ctx, state, g)
    return {int(g.slots[0]): g for g in stopped}, {int(g.slots[0]): e for g, e in failed.items()}


def advance(ctx: Context, state: DecodeState, max_steps: int) -> tuple[DecodeState, StepTokens]:
    """Up to `max_steps` steps, stopping after the first step in which a row finished; for
    callers that read the tokens from `state.tokens` rather than step by step. Returns the last
    step's StepTokens."""
    if state.fast and state.live_rows.size:
        return _greedy_steps(state, max_steps)
    return step(ctx, state)


def _greedy_steps(state: DecodeState, max_steps: int) -> tuple[DecodeState, StepTokens]:
    """The lean loop of greedy steps over a full batch: the argmax lands in the bound token
    input, nothing is gathered, the tokens go into the history once at the end, and the loop
    breaks at the first step in which a row can end."""
    rows, lengths, eos = state.live_rows, state.lengths, state.single_eos
    tokens, start = state.next_input, lengths + 1
    trace = []
    for logits in state.cache.decode_steps(lengths, min(max_steps, state.steps_to_limit)):
        logits.argmax(1, tokens)
        trace.append(chosen := tokens.tolist())
        if eos in chosen:
            break
    lengths += len(trace)
    state.tokens[rows[:, None], start[:, None] + np.arange(len(trace))] = np.array(trace).T
    state.refresh()  # the rows advanced: steps_to_limit is that much smaller
    if state.steps_to_limit > 0 and eos not in trace[-1]:
        return state, StepTokens(tokens.copy(), np.zeros(len(tokens), bool))
    return state, _settle(state, rows, tokens, lengths)


def _settle(state: DecodeState, rows: np.ndarray, tokens: np.ndarray, position: np.ndarray,
            failed: dict | None = None) -> StepTokens:
    """The step's output, and the rows it ended (an eos token, the row's limit, or a failure of
    its own: `failed`, by index into `rows`)."""
    out = StepTokens(np.full(state.slots, -1, np.int64), np.zeros(state.slots, bool))
    failed = {} if failed is None else failed
    is_eos, finished = ends(tokens, state.eos[rows], position + 1, state.limit[rows],
                             [state.stops[r] for r in rows.tolist()] if state.any_stops else (), failed)
    out.token[rows] = np.where(is_eos, -1, tokens)
    out.finished[rows] = finished
    if failed:
        out.token[rows[list(failed)]] = -1
        out.failed = {int(rows[i]): e for i, e in failed.items()}
    if finished.any():
        state.live[rows[finished]] = False
        out.any_finished = True
    state.refresh()
    return out


def release(ctx: Context, state: DecodeState, slot: int) -> DecodeState:
    """Free `slot` (a finished row, or a live one whose client went away)."""
    if not 0 <= slot < state.slots:
        raise ValueError(f"slot {slot} is outside this state's {state.slots} slots")
    if slot in state.groups:  # a beam search's first slot: all its slots
        _free_group(ctx, state, state.groups[slot])
    else:
        _free(ctx, state, slot)
    state.refresh()
    return state


def _free(ctx: Context, state: DecodeState, slot: int) -> None:
    state.cache.release(slot)
    state.live[slot] = state.used[slot] = False
    state.stops[slot] = None
    state.lengths[slot] = 0
    state.next_input[slot] = ctx.settings.pad_token_id


def _free_group(ctx: Context, state: DecodeState, group: BeamGroup) -> None:
    state.groups.pop(int(group.slots[0]), None)
    for slot in group.slots.tolist():
        _free(ctx, state, slot)


def row_logprobs(state: DecodeState, slot: int):
    """The log-probabilities of `row_tokens(state, slot)`, and the top alternatives of each
    ([(id, logprob), ...] best first; None without top_logprobs)."""
    start, count = int(state.prompt_length[slot]), len(row_tokens(state, slot))
    logprob = state.logprob[slot, start:start + count].tolist()
    if state.top is None:
        return logprob, None
    ids, top = state.top_ids[slot, start:start + count].tolist(), state.top[slot, start:start + count].tolist()
    return logprob, [list(zip(i, t)) for i, t in zip(ids, top)]


def row_eos_logprob(state: DecodeState, slot: int) -> float | None:
    """The log-probability of the eos token the row in `slot` ended at (None: it ended otherwise)."""
    end = int(state.lengths[slot])
    if end < int(state.prompt_length[slot]) or int(state.tokens[slot, end]) not in state.eos[slot]:
        return None
    return float(state.logprob[slot, end])


def row_tokens(state: DecodeState, slot: int) -> list[int]:
    """The new tokens of the row in `slot`, without a final eos token."""
    start, end = int(state.prompt_length[slot]), int(state.lengths[slot]) + 1
    new = state.tokens[slot, start:end].tolist()
    if new and new[-1] in state.eos[slot]:
        new.pop()
    return new
