"""The grow cache mode: exact-length caches in groups of rows of one length, the past
concatenated with each step's presents (any decoder graph with past_key_values)."""

from __future__ import annotations

import numpy as np

from ..runtime.device import Ledger
from ..runtime.feeds import step_inputs
from ..runtime.graph import DecoderGraph
from .base import BaseCache, moves_by_group


class GrowCache(BaseCache):
    """Exact-length caches, one per group of rows of equal length: the graph takes the cache
    length as every row's position, so only rows of one length can share a run. Each group's
    present becomes its next past; one run per group per step."""

    mode = "grow"

    @property
    def verifies_row_by_row(self) -> bool:
        return self.graph.has_group_query_attention

    def __init__(self, session, graph: DecoderGraph, slots: int, capacity: int, max_position: int,
                 ledger: Ledger | None = None):
        self.ledger = ledger if ledger is not None else Ledger()
        self.session, self.graph, self.max_position = session, graph, max_position
        self.capacity = capacity
        self.token_input = np.zeros(slots, np.int64)
        self.groups: list[dict] = []  # {"slots": [int] (-1 = released), "length": int, "past": {name: array}}
        self._names = ["logits"] + [e.present for e in graph.cache]

    def _count(self, feeds: dict, rows: int, count: int) -> None:
        """A run's crossing, were the groups on a device (grow_device.py): its inputs but the
        mask (made there) in, its logits out."""
        self.ledger.add("inputs", sum(a.nbytes for k, a in feeds.items()
                                      if k in self.graph.input_dtypes and k != "attention_mask"))
        self.ledger.add("logits", rows * count * self.graph.vocab_size * np.dtype(self.graph.logits_dtype).itemsize)

    def insert(self, slot: int, cache: dict[str, np.ndarray], length: int) -> None:
        self.ledger.add("insert", sum(a.nbytes for a in cache.values()))
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

    def read_row(self, slot: int, length: int) -> dict[str, np.ndarray] | None:
        for group in self.groups:
            if slot in group["slots"] and length <= group["length"]:
                i = group["slots"].index(slot)
                return {name: self._row(array, i, length) for name, array in group["past"].items()}
        return None

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
            parts = [None] if not self.graph.has_group_query_attention else list(np.arange(len(slots))[:, None])
            outs, presents = [], []
            for part in parts:
                chosen = group_ids if part is None else group_ids[part]
                out, present = self._run_group(group, chosen, np.broadcast_to(positions, (len(chosen), count)), count,
                                               part)
                outs.append(out)
                presents.append(present)
            out = np.concatenate(outs)
            group["past"] = {e.past: self._concat([p[i] for p in presents]) for i, e in enumerate(self.graph.cache)}
            group["length"] = length + count
            logits[slots[live]] = out[live]
        return logits[rows]

    def _run_group(self, group: dict, ids: np.ndarray, positions: np.ndarray, count: int,
                   part: np.ndarray | None = None) -> tuple[np.ndarray, list]:
        """One run of `count` tokens over the group's rows (or its rows `part`): (logits
        [n, count, V], the presents, one per cache input)."""
        n, length = ids.shape[0], group["length"]
        feeds = step_inputs(self.graph, ids, np.ones((n, length + count), np.int64), positions, length)
        self._count(feeds, n, count)
        feeds.update(group["past"] if part is None else {name: array[part] for name, array in group["past"].items()})
        out, *presents = self.session.run(self._names, feeds)
        return out, presents

    def _concat(self, arrays: list) -> np.ndarray:
        return np.concatenate(arrays)

    def rewind(self, lengths: np.ndarray) -> None:
        """Rows are cropped to their lengths (at most their group's) and grouped again by length."""
        members: dict[int, list] = {}
        for group in self.groups:
            for i, slot in enumerate(group["slots"]):
                if slot >= 0:
                    members.setdefault(min(int(lengths[slot]), group["length"]), []).append((slot, group, i))
        self.groups = [{"slots": [slot for slot, _, _ in rows], "length": length,
                        "past": {e.past: self._cropped(rows, e.past, length) for e in self.graph.cache}}
                       for length, rows in members.items()]

    def _cropped(self, rows: list, name: str, length: int) -> np.ndarray:
        """Rows (slot, group, index) of cache input `name`, each its first `length` cache rows."""
        return np.stack([g["past"][name][i, :, :length] for _, g, i in rows])

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
