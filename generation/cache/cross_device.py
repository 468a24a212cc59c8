"""The encoder-decoder cache with its groups on the session's device: each group's decoder
cache, cross cache, encoder hidden states and source mask are runtime.device.DeviceArrays; a
step's presents are allocated by onnxruntime on the device and become the next past. A row's
first step runs apart (cross.run_first_steps) and crosses once, at `insert`; a group that takes
rows of a longer source is padded to it on the device (zeros, the mask's too). A step sends its
ids and reads its logits.
"""

from __future__ import annotations

import numpy as np

from ..runtime.device import Device, DeviceArray, Ledger
from ..runtime.graph import DecoderGraph
from .base import moves_by_group
from .cross import Seq2SeqCache, _feeds



class DeviceSeq2SeqCache(Seq2SeqCache):
    """Seq2SeqCache over device buffers; `provider` ('cpu' or 'cuda') is the session's."""

    memory = "device"

    def __init__(self, session, graph: DecoderGraph, slots: int, capacity: int, max_position: int,
                 ledger: Ledger | None = None, provider: str = "cpu"):
        super().__init__(session, graph, slots, capacity, max_position, ledger)
        self.device = Device.for_provider(provider)

    def insert(self, slot: int, cache: dict[str, np.ndarray], length: int) -> None:
        self.ledger.add("insert", sum(np.asarray(a).nbytes for a in cache.values()))
        hidden = np.asarray(cache["encoder_hidden_states"])
        up = self.device.upload
        row = {"past": {e.past: up(np.ascontiguousarray(cache[e.past][None], self.graph.cache_dtype))
                        for e in self.graph.cache},
               "cross": {e.past: up(np.ascontiguousarray(cache[e.past][None], self.graph.cache_dtype))
                         for e in self.graph.cross_cache},
               "hidden": up(np.ascontiguousarray(hidden[None], self.inputs.get("encoder_hidden_states", hidden.dtype))),
               "mask": up(np.ones((1, len(hidden)), self.inputs.get("encoder_attention_mask", np.int64))),
               "slots": [slot], "length": length}
        for group in self.groups:
            if group["length"] == length:
                self._append(group, row)
                return
        self.groups.append(row)

    def _append(self, group: dict, rows: dict) -> None:
        """`rows` (a group's arrays of other slots) joined to `group`, both padded to the longer source."""
        width = max(group["mask"].shape[1], rows["mask"].shape[1])

        def joined(a: DeviceArray, b: DeviceArray, axis: int) -> DeviceArray:
            def wide(x):
                shape = list(x.shape)
                shape[axis] = width
                return x if x.shape[axis] == width else self.device.relayout(x, tuple(shape))
            return self.device.concat([wide(a), wide(b)])

        group["past"] = {k: self.device.concat([v, rows["past"][k]]) for k, v in group["past"].items()}
        group["cross"] = {k: joined(v, rows["cross"][k], 2) for k, v in group["cross"].items()}
        group["hidden"] = joined(group["hidden"], rows["hidden"], 1)
        group["mask"] = joined(group["mask"], rows["mask"], 1)
        group["slots"] = group["slots"] + rows["slots"]

    def copy_rows(self, dst, src, length: int, shared_cross: bool = False) -> None:
        def join(group, joining):
            where = {slot: i for i, slot in enumerate(group["slots"]) if slot >= 0}
            take = [where[s] for _, s in joining]
            gather = self.device.gather
            rows = {"past": {k: gather(v, take, self.ledger) for k, v in group["past"].items()},
                    "cross": {k: gather(v, take, self.ledger) for k, v in group["cross"].items()},
                    "hidden": gather(group["hidden"], take, self.ledger),
                    "mask": gather(group["mask"], take, self.ledger), "slots": [d for d, _ in joining]}
            self._append(group, rows)

        for group, into, take in moves_by_group(self.groups, dst, src, join):
            arrays = list(group["past"].values())
            if not shared_cross:
                arrays += [*group["cross"].values(), group["hidden"], group["mask"]]
            self.device.move_rows(arrays, into, take, self.ledger)

    def _step_group(self, group: dict, ids: np.ndarray) -> tuple[np.ndarray, list[DeviceArray]]:
        """As Seq2SeqCache's: the logits on the host, the presents allocated on the device."""
        on_device = {"encoder_hidden_states": group["hidden"], "encoder_attention_mask": group["mask"],
                     **group["past"], **group["cross"]}
        feeds = _feeds(self.inputs, ids, np.zeros(0, np.float32), np.zeros(0, np.int64), use_cache=True)
        feeds = {name: array for name, array in feeds.items() if name not in on_device}
        self._count(feeds, len(ids))
        io = self.session.io_binding()
        for name, array in feeds.items():
            io.bind_cpu_input(name, np.ascontiguousarray(array))
        for name, array in on_device.items():
            if name in self.inputs:
                io.bind_input(name, array.device, 0, array.dtype, list(array.shape), array.pointer)
        out = np.empty((len(ids), 1, self.graph.vocab_size), self.graph.logits_dtype)
        io.bind_output("logits", "cpu", 0, out.dtype, list(out.shape), out.ctypes.data)
        for e in self.graph.cache:
            io.bind_output(e.present, self.device.provider)
        self.session.run_with_iobinding(io)
        return out, [DeviceArray.of(value, self.device.provider) for value in io.get_outputs()[1:]]
