"""The generation context: a model, its settings, and how its cache and prompts run."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..logits.constraints import GrammarBudget
from ..params.settings import Settings, make_settings, model_settings
from ..params.checks import SettingError, shown
from ..cache import DEVICE_MODES
from ..runtime.graph import CACHE_MODES
from ..runtime.model import Model

PROMPT_STEPS = ("whole", "pieces")
LOGPROBS_OF = ("processed", "raw")
# bench/decode.py measures both on the CPU provider; the whole prompt in one run is faster
# (one call instead of up to log2(length) calls), so it is the default.
DEFAULT_PROMPT_STEPS = "whole"


@dataclass(frozen=True)
class Context:
    model: Model
    settings: Settings
    cache_mode: str
    prompt_steps: str
    batch_size: int | None = None
    buffers: str = "host"  # where the cache lives: 'host' arrays or the session's 'device' (see `context`)
    token_logprobs: bool = False  # each token with its log-probability (see `context`)
    top_logprobs: int = 0  # and the k most likely tokens of its step
    logprobs_of: str = "processed"  # the scores they are the log-softmax of: 'processed' or 'raw'
    processors: tuple = ()  # the user's (state, process) pairs, after transformers' processors
    draft: object = field(default=None, compare=False)  # the draft model's Context (assisted decoding)
    grammar_budget: GrammarBudget = GrammarBudget()  # what a structured_outputs constraint may cost
    # a decode state that generate() left empty, to reuse its buffers and bindings next call
    spare_states: list = field(default_factory=list, compare=False, repr=False)

    @property
    def max_position(self) -> int:
        return self.model.max_context or 1 << 30

    def with_settings(self, **overrides) -> Settings:
        """Settings for one request: this context's settings with `overrides` (validated, an
        adapter against the model's known ones too)."""
        base = {k: getattr(self.settings, k) for k in self.settings.__dataclass_fields__}
        settings = make_settings(base, overrides, self.model.vocab_size, self.model.max_context)
        check_adapter(self.model, settings.adapter)
        return settings


def check_adapter(model, name: str | None) -> None:
    """SettingError naming `adapter` where `model` does not know adapter `name` (None: the base)."""
    if name is None:
        return
    known = getattr(model, "lora", None)
    if known is None:
        raise SettingError("adapter", f"adapter {name!r}: this model was loaded without LoRA adapters (max_loras)")
    if name not in known.known:
        raise SettingError("adapter", f"adapter {name!r} is not one this model knows "
                                      f"({', '.join(sorted(known.known)) or 'none loaded'})")


def context(model: Model, *, cache_mode: str | None = None, prompt_steps: str = DEFAULT_PROMPT_STEPS,
            token_logprobs: bool = False, top_logprobs: int = 0, logprobs_of: str = "processed",
            processors=(), draft=None, draft_cache_mode: str | None = None, grammar_budget=None,
            buffers: str | None = None, **overrides) -> Context:
    """The context for `model`: generation_config.json, then `overrides` (any generation
    setting: max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty, ...).

    cache_mode: force a mode the graph supports (`model.graph.modes`); default its native mode.
    prompt_steps: 'whole' (the prompt in one run) or 'pieces' (power-of-two pieces, as the seed).
    token_logprobs: give each token's log-probability: the log-softmax of the scores it was
    chosen from (transformers' compute_transition_scores with normalize_logits=True), or of the
    raw logits with logprobs_of='raw' (what vLLM reports). top_logprobs: also the k most likely
    tokens of each step, with theirs. processors: (state, process) pairs (processors.py), applied
    after transformers' processors and before the sampling warpers. draft: a draft model (a
    folder or a loaded Model with the same tokenizer) that proposes tokens the model verifies
    (assisted.py; num_assistant_tokens, num_assistant_tokens_schedule), its cache in
    `draft_cache_mode` (default its native mode). grammar_budget: what compiling a
    structured_outputs constraint may cost (constraints.GrammarBudget, or a dict of some of its
    fields; default its defaults). buffers: where the cache's buffers live: 'device' (owned by
    the session's device, only the read logits crossing to the host: cache/in_place_device.py;
    the in_place mode only) or 'host' (numpy arrays bound by pointer, the CPU's fastest);
    default 'device' for an in_place cache on a CUDA session, else 'host'.
    """
    if cache_mode is None:
        cache_mode = model.graph.native_mode
    if cache_mode not in CACHE_MODES + ("seq2seq",):
        raise SettingError("cache_mode", f"cache_mode must be one of {', '.join(CACHE_MODES)}, not {shown(cache_mode)}")
    if cache_mode not in model.graph.modes:
        fused = (f", the fused rewrite of {model.fused_from.name}: load it with fuse=False for the export's own modes"
                 if model.fused_from is not None else "")
        raise SettingError("cache_mode", f"cache_mode '{cache_mode}' does not fit this graph "
                                         f"({model.decoder_path.name} runs as {' or '.join(model.graph.modes)}{fused})")
    buffers = _buffers(model, cache_mode, buffers)
    if prompt_steps not in PROMPT_STEPS:
        raise SettingError("prompt_steps", f"prompt_steps must be one of {', '.join(PROMPT_STEPS)}, "
                                           f"not {shown(prompt_steps)}")
    if not isinstance(token_logprobs, bool):
        raise SettingError("token_logprobs", f"token_logprobs must be true or false, not {shown(token_logprobs)}")
    if not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool) or not 0 <= top_logprobs <= model.vocab_size:
        raise SettingError("top_logprobs", f"top_logprobs must be an integer from 0 to the vocabulary size, "
                           f"not {shown(top_logprobs)}")
    if logprobs_of not in LOGPROBS_OF:
        raise SettingError("logprobs_of", f"logprobs_of must be one of {', '.join(LOGPROBS_OF)}, "
                                          f"not {shown(logprobs_of)}")
    processors = tuple(processors)
    for i, pair in enumerate(processors):
        if not (isinstance(pair, tuple) and len(pair) == 2 and all(callable(f) for f in pair)):
            raise SettingError("processors", f"processors[{i}] must be a (state, process) pair of functions, "
                                             f"not {shown(pair)}")
    grammar_budget = GrammarBudget.of(grammar_budget)
    base = model_settings(model.config, model.generation_config, model.max_context, model.vocab_size)
    settings = make_settings(base, overrides, model.vocab_size, model.max_context)
    if draft is not None:
        draft = _draft_context(model, draft, draft_cache_mode, prompt_steps)
    _check_verify(cache_mode, "draft" if draft is not None else
                  "prompt_lookup_num_tokens" if settings.prompt_lookup_num_tokens else None)
    return Context(model=model, settings=settings, cache_mode=cache_mode, prompt_steps=prompt_steps, buffers=buffers,
                   token_logprobs=token_logprobs or top_logprobs > 0, top_logprobs=top_logprobs,
                   logprobs_of=logprobs_of, processors=processors, draft=draft, grammar_budget=grammar_budget)


BUFFERS = ("host", "device")


def _buffers(model: Model, cache_mode: str, buffers: str | None) -> str:
    """Where the cache lives: as asked, or by default on the device of a CUDA session's in_place
    cache (RAYMUTER_BUFFERS=device: a CPU session's in_place cache too, on CPU OrtValues, the code
    a CUDA session runs); SettingError where the mode keeps its buffers on the host only."""
    windowed = cache_mode == "append" and bool(model.attention_window or model.graph.keys_at_end)
    on_device = cache_mode in DEVICE_MODES and not windowed
    if buffers is None:
        device = model.provider == "cuda" or os.environ.get("RAYMUTER_BUFFERS") == "device"
        return "device" if device and on_device else "host"
    if buffers not in BUFFERS:
        raise SettingError("buffers", f"buffers must be one of {', '.join(BUFFERS)}, not {shown(buffers)}")
    if buffers == "device" and not on_device:
        what = "a sliding window's append cache" if windowed else f"cache_mode '{cache_mode}'"
        raise SettingError("buffers", f"buffers 'device': {what} keeps its buffers on the host (a sliding "
                                      f"window's columns move with each row; see cache/windowed.py)")
    return buffers


def _check_verify(cache_mode: str, asked: str | None) -> None:
    """Assisted decoding (`asked`: the setting that asks for it) verifies candidates through the
    cache's verify and rewind: a mode without them is refused now, naming what it lacks."""
    from ..cache import CACHES
    from ..cache.base import VERIFY_VERBS, missing_verbs

    missing = missing_verbs(CACHES[cache_mode], VERIFY_VERBS) if asked else []
    if missing:
        raise SettingError(asked, f"{asked}: assisted decoding verifies candidates through the cache's "
                                  f"{' and '.join(VERIFY_VERBS)}; cache_mode '{cache_mode}' "
                                  f"({CACHES[cache_mode].__name__}) has no {', '.join(missing)}")


def assisted_refusal(model: Model, how: str, num_beams: int = 1, draft: Model | None = None) -> str | None:
    """Why assisted decoding cannot run here, or None: the one statement of what it supports
    (decoder-only text models, one beam), for a draft model and for prompt lookup alike. `how`:
    the setting that asks for it ("draft", "prompt_lookup_num_tokens"), which the message names."""
    what = "assisted decoding with a draft" if how == "draft" else "prompt lookup"
    if model.is_seq2seq or (draft is not None and draft.is_seq2seq):
        return f"{how}: {what} runs decoder-only models"
    if getattr(model, "vision_session", None) is not None:
        return f"{how}: {what} runs text models; this one reads images"
    if num_beams > 1:
        return f"{how}: {what} runs decoder-only text models with num_beams=1, not {num_beams}"
    return None


def _draft_context(model: Model, draft, cache_mode: str | None, prompt_steps: str) -> Context:
    """The draft's context: greedy, no processors, no eos (its tokens only propose). A draft
    named by its folder loads as the model did (`model.loader`: generation.load, its family too)."""
    if not isinstance(draft, Model):
        from ..runtime.model import load

        draft = (model.loader or load)(draft, threads=1)
    if draft.vocab_size != model.vocab_size:
        raise ValueError(f"draft: the draft model has {draft.vocab_size} token ids, the model {model.vocab_size}; "
                         "a draft needs the model's tokenizer")
    refusal = assisted_refusal(model, "draft", draft=draft)
    if refusal is not None:
        raise ValueError(refusal)
    return context(draft, cache_mode=cache_mode, prompt_steps=prompt_steps, do_sample=False, eos_token_id=[],
                   repetition_penalty=1.0, no_repeat_ngram_size=0, bad_words_ids=None, sequence_bias=None,
                   min_length=0, min_new_tokens=None, suppress_tokens=None, begin_suppress_tokens=None,
                   forced_bos_token_id=None, forced_eos_token_id=None, exponential_decay_length_penalty=None,
                   encoder_repetition_penalty=1.0, encoder_no_repeat_ngram_size=0, frequency_penalty=0.0,
                   presence_penalty=0.0)
