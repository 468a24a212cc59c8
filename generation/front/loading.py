"""A batching loop over a model loaded from its folder: what the front (and the engine process's
child) start. The loop itself (generation/engine/batching.py) takes a context; loading one reads
the model's family, which sits above the engine.
"""

from __future__ import annotations


def batcher_from_model(cls, source, slots: int = 8, capacity: int | None = None, max_waiting: int = 256,
                       prefix_cache_bytes: int = 0, kv_cache_bytes: int | None = None, max_logprobs: int = 20,
                       threads: int | None = None, provider: str | None = None, variant: str | None = None,
                       cache_mode: str | None = None, draft=None, fuse: bool = True, spin: bool = True,
                       grammar_budget=None, prefill_chunk_tokens: int | None = None, **settings):
    """Load `source` (and `draft`), warm its context up for `slots` rows and start a `cls` loop
    (a ContinuousBatcher, or the engine process's forwarding one) over it; EngineOptions
    (options.py) says what each argument is."""
    import generation  # the package's load, context and compile (generation/__init__.py)

    spin_wait = spin and draft is None  # the draft's runs come between the model's (generation.load)
    model = generation.load(source, variant=variant, provider=provider, threads=threads, spin_wait=spin_wait,
                            fuse=fuse)
    if draft is not None:
        draft = generation.load(draft, provider=provider, threads=threads, spin_wait=False, fuse=fuse)
    ctx = generation.context(model, cache_mode=cache_mode, token_logprobs=max_logprobs >= 0,
                             top_logprobs=max(0, max_logprobs), draft=draft, grammar_budget=grammar_budget, **settings)
    ctx = generation.compile(ctx, batch_size=slots)
    return cls(ctx, slots=slots, capacity=capacity, max_waiting=max_waiting, prefix_cache_bytes=prefix_cache_bytes,
               kv_cache_bytes=kv_cache_bytes, prefill_chunk_tokens=prefill_chunk_tokens)
