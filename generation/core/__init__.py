"""The engine's core: a context (model, settings, cache mode) and the decode state and its verbs.

    context.py    `context()`: a model, its settings and how its cache and prompts run
    state.py      DecodeState (new_state, release, the rows' tokens and log-probabilities read out)
    insert.py     rows into it: prefill, insert, admit (from the prefix store), admit_beams
    step.py       step (every live row one token) and advance (runs of greedy steps)
    rows.py       each row's token: processors, warpers, draw, stop strings, ends
    chunks.py     a prompt run in chunks, then seated
    stop_strings.py  stop strings: where a row ends (its StopMatcher), and text cut at a stop
    preempt.py    `pause` and `resume`: a row out of its slot and back, its cache recomputed
    keep.py       a finished row's answer into the prefix store: as decoded, or run again as a prompt
    warm.py       `compile`: a context sized for its batches, its session warmed up
    embed.py      text embeddings from a feature-extraction export

The loop over these verbs is generation.engine (the Scheduler, `generate`); the settings they
read are generation.params.
"""
