"""The in_place cache with its buffers on the session's device: every cache buffer and the
attention mask are runtime.device.DeviceArrays, bound once per layout; relayouts, beam
reorders, slot writes and mask updates run on the device (runtime.device.Device). Only the
read logits come to the host, and a step's inputs (ids, positions, read positions, the mask's
new entries) go to the device as small host arrays, which onnxruntime copies where a kernel
needs them.

On a CUDA session this is the decoder's path; on the CPU it runs over CPU OrtValues (the same
code), which is how the tests hold it. The host cache (in_place.py) stays the CPU's default: it
writes the mask with numpy where this runs a ScatterND.

`graphs`: CUDA graphs, captured per class (the leading rows a run takes and the layout's classes:
onnxruntime's `gpu_graph_id`, one per class, the model session made with `enable_cuda_graph`).
A captured graph replays at the addresses it was captured with, so every input and output of a
decode binding lives on the device at a fixed address: the step inputs and the logits get device
buffers of their own (bound once per class, as the cache and the mask are), written from the host
arrays before each run and read into the host logits after (the same bytes the ledger counts).
Prompt runs, whose shapes vary, run uncaptured (`gpu_graph_id` -1). A captured run cannot end
early: the cache then has no `run_options` (Scheduler.interrupt_for does nothing). The buffers are
laid out once, at every slot and the whole capacity (onnxruntime-genai's static buffers for its
graphs): a relayout would move the addresses a graph replays, and captured graphs are never
released, so the classes are the leading rows a run takes, at most one per slot count. The cache
is then not `sized` (admission by slots: the budget must hold the whole layout).
"""

from __future__ import annotations

import numpy as np

from ..runtime.device import Device, DeviceArray, Ledger
from ..runtime.feeds import Binding
from ..runtime.graph import DecoderGraph
from .base import BaseCache
from .in_place import InPlaceCache


class DeviceInPlaceCache(InPlaceCache):
    """InPlaceCache over device buffers; `provider` ('cpu' or 'cuda') is the session's."""

    memory = "device"

    def __init__(self, session, graph: DecoderGraph, slots: int, capacity: int, max_position: int,
                 ledger: Ledger | None = None, provider: str = "cpu", graphs: bool = False):
        self.device = Device.for_provider(provider)
        self._entries = np.zeros((slots, 2), np.int64)  # a step's new mask entries: (slot, column)
        self._entries[:, 0] = np.arange(slots)
        self.graphs, self._graph_ids, self._mirrors = graphs, {}, {}
        super().__init__(session, graph, slots, capacity, max_position, ledger)
        if graphs:
            self.run_options = None  # a captured run is not ended early
            self._lay_out(slots, capacity)  # once, for good
            self.sized = False

    def _row(self, array, row: int, length: int) -> np.ndarray:
        return self.device.read_row(array, row, length, self.ledger)

    def _grow(self, rows: int, length: int) -> None:
        if not self.graphs:
            super()._grow(rows, length)

    def fit(self, rows: int, length: int) -> None:
        if not self.graphs:
            super().fit(rows, length)

    # -- CUDA graphs --------------------------------------------------------------------------
    def _options_for(self, rows: int | None):
        """A decode binding's RunOptions: with `graphs`, its class's own `gpu_graph_id` (rows run,
        the layout's classes); a prompt's (rows None) -1, uncaptured."""
        if not self.graphs:
            return None
        from ..runtime.feeds import run_options

        key = None if rows is None else (rows, self.held, self.length)
        options = run_options()
        graph_id = -1 if key is None else self._graph_ids.setdefault(key, len(self._graph_ids))
        options.add_run_config_entry("gpu_graph_id", str(graph_id))
        return options

    def _own_inputs(self) -> None:
        """With `graphs`: a device buffer for each step input and the logits, bound in their place."""
        if not self.graphs:
            return
        binding = self._inputs_binding
        for key, array in list(binding._held.items()):
            mirror = self.device.zeros(array.shape, array.dtype)
            if key.startswith("output:"):
                binding.output(key[len("output:"):], mirror)
            else:
                self.device.write_from(array, mirror)  # use_cache_branch: once, for good
                binding.input(key, mirror)
            self._mirrors[key] = (array, mirror)

    def _graph_run(self, run, rows: int):
        """`run` of a class's binding with the step inputs written to their device buffers first
        and the logits of its `rows` read after."""
        sends = [(host, mirror) for key, (host, mirror) in self._mirrors.items()
                 if not key.startswith("output:") and key != "use_cache_branch"]
        logits, device_logits = self._mirrors["output:logits"]
        identity = self.device.write_from

        def graph_run():
            for host, mirror in sends:
                identity(host[:rows] if host.shape[0] == self.slots else host,
                         mirror[:rows] if mirror.shape[0] == self.slots else mirror)
            run()
            self.device.read_into(device_logits[:rows], logits[:rows])
        return graph_run

    def _leading(self, span: int):
        binding, run = super()._leading(span)
        if not self.graphs:
            return binding, run
        spans = self.__dict__["_spans"]  # made by the call above; a new layout drops it
        found = spans.get(("graph", span))
        if found is None:
            found = spans[("graph", span)] = (binding, self._graph_run(run, span))
        return found

    def _new_layout(self, held: int, length: int) -> tuple[dict, object]:
        device, buffers = self.device, {}
        for e in self.graph.cache:
            shape = (held, e.heads, length, e.head_dim)
            old = self.buffers.get(e.past)
            buffers[e.past] = (device.zeros(shape, self.graph.cache_dtype) if old is None
                               else device.relayout(old, shape))
        if self.mask is None:
            mask = device.zeros((self.slots, length), self.graph.dtype("attention_mask"))
            device.set_lengths(mask, np.arange(self.slots), np.zeros(self.slots, np.int64))
        else:
            mask = device.relayout(self.mask, (self.slots, length))
        return buffers, mask

    def _write_row(self, name: str, slot: int, rows: np.ndarray, length: int) -> None:
        self.device.write_row(self.buffers[name], slot, rows, self.ledger)

    def _set_lengths(self, slots, lengths) -> None:
        self.device.set_lengths(self.mask, slots, lengths, self.ledger)

    def _move_rows(self, dst, src, length: int) -> None:
        self.device.move_rows([*self.buffers.values(), self.mask], dst, src, self.ledger)

    def _bind_rows(self, binding: Binding, slot: int, rows: int) -> None:
        for e in self.graph.cache:
            buffer = self.buffers[e.past]
            pointer, shape = buffer.row_pointer(slot), (rows, *buffer.shape[1:])
            binding.on_device(e.past, buffer.device, pointer, shape, buffer.dtype)
            binding.on_device(e.present, buffer.device, pointer, shape, buffer.dtype, output=True)

    def _decoder(self):
        """As InPlaceCache's: the new mask entries go to the device's mask (a ScatterND bound
        over the layout's mask and the entry buffer) before the run."""
        entries, run, logits, inputs = self._entries, self.binding.run, self.logits, self.inputs
        held, partial, step = self.held, self._least_rows == 1, self.ledger.step
        if self.graphs:
            run = self._graph_run(run, held)
        markers = {}  # rows -> the mark of the leading `rows` slots' entries
        self._mark = mark = markers[held] = self.device.marker(self.mask, entries[:held])

        def decode(lengths: np.ndarray, span: int | None = None) -> np.ndarray:
            entries[:, 1] = lengths  # the new token's row: GroupQueryAttention writes it at the row's length
            if inputs.positions is not None:
                inputs.set_positions(lengths)
            if span is None or span >= held or not partial:
                mark()
                run()
                step(held)
            else:
                found = markers.get(span)
                if found is None:
                    found = markers[span] = self.device.marker(self.mask, entries[:span])
                found()
                self._leading(span)[1]()
                step(span)
            return logits
        return decode

    def decode_steps(self, lengths: np.ndarray, count: int):
        if self.inputs.positions is not None:
            yield from BaseCache.decode_steps(self, lengths, count)
            return
        self._grow(self.held, int(lengths.max()) + count)
        entries, mark, run, logits = self._entries, self._mark, self.binding.run, self.logits
        if self.graphs:
            run = self._graph_run(run, self.held)
        step, held = self.ledger.step, self.held
        for k in range(count):
            entries[:, 1] = lengths + k
            mark()
            run()
            step(held)
            yield logits

    def host_buffers(self) -> dict[str, np.ndarray]:
        """The buffers and the mask copied to the host (checks and tests; not counted)."""
        out = {name: buffer.copy_to_host() for name, buffer in self.buffers.items()}
        out["attention_mask"] = self.mask.copy_to_host()
        return out
