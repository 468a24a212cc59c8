"""Rewrite an Optimum / transformers.js decoder into the fused graph, once, cached on disk.

The layout users download most (Optimum exports, onnx-community merged decoders) runs its
attention, rotary embedding and norms as hundreds of small operators: 0.28-0.84x the speed of the
same weights in onnxruntime-genai's fused graph. At load, `fused_decoder` reads the weights out of
such a graph (weights.py), writes the fused graph (emit.py; its rotary tables: rotary.py) under the
cache folder keyed by a hash of the source files, and keeps it only when its logits equal the
source's on a probe prompt and step. A graph it cannot rewrite loads as before, with the reason in
the log (and remembered under the same key, so it is not retried at every load).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .families import FAMILIES, check, family  # noqa: F401  (FAMILIES: the families rewritten)
from .weights import FusionError

log = logging.getLogger(__name__)

VERSION = 8  # bump when what is rewritten or emitted changes: it is part of every cache key (refusals too)
_CONFIG_FIELDS = ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "num_hidden_layers", "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta",
                  "rope_scaling", "max_position_embeddings", "hidden_act", "hidden_activation", "tie_word_embeddings",
                  "partial_rotary_factor", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
                  "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
                  "attention_bias", "mlp_bias", "query_pre_attn_scalar", "attn_logit_softcapping",
                  "final_logit_softcapping", "rope_local_base_freq", "sliding_window_pattern",
                  "_sliding_window_pattern", "use_bidirectional_attention", "no_rope_layers", "no_rope_layer_interval",
                  "clip_qkv", "norm_eps", "layer_norm_eps", "qk_layernorm", "num_local_experts", "num_experts_per_tok")
PROBE_TOLERANCE = 1e-3  # of the logits' scale: a misplaced weight moves them by O(1)


def cache_root() -> Path:
    """Where derived models live: $RAYMUTER_CACHE, else ~/.cache/raymuter."""
    root = os.environ.get("RAYMUTER_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "raymuter")
    return Path(root).expanduser()


def unsupported_config(config: dict, provider: str) -> str | None:
    """Why a decoder of `config` is not rewritten (None: it is a candidate)."""
    try:
        check(config)
    except FusionError as e:
        return str(e)
    if provider != "cpu":
        return "GroupQueryAttention on CUDA takes float16 and the weights are float32"
    return None


def unsupported_graph(graph) -> str | None:
    """Why the decoder `graph` is not rewritten (None: it is a candidate)."""
    if graph.native_mode not in ("append", "grow"):
        return f"its graph already runs in the {graph.native_mode} cache mode"
    if graph.has_inputs_embeds or graph.position_axes != 1:
        return "it takes inputs_embeds or 3-D positions (a vision-language decoder)"
    if graph.cache_dtype is not np.float32 or graph.logits_dtype is not np.float32:
        return "its cache or logits are not float32"
    return None


def _source_files(path: Path) -> list[Path]:
    """The graph and its external data files (named after it, as exporters write them)."""
    return [path] + sorted(p for p in path.parent.iterdir() if p != path and p.name.startswith(path.name))


def cache_key(path: Path, config: dict) -> str:
    digest = hashlib.sha256(f"raymuter-fusion-{VERSION}".encode())
    digest.update(json.dumps({k: config.get(k) for k in _CONFIG_FIELDS}, sort_keys=True).encode())
    for file in _source_files(path):
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()[:32]


def fused_decoder(path: Path, config: dict, provider: str, load_source) -> Path | None:
    """The fused graph of the decoder at `path`, or None where it cannot be rewritten (the
    reason logged). Built once per source and kept in the cache; `load_source()` gives the
    source's (session, DecoderGraph), asked for only when the cache has no answer yet."""
    reason = unsupported_config(config, provider)
    if reason:
        log.info("%s runs unfused: %s", path.name, reason)
        return None
    folder = cache_root() / "fused" / cache_key(path, config)
    fused, refused = folder / "model.onnx", folder / "refused.json"
    with _exclusive(folder):  # replicas starting together on one node: one builds, the others wait and load it
        if fused.exists():
            log.info("%s runs as its fused graph %s", path.name, fused)
            return fused
        if refused.exists():
            log.warning("%s runs unfused: %s", path.name, json.loads(refused.read_text())["reason"])
            return None
        return _rewrite(path, config, folder, load_source)


@contextlib.contextmanager
def _exclusive(folder: Path):
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _rewrite(path: Path, config: dict, folder: Path, load_source) -> Path | None:
    session, graph = load_source()
    try:
        reason = unsupported_graph(graph)
        if reason:
            raise FusionError(reason)
        log.info("rewriting %s into the fused graph (once; cached in %s)", path, folder)
        built = _build(path, config, folder.parent)
        try:
            _check_against(session, graph, built / "model.onnx")
        except FusionError:
            shutil.rmtree(built, ignore_errors=True)
            raise
    except FusionError as e:
        log.warning("%s runs unfused: %s", path.name, e)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "refused.json").write_text(json.dumps({"source": str(path), "reason": str(e)}))
        return None
    try:
        os.rename(built, folder)
    except OSError:  # another machine built it first (a cache shared over a filesystem the lock does not span)
        shutil.rmtree(built, ignore_errors=True)
    return folder / "model.onnx"


def _build(path: Path, config: dict, parent: Path) -> Path:
    """Write the fused graph into a fresh temporary folder beside its final place."""
    try:
        import onnx
    except ImportError:  # pragma: no cover - a dependency of raymuter
        raise FusionError("the onnx package is not installed") from None

    from .emit import fused_graph
    from .weights import read_weights

    layout = family(config)
    weights = read_weights(onnx.load(str(path)), config, layout)
    model = fused_graph(weights, config, layout)
    parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=parent, prefix=".building-"))
    onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=1024)
    return folder


def probe_ids(vocab: int, count: int) -> np.ndarray:
    """Token ids spread over the vocabulary (a probe's prompt)."""
    return (np.arange(count, dtype=np.int64) * 7919 + 3) % vocab


def _run_probe(session, graph, ids: np.ndarray, steps: int) -> list[np.ndarray]:
    """Logits of a prompt and `steps` decodes after it, through `session`, with a growing cache."""
    names = {i.name for i in session.get_inputs()}
    entries = graph.cache
    past = {e.past: np.zeros((1, e.heads, 0, e.head_dim), np.float32) for e in entries}
    tokens, out, length = ids[None, :], [], 0
    for step in range(steps + 1):
        width = tokens.shape[1]
        feeds = {"input_ids": tokens, "attention_mask": np.ones((1, length + width), np.int64), **past}
        if "position_ids" in names:
            feeds["position_ids"] = (length + np.arange(width, dtype=np.int64))[None, :]
        if "use_cache_branch" in names:
            feeds["use_cache_branch"] = np.array([step > 0])
        if "logits_positions" in names:  # runtime.head's rewrite: every position, as the fused graph gives
            feeds["logits_positions"] = np.arange(width, dtype=np.int64)[None, :]
        feeds = {k: v.astype(graph.dtype(k)) if k in ("attention_mask", "position_ids") else v
                 for k, v in feeds.items() if k in names}
        wanted = ["logits"] + [e.present for e in entries]
        results = dict(zip(wanted, session.run(wanted, feeds)))
        out.append(results["logits"][0])
        past = {e.past: results[e.present] for e in entries}
        length += width
        tokens = np.array([[int(out[-1][-1].argmax())]], np.int64)
    return out


def _check_against(session, graph, fused_path: Path) -> None:
    """Raise FusionError unless the fused graph's logits equal the source's on a probe."""
    import onnxruntime as ort

    from ..graph import read_graph

    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        fused = ort.InferenceSession(str(fused_path), options, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise FusionError(f"onnxruntime cannot load the fused graph: {e}") from None
    fused_graph = read_graph(fused_path, fused, {})
    ids = probe_ids(graph.vocab_size, 7)
    expected = _run_probe(session, graph, ids, steps=2)
    try:
        got = _run_probe(fused, fused_graph, ids, steps=2)
    except Exception as e:  # an attribute the operator's kernel refuses shows only when it runs
        raise FusionError(f"onnxruntime cannot run the fused graph: {e}") from None
    for step, (a, b) in enumerate(zip(expected, got)):
        scale = max(1.0, float(np.abs(a).max()))
        diff = float(np.abs(a - b).max())
        if diff > PROBE_TOLERANCE * scale:
            raise FusionError(f"the fused graph's logits differ from the source's by {diff:.3g} at probe step {step} "
                              "(the weights did not map as expected)")
