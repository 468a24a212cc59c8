"""A batching loop over a model loaded from its folder: what the front (and the engine process's
child) start. The loop itself (generation/engine/batching.py) takes a context; loading one reads
the model's family, which sits above the engine. Each takes the EngineOptions whole (options.py):
an option is read where it is used, not passed on by name.
"""

from __future__ import annotations


def load_model(source, options, parent: bool = False, loader=None):
    """The model of `source` as `options` say (EngineOptions: variant, provider, threads, spin,
    fuse, precision). `parent`: the engine process's parent's copy, which only checks requests against its
    context (on the CPU, one thread asleep: the child runs the model). `loader`: another kind's
    load, which takes where the model runs only (an embedding model's load_embedder)."""
    import generation

    provider, threads = ("cpu", 1) if parent else (options.provider, options.threads)
    if loader is not None:
        return loader(source, variant=options.variant, provider=provider, threads=threads)
    spin_wait = options.spin and options.draft is None and not parent  # a draft's runs come between the model's
    return generation.load(source, variant=options.variant, provider=provider, threads=threads, spin_wait=spin_wait,
                           fuse=options.fuse, precision=options.precision, lora=options.lora())


def model_context(model, options, settings: dict, draft=None):
    """The context of `model` as `options` say (log-probabilities, cache mode, grammar budget),
    `settings` over its generation_config.json."""
    import generation

    return generation.context(model, draft=draft, **options.context_arguments(), **settings)


def batcher_from_model(cls, source, options, cores: tuple[int, ...] | None = None, **settings):
    """Load `source` (and the options' draft), warm its context up for the options' slots and
    start a `cls` loop (a ContinuousBatcher, or the engine process's forwarding one) over it.
    `cores`: this process's cores first (the engine process's child), onnxruntime's threads one a
    core unless the options say how many."""
    import generation  # the package's load, context and compile (generation/__init__.py)
    from dataclasses import replace

    if cores:  # before the model loads: onnxruntime's threads start on these cores, one a core
        from generation.runtime.cores import pin, span

        try:
            pin(cores)
        except OSError as e:
            raise ValueError(f"engine_cores: cannot run on cores {span(cores)} ({e.strerror})") from None
        options = replace(options, threads=options.threads or len(cores))
    model = load_model(source, options)
    draft = None
    if options.draft is not None:  # as exported, its threads asleep, without adapters
        draft = load_model(options.draft, replace(options, variant=None, spin=False).with_adapters(None))
    ctx = generation.compile(model_context(model, options, settings, draft), batch_size=warm_rows(options.slots))
    return cls(ctx, **options.loop_arguments())


WARM_ROWS = 32  # the most rows the warm-up runs: onnxruntime's arena keeps what a run took


def warm_rows(slots: int) -> int:
    """The rows a loop of `slots` (0: what the KV budget seats) is warmed up for."""
    return min(slots or WARM_ROWS, WARM_ROWS)
