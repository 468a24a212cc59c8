"""The engine's one loop, over the decode state's verbs (generation.core.state).

    scheduler.py  Scheduler: jobs in, tokens out, over one state of fixed slots (admission at step
                  boundaries, cancellation, candidate verification, beam groups, a family's
                  timestamped windows)
    generate.py   `generate` and `beam_search`: a Scheduler run to completion
    budget.py     admission by memory: what the rows need of the KV cache, against its budget

It sits above `search` and `assisted` (a step runs beam groups and verifies candidates) and below
`families` (Whisper's long-form windows run a Scheduler).
"""
