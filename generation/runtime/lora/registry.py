"""A model's adapters: which are known (by name), which sit in the bank (at a place), and which go
when a new one needs a place: the least recently used one that no running row uses (vLLM's
`--max-loras` LRU)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .adapter import Adapter, AdapterError, read_adapter
from .bank import LoraBank

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraSpec:
    """What `generation.load` builds LoRA for: `max_loras` adapters resident at once, each of rank
    up to `max_lora_rank`, and the adapters known from the start (name -> folder)."""

    max_loras: int = 4
    max_lora_rank: int = 16
    modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1024:
                raise ValueError(f"{name} must be an integer in 1..1024, not {value!r}")
        names = [n for n, _ in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names an adapter twice: {sorted(n for n in names if names.count(n) > 1)}")


@dataclass
class Adapters:
    """The known adapters (`known`: name -> the folder or hub id it was given; `folders`: name -> the
    local folder that was read, a hub id's download) and the bank's places (`places`: name -> place)."""

    bank: LoraBank
    known: dict[str, Path] = field(default_factory=dict)
    folders: dict[str, Path] = field(default_factory=dict)
    places: dict[str, int] = field(default_factory=dict)
    used: dict[str, int] = field(default_factory=dict)  # name -> the tick of its last use
    loads: int = 0
    evictions: int = 0
    _tick: int = 0
    # add / remove come from a server's threads, place from the batching loop's
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, path) -> Adapter:
        """Know adapter `name` at `path`, read and checked now (AdapterError naming what is wrong);
        it takes a place at its first use (`place`). A name known already is refused: unload it
        first (its rows may be running)."""
        if not isinstance(name, str) or not name:
            raise AdapterError(f"lora_name must be a non-empty string, not {name!r}")
        if name in self.known:
            raise AdapterError(f"lora_name {name!r} is loaded already (unload it first)")
        adapter = read_adapter(name, path)
        self.bank.check(adapter)
        with self._lock:
            self.known[name], self.folders[name] = Path(path), adapter.path
        return adapter

    def remove(self, name: str) -> None:
        """Forget adapter `name` (KeyError where it is not known). Rows running with it finish
        with it: its place is taken again only once no row sits at it (`place`'s `busy`)."""
        with self._lock:
            if name not in self.known:
                raise KeyError(name)
            self.places.pop(name, None)
            del self.known[name], self.folders[name]
            self.used.pop(name, None)

    def place(self, name: str, busy: set[int] = frozenset()) -> int:
        """The bank place of adapter `name`, loaded now if it has none: into a free place, or the
        least recently used one no running row uses (`busy`: the places rows sit at). KeyError for
        an unknown name; AdapterError where every place is busy."""
        with self._lock:
            return self._place(name, busy)

    def _place(self, name: str, busy: set[int]) -> int:
        if name not in self.known:
            raise KeyError(name)
        self._tick += 1
        self.used[name] = self._tick
        if name in self.places:
            return self.places[name]
        taken = set(self.places.values())
        free = [p for p in range(1, self.bank.places + 1) if p not in taken and p not in busy]
        if not free:
            idle = [n for n, p in self.places.items() if p not in busy]
            if not idle:
                raise AdapterError(f"every one of the {self.bank.places} adapter places (max_loras) is in use by "
                                   "running requests")
            victim = min(idle, key=lambda n: self.used.get(n, 0))
            free = [self.places.pop(victim)]
            self.evictions += 1
            log.info("adapter %r leaves place %d for %r", victim, free[0], name)
        # the folder read at `add` (a hub id is not fetched again on the loop's thread)
        self.bank.load(read_adapter(name, self.folders[name]), free[0])
        self.places[name] = free[0]
        self.loads += 1
        return free[0]


def adapters_for(path: Path, config: dict, spec: LoraSpec, graph) -> Adapters:
    """The adapters of a decoder loaded with `spec` (runtime.lora.registry.LoraSpec): its bank over
    the projections its graph takes LoRA inputs for, its modules read and checked (AdapterError
    naming what is wrong)."""
    import numpy as np

    from .projections import from_inputs

    projections = from_inputs(graph.lora_inputs, config)
    dtype = graph.input_dtypes.get(f"lora.{projections[0].key}.a", np.float32)
    adapters = Adapters(LoraBank(projections, spec.max_loras, spec.max_lora_rank, dtype))
    for name, folder in spec.modules:
        adapters.add(name, folder)
    log.info("%s: LoRA on %d projections, %d places of rank %d (%.1f MB), adapters %s", path.name, len(projections),
             spec.max_loras, spec.max_lora_rank, adapters.bank.nbytes / 1e6, sorted(adapters.known) or "none yet")
    return adapters
