"""The engine's one loop, over the decode state's verbs (generation.core.state).

    scheduler.py   Scheduler: jobs in, tokens out, over one state of fixed slots (the jobs, the
                   step, cancellation, candidate verification, beam groups, the endings)
    admission.py   its admission at a step boundary (batched prefill, beams, prompt-only passes)
    budget.py      admission by memory: what the rows need of the KV cache, against its budget
    chunked.py     chunked prefill: a long prompt a chunk per step boundary
    preemption.py  preemption and priority: rows paused and resumed exactly, steps ended early
    answers.py     finished rows' answers kept for a next turn (`tidy`: the idle loop's upkeep)
    jobs.py        a Job and an Update (one position of a step's tokens)
    generate.py    `generate` and `beam_search`: a Scheduler run to completion
    batching.py    ContinuousBatcher: a Scheduler on a thread, requests in and their tokens out as
                   they come (a server's loop)
    process.py     EngineProcess: the same loop in a child process, over a pipe
    batcher.py     Batcher: the contract both keep (and deployments/fake.py's known-output one)

It sits above `search` and `assisted` (a step runs beam groups and verifies candidates) and below
`families` (Whisper's long-form windows run a Scheduler).
"""
