"""The inputs of one decoder run, and binding arrays to onnxruntime without copies.

Every cache mode builds the same inputs: `input_ids [n, S]`, `attention_mask [n, W]`,
`position_ids [n, S]` (or `[3, n, S]` for M-RoPE) where the graph has them, and
`use_cache_branch [1]` for merged decoders (False exactly when the past is empty).
"""

from __future__ import annotations

import functools

import numpy as np

from .graph import DecoderGraph


def step_inputs(graph: DecoderGraph, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray,
                past_width: int, embeds: np.ndarray | None = None,
                read: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Inputs other than the cache. ids: [n, S]; positions: [n, S] (the same on every axis of an
    M-RoPE graph) or [3, n, S]; mask: [n, past_width + S]. A graph that takes inputs_embeds gets
    `embeds` [n, S, hidden] (the ids' embeddings, image features in place) instead of the ids.
    read: [n, P] the positions (of S) whose logits the run gives, where the graph computes only
    those (runtime.head); every position when None."""
    feeds = {"attention_mask": np.ascontiguousarray(mask, dtype=graph.dtype("attention_mask"))}
    if graph.has_inputs_embeds:
        feeds["inputs_embeds"] = np.ascontiguousarray(embeds, dtype=graph.dtype("inputs_embeds"))
    else:
        feeds["input_ids"] = np.ascontiguousarray(ids, dtype=graph.dtype("input_ids"))
    if graph.has_position_ids:
        pos = positions
        if graph.position_axes == 3 and positions.ndim == 2:
            pos = np.broadcast_to(positions, (3, *positions.shape))
        feeds["position_ids"] = np.ascontiguousarray(pos, dtype=graph.dtype("position_ids"))
    if graph.has_use_cache_branch:
        feeds["use_cache_branch"] = np.array([past_width > 0])
    if graph.has_logits_positions:
        n, width = ids.shape
        feeds["logits_positions"] = np.ascontiguousarray(
            np.broadcast_to(np.arange(width), (n, width)) if read is None else read, dtype=np.int64)
    return feeds


def last_read(lengths: np.ndarray, offset: int, width: int) -> np.ndarray:
    """[n, 1]: each row's last token within a run of `width` tokens from `offset` (its position
    in the run; 0 for a row with no token there)."""
    return np.clip(np.asarray(lengths) - offset - 1, 0, width - 1)[:, None]


def run_options():
    """One RunOptions for every run of a binding: without one, each run builds a default (~1.7 us
    a step). Another thread may set its `terminate` to end a run early (`terminated`)."""
    import onnxruntime as ort

    options = ort.RunOptions()
    options.log_severity_level = 3  # a terminated run is not an error worth a log line
    return options


def terminated(error: BaseException) -> bool:
    """Whether `error` is onnxruntime's for a run whose RunOptions.terminate was set."""
    return "terminate flag" in str(error)


class Binding:
    """An IOBinding over host arrays bound by pointer, with no copies.

    onnxruntime's public `bind_input` builds a device object on every call (~2 us) and its
    `run_with_iobinding` checks graph capture first; a step of the tiny models takes ~30 us and
    binds up to a dozen tensors, so where this onnxruntime allows, the binding keeps one device
    object and calls the C++ binding directly. The caller keeps bound arrays alive while bound.

    input_at(name, pointer, shape, dtype) / output_at(...) bind raw memory (the caller keeps it
    alive); input(name, array) / output(name, array) bind a C-contiguous array and hold it until
    the name is bound again; run() runs the session. Hot loops may call
    `bind_input(name, device, dtype, shape, pointer)` / `bind_output(...)` with `device`.
    `options`: the runs' RunOptions (shared with the bindings `leading` makes).
    """

    def __init__(self, session, options=None):
        self.session, self.options = session, options if options is not None else run_options()
        self.io = session.io_binding()
        self._held: dict[str, np.ndarray] = {}
        try:
            self.device, self.bind_input, self.bind_output, self.run = self._direct()
        except (AttributeError, TypeError):  # another onnxruntime: the public API
            self.device, self.bind_input, self.bind_output, self.run = self._public()

    def _public(self):
        io, session = self.io, self.session

        def bind_input(name, device, dtype, shape, pointer):
            io.bind_input(name, device, 0, dtype, list(shape), pointer)

        def bind_output(name, device, dtype, shape, pointer):
            io.bind_output(name, device, 0, dtype, list(shape), pointer)

        self._handle = str
        return "cpu", bind_input, bind_output, functools.partial(session.run_with_iobinding, io, self.options)

    def _direct(self):
        import onnxruntime as ort

        device = ort.OrtDevice.make("cpu", 0)._get_c_device()
        raw, run = self.io._iobinding, self.session._sess.run_with_iobinding
        probe = np.zeros(1, np.int64)
        name = self.session.get_inputs()[0].name  # (bound again before any run)
        raw.bind_input(name, device, probe.dtype, [1], probe.ctypes.data)  # TypeError if it differs
        self._handle = _device_handle
        return device, raw.bind_input, raw.bind_output, functools.partial(run, raw, self.options)

    def input_at(self, name: str, pointer: int, shape, dtype) -> None:
        self.bind_input(name, self.device, dtype, shape, pointer)

    def output_at(self, name: str, pointer: int, shape, dtype) -> None:
        self.bind_output(name, self.device, dtype, shape, pointer)

    def input(self, name: str, array) -> None:
        """Bind a host array, or a runtime.device.DeviceArray on its device."""
        self._held[name] = array
        if isinstance(array, np.ndarray):
            self.input_at(name, array.ctypes.data, array.shape, array.dtype)
        else:
            self.bind_input(name, self._handle(array.device), array.dtype, array.shape, array.pointer)

    def output(self, name: str, array) -> None:
        self._held["output:" + name] = array
        if isinstance(array, np.ndarray):
            self.output_at(name, array.ctypes.data, array.shape, array.dtype)
        else:
            self.bind_output(name, self._handle(array.device), array.dtype, array.shape, array.pointer)

    def on_device(self, name: str, device: str, pointer: int, shape, dtype, output: bool = False) -> None:
        """Bind raw memory on `device` ('cpu', 'cuda'): a device buffer's rows."""
        (self.bind_output if output else self.bind_input)(name, self._handle(device), dtype, shape, pointer)

    def leading(self, count: int, batch: int, options=None) -> "Binding":
        """A binding of the same session over the first `count` rows of every array bound here
        by `input` / `output` whose first axis is `batch` long (the others as they are): a run of
        the leading rows only, in the same memory (a C-contiguous array's leading rows are).
        `options`: its runs' RunOptions (default this binding's)."""
        out = Binding(self.session, options if options is not None else self.options)
        for key, array in self._held.items():
            part = array[:count] if array.ndim and array.shape[0] == batch else array
            if key.startswith("output:"):
                out.output(key[len("output:"):], part)
            else:
                out.input(key, part)
        return out


@functools.cache
def _device_handle(name: str):
    """onnxruntime's C++ device object for `name` (device 0), as the direct binding takes it."""
    import onnxruntime as ort

    return ort.OrtDevice.make(name, 0)._get_c_device()


def prompt_widths(length: int, steps: str) -> list[int]:
    """The runs a prompt of `length` takes: one ('whole') or its power-of-two pieces ('pieces')."""
    return pieces(length) if steps == "pieces" else [length]


def pieces(length: int) -> list[int]:
    """The seed's power-of-two prompt pieces, largest first.

    >>> pieces(45)
    [32, 8, 4, 1]
    """
    return [1 << b for b in reversed(range(length.bit_length())) if length >> b & 1]
