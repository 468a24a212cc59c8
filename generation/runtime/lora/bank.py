"""The resident adapters: each projection's stacked A and B, the places adapters sit in, a run's feeds.

Place p (1..places; 0 is zeros: "no adapter") holds an adapter in each projection's buffers A[p]
[in, K] and B[p] [K, out], K = W * max_rank with W = the projection's blocks (rewrite.py): block j
is the j-th adapter module that reaches the projection, its lora_A^T in A[p]'s columns
[j * max_rank, j * max_rank + r) and its lora_B's columns of the projection's atoms, times its
scaling, in the same rows of B[p] (zeros elsewhere: a module of smaller rank, or one that leaves
the projection alone, adds exact zeros). A run of rows at places P feeds the places from min(P)'s
to max(P)'s (views, no copy) and which group each row is in (rewrite.py).

Example (one projection q|k|v, W = 3, max_rank 8, an adapter of rank 4 at place 2 targeting
q_proj and v_proj): A[2]'s columns 0..3 hold q_proj's lora_A^T, columns 16..19 v_proj's; B[2]'s
rows 0..3 hold q_proj's lora_B^T * scaling in the q columns, rows 16..19 v_proj's in the v columns.
"""

from __future__ import annotations

import numpy as np

from .adapter import Adapter, AdapterError
from .projections import Projection, module_place
from .rewrite import ROWS, SLOTS, input_names, one_empty_group


class LoraBank:
    """Buffers for `places` adapters of rank up to `max_rank` on `projections`."""

    def __init__(self, projections: list[Projection], places: int, max_rank: int, dtype=np.float32):
        if places < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be at least 1, not {places} and {max_rank}")
        self.projections = {p.key: p for p in projections}
        self.by_place = {(p.layer, atom): p for p in projections for atom in p.atoms}
        self.places, self.max_rank, self.dtype = places, max_rank, np.dtype(dtype)
        self.a = {p.key: np.zeros((places + 1, p.in_features, self._width(p)), dtype) for p in projections}
        self.b = {p.key: np.zeros((places + 1, self._width(p), p.out_features), dtype) for p in projections}
        self.adapters: dict[int, Adapter] = {}

    def _width(self, projection: Projection) -> int:
        return len(projection.atoms) * self.max_rank

    def _size(self, layer: int, atom: str) -> int:
        """The columns of `atom` (q, k, v, gate, ...) in layer `layer`, whatever projection packs it."""
        projection = self.by_place[(layer, atom)]
        return projection.sizes[projection.atoms.index(atom)]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.a.values()) + sum(x.nbytes for x in self.b.values())

    def check(self, adapter: Adapter) -> dict[str, list]:
        """Where each of the adapter's modules goes: projection key -> [(block, module, weights)];
        AdapterError naming what does not fit."""
        if adapter.rank > self.max_rank:
            raise AdapterError(f"r: adapter {adapter.name!r} has rank {adapter.rank}, above max_lora_rank "
                               f"{self.max_rank}")
        placed: dict[str, list] = {}
        for module, weights in sorted(adapter.modules.items()):
            layer, atoms = module_place(module)
            targets = {self.by_place.get((layer, atom)) for atom in atoms}
            if None in targets:
                raise AdapterError(f"target_modules: {module} is not in the base model's graph (layer {layer} of "
                                   f"{1 + max(p.layer for p in self.projections.values())})")
            size = sum(self._size(layer, atom) for atom in atoms)
            projection = next(iter(targets))
            if weights.a.shape[1] != projection.in_features or weights.b.shape[0] != size:
                raise AdapterError(f"target_modules: {module} maps {weights.a.shape[1]} -> {weights.b.shape[0]} "
                                   f"features, where the base model's maps {projection.in_features} -> {size}")
            for target in sorted(targets, key=lambda p: p.key):
                blocks = placed.setdefault(target.key, [])
                blocks.append((len(blocks), module, weights))
        return placed

    def load(self, adapter: Adapter, place: int) -> None:
        """Write `adapter` into `place` (1..places), replacing what was there."""
        if not 1 <= place <= self.places:
            raise ValueError(f"place must be 1..{self.places}, not {place}")
        placed = self.check(adapter)
        self.unload(place)
        for key, blocks in placed.items():
            projection = self.projections[key]
            offsets = np.cumsum((0,) + projection.sizes)
            for block, module, weights in blocks:
                rank = slice(block * self.max_rank, block * self.max_rank + weights.rank)
                self.a[key][place, :, rank] = weights.a.T
                _, atoms = module_place(module)
                column = 0
                for atom in atoms:  # the module's output, atom by atom (a packed module: several)
                    size = self._size(projection.layer, atom)
                    if atom in projection.atoms:
                        j = projection.atoms.index(atom)
                        self.b[key][place, rank, offsets[j]:offsets[j + 1]] = (weights.b[column:column + size] *
                                                                                np.float32(weights.scale)).T
                    column += size
        self.adapters[place] = adapter

    def unload(self, place: int) -> None:
        for key in self.projections:
            self.a[key][place] = 0
            self.b[key][place] = 0
        self.adapters.pop(place, None)

    def prefix_key(self, prompt, place: int) -> list[int]:
        """`prompt` as a prefix store names it for a row at `place`: its first token replaced by a
        value no token id takes, made of the adapter's serial and that token, so the rows an adapter
        computed are found by its rows only (place 0: the prompt as it is)."""
        out = [int(t) for t in prompt]
        if place and out:
            out[0] = (1 << 61) | ((self.adapters[place].serial * 1_000_003 + out[0]) % (1 << 60))
        return out

    def feeds(self, places: np.ndarray) -> dict[str, np.ndarray]:
        """The inputs of a run whose rows sit at `places` [n] (0: no adapter): the places from the
        lowest to the highest, each a group of the rows at it (rewrite.py)."""
        places = np.asarray(places, np.int64)
        if not places.any():  # no adapter: K = 0 (as rewrite.empty_feeds)
            low, high, width = 0, 1, 0
            out = one_empty_group(len(places))
        else:
            low, high, width = int(places.min()), int(places.max()) + 1, None
            group = places - low
            counts = np.bincount(group, minlength=high - low)
            order = np.argsort(group, kind="stable")
            index = np.arange(len(places)) - np.repeat(np.cumsum(counts) - counts, counts)  # in its group
            rows = np.zeros((high - low, int(counts.max())), np.int64)  # padding: row 0, read by none
            rows[group[order], index] = order
            slots = np.zeros((len(places), 2), np.int64)
            slots[order, 0], slots[order, 1] = group[order], index
            out = {ROWS: rows, SLOTS: slots}
        for key, projection in self.projections.items():
            a, b = input_names(projection)
            out[a] = self.a[key][low:high, :, :width]
            out[b] = self.b[key][low:high, :width]
        return out
