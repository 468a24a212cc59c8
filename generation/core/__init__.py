"""The engine's core: a context (model, settings, cache mode), the decode state and its verbs,
and the one loop over them.

    context.py    `context()`: a model, its settings and how its cache and prompts run
    settings.py   Settings: generation_config.json, config.json and the caller's overrides, checked
    state.py      DecodeState and its verbs (new_state, prefill, insert, admit, admit_beams, step,
                  release): pure functions of the state for the whole batch
    scheduler.py  Scheduler: jobs in, tokens out, over one state of fixed slots (admission at step
                  boundaries, cancellation, candidate verification, beam groups)
    generate.py   `generate` and `beam_search`: a Scheduler run to completion
    inputs.py, limits.py, rng.py, stops.py, warm.py: requests checked at the boundary, the most
                  one request may ask, per-row random numbers, stop strings, `compile`
"""
