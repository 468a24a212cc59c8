"""Which candidates pay for themselves: assisted decoding verifies a row's candidates only
where the tokens they are expected to add outrun the wider run they cost.

A verify step is wider than a plain one, and on a batch it can be much wider: every slot runs
the longest candidate list (append cache), or each row runs the weights alone (in_place: the
GroupQueryAttention operator takes several new tokens of one row at a time). Where a plain step
already fills the hardware (a 125M model at batch 8 on 2 CPU cores is half compute-bound), ten
candidates a row cost five plain steps. Two things, measured as the batch runs, decide:

- a row's acceptance rate `rate` (the chance its next candidate is kept, given the ones before
  were): kept candidates over trials, decaying so it follows the text (a copied span starts and
  ends), from a hopeful prior of 0.8 (worth one trial), so that a row gets tried and the rate
  can come from what it does. k candidates then add sum(rate ** j, j = 1..k) tokens on average;
- the seconds of a run, `a * runs + b * positions` (a: a run's fixed part, reading the weights;
  b: one token position's compute), fitted to the timed steps.

A plan (which rows verify, how many candidates each) is the one that makes the most tokens per
second, found by Dinkelbach's iteration (maximise tokens - rho * seconds, set rho to the plan's
rate, repeat), from rho = the plain step's rate. The plan only drops candidates, so the tokens
are the target's whatever it decides: it may only wrap a generator whose candidates do not
change the output (prompt lookup; not a draft's speculative sampling).
"""

from __future__ import annotations

import time

import numpy as np

PRIOR_RATE = 0.8  # a new row's acceptance rate, worth PRIOR_TRIALS trials: hopeful, so a row is tried
PRIOR_TRIALS = 1.0
RATE_DECAY = 0.9  # a row's evidence fades by this per step: its rate follows the text
COST_DECAY = 0.97  # the run-cost averages forget a step's weight by this
PRIOR_COST_RATIO = 0.05  # b / a before a verify step is timed (a CPU's order of magnitude)
OUTLIER = 3.0  # a step timed past this many times its expected seconds counts as this many


def expected_gain(rates: np.ndarray, width: int) -> np.ndarray:
    """gain[b, k]: the tokens k candidates of row b add on average, sum(rates[b] ** j, j <= k).

    >>> expected_gain(np.array([0.5, 1.0]), 3).tolist()
    [[0.0, 0.5, 0.75, 0.875], [0.0, 1.0, 2.0, 3.0]]
    """
    powers = rates[:, None] ** np.arange(1, width + 1)
    return np.concatenate([np.zeros((len(rates), 1)), np.cumsum(powers, axis=1)], axis=1)


def plan_shared(gain: np.ndarray, counts: np.ndarray, slots: int, a: float, b: float,
                max_seconds: float = np.inf) -> np.ndarray:
    """Counts for a cache that runs every slot as wide as the longest row (1 + max count): the
    cap on candidates that makes the most tokens per second, among the steps that take at most
    `max_seconds`. gain [n, K + 1] (expected_gain), counts [n] the candidates each row has; a, b
    the run's costs. Returns the counts capped (0 everywhere: a plain step).

    >>> plan_shared(expected_gain(np.array([0.9, 0.9]), 4), np.array([4, 2]), 2, 1.0, 0.01).tolist()
    [4, 2]
    >>> plan_shared(expected_gain(np.array([0.9, 0.1]), 4), np.array([4, 4]), 8, 1.0, 0.1).tolist()
    [1, 1]
    >>> plan_shared(expected_gain(np.array([0.2, 0.2]), 4), np.array([4, 4]), 8, 1.0, 0.1).tolist()
    [0, 0]

    Two rows that keep 9 in 10 candidates, on a cheap width: all of them. Eight slots where a
    token position costs a tenth of a run, two live rows: a column costs 0.8 runs and the second
    row's candidates are worth little; one column makes the most tokens per second (3.0 tokens
    in 2.6 runs' time, two 3.82 in 3.4, a plain step 2 in 1.8). Rows that keep 1 in 5: none.
    """
    n, top = len(counts), int(counts.max(initial=0))
    caps = np.arange(top + 1)
    tokens = n + gain[np.arange(n)[:, None], np.minimum(counts[:, None], caps)].sum(axis=0)  # [top + 1]
    seconds = a + b * slots * (1 + caps)
    return np.minimum(counts, _fastest(tokens, seconds, max_seconds))


def plan_rows(gain: np.ndarray, counts: np.ndarray, slots: int, a: float, b: float,
              max_seconds: float = np.inf) -> np.ndarray:
    """Counts for a cache that verifies row by row: a row with candidates runs alone (a + b per
    position); the rows without share one decode of all slots (a + b * slots; a row left alone
    runs by itself). The rows worth a run of their own, each with its best count, found by
    Dinkelbach's iteration on rho, the rate to beat (from the plain step's); a step may take at
    most `max_seconds`.

    >>> plan_rows(expected_gain(np.array([0.95, 0.5, 0.5]), 8), np.array([8, 8, 0]), 3, 1.0, 0.01).tolist()
    [8, 0, 0]
    >>> plan_rows(expected_gain(np.full(8, 0.95), 8), np.full(8, 8), 8, 1.0, 0.01).tolist()
    [0, 0, 0, 0, 0, 0, 0, 0]

    Three slots: the row that keeps 19 in 20 is worth a run of its own (1 + 6.4 tokens expected
    for 1.09 runs' time; with the others' decode 9.4 tokens in 2.12, a plain step 3 in 1.03);
    the second row's run would add 1 token for another run. Eight such rows: a plain step makes
    8 tokens in 1.08 runs' time (7.4 a run), all eight alone 59 in 8.7 (6.8 a run).
    """
    n, top = len(counts), int(counts.max(initial=0))
    k = np.arange(top + 1)
    usable = k[None, :] <= counts[:, None]
    plan = np.zeros(n, np.int64)
    rho = n / (a + b * slots)
    for _ in range(8):
        # each row's best count at rate rho, and its run's net tokens beyond the one it gets anyway
        net = np.where(usable, gain - rho * b * k, -np.inf)
        net[:, 0] = -np.inf
        choice = net.argmax(axis=1)
        value = gain[np.arange(n), choice] - rho * (a + b * (1 + choice))
        order = np.argsort(-value, kind="stable")
        tokens, seconds = np.empty(n + 1), np.empty(n + 1)
        for m in range(n + 1):  # the m rows of most value run alone
            alone, rest = order[:m], n - m
            decode = (a + b * slots) if rest >= 2 or m == 0 else (a + b) if rest == 1 else 0.0
            tokens[m] = n + gain[alone, choice[alone]].sum()
            seconds[m] = decode + a * m + b * (1 + choice[alone]).sum()
        m = _fastest(tokens, seconds, max_seconds)
        plan = np.zeros(n, np.int64)
        plan[order[:m]] = choice[order[:m]]
        if tokens[m] / seconds[m] <= rho * (1 + 1e-9):
            break
        rho = tokens[m] / seconds[m]
    return plan


def _fastest(tokens: np.ndarray, seconds: np.ndarray, max_seconds: float = np.inf) -> int:
    """The option of most tokens per second among those of at most `max_seconds` (option 0,
    the plain step, always counts), if it beats option 0; ties go to the narrower."""
    rates = np.where(seconds <= max_seconds, tokens / seconds, -np.inf)
    rates[0] = tokens[0] / seconds[0]
    choice = int(rates.argmax())
    return choice if rates[choice] > rates[0] * (1 + 1e-9) else 0


def run_shape(widths: np.ndarray, slots: int, row_by_row: bool) -> tuple[float, float]:
    """(runs, token positions) of a step whose live rows run `widths` tokens (1: no candidate),
    as the cache runs them (see plan_shared, plan_rows); a plain step is (1, slots)."""
    if widths.max(initial=1) <= 1:
        return 1.0, float(slots)
    if not row_by_row:
        return 1.0, float(slots * widths.max())
    alone = widths > 1
    rest = int((~alone).sum())
    return (float(alone.sum() + (rest > 0)),
            float(widths[alone].sum() + (slots if rest >= 2 else rest)))


class RunCosts:
    """The fitted a (seconds a run) and b (seconds a token position) of one state's cache:
    decaying averages of the plain steps' seconds (a + b * slots) and of what the verify steps
    took beyond `runs` plain steps, which is b times their extra positions. Until a verify step
    is timed, b = PRIOR_COST_RATIO * a."""

    def __init__(self, slots: int):
        self.slots = slots
        self.plain = None  # seconds of a plain step
        self.extra = self.extra_weight = 0.0  # sum of w * (seconds - runs * plain) * extra, and of w * extra ** 2

    def observe(self, runs: float, positions: float, seconds: float) -> None:
        extra = positions - runs * self.slots
        if runs == 1 and extra == 0:
            if self.plain is not None:  # a step the machine stalled (another process, a page fault) counts as 3
                seconds = min(seconds, OUTLIER * self.plain)
            self.plain = seconds if self.plain is None else COST_DECAY * self.plain + (1 - COST_DECAY) * seconds
            return
        if self.plain is None:  # a = seconds / (runs + r * positions) with b = r * a; a plain step is a + b * slots
            self.plain = seconds * (1 + PRIOR_COST_RATIO * self.slots) / (runs + PRIOR_COST_RATIO * positions)
        a, b = self.ab()
        seconds = min(seconds, OUTLIER * (a * runs + b * positions))
        self.extra = COST_DECAY * self.extra + (seconds - runs * self.plain) * extra
        self.extra_weight = COST_DECAY * self.extra_weight + extra * extra

    def ab(self) -> tuple[float, float]:
        plain = self.plain if self.plain is not None else 1.0
        prior = PRIOR_COST_RATIO * plain / (1 + PRIOR_COST_RATIO * self.slots)
        # the prior counts as one step of 4 extra positions a slot
        weight = (4.0 * self.slots) ** 2
        b = max((self.extra + prior * weight) / (self.extra_weight + weight), 1e-3 * prior)
        return max(plain - b * self.slots, 1e-3 * plain), b


class CostAware:
    """Wraps a candidate generator whose candidates never change the output (prompt lookup),
    with `cut(state, rows, ids, counts, allowed)` for the processors' verdict: each step keeps
    only the candidates `plan_shared` or `plan_rows` finds worth their cost, from each slot's
    acceptance rate and the state's timed runs, then cuts those the processors forbid. A slot's rate starts again
    when a new row enters it (its first step: length == prompt length).

    `max_slowdown`: while two or more rows are live, a step may take at most this many plain
    steps' time. The plans make the most tokens per second for the batch as a whole, and in a
    row-by-row cache that can mean one row's 33-token run beside everyone's decode: 2.5x the
    others' step, for tokens only that row gets. A server whose rows belong to different clients
    sets it (limits.MAX_STEP_SLOWDOWN), so one request's lookup never slows the others past it."""

    def __init__(self, inner, max_slowdown: float = np.inf):
        self.inner = inner
        self.max_slowdown = max_slowdown
        self._hits = self._trials = None  # [slots]: decaying kept candidates and trials
        self._costs: RunCosts | None = None
        self._started = None  # (perf_counter at the end of propose, slots, row_by_row): the step's timer

    def _fit(self, state) -> None:
        if self._hits is None or len(self._hits) != state.slots:
            self._hits, self._trials = np.zeros(state.slots), np.zeros(state.slots)
            self._costs = RunCosts(state.slots)

    def rates(self, rows: np.ndarray) -> np.ndarray:
        return (self._hits[rows] + PRIOR_RATE * PRIOR_TRIALS) / (self._trials[rows] + PRIOR_TRIALS)

    def propose(self, state, rows: np.ndarray, room: np.ndarray, allowed=None):
        self._fit(state)
        fresh = rows[state.lengths[rows] == state.prompt_length[rows]]
        self._hits[fresh] = self._trials[fresh] = 0.0
        # the processors judge only the candidates the plan keeps (their verdict costs a pass
        # over the vocabulary per candidate column)
        ids, counts, probs = self.inner.propose(state, rows, room, None)
        if counts.any():
            gain = expected_gain(self.rates(rows), int(counts.max()))
            a, b = self._costs.ab()
            plan = plan_rows if state.cache.verifies_row_by_row else plan_shared
            most = self.max_slowdown * (a + b * state.slots) if len(rows) > 1 else np.inf
            counts = self.inner.cut(state, rows, ids, plan(gain, counts, state.slots, a, b, most), allowed)
        self._started = (time.perf_counter(), state.slots, state.cache.verifies_row_by_row)
        return ids, counts, probs

    def accepted(self, rows: np.ndarray, accepted: np.ndarray, counts: np.ndarray) -> None:
        if self._started is not None:
            started, slots, row_by_row = self._started
            self._costs.observe(*run_shape(1 + counts, slots, row_by_row), time.perf_counter() - started)
            self._started = None
        self._hits[rows] *= RATE_DECAY
        self._trials[rows] *= RATE_DECAY
        tried = counts > 0
        self._hits[rows[tried]] += accepted[tried]
        self._trials[rows[tried]] += accepted[tried] + (accepted[tried] < counts[tried])
        self.inner.accepted(rows, accepted, counts)
