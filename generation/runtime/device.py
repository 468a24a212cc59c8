"""Buffers owned by a session's device, the moves between them run on that device, and the
ledger of the bytes that cross between the host and the device.

A decoder on a GPU keeps its cache where it runs: a step may move only what Python must read
(the logits at the read positions) and the few inputs that change (ids, positions, the mask's
new entries), never the cache. `DeviceArray` is memory onnxruntime allocated on the device
(an OrtValue), bound to a session by pointer as numpy arrays are on the host; `Device` runs the
moves a cache makes (a fresh buffer, a relayout to other size classes, rows copied between
slots, a row written from the host, mask rows set by length, a step's mask entries) as small
ONNX graphs (ConstantOfShape, Slice + Pad, Gather + ScatterND: device_moves.py) on the
session's own provider, built once per dtype and run through IOBinding, as onnxruntime-genai's
CUDA loop keeps its cache in device buffers bound once per layout. On the CPU the same code runs over CPU
OrtValues, so the tests exercise what a CUDA session runs.

ScatterND's output is bound to its input's memory: onnxruntime's kernels (CPU and CUDA) copy
the input to the output only where the two differ, so the scatter writes in place.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from .device_moves import move_graph

# Why bytes cross: a decode step's `logits` (at the read positions) and `inputs` (ids, positions,
# read positions, the rows' lengths or new mask entries); a prompt's run (`prompt`: its ids, mask
# and positions in, its logits out, and the rows of a run apart from the buffers out); a row
# prefilled apart from the batch and inserted (`insert`), but the part a prefix store on the host
# gave back (`prefix_restore`); a finished row's cache read back for the prefix store to keep its
# decoded blocks (`prefix_keep`); the row indices of a move (`indices`). Relayouts and beam
# reorders run on the device: no cause of theirs. (The prefix store keeps the prompt rows a run
# apart already brought to the host: storing those moves nothing.)
CAUSES = ("prompt", "inputs", "logits", "insert", "prefix_restore", "prefix_keep", "indices")


@dataclass
class Ledger:
    """Bytes crossing host <-> device by cause, and the decode steps and rows (summed over steps)
    behind them. A cache on host buffers counts the same: what would cross were it on a device.

    A decode step's bytes are counted as rates (bytes a row, bytes a step, per cause: fixed for a
    cache's layout) times the steps and rows, so the step loop adds two integers, not a dict."""

    counted: dict = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    steps: int = 0
    rows: int = 0
    # per cause: (bytes a row, bytes a step) of a decode step
    rates: dict = field(default_factory=dict)
    _rated: dict = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, cause: str, nbytes: int) -> None:
        self.counted[cause] += int(nbytes)

    def step(self, rows: int) -> None:
        """One decode step of `rows` rows (its bytes by `rates`)."""
        self.steps += 1
        self.rows += rows

    def rate(self, rates: dict) -> None:
        """New per-row / per-step rates (a new layout); the steps so far keep the old ones."""
        with self.lock:
            for cause, (row, step) in self.rates.items():
                self._rated[cause] += row * self.rows + step * self.steps
            for cause, (row, step) in rates.items():
                self._rated[cause] -= row * self.rows + step * self.steps
            self.rates = dict(rates)

    @property
    def bytes(self) -> dict[str, int]:
        """Bytes by cause so far."""
        out = dict(self.counted)
        for cause, value in self._rated.items():
            out[cause] += value
        for cause, (row, step) in self.rates.items():
            out[cause] += row * self.rows + step * self.steps
        return out

    def stats(self) -> dict:
        return {"host_device_bytes": self.bytes, "decode_steps": self.steps, "decode_rows": self.rows}


class DeviceArray:
    """A tensor on a device: `value` the OrtValue that owns the memory (None for a view of the
    leading rows of another), bound by `pointer` with its `shape` and `dtype`."""

    __slots__ = ("value", "pointer", "shape", "dtype", "device")

    def __init__(self, value, pointer: int, shape: tuple, dtype, device: str):
        self.value, self.pointer, self.shape, self.dtype, self.device = value, pointer, tuple(shape), np.dtype(dtype), device

    @classmethod
    def of(cls, value, device: str) -> "DeviceArray":
        return cls(value, value.data_ptr(), value.shape(), _NUMPY[value.data_type()], device)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def row_pointer(self, row: int) -> int:
        return self.pointer + row * (self.nbytes // self.shape[0])

    def __getitem__(self, rows: slice) -> "DeviceArray":
        """The leading rows `[:count]` (the same memory: a contiguous tensor's leading rows are)."""
        if not (isinstance(rows, slice) and rows.start in (None, 0) and rows.step in (None, 1)):
            raise IndexError("a DeviceArray gives only its leading rows ([:count])")
        count = min(self.shape[0], self.shape[0] if rows.stop is None else rows.stop)
        return DeviceArray(self.value, self.pointer, (count, *self.shape[1:]), self.dtype, self.device)

    def copy_to_host(self) -> np.ndarray:
        """The contents as a numpy array (tests and checks: not counted in a ledger)."""
        host = np.empty(self.shape, self.dtype)
        if self.device == "cpu":
            import ctypes

            ctypes.memmove(host.ctypes.data, self.pointer, self.nbytes)
            return host
        return _read(self)


_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
          "tensor(int32)": np.int32, "tensor(bool)": np.bool_, "tensor(bfloat16)": np.uint16}


def _read(array: DeviceArray) -> np.ndarray:
    """A device array's contents through an Identity run whose output is on the host."""
    device = Device.for_provider(array.device)
    return device._run("identity", array.dtype, {"x": array}, host_out=("y", array.shape), rank=array.ndim)


class Device:
    """The moves of a cache's buffers, run on `provider` ('cpu' or 'cuda', device 0): one small
    session per graph and dtype, built when first used and shared by every cache of the process."""

    _made: dict = {}
    _lock = threading.Lock()

    def __init__(self, provider: str):
        self.provider = provider
        self._sessions: dict = {}
        self._session_lock = threading.Lock()

    @classmethod
    def for_provider(cls, provider: str) -> "Device":
        with cls._lock:
            found = cls._made.get(provider)
            if found is None:
                found = cls._made[provider] = cls(provider)
            return found

    # -- the moves --------------------------------------------------------------------------
    def zeros(self, shape, dtype) -> DeviceArray:
        """A buffer of zeros allocated on the device."""
        return self._run("zeros", dtype, {"shape": np.asarray(shape, np.int64)}, out="y", rank=len(shape))

    def relayout(self, old: DeviceArray, shape) -> DeviceArray:
        """A new buffer of `shape` (zeros) holding what fits of `old` (its leading part on every
        axis), allocated and filled on the device."""
        keep = np.minimum(old.shape, shape).astype(np.int64)
        pads = np.concatenate([np.zeros(len(shape), np.int64), np.asarray(shape, np.int64) - keep])
        return self._run("relayout", old.dtype, {"x": old, "ends": keep, "pads": pads}, out="y", rank=old.ndim)

    def copy_into(self, old: DeviceArray, into: DeviceArray) -> None:
        """`into` (zeros) holding what fits of `old` (its leading part on every axis): a buffer
        laid out again in memory of its own (the append cache's other buffer)."""
        keep = np.minimum(old.shape, into.shape).astype(np.int64)
        pads = np.concatenate([np.zeros(len(into.shape), np.int64), np.asarray(into.shape, np.int64) - keep])
        self._run("relayout", old.dtype, {"x": old, "ends": keep, "pads": pads}, inplace=("y", into), rank=old.ndim)

    def move_columns(self, array: DeviceArray, lengths: DeviceArray, start: int, count: int) -> None:
        """array[b, :, lengths[b] + k] = array[b, :, start + k] for k < count, every row b, in place
        (array [rows, heads, columns, head_dim]): a run's new columns, landed at `start` for every
        row, moved to each row's length (the widest rows' own place: they stay)."""
        self._run("move_columns", array.dtype, {"x": array, "lengths": lengths, "starts": np.array([start], np.int64),
                                                "ends": np.array([start + count], np.int64)},
                  inplace=("y", array), rank=array.ndim)

    def valid_mask(self, mask: DeviceArray, lengths: DeviceArray, width: int) -> None:
        """mask [n, total] = 1 where column c < lengths[b] or c >= width: each row's valid cache
        rows and a run's new columns, computed on the device from the lengths."""
        self._run("valid_mask", mask.dtype, {"lengths": lengths, "width": np.array([width], np.int64),
                                             "total": np.array([mask.shape[1]], np.int64)},
                  inplace=("y", mask), rank=2)

    def gather(self, array: DeviceArray, rows, ledger: Ledger | None = None) -> DeviceArray:
        """array[rows] in a new buffer (rows may repeat)."""
        rows = np.asarray(rows, np.int64)
        if ledger is not None:
            ledger.add("indices", rows.nbytes)
        return self._run("gather", array.dtype, {"x": array, "rows": rows}, out="y", rank=array.ndim)

    def concat(self, arrays: list[DeviceArray]) -> DeviceArray:
        """The arrays one after another along their first axis, in a new buffer."""
        if len(arrays) == 1:
            return self.relayout(arrays[0], arrays[0].shape)
        out = arrays[0]
        for array in arrays[1:]:
            out = self._run("concat", array.dtype, {"a": out, "b": array}, out="y", rank=array.ndim)
        return out

    def view(self, array: DeviceArray, offset: int, shape) -> DeviceArray:
        """`shape` of `array`'s memory from element `offset` on (a layout of a flat block)."""
        return DeviceArray(array.value, array.pointer + offset * array.dtype.itemsize, shape, array.dtype, array.device)

    def write_from(self, host: np.ndarray, array: DeviceArray) -> None:
        """array = host (same shape), into the device buffer's own memory (a fixed address)."""
        self._run("identity", array.dtype, {"x": np.ascontiguousarray(host, array.dtype)}, inplace=("y", array),
                  rank=array.ndim)

    def read_into(self, array: DeviceArray, host: np.ndarray) -> None:
        """host = array (same shape): a device buffer read into a host array of the caller's."""
        binding = _Bound(self._session("identity", array.dtype, array.ndim), self)
        binding.bind("x", array)
        binding.bind_out("y", host)
        binding.run()

    def read_row(self, array: DeviceArray, row: int, length: int, ledger: Ledger | None = None) -> np.ndarray:
        """array[row, :, :length] on the host ([heads, length, head_dim] of a [rows, heads, width,
        head_dim] buffer): a finished row's cache for the prefix store, counted as `prefix_keep`."""
        one = DeviceArray(array.value, array.row_pointer(row), (1, *array.shape[1:]), array.dtype, array.device)
        host = np.empty(one.shape, array.dtype)
        self.read_into(one, host)
        if ledger is not None:
            ledger.add("prefix_keep", host[0, :, :length].nbytes)
        return host[0, :, :length]

    def upload(self, values: np.ndarray, ledger: Ledger | None = None, cause: str = "indices") -> DeviceArray:
        """A host array copied to the device once (row indices several moves share)."""
        import onnxruntime as ort

        values = np.ascontiguousarray(values)
        if ledger is not None:
            ledger.add(cause, values.nbytes)
        return DeviceArray.of(ort.OrtValue.ortvalue_from_numpy(values, self.provider, 0), self.provider)

    def move_rows(self, arrays: list[DeviceArray], dst, src, ledger: Ledger | None = None) -> None:
        """array[dst] = array[src] (as they were before) in place, for each of `arrays` (every
        buffer of a cache): a beam reorder or a copy of slots. The indices go to the device once;
        whole rows move (past a row's length they hold nothing it reads)."""
        dst, src = self.upload(np.asarray(dst, np.int64), ledger), self.upload(np.asarray(src, np.int64), ledger)
        for array in arrays:
            self._run("move_rows", array.dtype, {"x": array, "dst": dst, "src": src}, inplace=("y", array),
                      rank=array.ndim)

    def write_row(self, array: DeviceArray, row: int, values: np.ndarray, ledger: Ledger | None = None) -> None:
        """array[row, :, :n] = values ([heads, n, head_dim] from the host; the row's entries past n
        become zeros): a row prefilled apart from the batch, or restored from a host store (the
        caller counts the values' bytes under its cause)."""
        values = np.ascontiguousarray(values, array.dtype)
        if ledger is not None:
            ledger.add("indices", 8)
        self._run("write_row", array.dtype, {"x": array, "row": np.array([row], np.int64), "values": values[None],
                                             "pads": _pad_to(values[None].shape, (1, *array.shape[1:]))},
                  inplace=("y", array))

    def set_lengths(self, mask: DeviceArray, rows, lengths, ledger: Ledger | None = None) -> None:
        """mask[rows] = ones for each row's first max(length, 1) columns, zeros after (a free
        slot, length 0, is a one-token padding row)."""
        rows, lengths = np.asarray(rows, np.int64), np.asarray(lengths, np.int64)
        if ledger is not None:
            ledger.add("indices", rows.nbytes + lengths.nbytes)
        self._run("set_lengths", mask.dtype, {"x": mask, "rows": rows, "lengths": lengths}, inplace=("y", mask), rank=2)

    def mark(self, mask: DeviceArray, entries: np.ndarray) -> None:
        """mask[entries[:, 0], entries[:, 1]] = 1 in place: a step's new tokens (its bytes are
        the step's, counted by the ledger's rates)."""
        self._run("mark", mask.dtype, {"x": mask, "entries": entries}, inplace=("y", mask), rank=2)

    def marker(self, mask: DeviceArray, entries: np.ndarray):
        """`mark` for a fixed mask and entry buffer as a function of no arguments: the step loop
        writes the entries on the host and calls it (bound once)."""
        session = self._session("mark", mask.dtype, 2)
        binding = _Bound(session, self)
        binding.bind("x", mask)
        binding.bind("entries", entries)
        binding.bind_out("y", mask)
        return binding.run

    # -- sessions ---------------------------------------------------------------------------
    def _session(self, op: str, dtype, rank: int = 4):
        key = (op, np.dtype(dtype).str, rank)
        with self._session_lock:
            found = self._sessions.get(key)
            if found is None:
                import onnxruntime as ort

                options = ort.SessionOptions()
                options.intra_op_num_threads = 1
                options.inter_op_num_threads = 1
                options.log_severity_level = 3
                options.add_session_config_entry("session.intra_op.allow_spinning", "0")
                options.enable_cpu_mem_arena = False  # a dropped layout's buffers go back to the system
                providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if self.provider == "cuda" \
                    else ["CPUExecutionProvider"]
                graph = move_graph(op, np.dtype(dtype), rank).SerializeToString()
                found = self._sessions[key] = ort.InferenceSession(graph, options, providers=providers)
            return found

    def _run(self, op: str, dtype, feeds: dict, out: str | None = None, inplace=None, host_out=None,
             rank: int = 4):
        binding = _Bound(self._session(op, dtype, rank), self)
        for name, value in feeds.items():
            binding.bind(name, value)
        if inplace is not None:
            binding.bind_out(*inplace)
        elif host_out is not None:
            host = np.empty(host_out[1], np.dtype(dtype))
            binding.bind_out(host_out[0], host)
        else:
            binding.io.bind_output(out, self.provider, 0)
        binding.run()
        if host_out is not None:
            return host
        if out is not None:
            return DeviceArray.of(binding.io.get_outputs()[0], self.provider)
        return None


class _Bound:
    """An IOBinding of one of Device's sessions: DeviceArrays by pointer on their device, numpy
    arrays on the host (onnxruntime copies those a kernel needs on the device; the shapes and
    counts a kernel reads on the host stay there)."""

    def __init__(self, session, device: Device):
        self.session, self.device, self.io = session, device, session.io_binding()
        self._held = []

    def bind(self, name: str, value) -> None:
        if isinstance(value, DeviceArray):
            self.io.bind_input(name, value.device, 0, value.dtype, list(value.shape), value.pointer)
        else:
            value = np.ascontiguousarray(value)
            self._held.append(value)
            self.io.bind_input(name, "cpu", 0, value.dtype, list(value.shape), value.ctypes.data)

    def bind_out(self, name: str, value) -> None:
        if isinstance(value, DeviceArray):
            self.io.bind_output(name, value.device, 0, value.dtype, list(value.shape), value.pointer)
        else:
            self._held.append(value)
            self.io.bind_output(name, "cpu", 0, value.dtype, list(value.shape), value.ctypes.data)

    def run(self) -> None:
        self.session.run_with_iobinding(self.io)


def _pad_to(shape, target) -> np.ndarray:
    return np.concatenate([np.zeros(len(shape), np.int64), np.asarray(target, np.int64) - np.asarray(shape)])
