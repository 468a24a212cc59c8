"""The batching loop's contract: what the front and a server's services call, whichever loop runs.

Three keep it: ContinuousBatcher (batching.py: a Scheduler on a thread of this process),
EngineProcess (process.py: the same loop in a child process, over a pipe) and the known-output
FakeBatcher of the serving tests (deployments/fake.py). A request they hand back is a
batching.Request: its reader side (`events`, `stream`, `abatches`, `result`, `cancel`) is the
caller's, its producer side (`emit`, `finish`, `settle`, `fail`) the loop's.

    batcher: Batcher = ContinuousBatcher(ctx, slots=8)
    request = batcher.submit([1, 2, 3], seed=0, settings={"max_new_tokens": 16}, priority=0)
    completion = request.result()
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .batching import Request

# What every loop's submit takes (a loop may take more: ContinuousBatcher's timestamped windows).
SUBMIT_PARAMETERS = ("prompt", "seed", "settings", "encoder", "prompt_logprobs", "priority", "logprobs")


@runtime_checkable
class Batcher(Protocol):
    """A continuous batching loop: requests in (`submit`: checked at once, a bad setting raising
    ValueError naming it, a full queue QueueFull), their tokens out as they come (the Request);
    the counts a server's metrics and autoscaling read."""

    slots: int  # rows that step together
    capacity: int  # the most tokens a row holds (prompt and new tokens)
    running: int  # requests in slots now (a beam search counts once)
    waiting: int  # requests queued
    occupied: int  # slots held now (a beam search holds num_beams)
    steps: int  # model runs of decode steps so far

    def submit(self, prompt: list[int], seed: int = 0, settings: dict | None = None, encoder=None,
               prompt_logprobs: int | None = None, priority: int = 0, logprobs: bool = True) -> Request: ...

    def close(self) -> None: ...

    @property
    def alive(self) -> bool: ...
