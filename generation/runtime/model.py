"""Load a model folder in Hugging Face layout into onnxruntime sessions.

Three layouts are found, in this order:
  (c) onnxruntime-genai builds: `genai_config.json` names the decoder file (`model.onnx`, with
      `model.onnx.data`); the configuration comes from `config.json` when present, else from
      `genai_config.json`.
  (b) transformers.js / onnx-community exports: `onnx/decoder_model_merged{_variant}.onnx`
      (or `onnx/model{_variant}.onnx`), with `use_cache_branch`.
  (a) Optimum exports: `model.onnx` (or `decoder_model_merged.onnx`) at the top of the folder.
An encoder-decoder folder (config.json `is_encoder_decoder`) has `encoder_model.onnx` and
`decoder_model_merged.onnx` (or the unmerged `decoder_model.onnx` + `decoder_with_past_model.onnx`),
at the top or in `onnx/`.
A vision-language folder (onnx-community layout) has a decoder that takes `inputs_embeds`, with
`embed_tokens.onnx` (token ids -> embeddings) and `vision_encoder.onnx` beside it (or in `onnx/`);
its config.json keeps the text model's fields under `text_config`, read here as if at the top.
A hub id ("org/name") that is not a local folder is downloaded with `huggingface_hub`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import ModelError
from .fusion import cache_root, fused_decoder
from .graph import DecoderGraph, GraphError, read_graph
from .hooks import Hooks
from .positions import append_layout
from .precision import CHOICES as PRECISIONS
from .precision import Choice, choose
from .session import captures_graphs, chosen_provider, open_session

__all__ = ["Encoder", "Model", "ModelError", "default_threads", "load", "open_session", "read_json", "resolve_folder"]

log = logging.getLogger(__name__)

# transformers.js / onnx-community dtype suffixes.
VARIANTS = ("fp16", "q4", "q4f16", "quantized", "int8", "uint8", "bnb4")
_DECODER_NAMES = ("onnx/decoder_model_merged", "onnx/model", "decoder_model_merged", "model")


@dataclass
class Encoder:
    """The encoder of an encoder-decoder model: text (input_ids, attention_mask) or audio
    (input_features) in, last_hidden_state out."""

    path: Path
    session: object
    input_names: tuple[str, ...]
    output_name: str

    @property
    def takes_audio(self) -> bool:
        return "input_features" in self.input_names

    @property
    def takes_images(self) -> bool:
        return "pixel_values" in self.input_names


@dataclass
class Model:
    """A loaded decoder: its session, what its graph takes, and its configuration."""

    folder: Path
    decoder_path: Path
    session: object  # onnxruntime.InferenceSession
    graph: DecoderGraph
    config: dict
    generation_config: dict
    provider: str
    threads: int
    tokenizer_path: Path | None = None
    extras: dict = field(default_factory=dict)
    encoder: "Encoder | None" = None  # encoder-decoder models: the encoder, run once per request
    first_step_session: object = None  # an unmerged decoder pair: decoder_model.onnx (no past), step 0
    embed_session: object = None  # vision-language models: embed_tokens.onnx, run at every step
    vision_session: object = None  # and vision_encoder.onnx, run once per image
    family: str = "text"  # generation.families: what the folder is, decided by generation.load
    hooks: Hooks = field(default_factory=Hooks)  # what its family adds to the engine's layers (runtime/hooks.py)
    # the load that made it (generation.load: with its family), so a draft model named by its
    # folder loads the same way (core/context.py); None: runtime.model.load
    loader: Callable | None = field(default=None, compare=False, repr=False)
    fused_from: Path | None = None  # the decoder file whose fused rewrite this is (generation.runtime.fusion)
    # the decoder session captures CUDA graphs (load's cuda_graphs): its in_place device cache runs
    # each class as a captured graph (cache/in_place_device.py)
    cuda_graphs: bool = False
    precision: str | None = None  # what load ran it at (runtime.precision: None, as exported) ...
    precision_reason: str = ""  # ... and why (an 'auto' choice's reasoning)
    # LoRA adapters per row (load's lora): runtime.lora.registry.Adapters, the bank and its places
    lora: object = None

    @property
    def is_seq2seq(self) -> bool:
        return self.encoder is not None

    @property
    def vocab_size(self) -> int:
        return self.graph.vocab_size

    @property
    def image_token_id(self) -> int | None:
        """The token whose embeddings image features replace (None: a text-only model)."""
        value = self.config.get("image_token_id")
        return value if isinstance(value, int) and self.vision_session is not None else None

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """ids [n, S] -> inputs_embeds [n, S, hidden] through embed_tokens.onnx."""
        return self.embed_session.run(None, {"input_ids": np.ascontiguousarray(ids, np.int64)})[0]

    @property
    def attention_window(self) -> int | None:
        """The sliding window of the decoder's local attention layers, where one can be crossed
        (smaller than the context); None where every layer sees the whole context. Read from
        config.json as transformers 4.57 reads it: GPT-Neo's `window_size` where a layer is
        'local'; else `sliding_window`, unless `use_sliding_window` is false (Qwen2) or no layer
        type is 'sliding_attention' (Gemma 2/3, gpt-oss, Qwen2 name their layers)."""
        config = self.config
        if config.get("model_type") == "gpt_neo":
            window = config.get("window_size") if "local" in (config.get("attention_layers") or []) else None
        elif config.get("use_sliding_window") is False:
            window = None
        elif isinstance(config.get("layer_types"), list) and "sliding_attention" not in config["layer_types"]:
            window = None
        else:
            window = config.get("sliding_window")
        if not isinstance(window, int) or window <= 0 or window >= (self.max_context or window + 1):
            return None
        return window

    @property
    def max_context(self) -> int | None:
        """Longest sequence the model's positions allow (None when the config does not say)."""
        for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "context_length",
                    "max_target_positions"):  # the last: Whisper's decoder
            value = self.config.get(key)
            if isinstance(value, int) and value > 0:
                return value
        return None


def read_json(path: Path, required: bool) -> dict:
    """The JSON object in `path`; {} for a missing file that is not `required`. ModelError for a
    missing required file, invalid JSON or a value that is not an object."""
    if not path.exists():
        if required:
            raise ModelError(f"{path.name} is missing from {path.parent}")
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def _looks_like_hub_id(source: str) -> bool:
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "~")) and "\\" not in source


def resolve_folder(source: str | os.PathLike, variant: str | None = None) -> Path:
    """The local folder for `source`: the folder itself, or a hub download of its files."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        raise ModelError(f"'{source}' is a file; pass the model folder that holds config.json")
    if not _looks_like_hub_id(str(source)):
        raise ModelError(f"model folder '{source}' does not exist")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a dependency of raymuter
        raise ModelError(f"'{source}' is not a local folder and huggingface_hub is not installed") from None
    suffix = f"_{variant}" if variant else ""
    patterns = ["*.json", "*.jinja", "*.txt", "*.model", f"onnx/decoder_model_merged{suffix}.onnx*",
                f"onnx/model{suffix}.onnx*", "model.onnx*", "decoder_model_merged.onnx*",
                f"onnx/embed_tokens{suffix}.onnx*", f"onnx/vision_encoder{suffix}.onnx*"]
    try:
        return Path(snapshot_download(str(source), allow_patterns=patterns))
    except Exception as e:  # network errors, missing repos, offline mode
        raise ModelError(
            f"'{source}' is not a local folder, and downloading it from the Hugging Face hub failed "
            f"(hub unreachable, offline, or no such repository): {type(e).__name__}: {e}") from None


def preprocessor_config(model: "Model") -> dict:
    """preprocessor_config.json of the model's folder (empty where it has none)."""
    path = Path(model.folder) / "preprocessor_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def config_texts(model: "Model") -> list[str]:
    """config.json and generation_config.json as the model's folder holds them (those present),
    for what identifies a model's configuration (a server's system_fingerprint)."""
    folder = Path(model.folder)
    return [(folder / f).read_text() for f in ("config.json", "generation_config.json") if (folder / f).is_file()]


def _genai_decoder(folder: Path, genai: dict) -> tuple[Path, dict, dict]:
    model = genai.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("decoder"), dict):
        raise ModelError(f"{folder / 'genai_config.json'}: field 'model.decoder' is missing")
    decoder = model["decoder"]
    filename = decoder.get("filename")
    if not filename:
        raise ModelError(f"{folder / 'genai_config.json'}: field 'model.decoder.filename' is missing")
    ins, outs = decoder.get("inputs", {}), decoder.get("outputs", {})
    layers = decoder.get("num_hidden_layers", 0)
    present = {}
    for kind in ("key", "value"):
        past_t, present_t = ins.get(f"past_{kind}_names"), outs.get(f"present_{kind}_names")
        if past_t and present_t:
            present.update({past_t % i: present_t % i for i in range(layers)})
    config = {
        "vocab_size": model.get("vocab_size"),
        "num_key_value_heads": decoder.get("num_key_value_heads"),
        "num_attention_heads": decoder.get("num_attention_heads"),
        "hidden_size": decoder.get("hidden_size"),
        "head_dim": decoder.get("head_size"),
        "num_hidden_layers": layers,
        "context_length": model.get("context_length"),
        "eos_token_id": model.get("eos_token_id"),
        "bos_token_id": model.get("bos_token_id"),
        "pad_token_id": model.get("pad_token_id"),
    }
    return folder / filename, {k: v for k, v in config.items() if v is not None}, present


def find_decoder(folder: Path, variant: str | None) -> Path:
    """The decoder file of an Optimum or transformers.js folder, for `variant` (None: fp32)."""
    if variant is not None and variant not in VARIANTS and variant != "fp32":
        raise ModelError(f"variant '{variant}' is not one of fp32, {', '.join(VARIANTS)}")
    suffix = "" if variant in (None, "fp32") else f"_{variant}"
    for name in _DECODER_NAMES:
        candidate = folder / f"{name}{suffix}.onnx"
        if candidate.exists():
            return candidate
    found = sorted(str(p.relative_to(folder)) for p in list(folder.glob("*.onnx")) + list(folder.glob("onnx/*.onnx")))
    if not found:
        raise ModelError(f"no ONNX decoder in {folder}: expected model.onnx, onnx/decoder_model_merged.onnx "
                         "or genai_config.json")
    have = sorted({p.rsplit("_", 1)[1][:-5] for p in found if p.rsplit("_", 1)[-1][:-5] in VARIANTS})
    raise ModelError(f"no decoder file for variant '{variant or 'fp32'}' in {folder}; found {found}"
                     + (f" (pass variant= one of {have})" if have else ""))


def default_threads() -> int:
    """One a core this process may use, within its cgroup's CPU quota (runtime.cores.allowed)."""
    from .cores import allowed

    return len(allowed())


def load(source: str | os.PathLike, *, variant: str | None = None, provider: str | None = None,
         threads: int | None = None, spin_wait: bool = True, fuse: bool = True, precision: str | None = None,
         cuda_graphs: bool = False, lora=None) -> Model:
    """Load the decoder of `source` (a folder or a hub id).

    variant: dtype variant of a transformers.js export (fp16, q4, quantized, ...), None for fp32.
    provider: 'cuda', 'cpu', or None for CUDA where usable, else CPU.
    threads: onnxruntime intra-op threads (default: the CPUs this process may use).
    spin_wait: onnxruntime's idle threads spin between runs (the fastest for a session alone);
    False where another session of the process runs between its runs, as a draft model's does
    (load both so: measured 20% faster with a draft on 2 cores, 5-10% slower alone).
    fuse: run an Optimum / transformers.js decoder of a family the rewrite knows (Llama, Mistral,
    Qwen2, Qwen3, Granite, Phi-3, Gemma: generation.runtime.fusion.FAMILIES) as its fused rewrite
    (generation.runtime.fusion: built once, cached under $RAYMUTER_CACHE, checked against the
    source); False runs the file as exported. precision (runtime.precision): 'fp32' or 'fp16', the
    fused graph's (None: fp16 on CUDA, whose GroupQueryAttention takes float16; fp32 on the CPU);
    'int8', a float32 decoder's MatMuls on int8 weights and per-token int8 activations
    (runtime.quantize; built once, cached; the CPU); 'auto', the one this machine is fast at.
    cuda_graphs: the decoder session captures CUDA graphs, its in_place cache on device buffers
    replaying one per class (CUDA only; off by default; where onnxruntime refuses the graph, the
    session runs without them and the log says why).
    lora: a runtime.lora.registry.LoraSpec: each projection of the decoder takes a LoRA adapter per
    batch row (runtime.lora: `model.lora`, the adapters by name; float weights only, so 'auto'
    precision picks fp32); None: no adapter path in the graph, nothing to pay.

    The model's family is not looked at here: `generation.load` (generation.families.load) loads
    through this and then gives the model its family and that family's hooks.
    """
    if not isinstance(fuse, bool):
        raise ModelError(f"fuse must be true or false, not {fuse!r}")
    if precision is not None and precision not in PRECISIONS:
        raise ModelError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if not isinstance(cuda_graphs, bool):
        raise ModelError(f"cuda_graphs must be true or false, not {cuda_graphs!r}")
    if cuda_graphs and chosen_provider(provider) != "cuda":
        raise ModelError(f"cuda_graphs needs the CUDA provider; this session runs on {chosen_provider(provider)}")
    return _load(source, variant, provider, threads, spin_wait, fuse, precision, cuda_graphs, lora)


def _load(source, variant: str | None, provider: str | None, threads: int | None, spin_wait: bool,
          fuse: bool, precision: str | None = None, cuda_graphs: bool = False, lora=None) -> Model:
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ModelError(f"threads must be a positive integer, not {threads!r}")
    folder = resolve_folder(source, variant)
    genai_path = folder / "genai_config.json"
    decoder_path, config, present_names = decoder_files(folder, variant)
    generation_config = read_json(folder / "generation_config.json", required=False)
    threads = threads or default_threads()
    tokenizer = folder / "tokenizer.json"
    tokenizer_path = tokenizer if tokenizer.exists() else None
    if config.get("is_encoder_decoder"):
        if precision not in (None, "auto", "fp32"):
            raise ModelError(f"precision {precision!r} applies to decoder-only models; an encoder-decoder runs as exported")
        if lora is not None:
            raise ModelError("lora: adapters apply to decoder-only models; an encoder-decoder runs without them")
        return _load_seq2seq(folder, variant, provider, threads, config, generation_config, tokenizer_path)
    choice = planned_precision(decoder_path, config, precision, provider)
    if lora is not None and choice.precision == "int8":
        if precision == "int8":
            raise ModelError("precision 'int8' quantizes the projections LoRA adapters add to: run adapters at "
                             "fp32 (or 'auto', which picks it for them)")
        choice = Choice("fp32", "LoRA adapters apply to float projections (the 'auto' choice was int8)")
    if choice.precision == "int8" and chosen_provider(provider) != "cpu":
        raise ModelError("precision 'int8' runs on the CPU provider only (its int8 kernels are MLAS's)")
    fused, source = None, None
    if fuse and not genai_path.exists():
        def load_source():  # asked for only when the cache has no answer for this file yet
            nonlocal source
            session, used = open_session(decoder_path, provider, threads, spin_wait, head=True, int8_rows=True)
            source = session, used, read_graph(decoder_path, session, _config_dims(config), present_names)
            return source[0], source[2]
        fused = fused_decoder(decoder_path, config, chosen_provider(provider), load_source,
                              choice.precision if choice.precision in ("fp32", "fp16") else None)
    path = fused or decoder_path
    if choice.precision == "fp16" and fused is None:
        choice = Choice(None, "fp16 was asked for, but the fused rewrite does not apply (the log says why): the file "
                              "runs as exported")
    if choice.precision == "int8":
        path, source = _int8_decoder(path, config, present_names, tokenizer_path), None
    if fused is None and source is not None and lora is None:  # refused just now: the source is loaded already
        session, used, graph = source
    else:
        source = None  # the source's weights are not kept beside the fused graph's
        session, used = open_session(path, provider, threads, spin_wait, head=True, int8_rows=True,
                                     cuda_graphs=cuda_graphs, lora=config if lora is not None else None)
        graph = read_graph(path, session, _config_dims(config), present_names)
    graph = _placed(graph, config, path)
    if lora is not None and graph.has_inputs_embeds:
        raise ModelError("lora: adapters apply to decoder-only text models; a vision-language model runs without them")
    model = Model(folder=folder, decoder_path=path, session=session, graph=graph, config=config,
                  generation_config=generation_config, provider=used, threads=threads, tokenizer_path=tokenizer_path,
                  fused_from=decoder_path if fused else None,
                  cuda_graphs=cuda_graphs and used == "cuda" and captures_graphs(session),
                  precision=choice.precision, precision_reason=choice.reason)
    if lora is not None:
        from .lora.registry import adapters_for

        model.lora = adapters_for(path, config, lora, graph)
    log.info("%s runs at %s: %s", model.folder, choice.name, choice.reason)
    if graph.has_inputs_embeds:
        _load_vision_parts(model, variant, provider, threads)
    return model


def planned_precision(decoder_path: Path | None, config: dict, precision: str | None, provider: str | None) -> Choice:
    """The precision `load` runs the decoder at `decoder_path` at, as asked, and why (before a
    fused rewrite that may refuse float16: load then says it runs as exported)."""
    if config.get("is_encoder_decoder"):
        return Choice(None, "an encoder-decoder runs as exported")
    return choose(precision, chosen_provider(provider), decoder_path)


def _int8_decoder(path: Path, config: dict, present_names: dict[str, str], tokenizer_path: Path | None) -> Path:
    """The int8 rewrite of the float32 decoder at `path` (runtime.quantize), smoothed by the ranges
    of a prefill of its calibration text."""
    from .quantize import calibration_ids, quantized_decoder

    def graph_of(session):  # the calibration session's view of the graph at `path`
        return read_graph(path, session, _config_dims(config), present_names)

    ids = calibration_ids(tokenizer_path, int(config.get("vocab_size") or 0) or 2**31)
    return quantized_decoder(path, cache_root(), ids, graph_of)


def decoder_files(folder: Path, variant: str | None) -> tuple[Path | None, dict, dict[str, str]]:
    """What `load` reads of a folder before it opens a session: the decoder file (None for an
    encoder-decoder, whose files _load_seq2seq finds), the configuration and the genai build's
    present names; ModelError naming what is missing (config.json, the decoder file). A server
    checks a folder with it before it starts anything."""
    genai_path = folder / "genai_config.json"
    if genai_path.exists():
        if variant not in (None, "fp32"):
            raise ModelError(f"variant '{variant}' does not apply to {folder}: an onnxruntime-genai build has "
                             "one decoder, named by genai_config.json")
        decoder_path, config, present_names = _genai_decoder(folder, read_json(genai_path, True))
        config.update(read_json(folder / "config.json", required=False))
        if not decoder_path.exists():
            raise ModelError(f"{decoder_path.name}, named by genai_config.json, is missing from {folder}")
        return decoder_path, config, present_names
    config = _text_fields(read_json(folder / "config.json", required=True))
    return (None if config.get("is_encoder_decoder") else find_decoder(folder, variant)), config, {}


def _placed(graph: DecoderGraph, config: dict, path: Path) -> DecoderGraph:
    """A graph that takes no position_ids runs `append` where its family places tokens by the
    attention mask or by column distances (runtime/positions.py), else `grow`; the log says which
    and why."""
    if graph.native_mode != "grow" or graph.has_group_query_attention or graph.has_position_ids:
        return graph
    layout, why = append_layout(config)
    if layout is None:
        log.info("%s runs in the grow cache mode: %s", path.name, why)
        return graph
    log.info("%s runs in the append cache mode without position_ids: %s", path.name, why)
    return replace(graph, native_mode="append", keys_at_end=layout == "end")


def _text_fields(config: dict) -> dict:
    """A vision-language config.json with its text model's fields (`text_config`; a
    vision-encoder-decoder's `decoder`) read as if at the top; the top level wins where both give
    a field (eos, pad and bos sit at both)."""
    text = config.get("text_config")
    if config.get("model_type") == "vision-encoder-decoder":
        text = config.get("decoder")
    return {**text, **config} if isinstance(text, dict) else config


def _load_vision_parts(model: Model, variant: str | None, provider: str | None, threads: int) -> None:
    """embed_tokens.onnx (required: the decoder takes inputs_embeds) and vision_encoder.onnx
    (optional: without it the model runs text only), beside the decoder or in `onnx/`."""
    suffix = "" if variant in (None, "fp32") else f"_{variant}"
    folder = model.folder
    embed = _find(folder, "embed_tokens", suffix) or _find(model.decoder_path.parent, "embed_tokens", suffix)
    if embed is None:
        raise ModelError(f"{model.decoder_path.name} takes inputs_embeds, but there is no embed_tokens{suffix}.onnx "
                         f"in {folder} (or onnx/) to make them")
    model.embed_session, _ = open_session(embed, provider, threads)
    vision = _find(folder, "vision_encoder", suffix) or _find(model.decoder_path.parent, "vision_encoder", suffix)
    if vision is not None:
        model.vision_session, _ = open_session(vision, provider, threads)


def _find(folder: Path, stem: str, suffix: str) -> Path | None:
    for candidate in (folder / f"{stem}{suffix}.onnx", folder / "onnx" / f"{stem}{suffix}.onnx"):
        if candidate.exists():
            return candidate
    return None


def _load_seq2seq(folder: Path, variant: str | None, provider: str | None, threads: int, config: dict,
                  generation_config: dict, tokenizer_path: Path | None) -> Model:
    """An encoder-decoder folder (Optimum or transformers.js layout): encoder_model.onnx and
    decoder_model_merged.onnx, or the unmerged decoder_model.onnx + decoder_with_past_model.onnx."""
    suffix = "" if variant in (None, "fp32") else f"_{variant}"
    encoder_path = _find(folder, "encoder_model", suffix)
    if encoder_path is None:
        raise ModelError(f"{folder}: config.json says is_encoder_decoder, but there is no "
                         f"encoder_model{suffix}.onnx (in the folder or onnx/)")
    merged = _find(folder, "decoder_model_merged", suffix)
    with_past = _find(folder, "decoder_with_past_model", suffix)
    first = _find(folder, "decoder_model", suffix)
    if merged is None and (with_past is None or first is None):
        raise ModelError(f"{folder}: no decoder for the encoder: expected decoder_model_merged{suffix}.onnx, "
                         f"or decoder_model{suffix}.onnx with decoder_with_past_model{suffix}.onnx")
    decoder_path = merged or with_past
    encoder_session, used = open_session(encoder_path, provider, threads)
    session, _ = open_session(decoder_path, provider, threads)
    first_session = None if merged is not None else open_session(first, provider, threads)[0]
    try:
        graph = read_graph(decoder_path, session, _config_dims(config))
    except GraphError as e:
        raise ModelError(str(e)) from None
    if not graph.is_seq2seq or not (graph.cross_cache or graph.has_encoder_hidden_states):
        # (a GPT-2 decoder of a vision-encoder-decoder keeps no cross cache: it takes
        # encoder_hidden_states at every step)
        raise ModelError(f"{decoder_path.name}: a decoder of an encoder-decoder model takes encoder_hidden_states "
                         "and past_key_values.N.encoder.* (export with the -with-past task)")
    outputs = [o.name for o in encoder_session.get_outputs()]
    encoder = Encoder(encoder_path, encoder_session, tuple(i.name for i in encoder_session.get_inputs()),
                      "last_hidden_state" if "last_hidden_state" in outputs else outputs[0])
    return Model(folder=folder, decoder_path=decoder_path, session=session, graph=graph, config=config,
                 generation_config=generation_config, provider=used, threads=threads, tokenizer_path=tokenizer_path,
                 encoder=encoder, first_step_session=first_session)


def _config_dims(config: dict) -> dict:
    """Cache dims and vocabulary from config.json, for graphs whose dims are symbolic (the keys
    of Llama/Qwen2, GPT-2, and the decoders of Marian/BART/Whisper and T5)."""
    heads = (config.get("num_attention_heads") or config.get("n_head") or config.get("decoder_attention_heads")
             or config.get("num_heads"))
    hidden = config.get("hidden_size") or config.get("n_embd") or config.get("d_model")
    return {
        "num_key_value_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config.get("d_kv") or (hidden // heads if hidden and heads else None),
        "vocab_size": config.get("vocab_size"),
    }
