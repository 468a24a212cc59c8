"""The adapter place of each slot of a cache, and the LoRA inputs of the cache's runs.

A model loaded with LoRA (runtime.lora) runs every decoder run with its rows' places in the
adapter bank. The in_place and append caches keep a `LoraRows` as `cache.lora` (None for a model
without adapters): the decode runs bind the places' inputs (`bind`, again only when a row's place
changed), and a prompt run into slots feeds those slots' (`feeds`)."""

from __future__ import annotations

import numpy as np


class LoraRows:
    """`places[slot]`: the bank place of the row in `slot` (0: no adapter)."""

    def __init__(self, adapters, slots: int):
        self.adapters, self.bank = adapters, adapters.bank
        self.places = np.zeros(slots, np.int64)
        self.version = 0

    def set(self, slots, places) -> None:
        self.places[np.asarray(slots, np.int64)] = places
        self.version += 1

    def copy(self, dst, src) -> None:
        self.places[np.asarray(dst, np.int64)] = self.places[np.asarray(src, np.int64)]
        self.version += 1

    def busy(self) -> set[int]:
        return set(self.places[self.places > 0].tolist())

    def feeds(self, places) -> dict[str, np.ndarray]:
        return self.bank.feeds(np.asarray(places, np.int64))

    def bind(self, binding, rows: int) -> None:
        """The inputs of a decode run over slots [0, rows) on `binding`, bound again only where a
        place changed since this binding last ran."""
        key = (rows, self.version)
        if getattr(binding, "lora_key", None) != key:
            for name, array in self.feeds(self.places[:rows]).items():
                binding.input(name, array)
            binding.lora_key = key


def lora_rows(model, slots: int) -> LoraRows | None:
    return None if getattr(model, "lora", None) is None else LoraRows(model.lora, slots)
