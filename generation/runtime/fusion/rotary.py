"""The rotary tables GroupQueryAttention takes, as transformers 4.57 computes cos and sin.

`rope_tables` gives each rope type's cos and sin over positions (default, linear, llama3 and yarn;
the others refused by name); `gqa_rotary` pads a partial rotary width the operator cannot rotate as
it is, and gives the order of each head's q and k dimensions that makes its rotation transformers';
`_reordered` lays the q / k projections out in that order.
"""

from __future__ import annotations

import math

import numpy as np

from .weights import DecoderWeights, FusionError, Linear


def rope_tables(config: dict, head_dim: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, rotary_dim / 2] of transformers 4.57's rotary embedding (the default,
    linear, llama3 and yarn rope types; float32 throughout, as its forward computes them; yarn's
    attention factor scales both tables, as transformers scales cos and sin). rotary_dim is
    head_dim * partial_rotary_factor: GroupQueryAttention rotates that many leading dimensions of
    each head, as Phi-3's apply_rotary_pos_emb does."""
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    dim = int(head_dim * float(config.get("partial_rotary_factor") or 1.0))
    if dim % 2 or dim <= 0:
        raise FusionError(f"partial_rotary_factor {config['partial_rotary_factor']} leaves {dim} rotary dimensions: "
                          "not rewritten (an even count is)")
    base = float(config.get("rope_theta", 10000.0))
    inv_freq = (1.0 / _base_powers(base, dim)).astype(np.float32)
    if kind == "linear":
        inv_freq = (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    elif kind == "llama3":
        factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    elif kind == "yarn":
        inv_freq, factor = _yarn(scaling, dim, base, int(config.get("max_position_embeddings") or 4096))
        freqs = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :]
        scale = np.float32(factor)
        return (np.cos(freqs) * scale).astype(np.float32), (np.sin(freqs) * scale).astype(np.float32)
    elif kind == "longrope":  # its factors switch for the whole sequence once it passes the original length
        raise FusionError("rope_scaling of type 'longrope' is not rewritten: transformers switches every "
                          "position's frequencies once a sequence passes original_max_position_embeddings, "
                          "which one table of positions cannot hold")
    elif kind != "default":
        raise FusionError(f"rope_scaling of type '{kind}' is not rewritten (default, linear, llama3 and yarn are)")
    freqs = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


def _base_powers(base: float, dim: int) -> np.ndarray:
    """base ** (2i / dim) for i < dim / 2 in float32, as torch's pow gives it: the float32 exponents
    raised in float64 and rounded once (numpy's float32 power is an ulp off it at a few of them)."""
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float64(base) ** exponents.astype(np.float64)).astype(np.float32)


def _yarn(scaling: dict, dim: int, base: float, max_positions: int) -> tuple[np.ndarray, float]:
    """inv_freq [dim / 2] and the attention factor of transformers 4.57's _compute_yarn_parameters:
    each frequency blended between itself and itself / factor by a ramp over the dimensions whose
    rotations within original_max_position_embeddings fall between beta_slow and beta_fast."""
    factor = float(scaling["factor"])
    original = scaling.get("original_max_position_embeddings") or max_positions

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        both = scaling.get("mscale") and scaling.get("mscale_all_dim")
        attention = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]) if both else \
            mscale(factor)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(fast), correction(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    powers = _base_powers(base, dim)
    extrapolation = (np.float32(1.0) / powers).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(factor) * powers)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    kept = (np.float32(1) - ramp).astype(np.float32)
    return (interpolation * (np.float32(1) - kept) + extrapolation * kept).astype(np.float32), float(attention)


def gqa_rotary(cos: np.ndarray, sin: np.ndarray, head_dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The tables GroupQueryAttention takes for transformers' `cos`, `sin` [positions, r], and the
    order of each head's q and k dimensions that makes its rotation transformers' (None: as they are).

    transformers rotates a head's first 2r dimensions, pairing dimension j with j + r (its
    rotate_half); GroupQueryAttention pairs j with j + T for tables of T columns, T a multiple of 8.
    Where r is not, the tables get T - r more columns of cos 1 and sin 0 (pairs left as they are),
    and each head's dimensions are laid out so that transformers' pairs meet: [0, r) stay, [r, 2r)
    move to [T, T + r), the dimensions past 2r fill the rest in order. q and k (their projections'
    columns) take the same order, so every score q . k sums the same products.

    Example: head_dim 16, 2r = 8 rotary (r = 4, T = 8); the new place of each dimension:
        dimension  0 1 2 3 | 4 5 6 7    | 8 9 10 11 | 12 13 14 15
        place      0 1 2 3 | 8 9 10 11  | 4 5 6 7   | 12 13 14 15
    so GroupQueryAttention's pair (1, 9) is transformers' (1, 5), and (5, 13) two dimensions it
    leaves alone (8 and 12 here: cos 1, sin 0)."""
    r = cos.shape[1]
    if r % 8 == 0:
        return cos, sin, None
    t = -(-r // 8) * 8
    if 2 * t > head_dim:
        raise FusionError(f"{2 * r} rotary dimensions of {head_dim}: GroupQueryAttention rotates a multiple of 16, "
                          f"and {2 * t} do not fit a head")
    rows = len(cos)
    cos = np.concatenate([cos, np.ones((rows, t - r), np.float32)], axis=1)
    sin = np.concatenate([sin, np.zeros((rows, t - r), np.float32)], axis=1)
    rest = list(range(2 * r, head_dim))
    order = list(range(r)) + rest[:t - r] + list(range(r, 2 * r)) + rest[t - r:]
    return cos, sin, np.array(order, np.int64)


def _reordered(weights: DecoderWeights, order: np.ndarray, heads: int, kv_heads: int) -> DecoderWeights:
    """`weights` with each head's q and k dimensions in `order` (gqa_rotary): the q / k projections'
    columns and biases, and their norms' weights."""
    from dataclasses import replace

    head_dim = len(order)

    def columns(count: int) -> np.ndarray:
        return (np.arange(count)[:, None] * head_dim + order[None, :]).ravel()

    def linear(x: Linear, count: int, name: str) -> Linear:
        if x.quantized:
            raise FusionError(f"a quantized {name}_proj with partial rotary dimensions GroupQueryAttention cannot "
                              "rotate as they are: not rewritten")
        index = columns(count)
        return Linear(np.ascontiguousarray(x.weight[:, index]), None if x.bias is None else x.bias[index], x.shape)

    def norm(w: np.ndarray | None, count: int) -> np.ndarray | None:
        return None if w is None else w[order] if len(w) == head_dim else w[columns(count)]

    layers = [replace(layer, q=linear(layer.q, heads, "q"), k=linear(layer.k, kv_heads, "k"),
                      q_norm=norm(layer.q_norm, heads), k_norm=norm(layer.k_norm, kv_heads))
              for layer in weights.layers]
    return replace(weights, layers=layers)
