"""The in_place cache mode: GroupQueryAttention over one shared buffer [rows, heads, length,
head_dim], each step's keys and values written in place (onnxruntime-genai's layout), its rows
and its length sized by classes that grow (and shrink, through `fit`) with what the rows hold."""

from __future__ import annotations

import mmap

import numpy as np

from ..runtime.device import Ledger
from ..runtime.feeds import Binding, last_read, pieces, prompt_widths, run_options, step_inputs
from ..runtime.graph import DecoderGraph
from .base import BaseCache, CacheInputs, size_class, token_bytes


class InPlaceCache(BaseCache):
    """One buffer [held, heads, length, head_dim] per cache input, bound as both the past input
    and the present output of GroupQueryAttention, which writes the new rows in place at each
    row's length (the sum of its mask row, minus one).

    `held` (the leading slots the buffer has rows for) and `length` (the cache rows each holds)
    are size classes (base.size_class: powers of two, up to the slots and the capacity): a row
    written past them (a prompt into a higher slot, a longer prompt, a decode at the buffer's
    end) lays the buffers out again at the next classes, the rows copied over and everything
    bound again; `fit` lays them out at the classes the rows need, smaller too. The operator
    reads a row's valid rows only (its mask), so a row's keys and values, and its logits, do not
    depend on the classes. The slots from `held` on are free: a run leaves them out, as it
    leaves out the free slots past `span`.

    Between layouts everything stays bound: the buffers, the token inputs, the logits, and an
    attention mask as wide as the buffer. A step writes one mask entry per row and runs
    (onnxruntime-genai's C++ loop does the same).

    The buffers here are host arrays bound by pointer (the CPU's fastest); in_place_device.py's
    DeviceInPlaceCache keeps them on the session's device, the same verbs through the moves of
    runtime.device (`_new_layout`, `_write_row`, `_set_lengths`, `_move_rows`, `_bind_rows`,
    `_decoder` are the seam). Both count in `ledger` what crosses host <-> device (here: what
    would cross, were the buffers on a device)."""

    mode = "in_place"
    verifies_row_by_row = True  # see verify
    sized = True

    memory = "host"

    def __init__(self, session, graph: DecoderGraph, slots: int, capacity: int, max_position: int,
                 ledger: Ledger | None = None):
        self.graph, self.slots, self.capacity = graph, slots, capacity
        self.ledger = ledger if ledger is not None else Ledger()
        # the decode runs' options: Scheduler.interrupt_for ends a step's run early (its writes are
        # the step's own rows at each row's length: the step run again writes them the same)
        self.run_options = run_options()
        # the step inputs of every slot; a layout binds their leading rows
        self._inputs_binding = Binding(session, self.run_options)
        self.inputs = CacheInputs(self._inputs_binding, graph, slots)
        self.ledger.rate(self.inputs.step_rates(mask_row=16))
        self.token_input = self.inputs.ids[:, 0]
        self.logits = self.inputs.logits[:, 0]
        self.rows = np.arange(slots)
        self.token_bytes = token_bytes(graph)
        # M-RoPE positions ([3, B, 1]) and embedding inputs run every slot: their rows do not shrink
        self._least_rows = 1 if self.inputs.offsets is None and self.inputs.embeds is None else slots
        self.held, self.length, self.buffers = 0, 0, {}
        self.mask = None
        self.lora = None  # cache/lora.LoraRows of a model with adapters (new_cache sets it)
        self._own_inputs()
        self._lay_out(self._least_rows, size_class(1, capacity))
        # prompts bind their own shapes, apart from decode's
        self._prompt_binding = Binding(session, self._options_for(None))
        self._prompt_logits = np.empty(0, graph.logits_dtype)

    # -- sizes ------------------------------------------------------------------------------
    def footprint(self, rows: int, length: int) -> int:
        """Bytes of the buffers (and the mask) laid out for slots [0, rows) of `length` cache rows."""
        held, length = size_class(max(rows, 1), self.slots, self._least_rows), size_class(length, self.capacity)
        return held * length * self.token_bytes + self.slots * length * np.dtype(self.graph.dtype("attention_mask")).itemsize

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values()) + self.mask.nbytes

    def fit(self, rows: int, length: int) -> None:
        """The buffers at the classes of `rows` slots and `length` cache rows, smaller or larger
        than now (the slots from `rows` on are free; no row holds `length` cache rows or more)."""
        held, length = size_class(max(rows, 1), self.slots, self._least_rows), size_class(length, self.capacity)
        if (held, length) != (self.held, self.length):
            self._lay_out(held, length)

    def _grow(self, rows: int, length: int) -> None:
        """Room for slots [0, rows) of `length` cache rows: the next classes where they are past."""
        if rows > self.held or length > self.length:
            self._lay_out(max(self.held, size_class(rows, self.slots, self._least_rows)),
                          max(self.length, size_class(length, self.capacity)))

    def _lay_out(self, held: int, length: int) -> None:
        """Buffers [held, heads, length, head_dim] holding the rows (and the mask the columns)
        that fit of the ones before, bound for the step; the leading runs (`_leading`) are made
        again over them."""
        self.buffers, self.mask = self._new_layout(held, length)
        self.held, self.length = held, length
        binding = self._inputs_binding.leading(held, self.slots, self._options_for(held))
        for e in self.graph.cache:
            binding.input(e.past, self.buffers[e.past])
            binding.output(e.present, self.buffers[e.past])
        binding.input("attention_mask", self.mask[:held])
        self.binding = binding
        self.__dict__.pop("_spans", None)  # the leading runs of the old buffers
        self._decode = self._decoder()

    def _own_inputs(self) -> None:
        """Where the step inputs and logits bound in `_inputs_binding` live: here, the host arrays
        CacheInputs made (the device cache's CUDA graphs move them to the device)."""

    def _new_layout(self, held: int, length: int) -> tuple[dict, np.ndarray]:
        """(buffers, mask) at the classes (held, length), holding the rows (and the mask the
        columns) that fit of the ones before."""
        keep_rows, keep = min(held, self.held), min(length, self.length)
        old, dtype = self.buffers, self.graph.cache_dtype
        buffers = {}
        for e in self.graph.cache:
            buffer = _mapped((held, e.heads, length, e.head_dim), dtype)
            if e.past in old:
                buffer[:keep_rows, :, :keep] = old[e.past][:keep_rows, :, :keep]
            buffers[e.past] = buffer
        mask = np.zeros((self.slots, length), self.graph.dtype("attention_mask"))
        if self.mask is not None:
            mask[:, :keep] = self.mask[:, :keep]
        mask[~mask.any(axis=1), 0] = 1  # a free slot is a one-token padding row
        return buffers, mask

    def _write_row(self, name: str, slot: int, rows: np.ndarray, length: int) -> None:
        self.buffers[name][slot, :, :length] = rows

    def _set_lengths(self, slots, lengths) -> None:
        """The mask rows of `slots`: ones for their first `lengths` columns (at least one: a free
        slot is a one-token padding row)."""
        lengths = np.maximum(np.asarray(lengths, np.int64), 1)
        self.mask[np.asarray(slots, np.int64)] = np.arange(self.length) < lengths[:, None]

    def _move_rows(self, dst, src, length: int) -> None:
        for buffer in self.buffers.values():
            buffer[dst, :, :length] = buffer[src, :, :length]
        self.mask[dst] = self.mask[src]

    def _bind_rows(self, binding: Binding, slot: int, rows: int) -> None:
        """Bind the buffers' rows slot..slot+rows-1 as a prompt run's past and present."""
        for e in self.graph.cache:
            buffer = self.buffers[e.past]
            pointer, shape = buffer.ctypes.data + slot * buffer[0].nbytes, (rows, *buffer.shape[1:])
            binding.input_at(e.past, pointer, shape, buffer.dtype)
            binding.output_at(e.present, pointer, shape, buffer.dtype)

    def insert(self, slot: int, cache: dict[str, np.ndarray], length: int) -> None:
        """A row prefilled apart from the batch (on the host: its rows cross, `insert`)."""
        self._grow(slot + 1, length + 1)
        for name, rows in cache.items():
            self.ledger.add("insert", rows[:, :length].nbytes)
            self._write_row(name, slot, rows[:, :length], length)
        self._set_lengths([slot], [length])

    def prefill(self, slots: list[int], prompts: list[list[int]], steps: str, pad: int, apart=None) -> np.ndarray:
        """Run fresh prompts straight into their free slots' buffer rows; the last logits [n, V].

        Slots in one contiguous run share the first piece (GroupQueryAttention's first prompt
        takes any batch; under int8 dynamic quantization, prompts of one length only); later
        pieces run slot by slot, as onnxruntime requires. No copy: the operator writes into the
        slots, bound by pointer. (`apart` is not needed: the prompts never run apart from the
        buffer.)"""
        self._grow(max(slots) + 1, max(len(p) for p in prompts) + 1)
        last = np.zeros((len(prompts), self.graph.vocab_size), np.float32)
        order = sorted(range(len(slots)), key=lambda j: slots[j])
        runs, run = [], [order[0]]
        by_length = self.graph.prompts_by_length  # int8 scales: no padding position in a run (runtime/int8_rows.py)
        for j in order[1:]:
            if slots[j] == slots[run[-1]] + 1 and not (by_length and len(prompts[j]) != len(prompts[run[-1]])):
                run.append(j)
            else:
                runs.append(run)
                run = [j]
        runs.append(run)
        for run in runs:
            lengths = [len(prompts[j]) for j in run]
            first = prompt_widths(max(lengths), steps)[0]
            ids = np.full((len(run), first), pad, np.int64)
            for i, j in enumerate(run):
                ids[i, :min(first, lengths[i])] = prompts[j][:first]
            logits = self._prompt_step(slots[run[0]], ids, 0, last_read(lengths, 0, first))
            for i, j in enumerate(run):
                last[j] = logits[i, -1 if self.graph.has_logits_positions else min(first, lengths[i]) - 1]
                offset = first
                for width in pieces(lengths[i] - first) if lengths[i] > first else []:
                    row = np.array([prompts[j][offset:offset + width]], np.int64)
                    last[j] = self._prompt_step(slots[j], row, offset, last_read([width], 0, width))[0, -1]
                    offset += width
        self._set_lengths(slots, [len(p) for p in prompts])
        return last

    def _prompt_step(self, slot: int, ids: np.ndarray, offset: int, read: np.ndarray | None = None) -> np.ndarray:
        """ids [n, S] after `offset` cached tokens, into slots slot..slot+n-1; logits [n, S, V],
        or [n, P, V] at the positions `read` [n, P] where the graph computes only those."""
        rows, width = ids.shape
        binding = self._prompt_binding
        self._bind_rows(binding, slot, rows)
        positions = np.broadcast_to(offset + np.arange(width), ids.shape)
        read = read if self.graph.has_logits_positions else None
        feeds = step_inputs(self.graph, ids, np.ones((rows, offset + width), np.int64), positions, offset, read=read)
        feeds["use_cache_branch"] = np.array([True])  # the shared buffer is the past, even when empty
        if self.lora is not None:
            feeds.update(self.lora.feeds(self.lora.places[slot:slot + rows]))
        for name, array in feeds.items():
            if name in self.graph.input_dtypes:
                binding.input(name, array)
                self.ledger.add("prompt", array.nbytes)
        given = width if read is None else read.shape[1]
        size = rows * given * self.graph.vocab_size
        self.ledger.add("prompt", size * np.dtype(self.graph.logits_dtype).itemsize)
        if self._prompt_logits.size < size:  # kept between prompts: no fresh pages per request
            self._prompt_logits = np.empty(size, self.graph.logits_dtype)
        logits = self._prompt_logits[:size].reshape(rows, given, self.graph.vocab_size)
        binding.output("logits", logits)
        binding.run()
        return logits

    def verify(self, lengths: np.ndarray, ids: np.ndarray, rows: np.ndarray, widths: np.ndarray) -> np.ndarray:
        """Row by row, each its own width: GroupQueryAttention refuses several tokens of more
        than one row over a past ("batch_size must be 1 when sequence_length > 1"). Rows of
        width 1, when there are several, take one batched decode instead (which also writes the
        first token of the other rows, as their own runs then write it again)."""
        self._grow(self.held, int((lengths[rows] + widths[rows]).max()))
        out = np.zeros((len(rows), ids.shape[1], self.graph.vocab_size), np.float32)
        single = widths[rows] == 1
        if single.sum() >= 2:
            self.token_input[rows] = ids[rows, 0]
            out[single, 0] = self.decode(lengths)[rows[single]]
        for i, slot in enumerate(rows.tolist()):
            if single[i] and single.sum() >= 2:
                continue
            width = int(widths[slot])
            out[i, :width] = self._prompt_step(slot, ids[slot:slot + 1, :width], int(lengths[slot]))[0]
        return out

    def read_row(self, slot: int, length: int) -> dict[str, np.ndarray] | None:
        if slot >= self.held or length > self.length:
            return None
        return {name: self._row(buffer, slot, length) for name, buffer in self.buffers.items()}

    def rewind(self, lengths: np.ndarray) -> None:
        """A row's valid rows are its mask's ones: the rows past its length are overwritten later."""
        self._set_lengths(self.rows, lengths)

    def copy_rows(self, dst, src, length: int) -> None:
        """Only the rows that move, only their valid part: a beam step moves a few rows of a
        few hundred tokens, where gathering whole buffers would copy them all."""
        self._grow(int(max(dst)) + 1, length + 1)
        self._move_rows(dst, src, length)
        if self.lora is not None:
            self.lora.copy(dst, src)

    def release(self, slot: int) -> None:
        """The slot's rows stay until a new row is inserted; its mask becomes a padding row's."""
        self._set_lengths([slot], [0])
        if self.lora is not None:
            self.lora.set([slot], 0)

    def decode(self, lengths: np.ndarray, span: int | None = None) -> np.ndarray:
        """See the package docstring; a row at the buffer's end first lays it out longer."""
        if lengths.max() >= self.length:
            self._grow(self.held, int(lengths.max()) + 1)
        return self._decode(lengths, span)

    def _decoder(self):
        """`decode(lengths, span)` over the current layout, as a closure over what it touches
        (the step loop calls it often).

        `span`: the rows from `span` on are free, so the run takes the leading rows only (their
        bindings made once per span, over the same buffers): a server's batch of 8 slots holding
        one request runs a batch of one, not of eight (1.4x a batch of one's time on SmolLM2-135M,
        3.5x on the default model). The slots from `held` on are free too. M-RoPE positions
        ([3, B, 1]) and embedding inputs run whole."""
        mask, rows, run, logits, inputs = self.mask, self.rows, self.binding.run, self.logits, self.inputs
        held, partial, step = self.held, self._least_rows == 1, self.ledger.step

        def decode(lengths: np.ndarray, span: int | None = None) -> np.ndarray:
            mask[rows, lengths] = 1  # the new token's row: GroupQueryAttention writes it at the row's length
            if inputs.positions is not None:
                inputs.set_positions(lengths)
            rows_run = held if span is None or span >= held or not partial else span
            binding, go = (self.binding, run) if rows_run == held else self._leading(span)
            if self.lora is not None:
                self.lora.bind(binding, rows_run)
            go()
            step(rows_run)
            return logits
        return decode

    def decode_steps(self, lengths: np.ndarray, count: int):
        """Up to `count` decodes from `lengths` on; see `BaseCache.decode_steps`. The mask entries
        of all steps are indexed up front, so a step is one numpy write and the run: on the
        tiny models a step's Python work is a tenth of the step, and every microsecond shows."""
        if self.inputs.positions is not None or self.lora is not None:
            yield from BaseCache.decode_steps(self, lengths, count)
            return
        self._grow(self.held, int(lengths.max()) + count)
        width = self.mask.shape[1]
        where = (self.rows * width + lengths)[None, :] + np.arange(count)[:, None]
        set_mask, run, logits = self.mask.reshape(-1).__setitem__, self.binding.run, self.logits
        step, held = self.ledger.step, self.held
        for entries in where:
            set_mask(entries, 1)
            run()
            step(held)
            yield logits


def _mapped(shape, dtype) -> np.ndarray:
    """Zeros in pages of their own (an anonymous mmap), mapped now. np.zeros maps a large array's
    pages lazily, and a prompt's run reaches its rows' buffers over the whole length: the first
    8-row prompt of SmolLM2-135M at capacity 4096 took 2.3 s in page faults (0.08 s after). Pages
    of their own also go back to the system when a layout is dropped (a heap block may not)."""
    count = int(np.prod(shape))
    out = np.frombuffer(mmap.mmap(-1, max(1, count * np.dtype(dtype).itemsize)), dtype, count).reshape(shape)
    out.fill(0)
    return out
