"""The KV cache of a running batch: one contract, three modes.

Every mode implements the same verbs over `slots` rows:
  insert(slot, cache, length)  put a prefilled row's cache ([heads, length, head_dim] per
                               cache input) into a free slot
  decode(tokens, lengths)      run one token per slot ([B] each; lengths = valid cache rows of
                               each slot, 0 for free slots) and return the logits [B, V]; the new
                               token's keys and values land at row `lengths[b]` of slot b
  release(slot)                forget a slot's rows
The state around the cache (lengths, tokens, stops) lives in `state.py`; the cache holds only
buffers and does not advance lengths itself.
"""

from __future__ import annotations

import numpy as np

from .feeds import bind_input, bind_output, step_inputs
from .graph import DecoderGraph


def _pad_tokens(tokens: np.ndarray, lengths: np.ndarray, max_position: int):
    ids = tokens.reshape(-1, 1)
    positions = np.minimum(lengths, max_position - 1).reshape(-1, 1)
    return ids, positions


class InPlaceCache:
    """One buffer [slots, heads, capacity, head_dim] per cache input, bound as both the past
    input and the present output of GroupQueryAttention, which writes the new rows in place at
    each row's length (the sum of its mask row). One IOBinding is reused for every step."""

    mode = "in_place"

    def __init__(self, session, graph: DecoderGraph, slots: int, capacity: int, max_position: int):
        self.session, self.graph, self.max_position = session, graph, max_position
        self.capacity = capacity
        self.buffers = {e.past: np.zeros((slots, e.heads, capacity, e.head_dim), graph.cache_dtype)
                        for e in graph.cache}
        self.logits = np.empty((slots, 1, graph.vocab_size), graph.logits_dtype)
        self.io = session.io_binding()
        for e in graph.cache:
            bind_input(self.io, e.past, self.buffers[e.past])
            bind_output(self.io, e.present, self.buffers[e.past])
        bind_output(self.io, "logits", self.logits)
        self._columns = np.arange(capacity + 1)

    def insert(self, slot: int, cache: dict[str, np.ndarray], length: int) -> None:
        for name, rows in cache.items():
            self.buffers[name][slot, :, :length] = rows

    def release(self, slot: int) -> None:
        """Nothing to free: the slot's rows are overwritten by the next row inserted there."""

    def decode(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        width = int(lengths.max()) + 1
        if width > self.capacity:
            raise ValueError(f"a row needs {width} cache rows; this state holds {self.capacity}")
        mask = self._columns[:width] <= lengths[:, None]
        ids, positions = _pad_tokens(tokens, lengths, self.max_position)
        feeds = step_inputs(self.graph, ids, mask, positions, width - 1)
        for name, array in feeds.items():
            bind_input(self.io, name, array)
        self.session.run_with_iobinding(self.io)
        return self.logits[:, 0]


class AppendCache:
    """A fixed buffer whose free rows the attention mask hides, for graphs with position_ids.

    The graph returns present = past + the new row, so the buffer is kept twice: the past is a
    [slots, heads, width, head_dim] view of one flat block, the present is written by onnxruntime
    straight into a [.., width + 1, ..] view of the other, and the two swap each step (no
    allocation, no copy beyond the one the graph makes). The new row lands at column `width` for
    every slot; it is then moved to column `lengths[b]`, so each slot's valid rows stay the prefix
    [0, length) and the mask is a function of the lengths. When the width reaches the capacity the
    rows are laid out again at the width of the longest row.
    """

    mode = "append"

    def __init__(self, session, graph: DecoderGraph, slots: int, capacity: int, max_position: int):
        self.session, self.graph, self.max_position = session, graph, max_position
        shapes = {(e.heads, e.head_dim) for e in graph.cache}
        if len(shapes) != 1:
            raise ValueError(f"append mode needs one cache shape for all layers, found {sorted(shapes)}")
        (self.heads, self.head_dim), = shapes
        self.slots, self.capacity = slots, capacity
        self.block = slots * self.heads * capacity * self.head_dim
        self.flat = [np.zeros(len(graph.cache) * self.block, graph.cache_dtype) for _ in range(2)]
        self.current, self.width = 0, 0
        self.logits = np.empty((slots, 1, graph.vocab_size), graph.logits_dtype)
        self.io = session.io_binding()
        self._columns = np.arange(capacity + 1)

    def _views(self, which: int, width: int) -> np.ndarray:
        """All cache inputs of buffer `which` laid out at `width`: [inputs, slots, heads, width, dim]."""
        itemsize = self.flat[which].itemsize
        inner = self.heads * width * self.head_dim
        return np.lib.stride_tricks.as_strided(
            self.flat[which], shape=(len(self.graph.cache), self.slots, self.heads, width, self.head_dim),
            strides=(self.block * itemsize, inner * itemsize, width * self.head_dim * itemsize,
                     self.head_dim * itemsize, itemsize), writeable=True)

    def _relayout(self, width: int) -> None:
        """Lay the rows out again at `width` in the other buffer, and make it current."""
        keep = min(width, self.width)
        other = 1 - self.current
        self._views(other, width)[..., :keep, :] = self._views(self.current, self.width)[..., :keep, :]
        self.current, self.width = other, width

    def insert(self, slot: int, cache: dict[str, np.ndarray], length: int) -> None:
        if length > self.width:
            self._relayout(length)
        views = self._views(self.current, self.width)
        for i, e in enumerate(self.graph.cache):
            views[i, slot, :, :length] = cache[e.past]

    def release(self, slot: int) -> None:
        """Nothing to free: a slot's rows are hidden by its length and overwritten on insert."""

    def decode(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        if self.width + 1 > self.capacity:
            self._relayout(int(lengths.max()))
            if self.width + 1 > self.capacity:
                raise ValueError(f"a row needs {self.width + 1} cache rows; this state holds {self.capacity}")
        width = self.width
        past, present = self._views(self.current, width), self._views(1 - self.current, width + 1)
        mask = self._columns[:width + 1] < lengths[:, None]
        mask[:, width] = True
        ids, positions = _pad_tokens(tokens, lengths, self.max_position)
        feeds = step_inputs(self.graph, ids, mask, positions, width)
        for name, array in feeds.items():
            bind_input(self.io, name, array)
        for i, e in enumerate(self.graph.cache):
            bind_input(self.io, e.past, past[i])
            bind_output(self.io, e.present, present[i])
        bind_output(self.io, "logits", self.logits)
        self.session.run_with_iobinding(self.io)
        behind = np.flatnonzero(lengths < width)
        if behind.size:
            present[:, behind, :, lengths[behind], :] = present[:, behind, :, width, :]
        self.current, self.width = 1 - self.current, width + 1
        return self.logits[:, 0]


class GrowCache:
    """Exact-length caches, one per group of rows of equal length: the graph takes the cache
    length as every row's position, so only rows of one length can share a run. Each group's
    present becomes its next past; one run per group per step."""

    mode = "grow"

    def __init__(self, session, graph: DecoderGraph, slots: int, capacity: int, max_position: int):
        self.session, self.graph, self.max_position = session, graph, max_position
        self.capacity = capacity
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

    def release(self, slot: int) -> None:
        for group in self.groups:
            if slot in group["slots"]:
                group["slots"][group["slots"].index(slot)] = -1
        self.groups = [g for g in self.groups if any(s >= 0 for s in g["slots"])]

    def decode(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        logits = np.zeros((len(tokens), self.graph.vocab_size), np.float32)
        for group in self.groups:
            slots = np.array(group["slots"])
            live = slots >= 0
            length = group["length"]
            if length + 1 > self.capacity:
                raise ValueError(f"a row needs {length + 1} cache rows; this state holds {self.capacity}")
            ids = np.where(live, tokens[np.maximum(slots, 0)], 0).reshape(-1, 1)
            positions = np.full((len(slots), 1), min(length, self.max_position - 1))
            mask = np.ones((len(slots), length + 1), np.int64)
            feeds = step_inputs(self.graph, ids, mask, positions, length)
            feeds.update(group["past"])
            out, *presents = self.session.run(self._names, feeds)
            group["past"] = {e.past: p for e, p in zip(self.graph.cache, presents)}
            group["length"] = length + 1
            logits[slots[live]] = out[live, 0]
        return logits


CACHES = {"in_place": InPlaceCache, "append": AppendCache, "grow": GrowCache}
