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


def bind_input(io, name: str, array: np.ndarray) -> None:
    """Bind a C-contiguous host array as an input, by pointer (the caller keeps it alive)."""
    io.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)


def bind_output(io, name: str, array: np.ndarray) -> None:
    """Bind a C-contiguous host array as an output, by pointer: onnxruntime writes into it."""
    io.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)


def pieces(length: int) -> list[int]:
    """The seed's power-of-two prompt pieces, largest first.

    >>> pieces(45)
    [32, 8, 4, 1]
    """
    return [1 << b for b in reversed(range(length.bit_length())) if length >> b & 1]
