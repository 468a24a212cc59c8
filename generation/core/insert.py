"""Rows into the decode state: `prefill` fresh rows, `insert` them into free slots, `admit` both
at once (from the prefix store where it holds their prompts' start), `admit_beams` a beam search.
A failed admission leaves the state as it was (`undone_on_error`).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from ..cache.base import insert_prompts
from ..cache.cross import FirstStepStore, run_first_steps
from ..cache.prefill import PromptCache, run_from, run_prompts
from ..cache.prefix import PrefixStore
from ..params.settings import Settings
from ..params.checks import SettingError
from ..runtime.encoders import EncoderOutputs
from ..search.beam import BeamGroup, advance_groups, beam_min_keep, new_group
from .context import Context, check_adapter
from .rows import encoder_ids_of, ends, prompt_inputs, row_settings_of, select_rows, stop_matchers_of
from .state import DecodeState, Prefix, StepTokens, free_group, free_slot, with_logprobs


def first_tokens_of(ctx: Context, prompts, seeds, settings, max_new, last_logits, encoder_ids) -> Prefix:
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
    rows = row_settings_of(ctx, prompts, settings, limit, encoder_ids)
    history = np.zeros((len(prompts), max(1, int(lengths.max()))), np.int64)
    for j, prompt in enumerate(prompts):
        history[j, :len(prompt)] = prompt
    tokens, lp, failed = select_rows(ctx, last_logits, rows, rows.processes(), history, lengths, lengths, seeds,
                                     np.zeros(len(prompts), np.uint64))
    stops = stop_matchers_of(ctx, prompts, settings, failed)
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
    if any(s.adapter for s in settings or ()):
        raise SettingError("adapter", "adapter: rows with LoRA adapters are admitted into a state (`admit`), which "
                                      "gives them their places")
    encoder_ids = encoder_ids_of(ctx, prompts, encoder)
    cache = prompt_cache_of(ctx, prompts, encoder)
    prefix = first_tokens_of(ctx, prompts, seeds, settings, max_new, cache.last_logits, encoder_ids)
    prefix.cache = cache
    return prefix


def prompt_cache_of(ctx: Context, prompts: list[list[int]], encoder=None, places=None) -> PromptCache:
    """The prompts' caches and last logits, run apart from any state (an encoder-decoder's
    first decoder steps, or the decoder over the prompts). places: each prompt's adapter place
    (`adapter_places`; None: no adapter)."""
    model = ctx.model
    if model.is_seq2seq:
        last, rows = run_first_steps(model, prompts, encoder)
        return PromptCache(rows, np.array([len(p) for p in prompts]), last)
    lora = None if places is None else (lambda indices: lora_feeds(model, np.asarray(places)[np.asarray(indices)]))
    return run_prompts(model.session, model.graph, ctx.cache_mode, ctx.prompt_steps, prompts,
                       ctx.settings.pad_token_id, ctx.max_position, *prompt_inputs(model, prompts, encoder), lora=lora)


def lora_feeds(model, places) -> dict | None:
    """The LoRA inputs of a run apart from the slots whose rows sit at `places` (runtime.lora.bank);
    None where no row has an adapter (the run feeds the graph's empty ones)."""
    places = np.asarray(places, np.int64)
    return model.lora.bank.feeds(places) if places.any() else None


def set_places(state: DecodeState, slots, places) -> None:
    """The adapter places of the rows about to sit in `slots` (None: no adapter), where the cache
    keeps them (cache/lora.py: a model with adapters)."""
    rows = getattr(state.cache, "lora", None)
    if rows is not None:
        rows.set(slots, 0 if places is None else places)


def hold_place(ctx: Context, state: DecodeState, slot: int, settings: Settings) -> int:
    """The adapter place of a row whose prompt runs apart from its slot (in chunks), held by the
    slot meanwhile (so no other adapter takes it); 0 for a row without one."""
    places = adapter_places(ctx, state, [settings])
    if places is None:
        return 0
    set_places(state, [slot], places)
    return int(places[0])


def adapter_places(ctx: Context, state: DecodeState, settings: list[Settings] | None) -> np.ndarray | None:
    """Each row's place in the model's adapter bank (0: none), its adapter loaded into one where
    it has none (runtime.lora.registry); None where no row names an adapter. SettingError naming
    `adapter` for a model without adapters, an adapter it does not know, or no free place."""
    names = [s.adapter for s in settings or ()]
    if not any(names):
        return None
    places = np.zeros(len(names), np.int64)
    for j, name in enumerate(names):
        if name:
            check_adapter(ctx.model, name)
            busy = state.cache.lora.busy() | set(places[:j].tolist())
            try:
                places[j] = ctx.model.lora.place(name, busy)
            except (KeyError, ValueError) as e:  # unloaded meanwhile; no free place
                raise SettingError("adapter", f"adapter {name!r}: {e}") from None
    return places


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
    with undone_on_error(ctx, state, slots):
        for j, slot in enumerate(slots):
            if not prefix.first.finished[j]:
                state.cache.insert(slot, prefix.cache.rows[j], len(prefix.prompts[j]))
                _occupy(state, slot, prefix, j)
    state.refresh()
    return state


@contextmanager
def undone_on_error(ctx: Context, state: DecodeState, slots: list[int]):
    """Admission is all or nothing: when it raises, the `slots` (free before it) are freed again,
    whether the cache took their rows or not, and the rows already running are as they were."""
    try:
        yield
    except BaseException:
        for slot in slots:
            group = state.groups.get(slot)
            if group is not None:
                free_group(ctx, state, group)
            elif state.used[slot]:
                free_slot(ctx, state, slot)
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
    encoder_ids = encoder_ids_of(ctx, prompts, encoder)
    places = adapter_places(ctx, state, settings)
    with undone_on_error(ctx, state, slots):
        last = fill_prompts(ctx, state, slots, prompts, encoder, places)
        prefix = first_tokens_of(ctx, prompts, seeds, settings, max_new, last, encoder_ids)
        for j, slot in enumerate(slots):
            if prefix.first.finished[j]:
                state.cache.release(slot)  # it ended at its first token (or failed): the slot stays free
            else:
                _occupy(state, slot, prefix, j)
    state.refresh()
    return state, prefix.first


def fill_prompts(ctx: Context, state: DecodeState, slots: list[int], prompts: list[list[int]], encoder=None,
                 places=None) -> np.ndarray:
    """Run `prompts` into the caches of free `slots` and return their last logits [n, V]; no
    token is chosen (the caller's search does that). Sets `state.cached` of the slots. places:
    the rows' adapter places (`adapter_places`; None: no row has one), which the prefix store
    names them by."""
    set_places(state, slots, places)
    if isinstance(state.prefix, FirstStepStore) and isinstance(encoder, EncoderOutputs):
        found = _cached_first_steps(ctx, state.prefix, prompts, encoder)
    elif isinstance(state.prefix, PrefixStore) and (encoder is None
                                                    or isinstance(encoder, ctx.model.hooks.prompt_types)):
        found = _cached_prompts(ctx, state.prefix, prompts, encoder, places)
    else:
        state.cached[slots] = 0
        return state.cache.prefill(slots, prompts, ctx.prompt_steps, ctx.settings.pad_token_id,
                                   lambda rows: prompt_cache_of(ctx, rows, encoder, places))
    state.cached[slots] = found.cached
    return insert_prompts(state.cache, slots, prompts, found)


def _cached_first_steps(ctx: Context, store: FirstStepStore, prompts: list[list[int]],
                        encoder: EncoderOutputs) -> PromptCache:
    """`prompt_cache_of` of encoder-decoder rows through `store`: a row whose hidden states and
    decoder prompt were seen takes that first step's cache and logits; the others run together."""
    keys = [store.key(hidden, prompt) for hidden, prompt in zip(encoder.hidden, prompts)]
    found = [store.lookup(key, len(prompt)) for key, prompt in zip(keys, prompts)]
    cold = [j for j, f in enumerate(found) if f is None]
    rows: list = [None] * len(prompts)
    last = np.zeros((len(prompts), ctx.model.vocab_size), np.float32)
    if cold:
        fresh = prompt_cache_of(ctx, [prompts[j] for j in cold], encoder.take(cold))
        for i, j in enumerate(cold):
            rows[j], last[j] = fresh.rows[i], fresh.last_logits[i]
            store.store(keys[j], rows[j], last[j])
    for j, f in enumerate(found):
        if f is not None:
            rows[j], last[j] = f
    return PromptCache(rows, np.array([len(p) for p in prompts]), last,
                       cached=np.array([0 if f is None else len(p) for f, p in zip(found, prompts)], np.int64))


def _cached_prompts(ctx: Context, store: PrefixStore, prompts: list[list[int]], images=None, places=None
                    ) -> PromptCache:
    """`prompt_cache_of` of decoder-only prompts through `store`: a prompt with a cached prefix runs
    only the rest of it from the prefix's rows (as a later piece of the prompt runs), the others
    run together as always; every prompt's full blocks are then kept. A vision-language prompt
    is named by its images too (`images`: its family's prompt inputs, one of `hooks.prompt_types`,
    by their `prefix_key`), and its rows keep its M-RoPE delta; a row with a LoRA adapter (`places`)
    by its adapter too (LoraBank.prefix_key)."""
    model = ctx.model
    keyed = prompts if images is None else [images.take([j]).prefix_key(p) for j, p in enumerate(prompts)]
    if places is not None:
        keyed = [model.lora.bank.prefix_key(k, int(place)) for k, place in zip(keyed, places)]
    found = [store.lookup(k) for k in keyed]
    cold = [j for j, (length, _) in enumerate(found) if not length]
    rows: list = [None] * len(prompts)
    last = np.zeros((len(prompts), model.vocab_size), np.float32)
    if cold:
        fresh = prompt_cache_of(ctx, [prompts[j] for j in cold], None if images is None else images.take(cold),
                                None if places is None else np.asarray(places)[cold])
        for i, j in enumerate(cold):
            rows[j], last[j] = fresh.rows[i], fresh.last_logits[i]
    for j, (length, cached) in enumerate(found):
        if length:
            row_images = None if images is None else images.take([j])
            lora = None if places is None else lora_feeds(model, np.asarray(places)[j:j + 1])
            last[j], rows[j] = rest_after_prefix(ctx, prompts[j], length, cached, row_images, lora)
            if row_images is not None and row_images.positions[0] is not None:
                rows[j]["position_delta"] = row_images.deltas([len(prompts[j])])[0]
    for j, key in enumerate(keyed):
        store.store(key, rows[j])
    return PromptCache(rows, np.array([len(p) for p in prompts]), last,
                       cached=np.array([length for length, _ in found], np.int64))


def rest_after_prefix(ctx: Context, prompt: list[int], length: int, cached: dict, images=None, lora=None
                      ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One prompt's tokens from `length` on, run after `cached` (its first `length` tokens' rows
    from a prefix store, [heads, length, head_dim] per input) as a prompt's later piece runs:
    (its last logits [V], its rows [heads, len(prompt), head_dim] per cache input). `images`:
    a vision-language prompt's inputs (one row); `lora`: its LoRA adapter's inputs (LoraBank.feeds)."""
    model = ctx.model
    past = {name: np.ascontiguousarray(array[None]) for name, array in cached.items()}
    last, presents = run_from(model.session, model.graph, prompt, length, past, ctx.prompt_steps,
                              ctx.settings.pad_token_id, ctx.max_position, *prompt_inputs(model, [prompt], images),
                              lora=lora)
    return last[0], {name: array[0, :, :len(prompt)] for name, array in presents.items()}


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
    encoder_ids = encoder_ids_of(ctx, [prompt], encoder)[0]
    places = adapter_places(ctx, state, [settings])
    with undone_on_error(ctx, state, slots):
        last = fill_prompts(ctx, state, slots[:1], [prompt], encoder, places)
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
            free_group(ctx, state, group)
    state.refresh()
    return state, group if stopped else None
