"""Raymuter's engine: generation over ONNX decoders with onnxruntime, free of Ray.

    import generation
    model = generation.load("folder-or-hub-id")
    ctx = generation.context(model, max_new_tokens=32, do_sample=False)
    ctx = generation.compile(ctx, batch_size=4)
    rows = generation.generate(ctx, prompts=[[1, 2, 3], [4, 5], []], seeds=[0, 1, 2])

The house, one sub-package per concern, each importing only those listed before it
(tests/test_imports.py holds it to that order):

    runtime    model folders into onnxruntime sessions, graphs, feeds, encoder runs; the hooks a
               model's family gives the layers below the families (runtime/hooks.py)
    params     settings (generation_config.json and overrides, checked), limits, prompts and seeds
    cache      the cache contract and a module per mode; prompts through the decoder
    logits     processors, selection, per-row random numbers, log-probabilities, constraints
    text       tokenizer, chat templates, tool calls
    search     beam search
    core       the context, the decode state and its verbs, stop strings, `compile`, embeddings
    assisted   candidate verification, prompt lookup, draft models
    engine     the one loop (the Scheduler) and `generate` / `beam_search` over it
    families   what each model family adds (Whisper, the vision-language families, ...): one
               contract (families/contract.py); `load` gives a model its family and hooks
    front      the engine's front for servers: requests in, events out
    default_model  the bundled model's files (its training and export are imported only by their
               commands)

`tasks` (text, audio or images in, text out) and `cli` (`raymuter generate`) sit at the top.

The decode-state verbs (`new_state`, `prefill`, `insert`, `admit`, `step`, `release`; beam
searches as groups of rows: `state.admit_beams`) are what the engine's one loop,
`generation.engine.scheduler.Scheduler`, runs on: `generate`, `beam_search`, Whisper's windows and the
decoder deployment's continuous batching all run it.
"""

from .core.context import Context, context
from .core.insert import admit, insert, prefill
from .core.state import DecodeState, Prefix, StepTokens, new_state, release
from .core.step import advance, step
from .core.warm import compile
from .engine.generate import Generated, beam_search, generate
from .params.settings import Settings
from .params.checks import SettingError
from .families import load
from .runtime.model import Model, ModelError
from .search.beam import Hypothesis

__all__ = [
    "Context", "DecodeState", "Generated", "Hypothesis", "beam_search", "Model", "ModelError", "Prefix", "SettingError", "Settings", "StepTokens", "admit", "advance", "compile",
    "context", "generate", "insert", "load", "new_state", "prefill", "release", "step",
]
