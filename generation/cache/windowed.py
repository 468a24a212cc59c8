"""The append cache of a graph whose attention has a sliding window (or that biases keys by their
column's distance, as MPT's ALiBi: runtime/positions.py): each slot's rows end at the buffer's
width (left-padded, as transformers lays out a batch), where the plain append cache keeps them at
the start.

Why: an Optimum / transformers.js graph computes its sliding-window mask over buffer COLUMNS,
not over a row's positions (transformers 4.57: `kv_idx > cache_position - sliding_window`, with
cache_position counted from the past's width; GPT-Neo's local layers slice their `bias` the same
way). A query at column c sees columns (c - window, c]. With a row's rows at [0, length) and its
new token at column `width`, a row shorter than the widest loses up to `width - length` of
the keys its window should hold (its tokens differ from transformers from the first step after it
crosses the window). Rows that end where the new token lands are contiguous with it, so the
column window is the row's own window; the attention mask hides the columns before them, and
position_ids still give every token its own position.

Example (window 3; slot a holds 5 rows, slot b 2; the step's new token at column 5, where a
query sees columns 3-5):

    column              0 1 2 3 4  5
    rows at the start   a a a a a  a
                        b b - - -  b    b sees its new token only (transformers: b b b)
    rows at the end     a a a a a  a
                        - - - b b  b    b sees b b b

Every verb keeps the rows there: `insert` writes a row's rows at [width - length, width), a new
run's rows land at the width for every slot (no move), the buffer is laid out again keeping
the last columns, and `rewind` (assisted decoding keeps a prefix of the verified rows) moves the
rows it keeps to end at the width again: a copy of the row, the price of the window.
"""

from __future__ import annotations

import numpy as np

from .append import AppendCache


class WindowedAppendCache(AppendCache):
    """AppendCache with each slot's valid rows the suffix [width - length, width) of the buffer
    (see the module docstring). `_kept[b]`: the rows slot b holds there, verified rows
    included (a `rewind` cuts them to the caller's lengths)."""

    def __init__(self, session, graph, slots: int, capacity: int, max_position: int, embed=None):
        super().__init__(session, graph, slots, capacity, max_position, embed)
        self._kept = np.zeros(slots, np.int64)

    def _carry(self, into: np.ndarray, old: np.ndarray) -> None:
        """The trailing columns, as many as both layouts have: rows still end at the width."""
        keep = min(into.shape[3], old.shape[3])
        into[..., into.shape[3] - keep:, :] = old[..., old.shape[3] - keep:, :]

    def insert(self, slot: int, cache: dict[str, np.ndarray], length: int) -> None:
        """As AppendCache's (room made, rows written at [0, length)), then moved to end at the width."""
        super().insert(slot, cache, length)
        width = self.width
        if length < width:
            layout = self._layout(self.current, width)
            layout[:, slot, :, width - length:] = layout[:, slot, :, :length]  # overlaps: numpy buffers
        self._kept[slot] = length

    def copy_rows(self, dst, src, length: int) -> None:
        """Slots dst take the first `length` rows of slots src, ending at the width."""
        dst, src = np.asarray(dst, np.int64), np.asarray(src, np.int64)
        if (self._kept[src] < length).any():
            raise ValueError(f"copy_rows: slots {src[self._kept[src] < length].tolist()} hold fewer than "
                             f"{length} cache rows")
        self._used.update(dst.tolist())
        layout, width = self._layout(self.current, self.width), self.width
        starts = width - self._kept[src]
        if (starts == starts[0]).all():  # a beam group: one length (fancy indexing copies before writing)
            rows = layout[:, src, :, starts[0]:starts[0] + length]
        else:
            rows = np.stack([layout[:, s, :, a:a + length] for s, a in zip(src.tolist(), starts.tolist())], axis=1)
        layout[:, dst, :, width - length:width] = rows
        if self.inputs.offsets is not None:
            self.inputs.offsets[dst] = self.inputs.offsets[src]
        self._kept[dst] = length

    def release(self, slot: int) -> None:
        super().release(slot)
        self._kept[slot] = 0

    def read_row(self, slot: int, length: int) -> None:
        """None: past the window a row keeps only its last rows, which a prefix cannot use."""
        return None

    def rewind(self, lengths: np.ndarray) -> None:
        """Every slot keeps its first lengths[b] rows, moved to end at the width."""
        width = self.width
        layout = None
        for b in np.flatnonzero(lengths != self._kept).tolist():
            keep, held = int(lengths[b]), int(self._kept[b])
            if keep > held:
                raise ValueError(f"rewind: slot {b} holds {held} cache rows, not the {keep} asked for")
            if keep:
                layout = layout if layout is not None else self._layout(self.current, width)
                start = width - held
                layout[:, b, :, width - keep:width] = layout[:, b, :, start:start + keep]  # overlaps: numpy buffers
            self._kept[b] = keep

    def decode(self, lengths: np.ndarray, span: int | None = None) -> np.ndarray:
        self.rewind(lengths)  # rows a verify left longer than their lengths (a draft's cut prefix)
        return super().decode(lengths, span)

    def decode_steps(self, lengths: np.ndarray, count: int):
        """As AppendCache's (a batch whose rows all sit at the width steps without a mask)."""
        self.rewind(lengths)
        for k, logits in enumerate(AppendCache.decode_steps(self, lengths, count)):
            self._moved(lengths + k, 0, 1)
            yield logits

    def verify(self, lengths: np.ndarray, ids: np.ndarray, rows: np.ndarray, widths: np.ndarray) -> np.ndarray:
        self.rewind(lengths)
        return super().verify(lengths, ids, rows, widths)

    def _valid(self, mask: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
        """A row sees the columns from width - lengths[b] on: its rows and the run's new ones."""
        np.greater_equal(self._columns[:mask.shape[1]], (width - lengths)[:, None], out=mask)
        return mask

    def _moved(self, lengths: np.ndarray, width: int, count: int) -> None:
        """Nothing moves: each row's new rows landed right after its rows (a free slot, of
        length 0, still holds none)."""
        self._kept[:len(lengths)] = np.where(lengths > 0, lengths + count, 0)

