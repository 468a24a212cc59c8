"""The append cache with its buffers on the session's device: both flat blocks and the attention
mask are runtime.device.DeviceArrays; a layout is a pointer and a shape into a block, as on the
host. What the host cache does with numpy runs on the device (runtime.device.Device): a layout
carried to another width or room (`copy_into`), a row written (`write_row`), rows copied between
slots (`move_rows`), a run's new columns moved to each row's length (`move_columns`), and the
mask made from the lengths (`valid_mask`). A step sends its ids, positions and the rows'
lengths, and reads its logits; a graph that takes embeddings gets them from the ids on the
device (the embedding session's output bound there).

The windowed variant (sliding windows, ALiBi: windowed.py) keeps host buffers.
"""

from __future__ import annotations

import numpy as np

from ..runtime.device import Device, Ledger
from ..runtime.feeds import Binding, step_inputs
from ..runtime.graph import DecoderGraph
from .append import AppendCache
from .base import BaseCache


class DeviceAppendCache(AppendCache):
    """AppendCache over device buffers; `provider` ('cpu' or 'cuda') is the session's;
    `embed_session`: embed_tokens.onnx's session, for a graph that takes inputs_embeds."""

    memory = "device"

    def __init__(self, session, graph: DecoderGraph, slots: int, capacity: int, max_position: int, embed=None,
                 ledger: Ledger | None = None, provider: str = "cpu", embed_session=None):
        self.device = Device.for_provider(provider)
        self._embed_session = embed_session
        super().__init__(session, graph, slots, capacity, max_position, embed, ledger)
        self._mask = self.device.zeros((slots * (capacity + 1),), graph.dtype("attention_mask"))
        self._ones = self.device.zeros((slots * (capacity + 1),), graph.dtype("attention_mask"))
        self.device.valid_mask(self.device.view(self._ones, 0, (slots, capacity + 1)),
                               self.device.upload(np.zeros(slots, np.int64)), 0)
        if self.inputs.embeds is not None:
            self._embeds_on_device()

    def _row(self, array, row: int, length: int) -> np.ndarray:
        return self.device.read_row(array, row, length, self.ledger)

    # -- buffers ----------------------------------------------------------------------------
    def _allocate(self, room: int) -> None:
        self.room, self.block = room, self.slots * self.heads * room * self.head_dim
        self.flat = [self.device.zeros((len(self.graph.cache) * self.block,), self.graph.cache_dtype)
                     for _ in range(2)]
        item = np.dtype(self.graph.cache_dtype).itemsize
        self._entries = [(e.past, e.present, i * self.block * item) for i, e in enumerate(self.graph.cache)]

    def _layout(self, which: int, width: int) -> list:
        """Each cache input of block `which` laid out at `width`: [slots, heads, width, dim] views."""
        shape = (self.slots, self.heads, width, self.head_dim)
        return [self.device.view(self.flat[which], i * self.block, shape) for i in range(len(self.graph.cache))]

    def _carry(self, into: list, old: list) -> None:
        for target, source in zip(into, old):
            self.device.copy_into(source, target)

    def _write(self, slot: int, cache: dict[str, np.ndarray], length: int) -> None:
        for view, e in zip(self._layout(self.current, self.width), self.graph.cache):
            rows = np.ascontiguousarray(cache[e.past][:, :length])
            self.ledger.add("insert", rows.nbytes)
            self.device.write_row(view, slot, rows, self.ledger)

    def copy_rows(self, dst, src, length: int) -> None:
        self._used.update(int(d) for d in dst)
        self._reach(length + 1)
        if length > self.width:
            self._relayout(length)
        self.device.move_rows(self._layout(self.current, self.width), dst, src, self.ledger)
        if self.inputs.offsets is not None:
            self.inputs.offsets[dst] = self.inputs.offsets[src]

    def _bind_cache(self, width: int, count: int = 1, binding: Binding | None = None, rows: int | None = None) -> None:
        past, present = self.flat[self.current], self.flat[1 - self.current]
        rows = rows or self.slots
        past_shape = (rows, self.heads, width, self.head_dim)
        present_shape = (rows, self.heads, width + count, self.head_dim)
        binding, dtype, device = binding or self.binding, self._dtype, past.device
        for past_name, present_name, offset in self._entries:
            binding.on_device(past_name, device, past.pointer + offset, past_shape, dtype)
            binding.on_device(present_name, device, present.pointer + offset, present_shape, dtype, output=True)

    def _mask_for(self, binding: Binding, lengths: np.ndarray, width: int, count: int):
        """The mask of a run of `count` new columns over `width`, made on the device, bound."""
        on_device = self.device.upload(np.ascontiguousarray(lengths, np.int64))
        mask = self.device.view(self._mask, 0, (len(lengths), width + count))
        self.device.valid_mask(mask, on_device, width)
        binding.on_device("attention_mask", mask.device, mask.pointer, mask.shape, mask.dtype)
        return on_device

    def _moved_on_device(self, lengths: np.ndarray, on_device, width: int, count: int) -> None:
        if min(lengths.tolist()) >= width:
            return
        for view in self._layout(self.current, width + count):
            self.device.move_columns(view[:len(lengths)], on_device, width, count)

    # -- runs -------------------------------------------------------------------------------
    def decode(self, lengths: np.ndarray, span: int | None = None) -> np.ndarray:
        if self.width + 1 > self.room:
            self._make_room(lengths, 1)
        width = self.width
        self.inputs.set_positions(lengths)
        rows, binding, run = self.slots, self.binding, self._run
        if span is not None and 0 < span < self.slots and self.inputs.offsets is None:
            rows, (binding, run) = span, self._leading(span)
            lengths = lengths[:span]
        self.ledger.add("inputs", lengths.nbytes)
        on_device = self._mask_for(binding, lengths, width, 1)
        self._bind_cache(width, binding=binding, rows=rows)
        run()
        self.ledger.step(rows)
        self.current, self.width = 1 - self.current, width + 1
        self._moved_on_device(lengths, on_device, width, 1)
        return self.logits

    def decode_steps(self, lengths: np.ndarray, count: int):
        """As AppendCache's: rows that all sit at the width step with an all-ones mask (bound
        from a block of ones made once) and no move."""
        if not (lengths == self.width).all() or self.width + count > self.room:
            yield from BaseCache.decode_steps(self, lengths, count)
            return
        positions, offsets, logits, run = self.inputs.positions, self.inputs.offsets, self.logits, self._run
        for _ in range(count):
            width = self.width
            ones = self.device.view(self._ones, 0, (self.slots, width + 1))
            self.binding.on_device("attention_mask", ones.device, ones.pointer, ones.shape, ones.dtype)
            self._bind_cache(width)
            if offsets is not None:
                positions[..., 0] = width + offsets
            elif positions is not None:
                positions.fill(width)
            run()
            self.ledger.step(self.slots)
            self.current, self.width = 1 - self.current, width + 1
            yield logits

    def verify(self, lengths: np.ndarray, ids: np.ndarray, rows: np.ndarray, widths: np.ndarray) -> np.ndarray:
        count = ids.shape[1]
        if self.width + count > self.room:
            self._make_room(lengths, count)
        width, graph = self.width, self.graph
        positions = lengths[:, None] + np.arange(count)
        if self.inputs.offsets is not None:
            positions = positions + self.inputs.offsets[:, None]
        feeds = step_inputs(graph, ids, np.ones((self.slots, 1), np.int64), positions, width,
                            self.inputs._embed(ids) if self.inputs.embeds is not None else None)
        for name in ("use_cache_branch", "attention_mask"):  # bound once by CacheInputs; made on the device
            feeds.pop(name, None)
        logits = np.empty((self.slots, count, graph.vocab_size), graph.logits_dtype)
        for name, array in feeds.items():
            self.binding.input(name, array)
            self.ledger.add("inputs", array.nbytes)
        self.ledger.add("inputs", lengths.nbytes)
        self.ledger.add("logits", logits.nbytes)
        self.binding.output("logits", logits)
        on_device = self._mask_for(self.binding, lengths, width, count)
        self._bind_cache(width, count)
        try:
            self.binding.run()
        finally:  # decode's own inputs, bound again
            self.binding.output("logits", self.inputs.logits)
            for name, array in (("input_ids", self.inputs.ids), ("position_ids", self.inputs.positions),
                                ("logits_positions", self.inputs.read)):
                if name in feeds:
                    self.binding.input(name, array)
            if "inputs_embeds" in feeds:
                self.binding.input("inputs_embeds", self.inputs.embeds)
        self.current, self.width = 1 - self.current, width + count
        self._moved_on_device(lengths, on_device, width, count)
        return logits[rows].astype(np.float32, copy=False)

    def _embeds_on_device(self) -> None:
        """The step's embeddings made on the device: embed_tokens' session reads the ids and
        writes into a device buffer the decoder takes as inputs_embeds."""
        if self._embed_session is None:
            raise ValueError(f"{self.graph.path.name} takes inputs_embeds: device buffers need the model's "
                             "embed_tokens session")
        inputs = self.inputs
        embeds = self.device.zeros(inputs.embeds.shape, inputs.embeds.dtype)
        embed = Binding(self._embed_session)
        embed.input("input_ids", inputs.ids)
        embed.output(self._embed_session.get_outputs()[0].name, embeds)
        inputs.embeds = embeds
        self.binding.input("inputs_embeds", embeds)

        def runner(run):
            def embed_and_run():
                embed.run()
                run()
            return embed_and_run
        inputs.runner = runner
        self._run = runner(self.binding.run)
