"""Per-row random numbers that depend only on (seed, draw index).

A row's sampled tokens must not depend on the other rows, the batch size or the row's slot. A
counter-based generator gives that for free: the n-th uniform of a row is a hash of its seed and
n, computed for the whole batch at once, and the random state of a row is just its draw count.
The hash is SplitMix64 (Steele, Lea, Flood 2014), applied twice.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def uniforms(seeds: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """Uniform floats in (0, 1), one per row: a pure function of (seeds[i], draws[i]).

    seeds, draws: [B] uint64. Never returns 0 or 1, so inverse-CDF sampling never picks a token
    of probability 0.
    """
    seeds = np.asarray(seeds, dtype=np.uint64)
    draws = np.asarray(draws, dtype=np.uint64)
    with np.errstate(over="ignore"):
        bits = _splitmix64(_splitmix64(seeds) + draws * _GOLDEN)
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / 2**53)


def derived_seed(seed: int, index: int) -> int:
    """The `index`-th seed derived from `seed` (index 0: the seed itself), for a request that
    samples several independent runs (Whisper's windows) from one seed."""
    if index == 0:
        return int(seed)
    with np.errstate(over="ignore"):
        return int(_splitmix64(_splitmix64(np.uint64(seed)) ^ _splitmix64(np.uint64(index))))


def derived_seeds(seeds: np.ndarray, index: int) -> np.ndarray:
    """`derived_seed` over an array of seeds [B] uint64 (index >= 1): independent streams of
    the same rows, e.g. speculative sampling's acceptance draws beside the rows' own."""
    with np.errstate(over="ignore"):
        return _splitmix64(_splitmix64(np.asarray(seeds, np.uint64)) ^ _splitmix64(np.uint64(index)))
