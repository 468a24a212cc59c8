"""The KV cache of a running batch: one contract, four modes (in_place, append, grow: a
decoder-only model's; seq2seq: an encoder-decoder's decoder, with its cross-attention cache).

Every mode implements the step verbs (base.STEP_VERBS), checked when a cache is made (`new_cache`
refuses a mode missing one), over `slots` rows:
  token_input                  [B] int64: the token each slot feeds at the next decode (the
                               state writes its chosen tokens here; it is the bound input)
  prefill(slots, prompts, steps, pad, apart)
                               run fresh prompts into free slots and return their last logits
                               [n, V]: by default apart from the batch (`apart(prompts)`) and
                               inserted; the in_place cache runs them straight into its buffer
  insert(slot, cache, length)  put a prefilled row's cache ([heads, length, head_dim] per
                               cache input) into a free slot
  decode(lengths, span=None)   run one token per slot (lengths [B] = valid cache rows of each
                               slot, 0 for a free slot) and return the logits [B, V]; the new
                               token's keys and values land at row `lengths[b]` of slot b.
                               `span`: the slots from it on are free, and their logits are
                               not read (the in_place cache runs the leading rows only)
  decode_steps(lengths, count) decode as a generator over up to `count` steps, for loops that
                               make many tokens in a row (the in_place cache makes it lean)
  copy_rows(dst, src, length)  slots dst take the first `length` cache rows of slots src (as
                               they were before the call): beam search's reorder
  release(slot)                forget a slot's rows
  fit(rows, length)            lay the buffers out for slots [0, rows) of up to `length` cache
                               rows (a mode that sizes its buffers by classes: `sized`,
                               `footprint(rows, length)` its bytes; the others have nothing to do)
The modes that verify candidates (append, grow) also implement base.VERIFY_VERBS; assisted
decoding asks for them when its context is made (core/context.py refuses a mode without them):
  verify(lengths, ids, rows, widths)
                               run several tokens per row at once (ids [B, S], the first
                               `widths[b]` real; rows: the slots that count) and return their
                               logits [len(rows), S, V] (zeros past a row's width); slot b then
                               holds cache rows up to lengths[b] + S, of which the caller keeps
                               a prefix through `rewind` (assisted decoding's verification)
  rewind(lengths)              every slot keeps only its first lengths[b] cache rows
  verifies_row_by_row          whether verify runs each row with candidates alone (its cost,
                               for assisted/budget.py) or every slot as wide as the widest
The state around the cache (lengths, tokens, stops) lives in `generation.core.state`; the cache
holds only buffers and does not advance lengths itself.

Modules: base.py (BaseCache, the contract's verb lists, size classes, the bound step inputs of
the buffer modes), in_place.py, append.py, grow.py (the decoder-only modes; windowed.py: append for a
graph with a sliding window), cross.py (an encoder-decoder
decoder's first step and its cache), prefill.py (prompts through the decoder, apart from the
batch), prefix.py (computed prompt prefixes, reused by later prompts).
"""

from __future__ import annotations

from .append import AppendCache
from .base import STEP_VERBS, missing_verbs
from .cross import Seq2SeqCache
from .grow import GrowCache
from .in_place import InPlaceCache
from .in_place_device import DeviceInPlaceCache
from .append_device import DeviceAppendCache
from .cross_device import DeviceSeq2SeqCache
from .grow_device import DeviceGrowCache
from ..runtime.device import Ledger
from .windowed import WindowedAppendCache
from .lora import lora_rows

CACHES = {"in_place": InPlaceCache, "append": AppendCache, "grow": GrowCache, "seq2seq": Seq2SeqCache}
DEVICE_MODES = ("in_place", "append", "grow", "seq2seq")  # the modes whose buffers may live on the session's device


def new_cache(model, mode: str, slots: int, capacity: int, max_position: int, buffers: str = "host",
              ledger: Ledger | None = None):
    """The cache of `mode` for `model`'s decoder; a decoder that takes inputs_embeds gets the
    model's embedding (only the append cache takes one: the others refuse such a graph). An
    append cache of a model with a sliding window, or of a graph that reads buffer columns
    (MPT's ALiBi: graph.keys_at_end), keeps each row's rows where the graph looks for them
    (windowed.py). buffers: 'host' (numpy arrays bound by pointer) or 'device' (buffers on the
    session's device: in_place only, in_place_device.py); `ledger` counts what crosses
    host <-> device (the in_place caches count it; the others keep None)."""
    kind = CACHES[mode]
    windowed = kind is AppendCache and (model.attention_window or model.graph.keys_at_end)
    if buffers == "device":
        if mode not in DEVICE_MODES or windowed:
            raise ValueError(f"buffers 'device': the {mode} cache{' of a sliding window' if windowed else ''} "
                             f"keeps its buffers on the host")
        if mode == "in_place":
            cache = DeviceInPlaceCache(model.session, model.graph, slots, capacity, max_position, ledger,
                                       provider=model.provider, graphs=model.cuda_graphs)
        elif mode == "grow":
            cache = DeviceGrowCache(model.session, model.graph, slots, capacity, max_position, ledger,
                                    provider=model.provider)
        elif mode == "seq2seq":
            cache = DeviceSeq2SeqCache(model.session, model.graph, slots, capacity, max_position, ledger,
                                       provider=model.provider)
        else:
            cache = DeviceAppendCache(model.session, model.graph, slots, capacity, max_position,
                                      model.embed if model.graph.has_inputs_embeds else None, ledger,
                                      provider=model.provider, embed_session=model.embed_session)
    elif kind is InPlaceCache and not model.graph.has_inputs_embeds:
        cache = InPlaceCache(model.session, model.graph, slots, capacity, max_position, ledger)
    elif kind in (GrowCache, Seq2SeqCache):
        cache = kind(model.session, model.graph, slots, capacity, max_position, ledger)
    else:
        cache = _other(model, kind, slots, capacity, max_position)
        if isinstance(cache, AppendCache) and ledger is not None:
            cache.ledger = ledger
            cache.ledger.rate(cache.inputs.step_rates())
    missing = missing_verbs(cache)
    if missing:
        raise TypeError(f"cache mode {mode!r} ({type(cache).__name__}) does not implement {', '.join(missing)}: "
                        f"every mode implements {', '.join(STEP_VERBS)} (cache/base.py)")
    cache.lora = lora_rows(model, slots)
    if cache.lora is not None and type(cache) not in (InPlaceCache, AppendCache):
        raise ValueError(f"max_loras: LoRA adapters run in the in_place and append cache modes on host buffers, "
                         f"not {type(cache).__name__} (cache mode {mode!r}, buffers {buffers!r})")
    return cache


def _other(model, kind, slots: int, capacity: int, max_position: int):
    if kind is AppendCache and (model.attention_window or model.graph.keys_at_end):
        kind = WindowedAppendCache
    if model.graph.has_inputs_embeds:
        cache = kind(model.session, model.graph, slots, capacity, max_position, embed=model.embed)
    else:
        cache = kind(model.session, model.graph, slots, capacity, max_position)
    return cache
