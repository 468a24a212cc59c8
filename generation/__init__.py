"""Raymuter's engine: generation over ONNX decoders with onnxruntime, free of Ray.

    import generation
    model = generation.load("folder-or-hub-id")
    ctx = generation.context(model, max_new_tokens=32, do_sample=False)
    ctx = generation.compile(ctx, batch_size=4)
    rows = generation.generate(ctx, prompts=[[1, 2, 3], [4, 5], []], seeds=[0, 1, 2])

The decode-state verbs (`new_state`, `prefill`, `insert`, `admit`, `step`, `release`; beam
searches as groups of rows: `state.admit_beams`) are what the engine's one loop,
`generation.scheduler.Scheduler`, runs on: `generate`, `beam_search`, Whisper's windows and the
decoder deployment's continuous batching all run it.
"""

from .beam import Hypothesis
from .context import Context, context
from .generate import Generated, beam_search, generate
from .model import Model, ModelError, load
from .settings import SettingError, Settings
from .state import DecodeState, Prefix, StepTokens, admit, advance, insert, new_state, prefill, release, step
from .warm import compile

__all__ = [
    "Context", "DecodeState", "Generated", "Hypothesis", "beam_search", "Model", "ModelError", "Prefix", "SettingError", "Settings", "StepTokens", "admit", "advance", "compile",
    "context", "generate", "insert", "load", "new_state", "prefill", "release", "step",
]
