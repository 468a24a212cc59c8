"""What each decoder family the rewrite knows computes beyond Llama, read from config.json.

Every family here is Llama's block (pre-norm RMSNorm, rotary attention, a gated MLP) with some
of these differences, each of which the fused graph expresses (emit.py) as onnxruntime-genai's
builder does for the same family:

    mistral, qwen2  a sliding window on some layers: GroupQueryAttention's local_window_size
                    (counted from each row's own length, so rows of mixed lengths keep theirs)
    qwen3           an RMSNorm per head on q and k, before the rotary embedding
    granite         embedding, residual, attention and logits multipliers (folded into weights
                    and GroupQueryAttention's scale)
    phi3            q|k|v and gate|up packed into one projection each (split when read), a
                    window on every layer, partial rotary dimensions
    gemma           the embedding scaled by sqrt(hidden), (1 + w) norms (the exporters fold the
                    1 into the weight), a gelu gate (tanh or erf, as `hidden_act` says)

Families that are not rewritten are named with the reason (NOT_REWRITTEN: what their block adds
that is not emitted; an attribute GroupQueryAttention's kernel refuses surfaces as the probe's
"onnxruntime cannot run the fused graph").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .weights import FusionError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "granite", "phi3", "gemma")

#: families near these that the rewrite does not take, and what their block adds that it does not emit
NOT_REWRITTEN = {
    "gemma2": "its attention and final logits are soft-capped and its layers are sandwiched between four norms "
              "(not rewritten)",
    "gemma3_text": "its layers are sandwiched between four norms with per-head q/k norms and two rotary bases "
                   "(local and global layers; not rewritten)",
    "olmo2": "its q/k norms span all heads together and its norms follow attention and the MLP (not rewritten)",
    "phimoe": "a mixture of experts is not rewritten",
    "gpt_oss": "a mixture of experts with attention sinks is not rewritten",
}

_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _activation(config: dict) -> str:
    """The MLP's activation as transformers 4.57 reads it: `hidden_act` (Gemma's
    `hidden_activation` is not read)."""
    return config.get("hidden_act") or ("gelu_pytorch_tanh" if config.get("model_type") == "gemma" else "silu")


@dataclass(frozen=True)
class Family:
    """A family's block as the rewrite reads and emits it.

    linears / norms: a layer's projections and norm weights in the order the model calls them
    (`qkv` and `gate_up`: packed, split when read). The scales multiply: embedding rows, the
    attention scores (GroupQueryAttention's `scale`), each block's output before the residual
    add, the logits. windows: each layer's local_window_size (-1: the whole context)."""

    name: str
    linears: tuple[str, ...]
    norms: tuple[str, ...]
    activation: str
    embed_scale: float
    attention_scale: float
    residual_scale: float
    logits_scale: float
    windows: tuple[int, ...]


def check(config: dict) -> None:
    """Raise FusionError naming what in `config` is not rewritten (the family, its activation,
    its biases); the rest is read when the graph is built."""
    kind = config.get("model_type")
    if kind in NOT_REWRITTEN:
        raise FusionError(f"model_type '{kind}': {NOT_REWRITTEN[kind]}")
    if kind not in FAMILIES:
        raise FusionError(f"model_type '{kind}' is not one of {', '.join(FAMILIES)}")
    act, allowed = _activation(config), ("silu", "gelu_pytorch_tanh", "gelu") if kind == "gemma" else ("silu",)
    if act not in allowed:
        raise FusionError(f"hidden_act '{act}' is not {' or '.join(allowed)}")
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field) and kind != "qwen2":
            raise FusionError(f"{field} is true: biases outside qwen2's q/k/v are not rewritten")


def family(config: dict) -> Family:
    """The Family of `config`, or FusionError naming what is not rewritten."""
    check(config)
    kind = config.get("model_type")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    granite = kind == "granite"
    return Family(
        name=kind,
        linears=("qkv", "o", "gate_up", "down") if kind == "phi3" else ("q", "k", "v", "o", "gate", "up", "down"),
        norms=("input_norm", "q_norm", "k_norm", "post_norm") if kind == "qwen3" else ("input_norm", "post_norm"),
        activation=_ACTIVATIONS[_activation(config)],
        embed_scale=float(config.get("embedding_multiplier", 1.0)) if granite else
        math.sqrt(hidden) if kind == "gemma" else 1.0,
        attention_scale=float(config.get("attention_multiplier", 1.0)) if granite else 1.0 / math.sqrt(head_dim),
        residual_scale=float(config.get("residual_multiplier", 1.0)) if granite else 1.0,
        logits_scale=1.0 / float(config.get("logits_scaling", 1.0)) if granite else 1.0,
        windows=layer_windows(config))


def layer_windows(config: dict) -> tuple[int, ...]:
    """Each layer's sliding window as transformers 4.57 reads config.json (-1: none): Mistral's
    and Phi-3's `sliding_window` on every layer; Qwen2 / Qwen3's, where `use_sliding_window`, on
    the layers `layer_types` names 'sliding_attention' (without layer_types: from
    `max_window_layers` on); a window the context cannot cross is none."""
    layers = int(config["num_hidden_layers"])
    window = config.get("sliding_window")
    if not isinstance(window, int) or window <= 0 or window >= int(config.get("max_position_embeddings") or 1 << 62):
        return (-1,) * layers
    kind = config.get("model_type")
    if kind in ("mistral", "phi3"):
        return (window,) * layers
    if kind in ("qwen2", "qwen3") and config.get("use_sliding_window"):
        types = config.get("layer_types")
        if isinstance(types, list) and len(types) == layers:
            return tuple(window if t == "sliding_attention" else -1 for t in types)
        first = int(config.get("max_window_layers") or 0)
        return tuple(window if i >= first else -1 for i in range(layers))
    return (-1,) * layers  # llama, granite and gemma read no window
