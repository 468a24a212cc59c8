"""Prefix caching: the KV rows of prompts a decode state has run, and of the tokens its rows
decoded after them (core/keep.py: a conversation's next turn starts with this turn's
prompt and answer), kept by token blocks, so a new prompt that starts the same way copies them
and runs only the rest.

A prompt's full blocks of `block` tokens are named by a hash chain (each block's hash covers the
blocks before it, as vLLM's block hashes), so a prefix is found whatever follows it. An entry
holds the rows [heads, length, head_dim] of every cache input for one prompt's full blocks, and
every block hash of it points into it: a prompt that shares 3 blocks of a 10-block entry takes
its first 3. At least one token of a prompt always runs (its logits choose the first new token),
so a prompt found whole reuses all but its last block. Entries are evicted least recently used
first, within `max_bytes`. An entry that a new one holds whole (a prompt's, once its row's answer
is kept) leaves for it.

The rows are those a prompt's own run computed, so a prompt with a cached prefix runs its rest
from them as the prefill runs a prompt in pieces (`prompt_steps="pieces"`): the same tokens. A
decoded block's rows are those the decode steps computed, one token a run: equal to a prompt
run's up to float rounding (as a prompt run in one piece and in pieces already differ).
Decoder-only prompts; a vision-language prompt is named by its images too (PromptImages.prefix_key).
An encoder-decoder keeps its rows' first steps instead (cache/cross.py, FirstStepStore).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

BLOCK = 16


def checked_budget(max_bytes) -> int:
    """A prefix store's byte budget, checked (this store's and cross.FirstStepStore's)."""
    if not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"prefix cache bytes must be an integer >= 0, not {max_bytes!r}")
    return max_bytes


@dataclass
class Entry:
    rows: dict[str, np.ndarray]  # cache input name -> [heads, length, head_dim]
    length: int
    hashes: list[bytes]
    nbytes: int


class PrefixStore:
    """The cached prefixes of one decode state's prompts (see the module docstring); `queries`
    and `hits` count prompt tokens looked up and found (vLLM's prefix cache counters)."""

    def __init__(self, max_bytes: int, block: int = BLOCK):
        self.max_bytes, self.block = checked_budget(max_bytes), block
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()
        self.index: dict[bytes, tuple[bytes, int]] = {}  # block hash -> (entry key, blocks of the entry it ends)
        self.bytes = self.queries = self.hits = 0

    def hashes(self, prompt) -> list[bytes]:
        """The hash chain of `prompt`'s full blocks."""
        out, previous = [], b""
        ids = np.asarray(prompt, np.int64)
        for start in range(0, len(ids) - len(ids) % self.block, self.block):
            previous = hashlib.blake2b(previous + ids[start:start + self.block].tobytes(), digest_size=16).digest()
            out.append(previous)
        return out

    def lookup(self, prompt) -> tuple[int, dict[str, np.ndarray] | None]:
        """(length, rows) of the longest cached prefix of `prompt` that leaves at least one of
        its tokens to run; (0, None) when none is."""
        self.queries += len(prompt)
        length, rows = self._longest(prompt[:(len(prompt) - 1) // self.block * self.block])
        self.hits += length
        return length, rows

    def held(self, tokens) -> tuple[int, dict[str, np.ndarray] | None]:
        """(length, rows) of the longest cached prefix of `tokens`, all of it if held (the store's
        own upkeep: not counted as a query)."""
        return self._longest(tokens[:len(tokens) // self.block * self.block])

    def _longest(self, tokens) -> tuple[int, dict[str, np.ndarray] | None]:
        chain = self.hashes(tokens)
        for blocks in range(len(chain), 0, -1):
            found = self.index.get(chain[blocks - 1])
            if found is None:
                continue
            key, _ = found
            entry = self.entries[key]
            self.entries.move_to_end(key)
            length = blocks * self.block
            return length, {name: rows[:, :length] for name, rows in entry.rows.items()}
        return 0, None

    def store(self, prompt, rows: dict[str, np.ndarray]) -> None:
        """Keep the rows of `prompt`'s full blocks (`rows`: its cache, [heads, >= length, dim]
        per input), unless an entry already holds them all or they exceed the budget."""
        blocks = len(prompt) // self.block
        if not blocks or self.max_bytes == 0:
            return
        chain = self.hashes(prompt[:blocks * self.block])
        key = chain[-1]
        if key in self.index:  # an entry holds this whole prefix already
            self.entries.move_to_end(self.index[key][0])
            return
        length = blocks * self.block
        kept = {name: np.array(array[:, :length]) for name, array in rows.items() if name != "position_delta"}
        nbytes = sum(a.nbytes for a in kept.values())
        if nbytes > self.max_bytes:
            return
        for covered in [h for h in chain[:-1] if h in self.entries]:  # an entry this one holds whole
            self._evict(covered)
        self.entries[key] = Entry(kept, length, chain, nbytes)
        self.bytes += nbytes
        for i, h in enumerate(chain):
            self.index.setdefault(h, (key, i + 1))
        while self.bytes > self.max_bytes:
            self._evict(next(iter(self.entries)))

    def shrink(self, max_bytes: int) -> None:
        """Keep at most `max_bytes` (the least recently used entries leave first): what the
        running rows leave of a budget the store shares with them (engine/budget.py)."""
        while self.bytes > max(0, max_bytes) and self.entries:
            self._evict(next(iter(self.entries)))

    def _evict(self, key: bytes) -> None:
        entry = self.entries.pop(key)
        self.bytes -= entry.nbytes
        for h in entry.hashes:
            if self.index.get(h, (None,))[0] == key:
                del self.index[h]
                for other_key, other in self.entries.items():  # another entry may hold this block too
                    if h in other.hashes:
                        self.index[h] = (other_key, other.hashes.index(h) + 1)
                        break
