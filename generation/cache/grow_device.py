"""The grow cache with its groups on the session's device: each group's past is a
runtime.device.DeviceArray per cache input, a step's presents are allocated by onnxruntime on the
device and become the next past, and the moves run there (runtime.device.Device: rows gathered,
joined, cropped, copied between slots). A step sends its ids and positions and reads its
logits; its mask (all ones: a group's rows share a length) is a view of a block of ones made
once on the device.
"""

from __future__ import annotations

import numpy as np

from ..runtime.device import Device, DeviceArray, Ledger
from ..runtime.feeds import step_inputs
from ..runtime.graph import DecoderGraph
from .base import moves_by_group
from .grow import GrowCache


class DeviceGrowCache(GrowCache):
    """GrowCache over device buffers; `provider` ('cpu' or 'cuda') is the session's."""

    memory = "device"

    def __init__(self, session, graph: DecoderGraph, slots: int, capacity: int, max_position: int,
                 ledger: Ledger | None = None, provider: str = "cpu"):
        super().__init__(session, graph, slots, capacity, max_position, ledger)
        self.device = Device.for_provider(provider)
        size = slots * (capacity + 1)  # a group's [rows, length + new] mask fits in it
        self._ones = self.device.zeros((size,), graph.dtype("attention_mask"))
        self.device.valid_mask(self.device.view(self._ones, 0, (1, size)), self.device.upload(np.zeros(1, np.int64)), 0)

    def _row(self, array, row: int, length: int) -> np.ndarray:
        return self.device.read_row(array, row, length, self.ledger)

    def insert(self, slot: int, cache: dict[str, np.ndarray], length: int) -> None:
        rows = {}
        self.ledger.add("insert", sum(a.nbytes for a in cache.values()))
        for name, array in cache.items():
            rows[name] = self.device.upload(np.ascontiguousarray(array[None], self.graph.cache_dtype))
        for group in self.groups:
            if group["length"] == length:
                group["slots"].append(slot)
                group["past"] = {name: self.device.concat([array, rows[name]]) for name, array in group["past"].items()}
                return
        self.groups.append({"slots": [slot], "length": length, "past": rows})

    def copy_rows(self, dst, src, length: int) -> None:
        def join(group, joining):
            group["slots"] = group["slots"] + [d for d, _ in joining]
            fill = np.zeros(len(joining), np.int64)
            group["past"] = {name: self.device.concat([array, self.device.gather(array, fill, self.ledger)])
                             for name, array in group["past"].items()}

        for group, into, take in moves_by_group(self.groups, dst, src, join):
            self.device.move_rows(list(group["past"].values()), into, take, self.ledger)

    def _cropped(self, rows: list, name: str, length: int) -> DeviceArray:
        parts = []
        for _, group, i in rows:
            row = group["past"][name]
            parts.append(self.device.relayout(self.device.gather(row, [i], self.ledger),
                                              (1, row.shape[1], length, row.shape[3])))
        return self.device.concat(parts)

    def _run_group(self, group: dict, ids: np.ndarray, positions: np.ndarray, count: int,
                   part: np.ndarray | None = None) -> tuple[np.ndarray, list[DeviceArray]]:
        """As GrowCache's: the logits on the host, the presents allocated on the device."""
        past = group["past"] if part is None else {k: self.device.gather(v, part, self.ledger)
                                                   for k, v in group["past"].items()}
        n, length = ids.shape[0], group["length"]
        feeds = step_inputs(self.graph, ids, np.ones((n, 1), np.int64), positions, length)
        self._count(feeds, n, count)
        feeds.pop("attention_mask")
        io = self.session.io_binding()
        for name, array in feeds.items():
            io.bind_cpu_input(name, np.ascontiguousarray(array))
        mask = self.device.view(self._ones, 0, (n, length + count))
        io.bind_input("attention_mask", mask.device, 0, mask.dtype, list(mask.shape), mask.pointer)
        for name, array in past.items():
            io.bind_input(name, array.device, 0, array.dtype, list(array.shape), array.pointer)
        logits = np.empty((n, count, self.graph.vocab_size), self.graph.logits_dtype)
        io.bind_output("logits", "cpu", 0, logits.dtype, list(logits.shape), logits.ctypes.data)
        for e in self.graph.cache:
            io.bind_output(e.present, self.device.provider)
        self.session.run_with_iobinding(io)
        presents = [DeviceArray.of(value, self.device.provider) for value in io.get_outputs()[1:]]
        return logits, presents

    def _concat(self, arrays: list) -> DeviceArray:
        return self.device.concat(arrays)
