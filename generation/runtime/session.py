"""Open a decoder's onnxruntime session: the provider (CUDA where usable, else the CPU), its
threads, the rewrites made at open (runtime.head, runtime.int8_rows) and CUDA graphs. Apart from
model.py (the folders and their layouts), which opens every session through `open_session`."""

from __future__ import annotations

import logging
from pathlib import Path

from .errors import ModelError

log = logging.getLogger(__name__)


def chosen_provider(provider: str | None) -> str:
    """The provider a session will use: CUDA where asked, or by default where usable."""
    if provider is not None:
        return provider
    try:
        import onnxruntime as ort
    except ImportError:
        return "cpu"
    return "cuda" if "CUDAExecutionProvider" in ort.get_available_providers() else "cpu"


def open_session(path: Path, provider: str | None, threads: int, spin_wait: bool = True, head: bool = False,
                 int8_rows: bool = False, cuda_graphs: bool = False, lora: dict | None = None):
    """An onnxruntime session of `path` and the provider it got. head: a decoder's LM head runs
    only at the positions its `logits_positions` input names, where the graph allows
    (runtime.head; the reason logged where not). int8_rows: int8 dynamic quantization takes each
    batch row's own scale (runtime.int8_rows; the reason logged where it cannot). lora: the
    model's config.json, where each projection takes a LoRA path per row (runtime.lora.rewrite;
    AdapterError where the graph's projections cannot be read)."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise ModelError("onnxruntime is not installed: pip install 'raymuter[cpu]' (or '[gpu]' on a "
                         "CUDA node; never both)") from None
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    if not spin_wait:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    available = ort.get_available_providers()
    provider = chosen_provider(provider)
    names = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
    if provider not in names:
        raise ModelError(f"provider '{provider}' is not one of cpu, cuda")
    if provider == "cuda" and "CUDAExecutionProvider" not in available:
        raise ModelError("provider 'cuda' asked for, but this onnxruntime has no CUDA provider "
                         "(install raymuter[gpu] on a CUDA node)")
    source = str(path)
    if head or int8_rows or lora is not None:
        source = _rewritten_source(path, options, head, int8_rows, lora)
    providers = names[provider]
    if cuda_graphs and provider == "cuda":
        providers = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"}), "CPUExecutionProvider"]
    try:
        session = ort.InferenceSession(source, options, providers=providers)
    except Exception as e:
        if providers is not names[provider]:  # a graph CUDA graphs cannot capture (nodes on the CPU, ...)
            log.warning("%s: CUDA graphs refused (%s); running without them", path.name, e)
            return open_session(path, provider, threads, spin_wait, head, int8_rows, lora=lora)
        raise ModelError(f"onnxruntime cannot load {path}: {e}") from None
    used = "cuda" if session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
    if used != provider:
        log.warning("CUDA provider unusable for %s; running on the CPU", path.name)
    return session, used


def captures_graphs(session) -> bool:
    """Whether the session's CUDA provider was made with enable_cuda_graph (not refused)."""
    options = session.get_provider_options().get("CUDAExecutionProvider", {})
    return options.get("enable_cuda_graph") in ("1", "True", "true")


def _rewritten_source(path: Path, options, head: bool, int8_rows: bool, lora: dict | None = None):
    """The decoder at `path` rewritten in memory (runtime.int8_rows, runtime.lora, then runtime.head)
    as bytes whose weights onnxruntime reads from `path`'s folder; `path` itself where no rewrite
    applies."""
    import onnx

    from .head import head_positions
    from .int8_rows import rows_apart

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - an unreadable graph fails below, with onnxruntime's own message
        if lora is not None:
            raise ModelError(f"lora: {path.name} cannot be read to give it the adapters' path ({e})") from None
        log.info("%s is not rewritten: %s: %s", path.name, type(e).__name__, e)
        return str(path)
    changed = False
    if int8_rows:
        count, reason = rows_apart(model)
        if reason:
            log.warning("%s quantizes its activations over the whole batch: %s", path.name, reason)
        elif count:
            log.info("%s quantizes its activations per batch row (%d DynamicQuantizeLinear)", path.name, count)
        changed = count > 0
    if lora is not None:
        from .lora.rewrite import add_lora

        projections, _ = add_lora(model, lora)
        log.info("%s takes a LoRA adapter per row on %d projections", path.name, len(projections))
        changed = True
    if head:
        try:
            rewritten, reason = head_positions(model)
        except Exception as e:  # noqa: BLE001 - as above
            rewritten, reason = None, f"{type(e).__name__}: {e}"
        if rewritten is None:
            log.info("%s computes logits at every position: %s", path.name, reason)
        else:
            log.info("%s computes logits only at the positions read", path.name)
            model, changed = rewritten, True
    if not changed:
        return str(path)
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    return model.SerializeToString()
