"""The resident adapters: each projection's stacked A and B, the places adapters sit in, a run's feeds.

Place p (1..places; 0 is "no adapter") holds the adapter of rank r_p (its largest module's rank;
0 for a place never written) in each projection's buffers at rows [W * (r_1 + ... + r_(p-1)),
W * (r_1 + ... + r_p)), with W = the projection's blocks (rewrite.py): block j is the j-th adapter
module that reaches the projection, its lora_A [r, in] in A and its lora_B's columns of the
projection's atoms, times its scaling, in B (zeros elsewhere: a module of smaller rank, or one
that leaves the projection alone, adds exact zeros). Places sit side by side at their own ranks,
so a run multiplies no column of a rank-8 adapter's that a rank-16 place would have left empty;
writing an adapter of another rank moves the later places' rows (`layout` counts it, so a decode's
bound views are made again). A run of rows at places P feeds the rows from min(P)'s to max(P)'s:
views, no copy.

Example (one projection q|k|v, W = 3, place 1 rank 8, an adapter of rank 4 at place 2 targeting
q_proj and v_proj): place 2's rows are 24..35; A rows 24..27 hold q_proj's lora_A, rows 32..35
v_proj's; its B rows 24..27 hold q_proj's lora_B^T * scaling in the q columns, rows 32..35 v_proj's
in the v columns.
"""

from __future__ import annotations

import numpy as np

from .adapter import Adapter, AdapterError
from .projections import Projection, module_place
from .rewrite import MASK, input_names


class LoraBank:
    """Buffers for `places` adapters of rank up to `max_rank` on `projections`."""

    def __init__(self, projections: list[Projection], places: int, max_rank: int, dtype=np.float32):
        if places < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be at least 1, not {places} and {max_rank}")
        self.projections = {p.key: p for p in projections}
        self.by_place = {(p.layer, atom): p for p in projections for atom in p.atoms}
        self.places, self.max_rank, self.dtype = places, max_rank, np.dtype(dtype)
        self.a = {p.key: np.zeros((places * self._width(p), p.in_features), dtype) for p in projections}
        self.b = {p.key: np.zeros((places * self._width(p), p.out_features), dtype) for p in projections}
        self.adapters: dict[int, Adapter] = {}
        self.ranks = np.zeros(places + 2, np.int64)  # [p]: place p's rank (0 and places + 1: none)
        self.layout = 0  # counts the moves of places' rows

    def _width(self, projection: Projection) -> int:
        return len(projection.atoms) * self.max_rank

    def _row(self, projection: Projection, place: int) -> int:
        """The first row of `place` (1..places + 1: the end of the last) in the projection's buffers."""
        return len(projection.atoms) * int(self.ranks[1:place].sum())

    def _resize(self, place: int, rank: int) -> None:
        """Give `place` `rank` columns per block, moving the later places' rows (zeros where they were)."""
        for key, projection in self.projections.items():
            blocks = len(projection.atoms)
            start, old_end, end = (self._row(projection, place), self._row(projection, place + 1),
                                   self._row(projection, self.places + 1))
            new_end = start + blocks * rank
            for buffer in (self.a[key], self.b[key]):
                tail = buffer[old_end:end].copy()
                buffer[start:max(end, new_end + len(tail))] = 0
                buffer[new_end:new_end + len(tail)] = tail
        self.ranks[place] = rank
        self.layout += 1

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
        if adapter.rank != self.ranks[place]:
            self._resize(place, adapter.rank)
        self.unload(place)
        rank = adapter.rank
        for key, blocks in placed.items():
            projection = self.projections[key]
            start = self._row(projection, place)
            offsets = np.cumsum((0,) + projection.sizes)
            for block, module, weights in blocks:
                rows = slice(start + block * rank, start + block * rank + weights.rank)
                self.a[key][rows] = weights.a
                _, atoms = module_place(module)
                column = 0
                for atom in atoms:  # the module's output, atom by atom (a packed module: several)
                    size = self._size(projection.layer, atom)
                    if atom in projection.atoms:
                        j = projection.atoms.index(atom)
                        self.b[key][rows, offsets[j]:offsets[j + 1]] = (weights.b[column:column + size] *
                                                                          np.float32(weights.scale)).T
                    column += size
        self.adapters[place] = adapter

    def unload(self, place: int) -> None:
        for key, projection in self.projections.items():
            rows = slice(self._row(projection, place), self._row(projection, place + 1))
            self.a[key][rows] = 0
            self.b[key][rows] = 0
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
        """The inputs of a run whose rows sit at `places` [n] (0: no adapter)."""
        places = np.asarray(places)
        used = places[places > 0]
        low, high = (int(used.min()), int(used.max()) + 1) if used.size else (1, 1)
        out = {}
        for key, projection in self.projections.items():
            rows = slice(self._row(projection, low), self._row(projection, high))
            a, b = input_names(projection)
            out[a] = self.a[key][rows]
            out[b] = self.b[key][rows]
        chosen = (places[:, None] == np.arange(low, high)[None, :]).astype(self.dtype)
        for blocks in {len(p.atoms) for p in self.projections.values()}:
            # [n, places fed] -> [n, R]: 1 on the columns of a row's own place
            out[MASK.format(blocks)] = np.repeat(chosen, blocks * self.ranks[low:high], axis=1)
        return out
