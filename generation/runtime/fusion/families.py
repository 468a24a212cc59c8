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
    gemma2          gemma's, read from `hidden_activation`, and four norms per layer (each block's
                    output normed before its residual add), scores scaled by
                    query_pre_attn_scalar ** -0.5 and soft-capped (GroupQueryAttention's
                    `softcap`) where the source caps them (transformers 4.57 does in its eager
                    attention only: an export traced with sdpa, Optimum's default, does not),
                    soft-capped logits, windows on the layers `layer_types` names
    gemma3_text     gemma2's but the scores' soft-capping (transformers 4.57 does not apply it),
                    with per-head (1 + w) q/k norms, and a rotary table per kind of layer: the
                    local layers' `rope_local_base_freq` without scaling, the global layers'
                    `rope_theta` with `rope_scaling`
    smollm3         no rotary embedding on the layers `no_rope_layers` marks 0 (GroupQueryAttention
                    with do_rotary=0), windows on the layers `layer_types` names
    olmo            LayerNorm without weights (LayerNormalization over the ones and zeros the
                    export writes, as the genai builder does), q, k and v clipped to +-clip_qkv
                    where it is set
    olmo2           no norm before attention or the MLP: an RMSNorm of each block's output before
                    its residual add, and RMSNorms of q and k over all heads together
    nemotron        LayerNorm with a bias and (1 + w) weights (the exporters fold the 1 in), an MLP
                    without a gate (up, relu squared, down), partial rotary dimensions
    phi             attention and the MLP side by side on one LayerNorm's output, both added to the
                    residual; biases on every projection and on the LM head, a gelu-tanh MLP
                    without a gate, partial rotary dimensions
    gpt_oss         biases on q, k, v and o, a learned sink per head in each softmax's denominator
                    (GroupQueryAttention's head_sink), windows on the layers `layer_types` names
                    (without it: the even layers), YaRN rotary tables (rope_tables), and a mixture of
                    experts for the MLP: a biased router whose top `num_experts_per_tok` logits are
                    softmaxed into the chosen experts' weights, each expert a biased gate|up
                    projection (gate and up interleaved), the clamped SwiGLU
                    gate * sigmoid(1.702 gate) * (up + 1) with gate <= 7 and -7 <= up <= 7, and a
                    biased down projection: onnxruntime's MoE operator, as the genai builder writes
                    it for the CPU (transformers 4.57 fixes 1.702 and 7.0 in GptOssExperts: it does
                    not read config.json's swiglu_limit)

Partial rotary dimensions that GroupQueryAttention cannot rotate as they are (it takes a table
half that is a multiple of 8) are laid out so it can: rotary.gqa_rotary.

Families that are not rewritten are named with the reason (NOT_REWRITTEN: what their block adds
that is not emitted; an attribute GroupQueryAttention's kernel refuses surfaces as the probe's
"onnxruntime cannot run the fused graph").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .weights import FusionError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "granite", "phi3", "gemma", "gemma2", "gemma3_text", "smollm3",
            "olmo", "olmo2", "nemotron", "phi", "gpt_oss")

#: families near these that the rewrite does not take, and what their block adds that it does not emit
NOT_REWRITTEN = {
    "phimoe": "a mixture of experts routed by sparsemixer (not a softmax over the top-k) is not rewritten",
}

_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu",
                "relu2": "relu2"}
_LAYER_NORMED = ("olmo", "nemotron", "phi")  # LayerNorm (mean, variance, a bias) where the others' are RMSNorm
_UNGATED = ("nemotron", "phi")  # an MLP of up, the activation and down
_GEMMAS = ("gemma", "gemma2", "gemma3_text")
_SANDWICHED = ("gemma2", "gemma3_text")  # a norm after attention and after the MLP, before each residual add


def _activation(config: dict) -> str:
    """The MLP's activation as transformers 4.57 reads it: `hidden_act` (Gemma's
    `hidden_activation` is not read), Gemma 2 and 3's `hidden_activation`; where config.json has
    none, the config class's default."""
    if config.get("model_type") in _SANDWICHED:
        return config.get("hidden_activation") or "gelu_pytorch_tanh"
    defaults = {"gemma": "gelu_pytorch_tanh", "phi": "gelu_new", "nemotron": "relu2"}
    default = defaults.get(config.get("model_type"), "silu")
    return config.get("hidden_act") or default


@dataclass(frozen=True)
class Experts:
    """A mixture of experts in place of the MLP (gpt-oss): `count` experts, the `top_k` highest
    router logits softmaxed into the chosen ones' weights; each expert's SwiGLU is
    min(g, limit) * sigmoid(alpha * min(g, limit)) * (clip(u, -limit, limit) + 1) over its
    interleaved gate|up projection (g the even columns, u the odd ones); limit None: no clamp."""

    count: int
    top_k: int
    alpha: float = 1.702
    limit: float | None = 7.0


@dataclass(frozen=True)
class Family:
    """A family's block as the rewrite reads and emits it.

    linears / norms: a layer's projections and norm weights in the order the model calls them
    (`qkv` and `gate_up`: packed, split when read). The scales multiply: embedding rows, the
    attention scores (GroupQueryAttention's `scale`), each block's output before the residual
    add, the logits. windows: each layer's local_window_size (-1: the whole context).
    attention_softcap / logits_softcap: c in c * tanh(x / c) over the scaled scores / the logits
    (0: none; the scores' only where the source graph caps them: weights.scores_softcapped).
    rotary: each layer's rotary table, 'global' (rope_theta and rope_scaling), 'local' (Gemma 3's
    rope_local_base_freq) or 'none' (SmolLM3's NoPE layers); () is 'global' on every layer."""

    name: str
    linears: tuple[str, ...]
    norms: tuple[str, ...]
    activation: str
    embed_scale: float
    attention_scale: float
    residual_scale: float
    logits_scale: float
    windows: tuple[int, ...]
    attention_softcap: float = 0.0
    logits_softcap: float = 0.0
    rotary: tuple[str, ...] = ()
    # layer_norm: LayerNorm with a bias (`*_bias` weights) where the others' norms are RMSNorm;
    # eps: every norm's epsilon; parallel: Phi's attention and MLP both on the input norm's output,
    # their outputs summed into the residual (no post_norm); clip_qkv: q, k and v clipped to
    # +-clip_qkv (0: not); biased: the linears (and 'lm_head') that may carry a bias;
    # qk_norm_span: q_norm / k_norm over each head ('head') or over all heads together ('all');
    # sinks: a learned logit per head in each softmax's denominator; experts: a mixture of experts
    # in place of the MLP ('router' among the linears), None: an MLP
    layer_norm: bool = False
    eps: float = 1e-6
    parallel: bool = False
    clip_qkv: float = 0.0
    biased: tuple[str, ...] = ("q", "k", "v")
    qk_norm_span: str = "head"
    sinks: bool = False
    experts: Experts | None = None


def check(config: dict) -> None:
    """Raise FusionError naming what in `config` is not rewritten (the family, its activation,
    its biases); the rest is read when the graph is built."""
    kind = config.get("model_type")
    if kind in NOT_REWRITTEN:
        raise FusionError(f"model_type '{kind}': {NOT_REWRITTEN[kind]}")
    if kind not in FAMILIES:
        raise FusionError(f"model_type '{kind}' is not one of {', '.join(FAMILIES)}")
    act, allowed = _activation(config), ("silu", "gelu_pytorch_tanh", "gelu") if kind in _GEMMAS else \
        ("gelu_new", "gelu_pytorch_tanh", "gelu") if kind == "phi" else ("relu2",) if kind == "nemotron" else ("silu",)
    if act not in allowed and kind != "gpt_oss":  # GptOssExperts' SwiGLU does not read hidden_act
        raise FusionError(f"hidden_act '{act}' is not {' or '.join(allowed)}")
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field) and kind not in ("qwen2", "gpt_oss"):
            raise FusionError(f"{field} is true: biases outside qwen2's q/k/v and gpt_oss's attention are not "
                              "rewritten")
    if kind == "gpt_oss":
        _experts(config)
    if kind == "phi" and config.get("qk_layernorm"):
        raise FusionError("qk_layernorm is true: Phi's per-head LayerNorms of q and k are not rewritten")
    if kind == "gemma3_text" and config.get("use_bidirectional_attention"):
        raise FusionError("use_bidirectional_attention is true: GroupQueryAttention is causal")


def family(config: dict) -> Family:
    """The Family of `config`, or FusionError naming what is not rewritten."""
    check(config)
    kind = config.get("model_type")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    granite = kind == "granite"
    return Family(
        name=kind,
        linears=("qkv", "o", "gate_up", "down") if kind == "phi3" else ("q", "k", "v", "o", "up", "down")
        if kind in _UNGATED else ("q", "k", "v", "o", "router") if kind == "gpt_oss" else
        ("q", "k", "v", "o", "gate", "up", "down"),
        norms=_norms(kind),
        activation="swiglu" if kind == "gpt_oss" else _ACTIVATIONS[_activation(config)],
        embed_scale=float(config.get("embedding_multiplier", 1.0)) if granite else
        math.sqrt(hidden) if kind in _GEMMAS else 1.0,
        attention_scale=float(config.get("attention_multiplier", 1.0)) if granite else
        float(config.get("query_pre_attn_scalar", 256)) ** -0.5 if kind in _SANDWICHED else
        1.0 / math.sqrt(head_dim),
        residual_scale=float(config.get("residual_multiplier", 1.0)) if granite else 1.0,
        logits_scale=1.0 / float(config.get("logits_scaling", 1.0)) if granite else 1.0,
        windows=layer_windows(config),
        attention_softcap=float(config.get("attn_logit_softcapping") or 0.0) if kind == "gemma2" else 0.0,
        logits_softcap=float(config.get("final_logit_softcapping") or 0.0) if kind in _SANDWICHED else 0.0,
        rotary=layer_rotary(config),
        layer_norm=kind in _LAYER_NORMED,
        eps=_norm_eps(config),
        parallel=kind == "phi",
        clip_qkv=float(config.get("clip_qkv") or 0.0) if kind == "olmo" else 0.0,
        biased=("q", "k", "v", "o", "up", "down", "lm_head") if kind == "phi" else ("q", "k", "v", "o", "router")
        if kind == "gpt_oss" else ("q", "k", "v"),
        qk_norm_span="all" if kind == "olmo2" else "head",
        sinks=kind == "gpt_oss",
        experts=_experts(config) if kind == "gpt_oss" else None)


def _experts(config: dict) -> Experts:
    """gpt-oss's mixture of experts as GptOssConfig reads config.json (128 experts, 4 per token where
    it says none), or FusionError naming the field out of range."""
    count = config.get("num_local_experts", 128)
    top_k = config.get("num_experts_per_tok", 4)
    if not isinstance(count, int) or count < 1:
        raise FusionError(f"num_local_experts {count!r} is not a positive integer")
    if not isinstance(top_k, int) or not 1 <= top_k <= count:
        raise FusionError(f"num_experts_per_tok {top_k!r} is not an integer from 1 to num_local_experts ({count})")
    return Experts(count, top_k)


def _norm_eps(config: dict) -> float:
    """The norms' epsilon as transformers 4.57 reads it: OLMo's LayerNorm fixes 1e-5, Nemotron's
    reads `norm_eps`, Phi's `layer_norm_eps`, the RMSNorms `rms_norm_eps` (GptOssConfig's default 1e-5)."""
    kind = config.get("model_type")
    if kind == "olmo":
        return 1e-5
    field, default = {"nemotron": ("norm_eps", 1e-5), "phi": ("layer_norm_eps", 1e-5),
                      "gpt_oss": ("rms_norm_eps", 1e-5)}.get(kind, ("rms_norm_eps", 1e-6))
    value = config.get(field)
    return float(default if value is None else value)


def _norms(kind: str) -> tuple[str, ...]:
    """A layer's norm weights in the order the model calls them (its Mul nodes' order)."""
    if kind == "qwen3":
        return "input_norm", "q_norm", "k_norm", "post_norm"
    if kind == "gemma2":  # input, post_attention, pre_feedforward, post_feedforward
        return "input_norm", "attention_output_norm", "post_norm", "mlp_output_norm"
    if kind == "gemma3_text":  # q_norm and k_norm after the three projections
        return "input_norm", "q_norm", "k_norm", "attention_output_norm", "post_norm", "mlp_output_norm"
    if kind == "olmo2":  # post_attention_layernorm, post_feedforward_layernorm: each block's output
        return "q_norm", "k_norm", "attention_output_norm", "mlp_output_norm"
    if kind == "phi":
        return ("input_norm",)
    return "input_norm", "post_norm"


def _layer_types(config: dict) -> list[str]:
    """`layer_types` as transformers 4.57 fills it where config.json has none: Gemma 2 and gpt-oss
    local on even layers, Gemma 3 global on every `sliding_window_pattern`-th (6) layer, SmolLM3
    local on its NoPE layers where `use_sliding_window`."""
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return types
    kind = config.get("model_type")
    if kind in _SANDWICHED or kind == "gpt_oss":
        pattern = 2 if kind in ("gemma2", "gpt_oss") else int(config.get("sliding_window_pattern") or
                                                              config.get("_sliding_window_pattern") or 6)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if kind == "smollm3" and config.get("use_sliding_window") and config.get("sliding_window") is not None:
        return ["full_attention" if rope else "sliding_attention" for rope in _rope_layers(config)]
    return ["full_attention"] * layers


def _rope_layers(config: dict) -> list[int]:
    """SmolLM3's `no_rope_layers` (1: rotary, 0: none), as its config fills it where config.json
    has none: every `no_rope_layer_interval`-th (4) layer without."""
    layers = int(config["num_hidden_layers"])
    uses = config.get("no_rope_layers")
    if isinstance(uses, list) and len(uses) == layers:
        return [int(bool(use)) for use in uses]
    interval = int(config.get("no_rope_layer_interval") or 4)
    return [int((i + 1) % interval != 0) for i in range(layers)]


def layer_rotary(config: dict) -> tuple[str, ...]:
    """Each layer's rotary table (Family.rotary): Gemma 3's sliding layers 'local'; SmolLM3's
    layers `no_rope_layers` marks 0 'none'; the rest 'global'."""
    kind = config.get("model_type")
    if kind == "gemma3_text":
        return tuple("local" if t == "sliding_attention" else "global" for t in _layer_types(config))
    if kind == "smollm3":
        return tuple("global" if use else "none" for use in _rope_layers(config))
    return ("global",) * int(config["num_hidden_layers"])


def layer_windows(config: dict) -> tuple[int, ...]:
    """Each layer's sliding window as transformers 4.57 reads config.json (-1: none): Mistral's
    and Phi-3's `sliding_window` on every layer; Qwen2 / Qwen3's, where `use_sliding_window`, on
    the layers `layer_types` names 'sliding_attention' (without layer_types: from
    `max_window_layers` on); Gemma 2 / 3's, SmolLM3's and gpt-oss's on the layers `layer_types`
    names (without it: as their configs fill it; SmolLM3's `use_sliding_window` only changes that
    filling: its masks follow layer_types); a window the context cannot cross is none."""
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
    if kind in _SANDWICHED or kind in ("smollm3", "gpt_oss"):  # the layer's mask, whatever use_sliding_window is
        return tuple(window if t == "sliding_attention" else -1 for t in _layer_types(config))
    return (-1,) * layers  # llama, granite and gemma read no window
