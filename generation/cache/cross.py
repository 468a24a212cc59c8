"""An encoder-decoder decoder's first step and its cache: the prompt run with no cache computes
the cross-attention cache (`present.N.encoder.*`), which later steps feed back unchanged;
Seq2SeqCache holds it beside the decoder cache, in groups of rows of one decoder length."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from ..runtime.device import Ledger
from ..runtime.encoders import EncoderOutputs
from ..runtime.graph import ORT_TYPES, DecoderGraph
from .base import BaseCache, moves_by_group
from .prefix import checked_budget


def _pad_sources(rows: list[np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray]:
    """rows of [S_b, ...] into [n, width, ...] (zeros after each row) and the mask [n, width]."""
    out = np.zeros((len(rows), width) + rows[0].shape[1:], rows[0].dtype)
    mask = np.zeros((len(rows), width), np.int64)
    for i, row in enumerate(rows):
        out[i, :len(row)], mask[i, :len(row)] = row, 1
    return out, mask


def _feeds(inputs: dict, ids: np.ndarray, hidden: np.ndarray, mask: np.ndarray, use_cache: bool) -> dict:
    """The per-step inputs a decoder session takes, of those an encoder-decoder step has
    (`inputs`: the session's input names -> dtypes)."""
    feeds = {"input_ids": ids, "encoder_hidden_states": hidden, "encoder_attention_mask": mask,
             "use_cache_branch": np.array([use_cache])}
    return {name: value.astype(inputs[name], copy=False) for name, value in feeds.items() if name in inputs}


def session_inputs(session) -> dict:
    """A session's input names -> numpy dtypes."""
    return {i.name: ORT_TYPES.get(i.type) or np.float32 for i in session.get_inputs()}


def run_first_steps(model, prompts: list[list[int]], encoder: EncoderOutputs):
    """The decoder's first step for each row: its prompt with no cache. Returns (last logits
    [n, V], rows: per row {cache name: [heads, length, dim]} with the decoder cache, the cross
    cache and the row's encoder hidden states under "encoder_hidden_states")."""
    graph, n = model.graph, len(prompts)
    if len(encoder) != n:
        raise ValueError(f"encoder outputs have {len(encoder)} rows for {n} prompts")
    last = np.zeros((n, graph.vocab_size), np.float32)
    rows: list[dict] = [{} for _ in range(n)]
    lengths = np.array([len(p) for p in prompts])
    for length in np.unique(lengths):  # positions come from the cache length: one run per prompt length
        group = np.flatnonzero(lengths == length)
        sources = [encoder.hidden[b] for b in group]
        hidden, mask = _pad_sources(sources, max(len(s) for s in sources))
        ids = np.array([prompts[b] for b in group], np.int64)
        session = model.first_step_session or model.session
        feeds = _feeds(session_inputs(session), ids, hidden, mask, use_cache=False)
        if model.first_step_session is None:  # the merged decoder takes (unused) empty pasts
            for e in graph.cache + graph.cross_cache:
                feeds[e.past] = np.zeros((len(group), e.heads, 0, e.head_dim), graph.cache_dtype)
        wanted = ["logits"] + [e.present for e in graph.cache + graph.cross_cache]
        logits, *presents = session.run(wanted, feeds)
        for j, b in enumerate(group):
            last[b] = logits[j, -1]
            row = {e.past: presents[k][j] for k, e in enumerate(graph.cache)}
            source = len(sources[j])
            row.update({e.past: presents[len(graph.cache) + k][j, :, :source] for k, e in enumerate(graph.cross_cache)})
            row["encoder_hidden_states"] = sources[j]
            rows[b] = row
    return last, rows


class Seq2SeqCache(BaseCache):
    """The decoder cache of an encoder-decoder model, in groups of rows of one decoder length
    (as the grow mode): each group holds its decoder cache, its cross cache and encoder hidden
    states padded to the group's longest source, and the source mask. The cross cache never
    changes after the first step."""

    mode = "seq2seq"

    def __init__(self, session, graph: DecoderGraph, slots: int, capacity: int, max_position: int,
                 ledger: Ledger | None = None):
        self.ledger = ledger if ledger is not None else Ledger()
        self.session, self.graph, self.capacity = session, graph, capacity
        self.token_input = np.zeros(slots, np.int64)
        self.inputs = session_inputs(session)
        self.groups: list[dict] = []  # {"slots", "length", "past", "cross", "hidden", "mask"}
        self._names = ["logits"] + [e.present for e in graph.cache]

    def insert(self, slot: int, cache: dict[str, np.ndarray], length: int) -> None:
        """A row's first step, run apart (its decoder and cross cache and its source cross to a
        device once: `insert`)."""
        self.ledger.add("insert", sum(np.asarray(a).nbytes for a in cache.values()))
        row = {"past": {e.past: cache[e.past][None] for e in self.graph.cache},
               "cross": {e.past: cache[e.past] for e in self.graph.cross_cache},
               "hidden": cache["encoder_hidden_states"]}
        for group in self.groups:
            if group["length"] == length:
                self._join(group, [slot], [row])
                return
        self.groups.append(self._group([slot], [row], length))

    def _group(self, slots: list[int], rows: list[dict], length: int) -> dict:
        width = max(len(r["hidden"]) for r in rows)
        hidden, mask = _pad_sources([r["hidden"] for r in rows], width)
        cross = {name: np.stack([np.pad(r["cross"][name], ((0, 0), (0, width - r["cross"][name].shape[1]), (0, 0)))
                                 for r in rows]) for name in rows[0]["cross"]}
        past = {name: np.concatenate([r["past"][name] for r in rows]) for name in rows[0]["past"]}
        return {"slots": list(slots), "length": length, "past": past, "cross": cross, "hidden": hidden, "mask": mask}

    def _rows_of(self, group: dict) -> list[dict]:
        return [{"past": {k: v[i:i + 1] for k, v in group["past"].items()},
                 "cross": {k: v[i][:, :int(group["mask"][i].sum())] for k, v in group["cross"].items()},
                 "hidden": group["hidden"][i, :int(group["mask"][i].sum())]} for i in range(len(group["slots"]))]

    def _join(self, group: dict, slots: list[int], rows: list[dict]) -> None:
        group.update(self._group(group["slots"] + slots, self._rows_of(group) + rows, group["length"]))

    def release(self, slot: int) -> None:
        for group in self.groups:
            if slot in group["slots"]:
                group["slots"][group["slots"].index(slot)] = -1
        self.groups = [g for g in self.groups if any(s >= 0 for s in g["slots"])]

    def copy_rows(self, dst, src, length: int, shared_cross: bool = False) -> None:
        """Rows dst take src's decoder cache; a row new to the group also takes its cross cache and
        source (with `shared_cross`, rows already in the group keep theirs: a prompt's beams share
        one source, so its cross cache never moves)."""
        def join(group, joining):
            where = {slot: i for i, slot in enumerate(group["slots"]) if slot >= 0}
            rows = self._rows_of(group)
            self._join(group, [d for d, _ in joining], [rows[where[s]] for _, s in joining])

        for group, into, take in moves_by_group(self.groups, dst, src, join):
            for array in group["past"].values():
                array[into] = array[take]
            if not shared_cross:
                for array in list(group["cross"].values()) + [group["hidden"], group["mask"]]:
                    array[into] = array[take]

    def _count(self, feeds: dict, rows: int) -> None:
        """A step's crossing, were the groups on a device (cross_device.py): its ids and
        use_cache_branch in (the source and its mask stay there), its logits out."""
        self.ledger.add("inputs", sum(a.nbytes for k, a in feeds.items()
                                      if k not in ("encoder_hidden_states", "encoder_attention_mask")))
        self.ledger.add("logits", rows * self.graph.vocab_size * np.dtype(self.graph.logits_dtype).itemsize)
        self.ledger.step(rows)

    def _step_group(self, group: dict, ids: np.ndarray) -> tuple[np.ndarray, list]:
        """A decode step of the group's rows: (logits [n, 1, V], the presents of the decoder cache)."""
        feeds = _feeds(self.inputs, ids, group["hidden"], group["mask"], use_cache=True)
        self._count(feeds, len(ids))
        feeds.update(group["past"])
        feeds.update(group["cross"])
        out, *presents = self.session.run(self._names, feeds)
        return out, presents

    def decode(self, lengths: np.ndarray, span: int | None = None) -> np.ndarray:
        logits = np.zeros((len(lengths), self.graph.vocab_size), np.float32)
        for group in self.groups:
            slots = np.array(group["slots"])
            live = slots >= 0
            if group["length"] + 1 > self.capacity:
                raise ValueError(f"a row needs {group['length'] + 1} cache rows; this state holds {self.capacity}")
            ids = np.where(live, self.token_input[np.maximum(slots, 0)], 0).reshape(-1, 1)
            out, presents = self._step_group(group, ids)
            group["past"] = {e.past: p for e, p in zip(self.graph.cache, presents)}
            group["length"] += 1
            logits[slots[live]] = out[live, 0]
        return logits


class FirstStepStore:
    """An encoder-decoder's prefix cache: each row's first decoder step (its decoder cache, its
    cross cache, its encoder hidden states, its last logits) by a hash of the row's encoder hidden
    states and decoder prompt, least recently used out first, within `max_bytes`. A repeated
    source (the Encoder deployment's cache hands the same hidden states back) skips its first
    step; later steps depend on the tokens chosen, and run. `queries` and `hits` count decoder
    prompt tokens looked up and found, as PrefixStore's."""

    def __init__(self, max_bytes: int):
        self.max_bytes = checked_budget(max_bytes)
        self.entries: OrderedDict[bytes, tuple[dict, np.ndarray, int]] = OrderedDict()
        self.bytes = self.queries = self.hits = 0

    @staticmethod
    def key(hidden: np.ndarray, prompt: list[int]) -> bytes:
        digest = hashlib.blake2b(np.ascontiguousarray(hidden).tobytes(), digest_size=16)
        digest.update(repr((hidden.shape, str(hidden.dtype), [int(t) for t in prompt])).encode())
        return digest.digest()

    def lookup(self, key: bytes, length: int):
        """(row, last logits) of `key`, or None."""
        self.queries += length
        found = self.entries.get(key)
        if found is None:
            return None
        self.entries.move_to_end(key)
        self.hits += length
        return found[0], found[1]

    def store(self, key: bytes, row: dict, last: np.ndarray) -> None:
        if key in self.entries or self.max_bytes == 0:
            return
        kept = {name: np.array(array) for name, array in row.items()}
        nbytes = sum(a.nbytes for a in kept.values()) + last.nbytes
        if nbytes > self.max_bytes:
            return
        self.entries[key] = (kept, np.array(last), nbytes)
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            _, (_, _, gone) = self.entries.popitem(last=False)
            self.bytes -= gone
