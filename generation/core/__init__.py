"""The engine's core: a context (model, settings, cache mode) and the decode state and its verbs.

    context.py    `context()`: a model, its settings and how its cache and prompts run
    state.py      DecodeState and its verbs (new_state, prefill, insert, admit, admit_beams, step,
                  release): pure functions of the state for the whole batch
    stop_strings.py  stop strings: where a row ends (its StopMatcher), and text cut at a stop
    preempt.py    `pause` and `resume`: a row out of its slot and back, its cache recomputed
    warm.py       `compile`: a context sized for its batches, its session warmed up
    embed.py      text embeddings from a feature-extraction export

The loop over these verbs is generation.engine (the Scheduler, `generate`); the settings they
read are generation.params.
"""
