"""The base every KV cache mode builds on: the contract's verbs (STEP_VERBS, VERIFY_VERBS: the
package docstring says what each does) and `missing_verbs`, which `new_cache` checks a mode
against when it is made; BaseCache's shared verbs; `insert_prompts`; and CacheInputs, the bound
per-token inputs of the buffer modes. Apart from the modes so that the encoder-decoder cache
(cross.py) and the decoder-only ones (in_place.py, append.py, grow.py) all extend it without
importing each other."""

from __future__ import annotations

import numpy as np

from ..runtime.feeds import Binding
from ..runtime.graph import DecoderGraph

# The cache contract: what the decode-state verbs and the scheduler call on every cache
# (admission, each step, a beam search's row moves, a row leaving), and what verifying
# candidates calls besides (assisted decoding). A mode missing a verb is refused when it is made.
STEP_VERBS = ("prefill", "insert", "decode", "decode_steps", "copy_rows", "release", "fit")
VERIFY_VERBS = ("verify", "rewind")


def size_class(need: int, most: int, least: int = 16) -> int:
    """The size a buffer dimension takes for `need` entries: the smallest power of two that
    holds them, at least `least`, at most `most` (the dimension's largest size, a class of its
    own when it is no power of two). The in_place and append caches size their rows and their
    length by these classes, so a buffer grows (and shrinks) a few times, not every step.

    >>> [size_class(n, 1000) for n in (1, 16, 17, 100, 600)]
    [16, 16, 32, 128, 1000]
    """
    size = max(least, 1 << max(0, need - 1).bit_length())
    return min(size, most)


def token_bytes(graph: DecoderGraph) -> int:
    """The bytes one token of one row takes in a decoder's self-attention cache: every cache
    input (each layer's keys and values) holds heads x head_dim entries of the cache's dtype."""
    item = np.dtype(graph.cache_dtype).itemsize
    return sum(e.heads * e.head_dim * item for e in graph.cache)


def missing_verbs(cache, verbs=STEP_VERBS) -> list[str]:
    """The verbs of the contract that `cache` (a cache or its class) does not implement."""
    return [verb for verb in verbs if not callable(getattr(cache, verb, None))]


def moves_by_group(groups: list[dict], dst, src, join) -> list[tuple[dict, list[int], list[int]]]:
    """The copies dst <- src between slots of grouped caches (grow, seq2seq: each group is
    {"slots": [slot or -1], ...}), per group holding a source: (group, rows to write, rows to
    read). A dst slot new to its source's group joins it first through `join(group, [(dst, src)])`."""
    out = []
    for group in groups:
        where = {slot: i for i, slot in enumerate(group["slots"]) if slot >= 0}
        moves = [(int(d), int(s)) for d, s in zip(dst, src) if int(s) in where]
        if not moves:
            continue
        joining = [(d, s) for d, s in moves if d not in where]
        if joining:
            join(group, joining)
            where = {slot: i for i, slot in enumerate(group["slots"]) if slot >= 0}
        out.append((group, [where[d] for d, _ in moves], [where[s] for _, s in moves]))
    return out


class BaseCache:
    """What every cache mode shares (the decoder-only modes, cross.py's Seq2SeqCache).

    `sized`: whether the mode's buffers are sized by classes of the rows they hold and of their
    length (in_place), so that `footprint` says what they take for given needs and `fit` lays
    them out at those classes: what admission by memory needs (engine/budget.py). The append
    mode sizes its length by classes but keeps every slot's rows; the modes whose arrays follow
    their rows step by step (grow, seq2seq) size nothing ahead (their `fit` has nothing to do).
    Those admit by slots. A sized cache is laid out for its leading `held` slots of `length`
    cache rows.

    `run_options`: where not None, the RunOptions of the decode runs, whose `terminate` another
    thread may set to end a step's run early, to be run again unchanged (in_place: a run writes
    each row's new cache entry at its length, and the run again writes the same)."""

    sized = False
    run_options = None
    ledger = None  # the runtime.device.Ledger of what crosses host <-> device, where the mode counts it
    memory = "host"  # where its buffers live: 'host' arrays, or the session's 'device'

    def fit(self, rows: int, length: int) -> None:
        """Lay the buffers out for slots [0, rows) of up to `length` cache rows each (grow or
        shrink them to those classes; the slots past `rows` must be free). Here nothing to do:
        the arrays follow the rows."""

    def footprint(self, rows: int, length: int) -> int | None:
        """The bytes the buffers take for slots [0, rows) of up to `length` cache rows; None
        where the mode does not size its buffers ahead (`sized`)."""
        return None

    def prefill(self, slots: list[int], prompts: list[list[int]], steps: str, pad: int, apart) -> np.ndarray:
        """Run fresh prompts into free `slots` and return their last logits [n, V]. Here: apart
        from the batch (`apart(prompts)`: a prefill.PromptCache of their caches), each row then
        inserted; a mode that can run prompts straight into its buffer overrides it (in_place)."""
        return insert_prompts(self, slots, prompts, apart(prompts))

    def read_row(self, slot: int, length: int) -> dict[str, np.ndarray] | None:
        """The first `length` cache rows `slot` holds, [heads, length, head_dim] per cache input
        (views where the buffers are host arrays: read them before the next run), for the prefix
        store to keep a finished row's decoded blocks; None where the mode cannot give them."""
        return None

    def _row(self, array, row: int, length: int) -> np.ndarray:
        """array[row, :, :length] of one cache input's [rows, heads, width, head_dim] buffer, on the
        host (a device mode reads it back: `prefix_keep`; a host one counts what would cross)."""
        self.ledger.add("prefix_keep", array[row, :, :length].nbytes)
        return array[row, :, :length]

    def _leading(self, span: int):
        """(binding, run) of the first `span` slots: the decode binding's bound arrays, their
        leading rows (`Binding.leading`), made once per span; `run` embeds first where the graph
        takes embeddings (`CacheInputs.runner`). The decode binding's batch is its leading
        `held` slots where the buffers hold fewer rows than the slots (in_place's classes)."""
        spans = self.__dict__.setdefault("_spans", {})
        found = spans.get(span)
        if found is None:
            binding = self.binding.leading(span, getattr(self, "held", None) or self.inputs.ids.shape[0],
                                           self._options_for(span))
            found = spans[span] = (binding, self.inputs.runner(binding.run))
        return found

    def _options_for(self, rows: int):
        """The RunOptions of a decode binding over `rows` slots (None: the binding's own)."""
        return None

    def decode_steps(self, lengths: np.ndarray, count: int):
        """Up to `count` decodes, the k-th (from 0) at `lengths + k`, yielding each step's logits;
        the caller writes each step's tokens into `token_input` before asking for the next, and
        advances its lengths by the steps it took. `lengths` is not changed."""
        for k in range(count):
            yield self.decode(lengths + k)


def insert_prompts(cache, slots: list[int], prompts: list[list[int]], found) -> np.ndarray:
    """Insert prompts run apart from the batch (`found`, a prefill.PromptCache) into `slots` of
    any mode's cache and return their last logits (what a prefix cache needs even of in_place:
    the rows it reuses come from elsewhere).

    The ledger: a run apart from the buffers brings its rows and last logits to the host
    (`prompt`), except a prefix a prefix store on the host gave; each row then goes to the device
    (`insert`), the store's part of it as `prefix_restore`."""
    ledger = cache.ledger
    for j, slot in enumerate(slots):
        length = len(prompts[j])
        cache.insert(slot, found.rows[j], length)
        if ledger is not None and length:
            row = sum(np.asarray(a).nbytes for a in found.rows[j].values())
            restored = row * int(found.cached[j]) // length if found.cached is not None else 0
            ledger.add("prompt", row - restored + found.last_logits[j].nbytes)
            ledger.add("insert", -restored)
            ledger.add("prefix_restore", restored)
    return found.last_logits


class CacheInputs:
    """The per-token inputs every mode binds once: input_ids [B, 1], position_ids, logits,
    use_cache_branch (always True while decoding: the past is never empty) and logits_positions
    (0: the step's one token).

    A graph that takes inputs_embeds binds an embeddings buffer [B, 1, hidden] instead, which
    the run from `runner(run)` fills from the ids through `embed` (the model's embed_tokens)
    before each step: the steps are the same as for input_ids.
    An M-RoPE graph (position_ids [3, B, 1]) keeps a position offset per slot: the prompt's
    delta (largest position + 1 - length), so a new token sits at `length + delta` on all axes."""

    def __init__(self, binding: Binding, graph: DecoderGraph, slots: int, embed=None):
        self.ids = np.zeros((slots, 1), np.int64 if graph.has_inputs_embeds else graph.dtype("input_ids"))
        self.logits = np.empty((slots, 1, graph.vocab_size), graph.logits_dtype)
        self.embeds, self._embed = None, embed
        if graph.has_inputs_embeds:
            if embed is None:
                raise ValueError(f"{graph.path.name} takes inputs_embeds: this cache needs the model's embed function")
            self.embeds = np.zeros((slots, 1, graph.hidden_size), graph.dtype("inputs_embeds"))
            binding.input("inputs_embeds", self.embeds)
        else:
            binding.input("input_ids", self.ids)
        binding.output("logits", self.logits)
        self.positions = None
        self.offsets = np.zeros(slots, np.int64) if graph.position_axes == 3 else None
        if graph.has_position_ids:
            shape = (slots, 1) if graph.position_axes == 1 else (3, slots, 1)
            self.positions = np.zeros(shape, graph.dtype("position_ids"))
            binding.input("position_ids", self.positions)
        if graph.has_use_cache_branch:
            self.use_cache = np.array([True])
            binding.input("use_cache_branch", self.use_cache)
        self.read = None
        if graph.has_logits_positions:  # a step's one token is position 0 of its run
            self.read = np.zeros((slots, 1), np.int64)
            binding.input("logits_positions", self.read)

    def step_rates(self, mask_row: int = 0) -> dict:
        """What a decode step moves between the host and a device, per cause: (bytes a row, bytes
        a step). Its logits come to the host; its ids (a graph that takes embeddings gets them
        from the ids where the buffers live), positions and read positions go to the device,
        with `mask_row` bytes a row of what updates the mask there (in_place: each row's new
        entry, a row and a column), and use_cache_branch once."""
        row = self.ids[0].nbytes
        if self.positions is not None:
            row += self.positions[..., 0, :].nbytes
        if self.read is not None:
            row += self.read[0].nbytes
        step = self.use_cache.nbytes if getattr(self, "use_cache", None) is not None else 0
        return {"logits": (self.logits[0].nbytes, 0), "inputs": (row + mask_row, step)}

    def set_positions(self, lengths: np.ndarray) -> None:
        """A row's new token sits at its length (plus its offset; rows never outgrow the model's
        positions)."""
        if self.positions is not None:
            self.positions[..., 0] = lengths if self.offsets is None else lengths + self.offsets

    def runner(self, run):
        """`run`, preceded by the embedding of the step's tokens where the graph needs it."""
        if self.embeds is None:
            return run

        def embed_and_run():
            self.embeds[:] = self._embed(self.ids)
            run()
        return embed_and_run

    def place(self, slot: int, cache: dict) -> None:
        """A prefilled row's position offset (its prompt's M-RoPE delta; 0 when it has none)."""
        if self.offsets is not None:
            self.offsets[slot] = int(cache.get("position_delta", 0))
