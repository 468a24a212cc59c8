"""The append cache mode: a graph that declares position_ids over a fixed buffer whose free
rows the attention mask hides (the transformers.js / Optimum layout)."""

from __future__ import annotations

import numpy as np

from ..runtime.device import Ledger
from ..runtime.feeds import Binding, step_inputs
from ..runtime.graph import DecoderGraph
from .base import BaseCache, CacheInputs, size_class, token_bytes


class AppendCache(BaseCache):
    """A fixed buffer whose free rows the attention mask hides, for graphs with position_ids.

    The graph returns present = past + the new row, so the buffer is kept twice: the past is a
    [slots, heads, width, head_dim] layout of one flat block, onnxruntime writes the present
    straight into a [.., width + 1, ..] layout of the other, and the two swap each step (no
    allocation, no copy beyond the one the graph makes). The new row lands at column `width` for
    every slot and is then moved to column `lengths[b]`, so each slot's valid rows stay the prefix
    [0, length) and the mask is a function of the lengths. When the width reaches the buffers'
    `room` (the cache rows each slot has) the rows are laid out again at the width of the
    longest row, in longer buffers when the longest row fills the room: the room is a size class
    (base.size_class, up to the capacity) that grows with the rows, and `fit` sets it to the
    class the rows need (smaller too). Every slot keeps its rows: the buffers are
    [slots, heads, room, head_dim] whichever slots are used.
    """

    mode = "append"
    verifies_row_by_row = False
    sized = False  # its footprint does not shrink with the rows held (BaseCache.sized)

    def __init__(self, session, graph: DecoderGraph, slots: int, capacity: int, max_position: int, embed=None,
                 ledger: Ledger | None = None):
        self.ledger = ledger if ledger is not None else Ledger()
        shapes = {(e.heads, e.head_dim) for e in graph.cache}
        if len(shapes) != 1:
            raise ValueError(f"append mode needs one cache shape for all layers, found {sorted(shapes)}")
        (self.heads, self.head_dim), = shapes
        self.graph, self.slots, self.capacity = graph, slots, capacity
        self.token_bytes = token_bytes(graph)
        self.current, self.width = 0, 0
        self._allocate(size_class(1, capacity))
        self._used: set[int] = set()
        self.binding = Binding(session)
        self.inputs = CacheInputs(self.binding, graph, slots, embed)
        self.token_input = self.inputs.ids[:, 0]
        self.logits = self.inputs.logits[:, 0]
        self._run = self.inputs.runner(self.binding.run)
        self._columns = np.arange(capacity + 1)
        self._mask = np.zeros(slots * (capacity + 1), graph.dtype("attention_mask"))
        self._mask_pointer = self._mask.ctypes.data
        self._dtype = np.dtype(graph.cache_dtype)
        self.ledger.rate(self.inputs.step_rates())
        self.lora = None  # cache/lora.LoraRows of a model with adapters (new_cache sets it)

    def _allocate(self, room: int) -> None:
        """Both buffers at `room` cache rows per slot (their contents zeros)."""
        self.room, self.block = room, self.slots * self.heads * room * self.head_dim
        self.flat = [np.zeros(len(self.graph.cache) * self.block, self.graph.cache_dtype) for _ in range(2)]
        item = self.flat[0].itemsize
        self._entries = [(e.past, e.present, i * self.block * item) for i, e in enumerate(self.graph.cache)]

    def _resize(self, room: int, width: int) -> None:
        """Buffers of `room` rows per slot, the rows laid out at `width` (<= room, at least
        every slot's length) in the current one."""
        old = self._layout(self.current, self.width)  # a view: the old buffer lives until copied
        self._allocate(room)
        self.current, self.width = 0, width
        self._carry(self._layout(0, width), old)

    def _reach(self, length: int) -> None:
        """Room for `length` cache rows per slot (a longer class where the room is shorter)."""
        if length > self.room:
            self._resize(size_class(length, self.capacity), self.width)

    def _make_room(self, lengths: np.ndarray, count: int) -> None:
        """Room for `count` columns past the width: the rows laid out again at the longest
        row's width, in longer buffers where the longest row and its new columns pass the room."""
        longest = int(lengths.max())
        if longest + count > self.room:
            self._resize(size_class(longest + count, self.capacity), longest)
        else:
            self._relayout(longest)
        if self.width + count > self.room:
            raise ValueError(f"a row needs {self.width + count} cache rows; this state holds {self.capacity}")

    def footprint(self, rows: int, length: int) -> int:
        """Bytes of both buffers (and the mask) at the class of `length` cache rows; every slot
        has its rows, whichever `rows` are used."""
        return (2 * self.slots * size_class(length, self.capacity) * self.token_bytes
                + self._mask.nbytes)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.flat) + self._mask.nbytes

    def fit(self, rows: int, length: int) -> None:
        """Buffers at the class of `length` cache rows (no row holds that many or more)."""
        room = size_class(length, self.capacity)
        if room != self.room:
            self._resize(room, min(self.width, room))

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
        other = 1 - self.current
        self._carry(self._layout(other, width), self._layout(self.current, self.width))
        self.current, self.width = other, width

    def _carry(self, into: np.ndarray, old: np.ndarray) -> None:
        """Every slot's rows from the layout `old` into the layout `into` (of another width):
        the leading columns, as many as both have."""
        keep = min(into.shape[3], old.shape[3])
        into[..., :keep, :] = old[..., :keep, :]

    def insert(self, slot: int, cache: dict[str, np.ndarray], length: int) -> None:
        """A row prefilled apart from the batch (its rows cross to a device: `insert`)."""
        self._used.add(slot)
        self._reach(length + 1)
        if length > self.width:
            self._relayout(length)
        self._write(slot, cache, length)
        self.inputs.place(slot, cache)

    def _write(self, slot: int, cache: dict[str, np.ndarray], length: int) -> None:
        layout = self._layout(self.current, self.width)
        for i, e in enumerate(self.graph.cache):
            layout[i, slot, :, :length] = cache[e.past]
            self.ledger.add("insert", layout[i, slot, :, :length].nbytes)

    def copy_rows(self, dst, src, length: int) -> None:
        self._used.update(int(d) for d in dst)
        self._reach(length + 1)
        if length > self.width:
            self._relayout(length)
        layout = self._layout(self.current, self.width)
        layout[:, dst, :, :length] = layout[:, src, :, :length]
        if self.inputs.offsets is not None:
            self.inputs.offsets[dst] = self.inputs.offsets[src]
        if self.lora is not None:
            self.lora.copy(dst, src)

    def read_row(self, slot: int, length: int) -> dict[str, np.ndarray] | None:
        if length > self.width:
            return None
        layout = self._layout(self.current, self.width)
        return {e.past: self._row(layout[i], slot, length) for i, e in enumerate(self.graph.cache)}

    def release(self, slot: int) -> None:
        """A slot's rows are hidden by its length and overwritten on insert; once every slot is
        free the layout starts again from width 0."""
        self._used.discard(slot)
        if self.lora is not None:
            self.lora.set([slot], 0)
        if not self._used:
            self.width = 0

    def _bind_cache(self, width: int, count: int = 1, binding: Binding | None = None, rows: int | None = None) -> None:
        """The past and present of every cache input at `width`, in `binding` (default: the
        decode's), over the first `rows` slots (default: all; a slot's rows lead its layout)."""
        past, present = self.flat[self.current].ctypes.data, self.flat[1 - self.current].ctypes.data
        rows = rows or self.slots
        past_shape = (rows, self.heads, width, self.head_dim)
        present_shape = (rows, self.heads, width + count, self.head_dim)
        binding, dtype = binding or self.binding, self._dtype
        bind_input, bind_output, device = binding.bind_input, binding.bind_output, binding.device
        for past_name, present_name, offset in self._entries:
            bind_input(past_name, device, dtype, past_shape, past + offset)
            bind_output(present_name, device, dtype, present_shape, present + offset)

    def decode_steps(self, lengths: np.ndarray, count: int):
        """Up to `count` decodes (see `BaseCache.decode_steps`). Rows that all sit at the buffer's
        width (one prompt length, or batch 1) stay so: their mask is all ones and no new row
        moves, so a step is the binds of the new width and the run; other batches step as
        `decode` does."""
        if not (lengths == self.width).all() or self.width + count > self.room or self.lora is not None:
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
            self.ledger.step(self.slots)
            self.current, self.width = 1 - self.current, width + 1
            yield logits

    def decode(self, lengths: np.ndarray, span: int | None = None) -> np.ndarray:
        """`span`: only the first `span` slots run (their bindings made once per span); the free
        slots after them keep stale rows in the present buffer, which a row inserted there
        overwrites up to its length and the mask hides past it, as any free slot's."""
        if self.width + 1 > self.room:
            self._make_room(lengths, 1)
        width = self.width
        self.inputs.set_positions(lengths)
        rows, binding, run = self.slots, self.binding, self._run
        if span is not None and 0 < span < self.slots and self.inputs.offsets is None:  # not M-RoPE: [3, B, 1]
            rows, (binding, run) = span, self._leading(span)
            lengths = lengths[:span]
        mask = self._valid(self._mask[:rows * (width + 1)].reshape(rows, width + 1), lengths, width)
        self.ledger.add("inputs", lengths.nbytes)  # on a device the mask is made there from the lengths
        binding.input_at("attention_mask", self._mask_pointer, mask.shape, mask.dtype)
        self._bind_cache(width, binding=binding, rows=rows)
        if self.lora is not None:
            self.lora.bind(binding, rows)
        run()
        self.ledger.step(rows)
        self.current, self.width = 1 - self.current, width + 1
        self._moved(lengths, width, 1)
        return self.logits

    def _valid(self, mask: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
        """`mask` [n, width + S] set to the cache rows a run of S new tokens sees: each row's
        valid rows (the prefix [0, lengths[b])) and the S new ones."""
        np.less(self._columns[:mask.shape[1]], lengths[:, None], out=mask)
        mask[:, width:] = 1
        return mask

    def _moved(self, lengths: np.ndarray, width: int, count: int) -> None:
        """After a run of `count` tokens, whose rows landed at columns width .. width + count - 1
        of every slot: rows shorter than the widest move theirs to lengths[b] .. + count - 1."""
        if min(lengths.tolist()) >= width:
            return
        behind = np.flatnonzero(lengths < width)
        present = self._layout(self.current, width + count)
        into = lengths[behind, None] + np.arange(count)
        present[:, behind[:, None], :, into, :] = present[:, behind, :, width:width + count, :].transpose(1, 3, 0, 2, 4)


    def verify(self, lengths: np.ndarray, ids: np.ndarray, rows: np.ndarray, widths: np.ndarray) -> np.ndarray:
        """All slots in one run of S = ids.shape[1] tokens, as `decode` with S new columns: the
        new rows land at columns width .. width + S - 1 and move to lengths[b] .. + S - 1."""
        count = ids.shape[1]
        if self.width + count > self.room:
            self._make_room(lengths, count)
        width, graph = self.width, self.graph
        mask = self._valid(np.empty((self.slots, width + count), self._mask.dtype), lengths, width)
        positions = lengths[:, None] + np.arange(count)
        if self.inputs.offsets is not None:
            positions = positions + self.inputs.offsets[:, None]
        embeds = self.inputs._embed(ids) if self.inputs.embeds is not None else None
        feeds = step_inputs(graph, ids, mask, positions, width, embeds)
        feeds.pop("use_cache_branch", None)  # bound once by CacheInputs
        if self.lora is not None:
            self.lora.bind(self.binding, self.slots)
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
                                ("position_ids", self.inputs.positions), ("logits_positions", self.inputs.read)):
                if name in feeds:
                    self.binding.input(name, array)
        self.current, self.width = 1 - self.current, width + count
        self._moved(lengths, width, count)
        return logits[rows].astype(np.float32, copy=False)

    def rewind(self, lengths: np.ndarray) -> None:
        """Nothing to do: the mask of the next run is a function of the lengths."""
