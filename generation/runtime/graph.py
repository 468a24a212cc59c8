"""What a decoder graph takes and gives, and which cache modes it can run in.

The ONNX name mapping (`past_key_values.N.key` -> `present.N.key`) lives here and nowhere else.
The cache mode follows the seed's rules, read from the graph itself:

- `in_place`: GroupQueryAttention whose `seqlens_k` counts the valid cache rows from the VALUES
  of the attention mask (a ReduceSum over it). One buffer serves as past input and present
  output; rows of different lengths share it.
- `append`: the graph declares `position_ids`, so the mask can hide free rows of a fixed buffer.
- `grow`: neither (positions come from the cache length, or GroupQueryAttention counts rows from
  the mask LENGTH): an exact-length cache, one per prompt length. A graph without position_ids
  whose family places tokens by the mask or by column distances (BLOOM's and MPT's ALiBi) runs
  `append` after all: runtime/positions.py, applied when a model is loaded (`keys_at_end`: MPT's).

A graph can also run in any "lower" mode it supports: `in_place` and `append` graphs also run
as `grow` (used by benchmarks to compare modes on one model).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .onnx_graph import Node, flatten, read_nodes

QUANTIZED_ACTIVATIONS = ("DynamicQuantizeLinear", "QuantizedMatMul", "MatMulNBits", "DynamicQuantizeMatMul",
                         "MatMulIntegerToFloat")

CACHE_MODES = ("in_place", "append", "grow")

ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(bfloat16)": None,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}


class GraphError(ValueError):
    """The decoder graph lacks an input or output that generation needs."""


@dataclass(frozen=True)
class CacheEntry:
    """One cache tensor: its past input, its present output, its shape [B, heads, T, head_dim]."""

    past: str
    present: str
    heads: int
    head_dim: int


@dataclass(frozen=True)
class DecoderGraph:
    path: Path
    input_dtypes: dict[str, type]
    output_names: tuple[str, ...]
    cache: tuple[CacheEntry, ...]
    cache_dtype: type
    logits_dtype: type
    vocab_size: int
    has_position_ids: bool
    position_axes: int  # 3 for Qwen2-VL M-RoPE position_ids [3, B, S], else 1
    has_use_cache_branch: bool
    has_group_query_attention: bool
    native_mode: str
    # encoder-decoder models: the cross-attention cache (computed at the first step, then kept)
    # and the encoder's outputs every step takes
    cross_cache: tuple[CacheEntry, ...] = ()
    has_encoder_hidden_states: bool = False
    has_encoder_attention_mask: bool = False
    seq2seq: bool = False
    # vision-language decoders (onnx-community layout) take `inputs_embeds` [B, S, hidden_size]
    # instead of input_ids: the model's embed_tokens.onnx makes them from the tokens
    has_inputs_embeds: bool = False
    hidden_size: int = 0
    # the LM head runs at the positions of `logits_positions` [n, P] only (runtime.head's rewrite)
    has_logits_positions: bool = False
    # the append cache keeps each row's keys ending at the buffer's width (cache/windowed.py): the
    # graph reads buffer columns, not positions (runtime/positions.py)
    keys_at_end: bool = False
    # int8 dynamic quantization (DynamicQuantizeLinear): a row's activation scale spans its positions
    # (runtime.int8_rows makes it per row), so a prompt's padding positions would enter it: prompts
    # run in groups of one length (cache/prefill.py, cache/in_place.py)
    prompts_by_length: bool = False
    # activations quantized per token or per row (int8 precision's QuantizedMatMul, int8 and q4
    # exports): a float rounding apart becomes a quantized step apart, which grows through the
    # layers, so a decode step's cache rows are not a prompt run's (core/keep.py)
    quantized_activations: bool = False
    # the LoRA inputs of a graph loaded with adapters (runtime.lora.rewrite): (name, its shape, -1
    # where dynamic), so a run that names no adapter feeds empty ones (`no_adapter`)
    lora_inputs: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def is_seq2seq(self) -> bool:
        return self.seq2seq

    @property
    def modes(self) -> tuple[str, ...]:
        """The cache modes this graph can run in, its native mode first."""
        if self.native_mode in ("grow", "seq2seq") or self.has_inputs_embeds or self.position_axes == 3:
            # grow takes every row's position from the cache length: no room for M-RoPE deltas,
            # and only the append cache embeds its tokens
            return (self.native_mode,)
        return (self.native_mode, "grow")

    def dtype(self, name: str) -> type:
        return self.input_dtypes[name]

    def no_adapter(self, rows: int) -> dict[str, np.ndarray]:
        """The LoRA inputs of a run of `rows` rows none of which has an adapter: empty products."""
        from .lora.rewrite import empty_feeds

        return empty_feeds(self.lora_inputs, rows, self.input_dtypes)


def _present_name(past: str, outputs: set[str], present_names: dict[str, str]) -> str:
    if past in present_names:
        return present_names[past]
    candidate = "present." + past[len("past_key_values."):]
    if candidate in outputs:
        return candidate
    raise GraphError(f"cache input '{past}' has no matching output (looked for '{candidate}')")


def _gqa_counting(nodes: list[Node], inputs: set[str]) -> str | None:
    """How GroupQueryAttention counts valid cache rows: 'values' (ReduceSum of the mask),
    'length' (the mask's shape), or None when the graph has no GroupQueryAttention."""
    flat = flatten(nodes)
    gqa = [n for n in flat if n.op_type == "GroupQueryAttention"]
    if not gqa:
        return None
    producer = {out: n for n in flat for out in n.outputs}
    seen: set[str] = set()
    todo = [gqa[0].inputs[5]] if len(gqa[0].inputs) > 5 else []
    while todo:
        name = todo.pop()
        if name in seen or name not in producer:
            continue
        seen.add(name)
        node = producer[name]
        if node.op_type == "ReduceSum":
            return "values"
        todo.extend(node.inputs)
    return "length"


def read_graph(path: Path, session, config: dict, present_names: dict[str, str] | None = None) -> DecoderGraph:
    """Describe the decoder `session` loaded from `path`; `config` fills symbolic dims."""
    ins = {i.name: i for i in session.get_inputs()}
    outs = {o.name: o for o in session.get_outputs()}
    # an encoder-decoder's decoder: it takes the encoder's outputs, or (an unmerged
    # decoder_with_past) only the cross-attention cache they made
    seq2seq = "encoder_hidden_states" in ins or any(".encoder." in name for name in ins)
    _check_names(path, ins, outs, seq2seq)
    input_dtypes = _input_dtypes(path, ins)
    pasts = [n for n in ins if n.startswith("past_key_values.")]
    cache, cross = _cache_entries(path, ins, outs, pasts, config, present_names or {})
    vocab = _vocab_size(path, outs["logits"].shape, config)
    has_pos = "position_ids" in ins
    embeds = "inputs_embeds" in ins and "input_ids" not in ins
    hidden = _embeds_width(path, ins["inputs_embeds"].shape, config) if embeds else 0
    pos_axes = 3 if has_pos and len(ins["position_ids"].shape) == 3 else 1
    nodes = read_nodes(path)
    counting = None if seq2seq else _gqa_counting(nodes, set(ins))
    return DecoderGraph(
        path=path,
        input_dtypes=input_dtypes,
        output_names=tuple(outs),
        cache=tuple(cache),
        cache_dtype=input_dtypes[pasts[0]],
        logits_dtype=ORT_TYPES[outs["logits"].type],
        vocab_size=int(vocab),
        has_position_ids=has_pos,
        position_axes=pos_axes,
        has_use_cache_branch="use_cache_branch" in ins,
        has_group_query_attention=counting is not None,
        native_mode=_native_mode(seq2seq, counting, has_pos),
        cross_cache=tuple(cross),
        has_encoder_hidden_states="encoder_hidden_states" in ins,
        seq2seq=seq2seq,
        has_encoder_attention_mask="encoder_attention_mask" in ins,
        has_inputs_embeds=embeds,
        hidden_size=int(hidden),
        has_logits_positions="logits_positions" in ins,
        prompts_by_length=any(n.op_type == "DynamicQuantizeLinear" for n in flatten(nodes)),
        quantized_activations=any(n.op_type in QUANTIZED_ACTIVATIONS for n in flatten(nodes)),
        lora_inputs=tuple((n, tuple(d if isinstance(d, int) else -1 for d in i.shape)) for n, i in ins.items()
                          if n.startswith("lora.")),
    )


def _check_names(path: Path, ins: dict, outs: dict, seq2seq: bool) -> None:
    """The inputs and outputs every decoder needs: a mask (an encoder-decoder's may lack one),
    ids or embeddings, logits."""
    if not seq2seq and "attention_mask" not in ins:
        raise GraphError(f"{path.name}: the decoder has no 'attention_mask' input (inputs: {sorted(ins)})")
    if "input_ids" not in ins and "inputs_embeds" not in ins:
        raise GraphError(f"{path.name}: the decoder has neither 'input_ids' nor 'inputs_embeds' inputs")
    if "logits" not in outs:
        raise GraphError(f"{path.name}: the decoder has no 'logits' output (outputs: {sorted(outs)})")


def _input_dtypes(path: Path, ins: dict) -> dict[str, type]:
    """Each input's numpy dtype (ORT_TYPES; bfloat16 and others refused)."""
    input_dtypes = {}
    for name, arg in ins.items():
        dtype = ORT_TYPES.get(arg.type)
        if dtype is None:
            raise GraphError(f"{path.name}: input '{name}' has unsupported type {arg.type}")
        input_dtypes[name] = dtype
    return input_dtypes


def _cache_entries(path: Path, ins: dict, outs: dict, pasts: list[str], config: dict,
                   present_names: dict[str, str]) -> tuple[list[CacheEntry], list[CacheEntry]]:
    """(self-attention cache, cross-attention cache): each past input with its present output and
    its heads and head size (from config.json where the graph's dims are symbolic)."""
    if not pasts:
        raise GraphError(f"{path.name}: the decoder has no 'past_key_values.*' inputs; "
                         "export it with a KV cache (optimum task text-generation-with-past)")
    cache, cross = [], []
    for past in pasts:
        shape = ins[past].shape
        if len(shape) != 4:
            raise GraphError(f"{path.name}: cache input '{past}' has shape {shape}, expected [batch, heads, length, head_dim]")
        heads = shape[1] if isinstance(shape[1], int) else config.get("num_key_value_heads")
        head_dim = shape[3] if isinstance(shape[3], int) else config.get("head_dim")
        if not heads or not head_dim:
            raise GraphError(f"{path.name}: cannot tell the heads and head size of '{past}' ({shape}); "
                             "config.json lacks num_key_value_heads / head_dim")
        if ".encoder." in past and "present." + past[len("past_key_values."):] not in outs:
            present = "present." + past[len("past_key_values."):]  # an unmerged decoder_with_past: only step 0 gives it
        else:
            present = _present_name(past, set(outs), present_names)
        entry = CacheEntry(past, present, int(heads), int(head_dim))
        (cross if ".encoder." in past else cache).append(entry)
    return cache, cross


def _vocab_size(path: Path, logits_shape, config: dict):
    """The logits' last dim, or config.json's vocab_size where it is symbolic."""
    vocab = logits_shape[-1] if isinstance(logits_shape[-1], int) else config.get("vocab_size")
    if not vocab:
        raise GraphError(f"{path.name}: cannot tell the vocabulary size (logits {logits_shape}, no vocab_size in config)")
    return vocab


def _embeds_width(path: Path, shape, config: dict):
    """The width of `inputs_embeds` [B, S, hidden], or config.json's hidden_size where it is symbolic."""
    hidden = shape[-1]
    hidden = hidden if isinstance(hidden, int) else config.get("hidden_size")
    if not hidden:
        raise GraphError(f"{path.name}: cannot tell the width of 'inputs_embeds' ({shape}, "
                         "no hidden_size in config)")
    return hidden


def _native_mode(seq2seq: bool, counting: str | None, has_pos: bool) -> str:
    """The cache mode the graph runs in as it is (the module's docstring says why)."""
    if seq2seq:
        return "seq2seq"  # positions from the cache length, plus the encoder's outputs
    if counting == "values":
        return "in_place"
    if has_pos:
        return "append"
    return "grow"
