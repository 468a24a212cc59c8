"""Rewrite an Optimum / transformers.js decoder into the fused graph, once, cached on disk.

The layout users download most (Optimum exports, onnx-community merged decoders) runs its
attention, rotary embedding and norms as hundreds of small operators: 0.28-0.84x the speed of the
same weights in onnxruntime-genai's fused graph. At load, `fused_decoder` reads the weights out of
such a graph (weights.py), writes the fused graph (emit.py; its rotary tables: rotary.py) under the
cache folder keyed by a hash of the source files, and keeps it only when its logits equal the
source's on a probe prompt and step. A graph it cannot rewrite loads as before, with the reason in
the log (and remembered under the same key, so it is not retried at every load).

Precision: the fused graph is float32 for the CPU and float16 for CUDA (GroupQueryAttention on
CUDA takes float16), from a float32 or a float16 source alike: the weights are read as float32,
the graph emitted and then converted whole (onnxruntime.transformers.float16: weights, cache,
logits), and checked against the source within float16's tolerance. `precision` overrides the
provider's (onnxruntime's CPU kernels run the float16 graph too: how the tests hold it). A
float16 source on the CPU without precision='fp16' keeps running as exported.
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

VERSION = 9  # bump when what is rewritten or emitted changes: it is part of every cache key (refusals too)
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
# float16 against the source: float16 keeps 11 significant bits (2^-10 relative spacing) and a
# probe's logits pass through each layer's roundings; 2% of their scale, still far below O(1)
PROBE_TOLERANCE_FP16 = 2e-2
PRECISIONS = ("fp32", "fp16")


def precision_for(provider: str, precision: str | None) -> str:
    """The fused graph's precision: as asked, else float16 on CUDA and float32 on the CPU."""
    if precision is None:
        return "fp16" if provider == "cuda" else "fp32"
    if precision not in PRECISIONS:
        raise FusionError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    return precision


def cache_root() -> Path:
    """Where derived models live: $RAYMUTER_CACHE, else ~/.cache/raymuter."""
    root = os.environ.get("RAYMUTER_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "raymuter")
    return Path(root).expanduser()


def unsupported_config(config: dict, provider: str) -> str | None:
    """Why a decoder of `config` is not rewritten (None: it is a candidate; any provider: CUDA
    takes the float16 graph)."""
    try:
        check(config)
    except FusionError as e:
        return str(e)
    return None


def unsupported_graph(graph, precision: str = "fp32") -> str | None:
    """Why the decoder `graph` is not rewritten at `precision` (None: it is a candidate)."""
    if graph.native_mode not in ("append", "grow"):
        return f"its graph already runs in the {graph.native_mode} cache mode"
    if graph.has_inputs_embeds or graph.position_axes != 1:
        return "it takes inputs_embeds or 3-D positions (a vision-language decoder)"
    kinds = {np.dtype(graph.cache_dtype), np.dtype(graph.logits_dtype)}
    if precision == "fp32" and kinds != {np.dtype(np.float32)}:
        return "its cache or logits are not float32 (precision='fp16' rewrites it in float16)"
    if not kinds <= {np.dtype(np.float32), np.dtype(np.float16)}:
        return "its cache or logits are neither float32 nor float16"
    return None


def _source_files(path: Path) -> list[Path]:
    """The graph and its external data files (named after it, as exporters write them)."""
    return [path] + sorted(p for p in path.parent.iterdir() if p != path and p.name.startswith(path.name))


def cache_key(path: Path, config: dict, precision: str = "fp32") -> str:
    digest = hashlib.sha256(f"raymuter-fusion-{VERSION}".encode() + (b"" if precision == "fp32" else b"-fp16"))
    digest.update(json.dumps({k: config.get(k) for k in _CONFIG_FIELDS}, sort_keys=True).encode())
    return hash_files(digest, path)


def hash_files(digest, path: Path) -> str:
    """`digest` (a hashlib object) over the graph at `path` and its external data files: a derived
    model's cache key (this rewrite's, runtime.quantize's)."""
    for file in _source_files(path):
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()[:32]


def fused_decoder(path: Path, config: dict, provider: str, load_source, precision: str | None = None) -> Path | None:
    """The fused graph of the decoder at `path`, or None where it cannot be rewritten (the
    reason logged). Built once per source and precision (default the provider's:
    `precision_for`) and kept in the cache; `load_source()` gives the source's (session,
    DecoderGraph), asked for only when the cache has no answer yet."""
    precision = precision_for(provider, precision)
    reason = unsupported_config(config, provider)
    if reason:
        log.info("%s runs unfused: %s", path.name, reason)
        return None
    folder = cache_root() / "fused" / cache_key(path, config, precision)
    fused, refused = folder / "model.onnx", folder / "refused.json"
    with _exclusive(folder):  # replicas starting together on one node: one builds, the others wait and load it
        if fused.exists():
            log.info("%s runs as its fused graph %s", path.name, fused)
            return fused
        if refused.exists():
            log.warning("%s runs unfused: %s", path.name, json.loads(refused.read_text())["reason"])
            return None
        return _rewrite(path, config, folder, load_source, precision)


@contextlib.contextmanager
def _exclusive(folder: Path):
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _rewrite(path: Path, config: dict, folder: Path, load_source, precision: str) -> Path | None:
    session, graph = load_source()
    try:
        reason = unsupported_graph(graph, precision)
        if reason:
            raise FusionError(reason)
        log.info("rewriting %s into the fused graph, %s (once; cached in %s)", path, precision, folder)
        built = _build(path, config, folder.parent, precision)
        try:
            _check_against(session, graph, built / "model.onnx", precision)
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


def _build(path: Path, config: dict, parent: Path, precision: str = "fp32") -> Path:
    """Write the fused graph into a fresh temporary folder beside its final place (float16:
    emitted in float32, then converted whole)."""
    try:
        import onnx
    except ImportError:  # pragma: no cover - a dependency of raymuter
        raise FusionError("the onnx package is not installed") from None

    from .emit import fused_graph
    from .weights import read_weights

    layout = family(config)
    weights = read_weights(onnx.load(str(path)), config, layout)
    model = fused_graph(weights, config, layout)
    if precision == "fp16":
        model = _float16(model)
    parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=parent, prefix=".building-"))
    onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=1024)
    return folder


def _float16(model):
    """The float32 fused graph in float16: weights, cache inputs and outputs, logits, and every
    operator between (onnxruntime's converter; the ids, mask and positions stay integers)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    converted = convert_float_to_float16(model, keep_io_types=False, disable_shape_infer=True)
    converted.ir_version = model.ir_version
    return converted


def probe_ids(vocab: int, count: int) -> np.ndarray:
    """Token ids spread over the vocabulary (a probe's prompt)."""
    return (np.arange(count, dtype=np.int64) * 7919 + 3) % vocab


def _run_probe(session, graph, ids: np.ndarray, steps: int, follow: list[int] | None = None) -> list[np.ndarray]:
    """Logits of a prompt and `steps` decodes after it, through `session`, with a growing cache;
    each decode feeds the argmax of the step before, or `follow[step]` (another run's argmax: a
    float16 graph may break a near tie the other way)."""
    names = {i.name for i in session.get_inputs()}
    entries = graph.cache
    past = {e.past: np.zeros((1, e.heads, 0, e.head_dim), graph.cache_dtype) for e in entries}
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
        tokens = np.array([[int(out[-1][-1].argmax()) if follow is None else follow[step]]], np.int64)
    return out


def _check_against(session, graph, fused_path: Path, precision: str = "fp32") -> None:
    """Raise FusionError unless the fused graph's logits equal the source's on a probe (within
    float16's tolerance where either is float16)."""
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
        got = _run_probe(fused, fused_graph, ids, steps=2, follow=[int(a[-1].argmax()) for a in expected])
    except Exception as e:  # an attribute the operator's kernel refuses shows only when it runs
        raise FusionError(f"onnxruntime cannot run the fused graph: {e}") from None
    half = precision == "fp16" or np.dtype(graph.logits_dtype) == np.float16
    tolerance = PROBE_TOLERANCE_FP16 if half else PROBE_TOLERANCE
    for step, (a, b) in enumerate(zip(expected, got)):
        a, b = a.astype(np.float32), b.astype(np.float32)
        scale = max(1.0, float(np.abs(a).max()))
        diff = float(np.abs(a - b).max())
        if diff > tolerance * scale:
            why = (f"beyond float16's {tolerance:.0%} of their scale {scale:.3g}: float16 rounding across the layers, or "
                   "weights that did not map" if half else "the weights did not map as expected")
            raise FusionError(f"the fused graph's logits differ from the source's by {diff:.3g} at probe step {step} "
                              f"({why})")
