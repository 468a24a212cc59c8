"""The KV cache of a running batch: one contract, three modes.

Every mode implements the same verbs over `slots` rows:
  token_input                  [B] int64: the token each slot feeds at the next decode (the
                               state writes its chosen tokens here; it is the bound input)
  insert(slot, cache, length)  put a prefilled row's cache ([heads, length, head_dim] per
                               cache input) into a free slot
  decode(lengths)              run one token per slot (lengths [B] = valid cache rows of each
                               slot, 0 for a free slot) and return the logits [B, V]; the new
                               token's keys and values land at row `lengths[b]` of slot b
  release(slot)                forget a slot's rows
  copy_rows(dst, src, length)  slots dst take the first `length` cache rows of slots src (as
                               they were before the call): beam search's reorder
  decode_steps(lengths, count) decode as a generator over up to `count` steps, for loops that
                               make many tokens in a row (the in_place cache makes it lean)
  verify(lengths, ids, rows, widths)
                               run several tokens per row at once (ids [B, S], the first
                               `widths[b]` real; rows: the slots that count) and return their
                               logits [len(rows), S, V] (zeros past a row's width); slot b then
                               holds cache rows up to lengths[b] + S, of which the caller keeps
                               a prefix through `rewind` (assisted decoding's verification)
  rewind(lengths)              every slot keeps only its first lengths[b] cache rows
  verifies_row_by_row          whether verify runs each row with candidates alone (its cost,
                               for budget.py) or every slot as wide as the widest
The in_place cache also has prefill(slots, prompts, steps, pad): prompts straight into free
slots, no copy (`state.admit` uses it where a cache has it).
The state around the cache (lengths, tokens, stops) lives in `state.py`; the cache holds only
buffers and does not advance lengths itself.
"""

from __future__ import annotations

import numpy as np

from .cache_base import STEP_VERBS, BaseCache, missing_verbs, moves_by_group
from .feeds import Binding, pieces, prompt_widths, step_inputs
from .graph import DecoderGraph
from .seq2seq import Seq2SeqCache


class _Inputs:
    """The per-token inputs every mode binds once: input_ids [B, 1], position_ids, logits, and
    use_cache_branch (always True while decoding: the past is never empty).

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


class InPlaceCache(BaseCache):
    """One buffer [slots, heads, capacity, head_dim] per cache input, bound as both the past
    input and the present output of GroupQueryAttention, which writes the new rows in place at
    each row's length (the sum of its mask row, minus one).

    Everything is bound once: the buffers, the token and position inputs, the logits, and an
    attention mask as wide as the buffer. A step writes one mask entry per row and runs
    (onnxruntime-genai's C++ loop does the same)."""

    mode = "in_place"
    verifies_row_by_row = True  # see verify

    def __init__(self, session, graph: DecoderGraph, slots: int, capacity: int, max_position: int):
        self.binding = Binding(session)
        self.capacity = capacity
        self.buffers = {e.past: np.zeros((slots, e.heads, capacity, e.head_dim), graph.cache_dtype)
                        for e in graph.cache}
        for e in graph.cache:
            self.binding.input(e.past, self.buffers[e.past])
            self.binding.output(e.present, self.buffers[e.past])
        self.inputs = _Inputs(self.binding, graph, slots)
        self.token_input = self.inputs.ids[:, 0]
        self.mask = np.zeros((slots, capacity), graph.dtype("attention_mask"))
        self.mask[:, 0] = 1  # a free slot is a one-token padding row
        self.binding.input("attention_mask", self.mask)
        self.rows = np.arange(slots)
        self.logits = self.inputs.logits[:, 0]
        self.graph = graph
        self.decode = self._decoder()
        self._prompt_binding = Binding(session)  # prompts bind their own shapes, apart from decode's
        self._prompt_logits = np.empty(0, graph.logits_dtype)

    def insert(self, slot: int, cache: dict[str, np.ndarray], length: int) -> None:
        for name, rows in cache.items():
            self.buffers[name][slot, :, :length] = rows
        self.mask[slot] = 0
        self.mask[slot, :length] = 1

    def prefill(self, slots: list[int], prompts: list[list[int]], steps: str, pad: int) -> np.ndarray:
        """Run fresh prompts straight into their free slots' buffer rows; the last logits [n, V].

        Slots in one contiguous run share the first piece (GroupQueryAttention's first prompt
        takes any batch); later pieces run slot by slot, as onnxruntime requires. No copy: the
        operator writes into the slots, bound by pointer."""
        last = np.zeros((len(prompts), self.graph.vocab_size), np.float32)
        order = sorted(range(len(slots)), key=lambda j: slots[j])
        runs, run = [], [order[0]]
        for j in order[1:]:
            if slots[j] == slots[run[-1]] + 1:
                run.append(j)
            else:
                runs.append(run)
                run = [j]
        runs.append(run)
        for run in runs:
            lengths = [len(prompts[j]) for j in run]
            first = prompt_widths(max(lengths), steps)[0]
            ids = np.full((len(run), first), pad, np.int64)
            for i, j in enumerate(run):
                ids[i, :min(first, lengths[i])] = prompts[j][:first]
            logits = self._prompt_step(slots[run[0]], ids, 0)
            for i, j in enumerate(run):
                last[j] = logits[i, min(first, lengths[i]) - 1]
                offset = first
                for width in pieces(lengths[i] - first) if lengths[i] > first else []:
                    row = np.array([prompts[j][offset:offset + width]], np.int64)
                    last[j] = self._prompt_step(slots[j], row, offset)[0, -1]
                    offset += width
        for j, slot in enumerate(slots):
            self.mask[slot] = 0
            self.mask[slot, :len(prompts[j])] = 1
        return last

    def _prompt_step(self, slot: int, ids: np.ndarray, offset: int) -> np.ndarray:
        """ids [n, S] after `offset` cached tokens, into slots slot..slot+n-1; logits [n, S, V]."""
        rows, width = ids.shape
        binding = self._prompt_binding
        for e in self.graph.cache:
            buffer = self.buffers[e.past]
            pointer, shape = buffer.ctypes.data + slot * buffer[0].nbytes, (rows, *buffer.shape[1:])
            binding.input_at(e.past, pointer, shape, buffer.dtype)
            binding.output_at(e.present, pointer, shape, buffer.dtype)
        positions = np.broadcast_to(offset + np.arange(width), ids.shape)
        feeds = step_inputs(self.graph, ids, np.ones((rows, offset + width), np.int64), positions, offset)
        feeds["use_cache_branch"] = np.array([True])  # the shared buffer is the past, even when empty
        for name, array in feeds.items():
            if name in self.graph.input_dtypes:
                binding.input(name, array)
        size = rows * width * self.graph.vocab_size
        if self._prompt_logits.size < size:  # kept between prompts: no fresh pages per request
            self._prompt_logits = np.empty(size, self.graph.logits_dtype)
        logits = self._prompt_logits[:size].reshape(rows, width, self.graph.vocab_size)
        binding.output("logits", logits)
        binding.run()
        return logits

    def verify(self, lengths: np.ndarray, ids: np.ndarray, rows: np.ndarray, widths: np.ndarray) -> np.ndarray:
        """Row by row, each its own width: GroupQueryAttention refuses several tokens of more
        than one row over a past ("batch_size must be 1 when sequence_length > 1"). Rows of
        width 1, when there are several, take one batched decode instead (which also writes the
        first token of the other rows, as their own runs then write it again)."""
        out = np.zeros((len(rows), ids.shape[1], self.graph.vocab_size), np.float32)
        single = widths[rows] == 1
        if single.sum() >= 2:
            self.token_input[rows] = ids[rows, 0]
            out[single, 0] = self.decode(lengths)[rows[single]]
        for i, slot in enumerate(rows.tolist()):
            if single[i] and single.sum() >= 2:
                continue
            width = int(widths[slot])
            out[i, :width] = self._prompt_step(slot, ids[slot:slot + 1, :width], int(lengths[slot]))[0]
        return out

    def rewind(self, lengths: np.ndarray) -> None:
        """A row's valid rows are its mask's ones: the rows past its length are overwritten later."""
        np.less(np.arange(self.capacity), lengths[:, None], out=self.mask, casting="unsafe")
        self.mask[lengths == 0, 0] = 1  # a free slot stays a one-token padding row

    def copy_rows(self, dst, src, length: int) -> None:
        """Only the rows that move, only their valid part: a beam step moves a few rows of a
        few hundred tokens, where gathering whole buffers would copy them all."""
        for buffer in self.buffers.values():
            buffer[dst, :, :length] = buffer[src, :, :length]
        self.mask[dst] = self.mask[src]

    def release(self, slot: int) -> None:
        """The slot's rows stay until a new row is inserted; its mask becomes a padding row's."""
        self.mask[slot] = 0
        self.mask[slot, 0] = 1

    def _decoder(self):
        """`decode(lengths)` as a closure over what it touches (the step loop calls it often)."""
        mask, rows, run, logits, inputs = self.mask, self.rows, self.binding.run, self.logits, self.inputs

        def decode(lengths: np.ndarray) -> np.ndarray:
            mask[rows, lengths] = 1  # the new token's row: GroupQueryAttention writes it at the row's length
            if inputs.positions is not None:
                inputs.set_positions(lengths)
            run()
            return logits
        return decode

    def decode_steps(self, lengths: np.ndarray, count: int):
        """Up to `count` decodes from `lengths` on; see `BaseCache.decode_steps`. The mask entries
        of all steps are indexed up front, so a step is one numpy write and the run: on the
        tiny models a step's Python work is a tenth of the step, and every microsecond shows."""
        if self.inputs.positions is not None:
            yield from BaseCache.decode_steps(self, lengths, count)
            return
        width = self.mask.shape[1]
        where = (self.rows * width + lengths)[None, :] + np.arange(count)[:, None]
        set_mask, run, logits = self.mask.reshape(-1).__setitem__, self.binding.run, self.logits
        for entries in where:
            set_mask(entries, 1)
            run()
            yield logits


class AppendCache(BaseCache):
    """A fixed buffer whose free rows the attention mask hides, for graphs with position_ids.

    The graph returns present = past + the new row, so the buffer is kept twice: the past is a
    [slots, heads, width, head_dim] layout of one flat block, onnxruntime writes the present
    straight into a [.., width + 1, ..] layout of the other, and the two swap each step (no
    allocation, no copy beyond the one the graph makes). The new row lands at column `width` for
    every slot and is then moved to column `lengths[b]`, so each slot's valid rows stay the prefix
    [0, length) and the mask is a function of the lengths. When the width reaches the capacity
    the rows are laid out again at the width of the longest row.
    """

    mode = "append"
    verifies_row_by_row = False

    def __init__(self, session, graph: DecoderGraph, slots: int, capacity: int, max_position: int, embed=None):
        shapes = {(e.heads, e.head_dim) for e in graph.cache}
        if len(shapes) != 1:
            raise ValueError(f"append mode needs one cache shape for all layers, found {sorted(shapes)}")
        (self.heads, self.head_dim), = shapes
        self.graph, self.slots, self.capacity = graph, slots, capacity
        self.block = slots * self.heads * capacity * self.head_dim
        self.flat = [np.zeros(len(graph.cache) * self.block, graph.cache_dtype) for _ in range(2)]
        self.current, self.width = 0, 0
        self._used: set[int] = set()
        self.binding = Binding(session)
        self.inputs = _Inputs(self.binding, graph, slots, embed)
        self.token_input = self.inputs.ids[:, 0]
        self.logits = self.inputs.logits[:, 0]
        self._run = self.inputs.runner(self.binding.run)
        self._columns = np.arange(capacity + 1)
        self._mask = np.zeros(slots * (capacity + 1), graph.dtype("attention_mask"))
        self._mask_pointer = self._mask.ctypes.data
        item = self.flat[0].itemsize
        self._entries = [(e.past, e.present, i * self.block * item) for i, e in enumerate(graph.cache)]
        self._dtype = np.dtype(graph.cache_dtype)

    def _layout(self, which: int, width: int) -> np.ndarray:
        """All cache inputs of buffer `which` laid out at `width`: [inputs, slots, heads, width, dim]."""
        item = self.flat[which].itemsize
        inner = self.heads * width * self.head_dim
        return np.lib.stride_tricks.as_strided(
            self.flat[which], shape=(len(self.graph.cache), self.slots, self.heads, width, self.head_dim),
            strides=(self.block * item, inner * item, width * self.head_dim * item, self.head_dim * item, item),
            writeable=True)

    def _relayout(self, width: int) -> None:
        """Lay the rows out again at `width` in the other buffer, and make it current."""
        keep = min(width, self.width)
        other = 1 - self.current
        self._layout(other, width)[..., :keep, :] = self._layout(self.current, self.width)[..., :keep, :]
        self.current, self.width = other, width

    def insert(self, slot: int, cache: dict[str, np.ndarray], length: int) -> None:
        self._used.add(slot)
        if length > self.width:
            self._relayout(length)
        layout = self._layout(self.current, self.width)
        for i, e in enumerate(self.graph.cache):
            layout[i, slot, :, :length] = cache[e.past]
        self.inputs.place(slot, cache)

    def copy_rows(self, dst, src, length: int) -> None:
        self._used.update(int(d) for d in dst)
        if length > self.width:
            self._relayout(length)
        layout = self._layout(self.current, self.width)
        layout[:, dst, :, :length] = layout[:, src, :, :length]
        if self.inputs.offsets is not None:
            self.inputs.offsets[dst] = self.inputs.offsets[src]

    def release(self, slot: int) -> None:
        """A slot's rows are hidden by its length and overwritten on insert; once every slot is
        free the layout starts again from width 0."""
        self._used.discard(slot)
        if not self._used:
            self.width = 0

    def _bind_cache(self, width: int, count: int = 1) -> None:
        past, present = self.flat[self.current].ctypes.data, self.flat[1 - self.current].ctypes.data
        past_shape = (self.slots, self.heads, width, self.head_dim)
        present_shape = (self.slots, self.heads, width + count, self.head_dim)
        binding, dtype = self.binding, self._dtype
        bind_input, bind_output, device = binding.bind_input, binding.bind_output, binding.device
        for past_name, present_name, offset in self._entries:
            bind_input(past_name, device, dtype, past_shape, past + offset)
            bind_output(present_name, device, dtype, present_shape, present + offset)

    def decode_steps(self, lengths: np.ndarray, count: int):
        """Up to `count` decodes (see `BaseCache.decode_steps`). Rows that all sit at the buffer's
        width (one prompt length, or batch 1) stay so: their mask is all ones and no new row
        moves, so a step is the binds of the new width and the run; other batches step as
        `decode` does."""
        if not (lengths == self.width).all() or self.width + count > self.capacity:
            yield from BaseCache.decode_steps(self, lengths, count)
            return
        self._mask[:] = 1
        shape = [self.slots, self.heads, 0, self.head_dim]
        binding, dtype, positions, offsets = self.binding, self._dtype, self.inputs.positions, self.inputs.offsets
        bind_input, bind_output, device, run = binding.bind_input, binding.bind_output, binding.device, self._run
        pointers = [[(past, present, flat.ctypes.data + offset) for past, present, offset in self._entries]
                    for flat in self.flat]
        mask_pointer, mask_dtype, logits = self._mask_pointer, self._mask.dtype, self.logits
        for _ in range(count):
            width = self.width
            bind_input("attention_mask", device, mask_dtype, (self.slots, width + 1), mask_pointer)
            past_shape, shape[2] = shape.copy(), width + 1
            past_shape[2] = width
            for (name, _, past), (_, present_name, present) in zip(pointers[self.current], pointers[1 - self.current]):
                bind_input(name, device, dtype, past_shape, past)
                bind_output(present_name, device, dtype, shape, present)
            if offsets is not None:
                positions[..., 0] = width + offsets
            elif positions is not None:
                positions.fill(width)
            run()
            self.current, self.width = 1 - self.current, width + 1
            yield logits

    def decode(self, lengths: np.ndarray) -> np.ndarray:
        if self.width + 1 > self.capacity:
            self._relayout(int(lengths.max()))
            if self.width + 1 > self.capacity:
                raise ValueError(f"a row needs {self.width + 1} cache rows; this state holds {self.capacity}")
        width = self.width
        mask = self._mask[:self.slots * (width + 1)].reshape(self.slots, width + 1)
        np.less(self._columns[:width + 1], lengths[:, None], out=mask)  # a row's valid rows
        mask[:, width] = 1  # and its new token
        self.binding.input_at("attention_mask", self._mask_pointer, mask.shape, mask.dtype)
        self._bind_cache(width)
        self.inputs.set_positions(lengths)
        self._run()
        self.current, self.width = 1 - self.current, width + 1
        if min(lengths.tolist()) < width:  # rows shorter than the widest: move their new row to their length
            behind = np.flatnonzero(lengths < width)
            present = self._layout(self.current, width + 1)
            present[:, behind, :, lengths[behind], :] = present[:, behind, :, width, :]
        return self.logits


    def verify(self, lengths: np.ndarray, ids: np.ndarray, rows: np.ndarray, widths: np.ndarray) -> np.ndarray:
        """All slots in one run of S = ids.shape[1] tokens, as `decode` with S new columns: the
        new rows land at columns width .. width + S - 1 and move to lengths[b] .. + S - 1."""
        count = ids.shape[1]
        if self.width + count > self.capacity:
            self._relayout(int(lengths.max()))
            if self.width + count > self.capacity:
                raise ValueError(f"a row needs {self.width + count} cache rows; this state holds {self.capacity}")
        width, graph = self.width, self.graph
        mask = (np.arange(width + count) < lengths[:, None]) | (np.arange(width + count) >= width)
        positions = lengths[:, None] + np.arange(count)
        if self.inputs.offsets is not None:
            positions = positions + self.inputs.offsets[:, None]
        embeds = self.inputs._embed(ids) if self.inputs.embeds is not None else None
        feeds = step_inputs(graph, ids, mask, positions, width, embeds)
        feeds.pop("use_cache_branch", None)  # bound once by _Inputs
        logits = np.empty((self.slots, count, graph.vocab_size), graph.logits_dtype)
        for name, array in feeds.items():
            self.binding.input(name, array)
        self.binding.output("logits", logits)
        self._bind_cache(width, count)
        try:
            self.binding.run()
        finally:  # decode's own inputs, bound again
            self.binding.output("logits", self.inputs.logits)
            for name, array in (("input_ids", self.inputs.ids), ("inputs_embeds", self.inputs.embeds),
                                ("position_ids", self.inputs.positions)):
                if name in feeds:
                    self.binding.input(name, array)
        self.current, self.width = 1 - self.current, width + count
        behind = np.flatnonzero(lengths < width)
        if behind.size:
            present = self._layout(self.current, width + count)
            into = lengths[behind, None] + np.arange(count)
            present[:, behind[:, None], :, into, :] = present[:, behind, :, width:width + count, :].transpose(1, 3, 0, 2, 4)
        return logits[rows].astype(np.float32, copy=False)

    def rewind(self, lengths: np.ndarray) -> None:
        """Nothing to do: the mask of the next run is a function of the lengths."""


class GrowCache(BaseCache):
    """Exact-length caches, one per group of rows of equal length: the graph takes the cache
    length as every row's position, so only rows of one length can share a run. Each group's
    present becomes its next past; one run per group per step."""

    mode = "grow"

    @property
    def verifies_row_by_row(self) -> bool:
        return self.graph.has_group_query_attention

    def __init__(self, session, graph: DecoderGraph, slots: int, capacity: int, max_position: int):
        self.session, self.graph, self.max_position = session, graph, max_position
        self.capacity = capacity
        self.token_input = np.zeros(slots, np.int64)
        self.groups: list[dict] = []  # {"slots": [int] (-1 = released), "length": int, "past": {name: array}}
        self._names = ["logits"] + [e.present for e in graph.cache]

    def insert(self, slot: int, cache: dict[str, np.ndarray], length: int) -> None:
        for group in self.groups:
            if group["length"] == length:
                group["slots"].append(slot)
                group["past"] = {name: np.concatenate([array, cache[name][None]])
                                 for name, array in group["past"].items()}
                return
        self.groups.append({"slots": [slot], "length": length,
                            "past": {name: np.ascontiguousarray(rows[None]) for name, rows in cache.items()}})

    def copy_rows(self, dst, src, length: int) -> None:
        """Rows of one prompt's beams share a length, so each moves within its group; a slot
        that holds no row yet joins the group of its source."""
        def join(group, joining):  # placeholder rows, written below
            group["slots"] = group["slots"] + [d for d, _ in joining]
            fill = np.zeros(len(joining), np.int64)  # any row of the group's shape
            group["past"] = {name: np.concatenate([array, array[fill]]) for name, array in group["past"].items()}

        for group, into, take in moves_by_group(self.groups, dst, src, join):
            for array in group["past"].values():
                array[into] = array[take]

    def release(self, slot: int) -> None:
        for group in self.groups:
            if slot in group["slots"]:
                group["slots"][group["slots"].index(slot)] = -1
        self.groups = [g for g in self.groups if any(s >= 0 for s in g["slots"])]

    def verify(self, lengths: np.ndarray, ids: np.ndarray, rows: np.ndarray, widths: np.ndarray) -> np.ndarray:
        """One run of S tokens per group (row by row for a GroupQueryAttention graph, which
        refuses several tokens of more than one row over a past); every group grows by S."""
        count = ids.shape[1]
        logits = np.zeros((len(lengths), count, self.graph.vocab_size), np.float32)
        for group in self.groups:
            slots = np.array(group["slots"])
            live, length = slots >= 0, group["length"]
            if length + count > self.capacity:
                raise ValueError(f"a row needs {length + count} cache rows; this state holds {self.capacity}")
            group_ids = np.where(live[:, None], ids[np.maximum(slots, 0)], 0)
            positions = np.minimum(length + np.arange(count), self.max_position - 1)
            parts = [np.arange(len(slots))] if not self.graph.has_group_query_attention else np.arange(len(slots))[:, None]
            outs, presents = [], []
            for part in parts:
                feeds = step_inputs(self.graph, group_ids[part], np.ones((len(part), length + count), np.int64),
                                    np.broadcast_to(positions, (len(part), count)), length)
                feeds.update({name: array[part] for name, array in group["past"].items()})
                out, *present = self.session.run(self._names, feeds)
                outs.append(out)
                presents.append(present)
            out = np.concatenate(outs)
            group["past"] = {e.past: np.concatenate([p[i] for p in presents]) for i, e in enumerate(self.graph.cache)}
            group["length"] = length + count
            logits[slots[live]] = out[live]
        return logits[rows]

    def rewind(self, lengths: np.ndarray) -> None:
        """Rows are cropped to their lengths (at most their group's) and grouped again by length."""
        members: dict[int, list] = {}
        for group in self.groups:
            for i, slot in enumerate(group["slots"]):
                if slot >= 0:
                    members.setdefault(min(int(lengths[slot]), group["length"]), []).append((slot, group, i))
        self.groups = [{"slots": [slot for slot, _, _ in rows], "length": length,
                        "past": {e.past: np.stack([g["past"][e.past][i, :, :length] for _, g, i in rows])
                                 for e in self.graph.cache}}
                       for length, rows in members.items()]

    def decode(self, lengths: np.ndarray) -> np.ndarray:
        logits = np.zeros((len(lengths), self.graph.vocab_size), np.float32)
        for group in self.groups:
            slots = np.array(group["slots"])
            live = slots >= 0
            length = group["length"]
            if length + 1 > self.capacity:
                raise ValueError(f"a row needs {length + 1} cache rows; this state holds {self.capacity}")
            ids = np.where(live, self.token_input[np.maximum(slots, 0)], 0).reshape(-1, 1)
            positions = np.full((len(slots), 1), min(length, self.max_position - 1))
            mask = np.ones((len(slots), length + 1), np.int64)
            feeds = step_inputs(self.graph, ids, mask, positions, length)
            feeds.update(group["past"])
            out, *presents = self.session.run(self._names, feeds)
            group["past"] = {e.past: p for e, p in zip(self.graph.cache, presents)}
            group["length"] = length + 1
            logits[slots[live]] = out[live, 0]
        return logits


CACHES = {"in_place": InPlaceCache, "append": AppendCache, "grow": GrowCache, "seq2seq": Seq2SeqCache}


def new_cache(model, mode: str, slots: int, capacity: int, max_position: int):
    """The cache of `mode` for `model`'s decoder; a decoder that takes inputs_embeds gets the
    model's embedding (only the append cache takes one: the others refuse such a graph)."""
    if model.graph.has_inputs_embeds:
        cache = CACHES[mode](model.session, model.graph, slots, capacity, max_position, embed=model.embed)
    else:
        cache = CACHES[mode](model.session, model.graph, slots, capacity, max_position)
    missing = missing_verbs(cache)
    if missing:
        raise TypeError(f"cache mode {mode!r} ({type(cache).__name__}) does not implement {', '.join(missing)}: "
                        f"every mode implements {', '.join(STEP_VERBS)} (cache_base.py)")
    return cache
