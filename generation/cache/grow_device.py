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

    def rewind(self, lengths: np.ndarray) -> None:
        members: dict[int, list] = {}
        for group in self.groups:
            for i, slot in enumerate(group["slots"]):
                if slot >= 0:
                    members.setdefault(min(int(lengths[slot]), group["length"]), []).append((slot, group, i))
        groups = []
        for length, rows in members.items():
            past = {}
            for e in self.graph.cache:
                parts = []
                for _, g, i in rows:
                    row = g["past"][e.past]
                    parts.append(self.device.relayout(self.device.gather(row, [i], self.ledger),
                                                      (1, row.shape[1], length, row.shape[3])))
                past[e.past] = self.device.concat(parts)
            groups.append({"slots": [slot for slot, _, _ in rows], "length": length, "past": past})
        self.groups = groups

    def _run_group(self, group: dict, ids: np.ndarray, positions: np.ndarray, count: int,
                   part: np.ndarray | None = None) -> tuple[np.ndarray, list[DeviceArray]]:
        """One run of `count` tokens over the group's rows (or the rows `part` of it): (logits
        [n, count, V] on the host, the presents on the device)."""
        past = group["past"] if part is None else {k: self.device.gather(v, part, self.ledger)
                                                   for k, v in group["past"].items()}
        n, length = ids.shape[0], group["length"]
        feeds = step_inputs(self.graph, ids, np.ones((n, 1), np.int64), positions, length)
        feeds.pop("attention_mask")
        io = self.session.io_binding()
        for name, array in feeds.items():
            array = np.ascontiguousarray(array)
            io.bind_cpu_input(name, array)
            if name in self.graph.input_dtypes:
                self.ledger.add("inputs", array.nbytes)
        mask = self.device.view(self._ones, 0, (n, length + count))
        io.bind_input("attention_mask", mask.device, 0, mask.dtype, list(mask.shape), mask.pointer)
        for name, array in past.items():
            io.bind_input(name, array.device, 0, array.dtype, list(array.shape), array.pointer)
        logits = np.empty((n, count, self.graph.vocab_size), self.graph.logits_dtype)
        io.bind_output("logits", "cpu", 0, logits.dtype, list(logits.shape), logits.ctypes.data)
        for e in self.graph.cache:
            io.bind_output(e.present, self.device.provider)
        self.session.run_with_iobinding(io)
        self.ledger.add("logits", logits.nbytes)
        presents = [DeviceArray.of(value, self.device.provider) for value in io.get_outputs()[1:]]
        return logits, presents

    def decode(self, lengths: np.ndarray, span: int | None = None) -> np.ndarray:
        logits = np.zeros((len(lengths), self.graph.vocab_size), np.float32)
        for group in self.groups:
            slots = np.array(group["slots"])
            live = slots >= 0
            length = group["length"]
            if length + 1 > self.capacity:
                raise ValueError(f"a row needs {length + 1} cache rows; this state holds {self.capacity}")
            ids = np.where(live, self.token_input[np.maximum(slots, 0)], 0).reshape(-1, 1)
            positions = np.full((len(slots), 1), min(length, self.max_position - 1))
            out, presents = self._run_group(group, ids, positions, 1)
            self.ledger.step(len(slots))
            group["past"] = {e.past: p for e, p in zip(self.graph.cache, presents)}
            group["length"] = length + 1
            logits[slots[live]] = out[live, 0]
        return logits

    def verify(self, lengths: np.ndarray, ids: np.ndarray, rows: np.ndarray, widths: np.ndarray) -> np.ndarray:
        count = ids.shape[1]
        logits = np.zeros((len(lengths), count, self.graph.vocab_size), np.float32)
        for group in self.groups:
            slots = np.array(group["slots"])
            live, length = slots >= 0, group["length"]
            if length + count > self.capacity:
                raise ValueError(f"a row needs {length + count} cache rows; this state holds {self.capacity}")
            group_ids = np.where(live[:, None], ids[np.maximum(slots, 0)], 0)
            positions = np.minimum(length + np.arange(count), self.max_position - 1)
            parts = [None] if not self.graph.has_group_query_attention else [np.array([i]) for i in range(len(slots))]
            outs, presents = [], []
            for part in parts:
                chosen = group_ids if part is None else group_ids[part]
                out, present = self._run_group(group, chosen, np.broadcast_to(positions, (len(chosen), count)),
                                               count, part)
                outs.append(out)
                presents.append(present)
            group["past"] = {e.past: self.device.concat([p[i] for p in presents]) for i, e in enumerate(self.graph.cache)}
            group["length"] = length + count
            logits[slots[live]] = np.concatenate(outs)[live]
        return logits[rows]
