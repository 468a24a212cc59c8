"""The inputs of one decoder run, and binding arrays to onnxruntime without copies.

Every cache mode builds the same inputs: `input_ids [n, S]`, `attention_mask [n, W]`,
`position_ids [n, S]` (or `[3, n, S]` for M-RoPE) where the graph has them, and
`use_cache_branch [1]` for merged decoders (False exactly when the past is empty).
"""

from __future__ import annotations

import numpy as np

from .graph import DecoderGraph


def step_inputs(graph: DecoderGraph, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray,
                past_width: int) -> dict[str, np.ndarray]:
    """Inputs other than the cache. ids, positions: [n, S]; mask: [n, past_width + S]."""
    feeds = {"input_ids": np.ascontiguousarray(ids, dtype=graph.dtype("input_ids")),
             "attention_mask": np.ascontiguousarray(mask, dtype=graph.dtype("attention_mask"))}
    if graph.has_position_ids:
        pos = positions if graph.position_axes == 1 else np.broadcast_to(positions, (3, *positions.shape))
        feeds["position_ids"] = np.ascontiguousarray(pos, dtype=graph.dtype("position_ids"))
    if graph.has_use_cache_branch:
        feeds["use_cache_branch"] = np.array([past_width > 0])
    return feeds


class Binding:
    """An IOBinding over host arrays bound by pointer, with no copies.

    onnxruntime's public `bind_input` builds a device object on every call (~3 us); a step of
    the tiny models takes ~30 us, so the binding keeps one device object and calls the
    binding's own method, falling back to the public API where this onnxruntime differs.
    The caller keeps every bound array alive while it is bound.
    """

    def __init__(self, session):
        self.session = session
        self.io = session.io_binding()
        self._raw = self._device = None
        try:
            import onnxruntime as ort

            self._device = ort.OrtDevice.make("cpu", 0)._get_c_device()
            self._raw = self.io._iobinding
        except (AttributeError, TypeError):
            self._raw = None

    def input(self, name: str, array: np.ndarray) -> None:
        self.input_at(name, array.ctypes.data, array.shape, array.dtype)

    def output(self, name: str, array: np.ndarray) -> None:
        self.output_at(name, array.ctypes.data, array.shape, array.dtype)

    def input_at(self, name: str, pointer: int, shape, dtype) -> None:
        if self._raw is not None:
            try:
                return self._raw.bind_input(name, self._device, dtype, list(shape), pointer)
            except TypeError:
                self._raw = None
        self.io.bind_input(name, "cpu", 0, dtype, list(shape), pointer)

    def output_at(self, name: str, pointer: int, shape, dtype) -> None:
        if self._raw is not None:
            try:
                return self._raw.bind_output(name, self._device, dtype, list(shape), pointer)
            except TypeError:
                self._raw = None
        self.io.bind_output(name, "cpu", 0, dtype, list(shape), pointer)

    def run(self) -> None:
        self.session.run_with_iobinding(self.io)


def pieces(length: int) -> list[int]:
    """The seed's power-of-two prompt pieces, largest first.

    >>> pieces(45)
    [32, 8, 4, 1]
    """
    return [1 << b for b in reversed(range(length.bit_length())) if length >> b & 1]
