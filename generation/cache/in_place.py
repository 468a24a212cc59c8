"""The in_place cache mode: GroupQueryAttention over one shared buffer [slots, heads, capacity,
head_dim], each step's keys and values written in place (onnxruntime-genai's layout)."""

from __future__ import annotations

import numpy as np

from ..runtime.feeds import Binding, last_read, pieces, prompt_widths, step_inputs
from ..runtime.graph import DecoderGraph
from .base import BaseCache, CacheInputs


class InPlaceCache(BaseCache):
    """One buffer [slots, heads, capacity, head_dim] per cache input, bound as both the past
    input and the present output of GroupQueryAttention, which writes the new rows in place at
    each row's length (the sum of its mask row, minus one).

    Everything is bound once: the buffers, the token and position inputs, the logits, and an
    attention mask as wide as the buffer. A step writes one mask entry per row and runs
    (onnxruntime-genai's C++ loop does the same)."""

    mode = "in_place"
    verifies_row_by_row = True  # see verify

    def __init__(self, session, graph: DecoderGraph, slots: int, capacity: int, max_position: int):
        self.binding = Binding(session)
        self.capacity = capacity
        self.buffers = {e.past: _mapped((slots, e.heads, capacity, e.head_dim), graph.cache_dtype)
                        for e in graph.cache}
        for e in graph.cache:
            self.binding.input(e.past, self.buffers[e.past])
            self.binding.output(e.present, self.buffers[e.past])
        self.inputs = CacheInputs(self.binding, graph, slots)
        self.token_input = self.inputs.ids[:, 0]
        self.mask = np.zeros((slots, capacity), graph.dtype("attention_mask"))
        self.mask[:, 0] = 1  # a free slot is a one-token padding row
        self.binding.input("attention_mask", self.mask)
        self.rows = np.arange(slots)
        self.logits = self.inputs.logits[:, 0]
        self.graph = graph
        self.decode = self._decoder()
        self._prompt_binding = Binding(session)  # prompts bind their own shapes, apart from decode's
        self._prompt_logits = np.empty(0, graph.logits_dtype)

    def insert(self, slot: int, cache: dict[str, np.ndarray], length: int) -> None:
        for name, rows in cache.items():
            self.buffers[name][slot, :, :length] = rows
        self.mask[slot] = 0
        self.mask[slot, :length] = 1

    def prefill(self, slots: list[int], prompts: list[list[int]], steps: str, pad: int, apart=None) -> np.ndarray:
        """Run fresh prompts straight into their free slots' buffer rows; the last logits [n, V].

        Slots in one contiguous run share the first piece (GroupQueryAttention's first prompt
        takes any batch); later pieces run slot by slot, as onnxruntime requires. No copy: the
        operator writes into the slots, bound by pointer. (`apart` is not needed: the prompts
        never run apart from the buffer.)"""
        last = np.zeros((len(prompts), self.graph.vocab_size), np.float32)
        order = sorted(range(len(slots)), key=lambda j: slots[j])
        runs, run = [], [order[0]]
        for j in order[1:]:
            if slots[j] == slots[run[-1]] + 1:
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
        for j, slot in enumerate(slots):
            self.mask[slot] = 0
            self.mask[slot, :len(prompts[j])] = 1
        return last

    def _prompt_step(self, slot: int, ids: np.ndarray, offset: int, read: np.ndarray | None = None) -> np.ndarray:
        """ids [n, S] after `offset` cached tokens, into slots slot..slot+n-1; logits [n, S, V],
        or [n, P, V] at the positions `read` [n, P] where the graph computes only those."""
        rows, width = ids.shape
        binding = self._prompt_binding
        for e in self.graph.cache:
            buffer = self.buffers[e.past]
            pointer, shape = buffer.ctypes.data + slot * buffer[0].nbytes, (rows, *buffer.shape[1:])
            binding.input_at(e.past, pointer, shape, buffer.dtype)
            binding.output_at(e.present, pointer, shape, buffer.dtype)
        positions = np.broadcast_to(offset + np.arange(width), ids.shape)
        read = read if self.graph.has_logits_positions else None
        feeds = step_inputs(self.graph, ids, np.ones((rows, offset + width), np.int64), positions, offset, read=read)
        feeds["use_cache_branch"] = np.array([True])  # the shared buffer is the past, even when empty
        for name, array in feeds.items():
            if name in self.graph.input_dtypes:
                binding.input(name, array)
        given = width if read is None else read.shape[1]
        size = rows * given * self.graph.vocab_size
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

    def rewind(self, lengths: np.ndarray) -> None:
        """A row's valid rows are its mask's ones: the rows past its length are overwritten later."""
        np.less(np.arange(self.capacity), lengths[:, None], out=self.mask, casting="unsafe")
        self.mask[lengths == 0, 0] = 1  # a free slot stays a one-token padding row

    def copy_rows(self, dst, src, length: int) -> None:
        """Only the rows that move, only their valid part: a beam step moves a few rows of a
        few hundred tokens, where gathering whole buffers would copy them all."""
        for buffer in self.buffers.values():
            buffer[dst, :, :length] = buffer[src, :, :length]
        self.mask[dst] = self.mask[src]

    def release(self, slot: int) -> None:
        """The slot's rows stay until a new row is inserted; its mask becomes a padding row's."""
        self.mask[slot] = 0
        self.mask[slot, 0] = 1

    def _decoder(self):
        """`decode(lengths, span)` as a closure over what it touches (the step loop calls it often).

        `span`: the rows from `span` on are free, so the run takes the leading rows only (their
        bindings made once per span, over the same buffers): a server's batch of 8 slots holding
        one request runs a batch of one, not of eight (1.4x a batch of one's time on SmolLM2-135M,
        3.5x on the default model). M-RoPE positions ([3, B, 1]) and embedding inputs run whole."""
        mask, rows, run, logits, inputs = self.mask, self.rows, self.binding.run, self.logits, self.inputs
        slots, partial = len(rows), inputs.offsets is None and inputs.embeds is None

        def decode(lengths: np.ndarray, span: int | None = None) -> np.ndarray:
            mask[rows, lengths] = 1  # the new token's row: GroupQueryAttention writes it at the row's length
            if inputs.positions is not None:
                inputs.set_positions(lengths)
            if span is None or span >= slots or not partial:
                run()
            else:
                self._leading(span)[1]()
            return logits
        return decode

    def decode_steps(self, lengths: np.ndarray, count: int):
        """Up to `count` decodes from `lengths` on; see `BaseCache.decode_steps`. The mask entries
        of all steps are indexed up front, so a step is one numpy write and the run: on the
        tiny models a step's Python work is a tenth of the step, and every microsecond shows."""
        if self.inputs.positions is not None:
            yield from BaseCache.decode_steps(self, lengths, count)
            return
        width = self.mask.shape[1]
        where = (self.rows * width + lengths)[None, :] + np.arange(count)[:, None]
        set_mask, run, logits = self.mask.reshape(-1).__setitem__, self.binding.run, self.logits
        for entries in where:
            set_mask(entries, 1)
            run()
            yield logits


def _mapped(shape, dtype) -> np.ndarray:
    """Zeros whose pages are mapped now. np.zeros maps a large array's pages lazily, and a prompt's
    run reaches its rows' buffers over the whole capacity: the first 8-row prompt of SmolLM2-135M
    at capacity 4096 took 2.3 s in page faults (0.08 s after), a first token seconds late."""
    out = np.empty(shape, dtype)
    out.fill(0)
    return out
