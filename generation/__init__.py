"""Raymuter's engine: generation over ONNX decoders with onnxruntime, free of Ray.

    import generation
    model = generation.load("folder-or-hub-id")
    ctx = generation.context(model, max_new_tokens=32, do_sample=False)
    ctx = generation.compile(ctx, batch_size=4)
    rows = generation.generate(ctx, prompts=[[1, 2, 3], [4, 5], []], seeds=[0, 1, 2])

The house, one sub-package per concern: `core` (context, settings, the decode state and its
verbs, the Scheduler, generate), `runtime` (model folders into onnxruntime sessions, graphs,
feeds, encoder runs), `cache` (the cache contract and a module per mode), `logits` (processors,
selection, log-probabilities), `search` (beam search), `assisted` (candidate verification, prompt
lookup, draft models), `families` (what Whisper and the vision-language families add), `text`
(tokenizer, chat templates), `default_model` (the bundled model's files; its training and export
are imported only by their commands); `tasks` (text, audio or images in, text out) and `cli`
(`raymuter generate`) at the top.

The decode-state verbs (`new_state`, `prefill`, `insert`, `admit`, `step`, `release`; beam
searches as groups of rows: `state.admit_beams`) are what the engine's one loop,
`generation.core.scheduler.Scheduler`, runs on: `generate`, `beam_search`, Whisper's windows and the
decoder deployment's continuous batching all run it.
"""

from .core.context import Context, context
from .core.generate import Generated, beam_search, generate
from .core.settings import SettingError, Settings
from .core.state import DecodeState, Prefix, StepTokens, admit, advance, insert, new_state, prefill, release, step
from .core.warm import compile
from .runtime.model import Model, ModelError, load
from .search.beam import Hypothesis

__all__ = [
    "Context", "DecodeState", "Generated", "Hypothesis", "beam_search", "Model", "ModelError", "Prefix", "SettingError", "Settings", "StepTokens", "admit", "advance", "compile",
    "context", "generate", "insert", "load", "new_state", "prefill", "release", "step",
]
