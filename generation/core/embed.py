"""Text embeddings from a decoder model exported for feature extraction (optimum's `--task
feature-extraction`, onnx-community's embedding exports: a graph that gives `last_hidden_state`
and no logits).

The prompts run in one batched pass (right-padded, the mask hiding the padding, positions
counted from 0, so each row is what it is alone), and each row's hidden states are pooled as the
folder's sentence-transformers config says: `1_Pooling/config.json`'s mode (last token, mean,
CLS or max) and a `Normalize` module in `modules.json` (L2). A folder without that config gets
vLLM's default for decoder models: the last token, normalized. `dimensions` keeps the first
that many (Matryoshka truncation, as OpenAI's `dimensions`), normalized again if the model
normalizes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..runtime.graph import ORT_TYPES
from ..runtime.model import ModelError, default_threads, open_session, read_json, resolve_folder
from ..runtime.onnx_graph import read_output_names

POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max"}
UNSUPPORTED_MODES = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
HIDDEN_OUTPUTS = ("last_hidden_state", "token_embeddings")
TOKENS_PER_RUN = 16384  # rows x padded length of one run


@dataclass
class Embedder:
    """A loaded embedding model: its session, what the graph takes, and its pooling."""

    folder: Path
    path: Path
    session: object
    config: dict
    pooling: str  # last, mean, cls, max
    normalize: bool
    hidden_size: int
    max_context: int | None
    inputs: dict[str, type]  # graph input -> dtype
    past: list[tuple[str, int, int]]  # (past input, heads, head_dim) of a graph that takes a (here empty) past
    output: str
    tokenizer_path: Path | None
    provider: str = "cpu"
    family: str = "text"


def embedding_graph(folder: Path, variant: str | None = None) -> Path | None:
    """The feature-extraction graph of `folder` (onnx/model.onnx or model.onnx, a variant's
    file), or None when the folder has none (a generation export, say)."""
    suffix = "" if variant in (None, "fp32") else f"_{variant}"
    for candidate in (folder / "onnx" / f"model{suffix}.onnx", folder / f"model{suffix}.onnx"):
        outputs = _outputs(candidate) if candidate.exists() else set()
        if outputs & set(HIDDEN_OUTPUTS) and "logits" not in outputs:
            return candidate
    return None


def is_embedding_folder(folder: str | os.PathLike) -> bool:
    folder = Path(folder)
    return folder.is_dir() and embedding_graph(folder) is not None


def _outputs(path: Path) -> set[str]:
    try:
        return set(read_output_names(path))
    except (OSError, ValueError, IndexError):  # not an ONNX file we can read: not an embedding graph
        return set()


def pooling_of(folder: Path) -> tuple[str, bool]:
    """(pooling, normalize) as the folder's sentence-transformers modules say; vLLM's default
    (last token, normalized) without them. A mode Raymuter does not pool raises, naming it."""
    modules = folder / "modules.json"
    if not modules.exists():
        return "last", True
    try:
        entries = json.loads(modules.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{modules} is not valid JSON: {e}") from None
    pooling, normalize = None, False
    for entry in entries if isinstance(entries, list) else []:
        kind = str(entry.get("type", ""))
        if kind.endswith("Pooling"):
            settings = read_json(folder / entry.get("path", "") / "config.json", required=True)
            for name in UNSUPPORTED_MODES:
                if settings.get(name):
                    raise ModelError(f"{folder}: sentence-transformers pooling {name} is not supported "
                                     f"(supported: {', '.join(POOLING_MODES)})")
            if settings.get("include_prompt") is False:
                raise ModelError(f"{folder}: pooling with include_prompt false (instruction tokens left out) "
                                 "is not supported")
            chosen = [mode for key, mode in POOLING_MODES.items() if settings.get(key)]
            if len(chosen) != 1:
                raise ModelError(f"{folder}: the Pooling module must name one of {', '.join(POOLING_MODES)}; "
                                 f"it names {chosen or 'none'}")
            pooling = chosen[0]
        elif kind.endswith("Normalize"):
            normalize = True
        elif not kind.endswith("Transformer"):
            raise ModelError(f"{folder}: sentence-transformers module {kind or entry!r} is not supported "
                             "(Transformer, Pooling, Normalize)")
    if pooling is None:
        raise ModelError(f"{modules} names no Pooling module")
    return pooling, normalize


def load_embedder(source: str | os.PathLike, *, variant: str | None = None, provider: str | None = None,
                  threads: int | None = None) -> Embedder:
    """Load the embedding model of `source` (a folder or a hub id)."""
    folder = resolve_folder(source, variant)
    path = embedding_graph(folder, variant)
    if path is None:
        raise ModelError(f"{folder} has no feature-extraction graph (onnx/model.onnx or model.onnx giving "
                         f"{' or '.join(HIDDEN_OUTPUTS)} and no logits; optimum: --task feature-extraction)")
    config = read_json(folder / "config.json", required=True)
    pooling, normalize = pooling_of(folder)
    session, used = open_session(path, provider, threads or default_threads())
    inputs = {i.name: ORT_TYPES.get(i.type, np.int64) for i in session.get_inputs()}
    for needed in ("input_ids", "attention_mask"):
        if needed not in inputs:
            raise ModelError(f"{path.name} takes no {needed}")
    text = config.get("text_config", config)
    heads = text.get("num_key_value_heads") or text.get("num_attention_heads")
    head_dim = text.get("head_dim") or (text.get("hidden_size", 0) // max(1, text.get("num_attention_heads") or 1))
    past = [(name, heads, head_dim) for name in inputs if name.startswith("past_key_values")]
    outputs = {o.name: o for o in session.get_outputs()}
    output = next(name for name in HIDDEN_OUTPUTS if name in outputs)
    width = outputs[output].shape[-1]
    tokenizer = folder / "tokenizer.json"
    return Embedder(folder, path, session, config, pooling, normalize,
                    width if isinstance(width, int) else int(text.get("hidden_size", 0)),
                    text.get("max_position_embeddings"), inputs, past, output,
                    tokenizer if tokenizer.exists() else None, used)


def embed(embedder: Embedder, prompts: list[list[int]], dimensions: int | None = None) -> np.ndarray:
    """The pooled embeddings [n, dimensions or hidden] (float32) of token-id prompts."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("each input needs at least one token")
    if dimensions is not None and not 1 <= dimensions <= embedder.hidden_size:
        raise ValueError(f"dimensions: 1-{embedder.hidden_size} for this model, not {dimensions}")
    longest = embedder.max_context
    for i, prompt in enumerate(prompts):
        if longest and len(prompt) > longest:
            raise ValueError(f"input[{i}] has {len(prompt)} tokens; the model's context is {longest}")
    out = np.zeros((len(prompts), embedder.hidden_size), np.float32)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batch: list[int] = []
    for i in order + [None]:
        if i is not None and (len(batch) + 1) * len(prompts[i]) <= TOKENS_PER_RUN:
            batch.append(i)
            continue
        if batch:
            out[batch] = _pooled(embedder, [prompts[j] for j in batch])
        batch = [] if i is None else [i]
    if dimensions is not None:
        out = out[:, :dimensions]
    if embedder.normalize:
        out = out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out


def _pooled(embedder: Embedder, prompts: list[list[int]]) -> np.ndarray:
    n, width = len(prompts), max(len(p) for p in prompts)
    lengths = np.array([len(p) for p in prompts])
    ids = np.zeros((n, width), np.int64)
    for b, prompt in enumerate(prompts):
        ids[b, :len(prompt)] = prompt
    mask = (np.arange(width) < lengths[:, None]).astype(np.int64)
    feeds = {"input_ids": ids.astype(embedder.inputs["input_ids"]),
             "attention_mask": mask.astype(embedder.inputs["attention_mask"])}
    if "position_ids" in embedder.inputs:
        feeds["position_ids"] = np.broadcast_to(np.arange(width), (n, width)).astype(embedder.inputs["position_ids"])
    for name, heads, head_dim in embedder.past:
        feeds[name] = np.zeros((n, heads, 0, head_dim), embedder.inputs[name])
    if "use_cache_branch" in embedder.inputs:
        feeds["use_cache_branch"] = np.array([False])
    hidden = embedder.session.run([embedder.output], feeds)[0].astype(np.float32)  # [n, width, H]
    valid = mask[:, :, None].astype(bool)
    if embedder.pooling == "last":
        return hidden[np.arange(n), lengths - 1]
    if embedder.pooling == "cls":
        return hidden[:, 0]
    if embedder.pooling == "mean":
        return (hidden * valid).sum(1) / lengths[:, None]
    return np.where(valid, hidden, -np.inf).max(1)
