"""The decode state: its slots, their rows, their cache; `new_state` and `release`.

As JetStream's engine (`prefill`, `insert(prefix, decode_state, slot)`,
`generate(params, decode_state) -> (decode_state, tokens)`), a step is a function of an explicit
state and returns the next state with the step's tokens. The state has a fixed number of slots;
each slot holds one row: its tokens so far, its cache, its selection settings and its random
state (seed and draw count). Buffers are reused in place from step to step. The verbs, a module
each beside this one:

    prefix = prefill(ctx, prompts, seeds)        # core/insert.py: cache and first token of fresh rows
    state = insert(ctx, prefix, state, slots)    # core/insert.py: into free slots of a running batch
    state, out = step(ctx, state)                # core/step.py: one token for every live slot
    state = release(ctx, state, slot)            # here: free a finished or cancelled slot

Each row's token is chosen in core/rows.py. A beam search request holds num_beams slots as one
group (`admit_beams`); `step` runs its rows in the same model run as the others and moves them as
transformers' `_beam_search` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..cache import new_cache
from ..cache.cross import FirstStepStore
from ..cache.prefill import PromptCache
from ..cache.prefix import PrefixStore
from ..logits.constraints import Grammars
from ..logits.row_settings import RowSettings
from ..logits.selection import LogProbs
from ..params.settings import Settings
from ..search.beam import BeamGroup
from .context import Context


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
        settings=new_row_settings(ctx, slots), next_input=cache.token_input, stops=[None] * slots,
        lean=not (ctx.token_logprobs or ctx.processors), cached=np.zeros(slots, np.int64))
    if ctx.token_logprobs:
        state.logprob = np.full((slots, capacity), np.nan, np.float32)
        if ctx.top_logprobs:
            state.top_ids = np.zeros((slots, capacity, ctx.top_logprobs), np.int64)
            state.top = np.zeros((slots, capacity, ctx.top_logprobs), np.float32)  # read where written only
    if prefix is not None and ctx.model.is_seq2seq == isinstance(prefix, FirstStepStore):
        state.prefix = prefix
    state.next_input[:] = ctx.settings.pad_token_id
    state.refresh()
    return state


def new_row_settings(ctx: Context, n: int) -> RowSettings:
    """Empty settings of `n` rows for the context's model: its grammars, its family's timestamp
    processor (`model.hooks`)."""
    return RowSettings(n, ctx.model.vocab_size, Grammars.of(ctx), ctx.model.hooks.timestamps)


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


def release(ctx: Context, state: DecodeState, slot: int) -> DecodeState:
    """Free `slot` (a finished row, or a live one whose client went away)."""
    if not 0 <= slot < state.slots:
        raise ValueError(f"slot {slot} is outside this state's {state.slots} slots")
    if slot in state.groups:  # a beam search's first slot: all its slots
        free_group(ctx, state, state.groups[slot])
    else:
        free_slot(ctx, state, slot)
    state.refresh()
    return state


def free_slot(ctx: Context, state: DecodeState, slot: int) -> None:
    state.cache.release(slot)
    state.live[slot] = state.used[slot] = False
    state.stops[slot] = None
    state.lengths[slot] = 0
    state.next_input[slot] = ctx.settings.pad_token_id


def free_group(ctx: Context, state: DecodeState, group: BeamGroup) -> None:
    state.groups.pop(int(group.slots[0]), None)
    for slot in group.slots.tolist():
        free_slot(ctx, state, slot)


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
