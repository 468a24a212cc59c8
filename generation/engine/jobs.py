"""A job of the scheduler (engine/scheduler.py) and one position of its tokens.

    Job       one prompt to run, and once it ended, what it got (tokens, log-probabilities, reason)
    Update    one position of a step for the jobs it concerns, as Python values (`tokens()`)
    spread    an Update over a batch's rows (generate's on_token events)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.state import StepTokens, with_logprobs
from ..logits.selection import LogProbs
from ..params.settings import Settings
from ..search.beam import Hypothesis


@dataclass(eq=False)
class Job:
    """One prompt to run, and, once it ended, what it got: `reason` is "stop" (eos or a stop
    string), "length" (max_new tokens), "cancelled" or "error" (`error`, the exception).
    `tokens` are its new tokens without the eos token (a beam search's: its best hypothesis;
    `hypotheses` all it returns), with their `logprobs` and `top` alternatives when the
    context computes them. `key` is the caller's own."""

    prompt: list[int]
    seed: int
    settings: Settings
    max_new: int
    encoder: object = None  # one row of EncoderOutputs (an encoder-decoder's source) or PromptImages
    prompt_top: int | None = None  # also the prompt's log-probabilities, with this many alternatives
    key: object = None
    cancelled: bool = False
    reason: str | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top: list | None = None
    hypotheses: list[Hypothesis] | None = None
    error: BaseException | None = None
    admitting: bool = False  # the error came while admitting the job
    prompt_logprobs: object = None  # a prompt_logprobs.PromptLogprobs, before the first token
    started: float | None = None  # perf_counter() when it was admitted (or ended waiting)
    eos_logprob: float | None = None  # the log-probability of the eos token it ended at (token_logprobs)
    cached_tokens: int = 0  # prompt tokens that came from the prefix cache (OpenAI's usage.prompt_tokens_details)
    note: str | None = None  # why a "stop" came before its eos: its constraint left no token (constraints.DeadEnd)
    order: int = 0  # its place in arrival order (the newest running rows are preempted first)
    priority: int = 0  # lower first: waits behind lower values, and gives its slot up to them
    paused: object = None  # a preempted row waiting to resume (core.preempt.Paused)
    preemptions: int = 0  # times it was preempted
    partial: object = None  # its prompt part-way through a prefill in chunks (core.chunks.Partial)

    @property
    def beams(self) -> int:
        return self.settings.num_beams

    @property
    def done(self) -> bool:
        return self.reason is not None

    @property
    def rank(self) -> tuple[int, int]:
        """Its place in the queue and, running, in the order of preemption (the last first)."""
        return self.priority, self.order


@dataclass
class Update:
    """One position of a step (or an admission's first tokens) for the jobs it concerns: row i
    of `out` (a StepTokens) is `jobs[i]`'s."""

    jobs: list[Job]
    out: StepTokens

    def tokens(self) -> list[tuple[Job, int, float | None, list | None]]:
        """(job, token id, its log-probability or None, the top alternatives [(id, logprob)] or
        None) of each job that got a token, as Python values."""
        out = self.out
        got = [i for i in np.flatnonzero(out.token >= 0).tolist() if i not in out.failed]
        token = out.token[got].tolist()
        read = [not self.jobs[i].settings.no_logprobs for i in got]  # rows whose step computed them
        logprob = [None] * len(got) if out.logprob is None else [
            lp if r else None for lp, r in zip(out.logprob[got].tolist(), read)]
        top = [None] * len(got) if out.top is None else [
            list(zip(ids, lps)) if r else None
            for ids, lps, r in zip(out.top_ids[got].tolist(), out.top[got].tolist(), read)]
        return [(self.jobs[i], t, lp, tp) for i, t, lp, tp in zip(got, token, logprob, top)]

def joined(encoders: list, join):
    """The jobs' encoder outputs (EncoderOutputs) or images (PromptImages) as one batch's, as the
    model's family joins them (`join`: its hooks' `join`); None when no job has any."""
    if all(e is None for e in encoders):
        return None
    return join(encoders)


def timestamp_rules(model) -> tuple[int, int, int]:
    """The timestamp rule ids of a timestamped row of `model`, as its family gives them (its
    hooks' `timestamp_rules`); ValueError when the family decodes no timestamps."""
    if model.hooks.timestamp_rules is None:
        raise ValueError(f"{model.folder}: its model family decodes no timestamps")
    return model.hooks.timestamp_rules(model)


def spread(update: Update, rows: np.ndarray, size: int, finished: np.ndarray) -> StepTokens:
    """An Update over `size` rows (its job i is row rows[i]; -1 and nan elsewhere), with
    `finished` (all rows so far) as its finished flags."""
    out = update.out
    tokens = np.full(size, -1, np.int64)
    tokens[rows] = out.token
    lp = None if out.logprob is None else LogProbs(out.logprob, out.top_ids, out.top)
    return with_logprobs(StepTokens(tokens, finished.copy(), bool(out.finished.any())), rows, size, lp)
