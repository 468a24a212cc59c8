"""The decode-state verbs: prefill, insert, step, release.

Invariant: a row inserted into a running batch, at any step and in any free slot, produces the
tokens it produces alone; releasing a row (finished or cancelled) changes no other row.
"""

from __future__ import annotations

import numpy as np
import pytest

import generation

MODES = [("llama-genai", "in_place"), ("llama-genai", "grow"), ("llama-optimum", "append"),
         ("llama-optimum", "grow"), ("gpt2-grow", "grow")]


@pytest.fixture(scope="module")
def models(test_models, load_model):
    return {f: load_model(test_models[f]) for f in {f for f, _ in MODES}}


def alone(ctx, prompt, seed):
    return generation.generate(ctx, [prompt], seeds=[seed])[0]


def run_schedule(ctx, prompts, seeds, arrivals, slots, cancel=None, verb="insert", lowest=False):
    """Drive the verbs by hand: prompt i arrives before step arrivals[i]; each goes into the
    highest free slot (`lowest`: the lowest, as the scheduler fills them). cancel = (prompt, step): release that row while it is live. verb: rows
    enter by prefill + insert, or by admit (in_place: straight into the slot's buffer).
    Returns the new tokens of each prompt, read from the step outputs."""
    state = generation.new_state(ctx, slots=slots, capacity=128)
    tokens = {i: [] for i in range(len(prompts))}
    slot_of = {}
    step_no = 0
    while step_no < 200:
        for i in [i for i, at in enumerate(arrivals) if at == step_no]:
            slot = int(state.free_slots()[0 if lowest else -1])
            if verb == "insert":
                prefix = generation.prefill(ctx, [prompts[i]], [seeds[i]])
                state, first = generation.insert(ctx, prefix, state, [slot]), prefix.first
            else:
                state, first = generation.admit(ctx, state, [slot], [prompts[i]], [seeds[i]])
            if first.token[0] >= 0:
                tokens[i].append(int(first.token[0]))
            if not first.finished[0]:
                slot_of[slot] = i
        if cancel and cancel[1] == step_no:
            slot = next(s for s, i in slot_of.items() if i == cancel[0])
            state = generation.release(ctx, state, slot)
            del slot_of[slot]
        if not slot_of and step_no > max(arrivals):
            break
        state, out = generation.step(ctx, state)
        for slot, i in list(slot_of.items()):
            if out.token[slot] >= 0:
                tokens[i].append(int(out.token[slot]))
            if out.finished[slot]:
                state = generation.release(ctx, state, slot)
                del slot_of[slot]
        step_no += 1
    return [tokens[i] for i in range(len(prompts))]


@pytest.mark.parametrize("folder,mode", MODES, ids=[f"{f}-{m}" for f, m in MODES])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("verb,steps", [("insert", "whole"), ("admit", "whole"), ("admit", "pieces")])
def test_inserted_rows_equal_rows_alone(models, folder, mode, do_sample, verb, steps, prompts_of):
    ctx = generation.context(models[folder], max_new_tokens=24, cache_mode=mode, do_sample=do_sample,
                             temperature=0.8, top_k=40, prompt_steps=steps)
    prompts = prompts_of([9, 3, 17, 1, 12, 30], seed=1)
    seeds = [11, 12, 13, 14, 15, 16]
    arrivals = [0, 0, 3, 5, 26, 30]  # rows join a running batch, later ones into slots freed by others
    got = run_schedule(ctx, prompts, seeds, arrivals, slots=4, verb=verb)
    assert got == [alone(ctx, p, s) for p, s in zip(prompts, seeds)]
    assert all(len(r) == 24 for r in got)


@pytest.mark.parametrize("folder,mode", MODES, ids=[f"{f}-{m}" for f, m in MODES])
def test_rows_in_the_lowest_slots_equal_rows_alone(models, folder, mode, prompts_of):
    """Slots filled lowest first, as the scheduler does: the steps' runs leave the free slots
    past the last used one out (in_place), and a row that joins above or in a hole below still
    makes its own tokens."""
    ctx = generation.context(models[folder], max_new_tokens=16, cache_mode=mode, do_sample=True, top_k=40)
    prompts = prompts_of([9, 3, 17, 1, 12], seed=4)
    seeds = [21, 22, 23, 24, 25]
    got = run_schedule(ctx, prompts, seeds, arrivals=[0, 2, 4, 9, 19], slots=4, lowest=True, cancel=(0, 6))
    assert got[0] == alone(ctx, prompts[0], seeds[0])[:7]
    assert got[1:] == [alone(ctx, p, s) for p, s in zip(prompts[1:], seeds[1:])]


@pytest.mark.parametrize("folder,mode", [("llama-genai", "in_place"), ("llama-optimum", "append")])
def test_a_step_runs_the_slots_up_to_the_last_used_one(models, folder, mode, prompts_of):
    """The free slots past the last used one are not run (their logits stay as they were); a
    free slot below a used one is run, as a padding row."""
    ctx = generation.context(models[folder], max_new_tokens=8, do_sample=False, cache_mode=mode)
    state = generation.new_state(ctx, slots=4, capacity=64)
    state, _ = generation.admit(ctx, state, [0, 1], prompts_of([5, 9], seed=1), [0, 0])
    logits = state.cache.logits  # the decode run's bound output [slots, V]
    for used in ([0, 1], [1]):
        if used == [1]:
            state = generation.release(ctx, state, 0)
        logits[:] = np.nan
        state, _ = generation.step(ctx, state)
        assert np.isfinite(logits[:2]).all() and np.isnan(logits[2:]).all(), used
    state, _ = generation.admit(ctx, state, [3], prompts_of([4], seed=1), [0])
    logits[:] = np.nan
    state, _ = generation.step(ctx, state)
    assert np.isfinite(logits).all()


def test_in_place_buffers_are_mapped_when_laid_out(models):
    """The in_place buffers' pages are written when they are laid out at a size class (np.zeros
    would map them at a prompt's first run over each row: seconds late for the first token on a
    30-layer model), and go back to the system when a smaller layout replaces them; a fresh
    state holds the smallest classes."""
    import os

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    ctx = generation.context(models["llama-genai"], max_new_tokens=8, buffers="host")  # (numpy pages: _mapped)
    before = resident()
    state = generation.new_state(ctx, slots=256, capacity=256)
    assert (state.cache.held, state.cache.length) == (1, 16)
    state.cache.fit(256, 256)
    size = sum(b.nbytes for b in state.cache.buffers.values())
    assert size >= 16 << 20 and resident() - before >= 0.8 * size
    laid_out = resident()
    state.cache.fit(1, 16)  # and given back when a smaller layout replaces it
    assert laid_out - resident() >= 0.8 * size


@pytest.mark.parametrize("folder,mode", MODES, ids=[f"{f}-{m}" for f, m in MODES])
def test_cancelled_row_leaves_others_unchanged(models, folder, mode, prompts_of):
    ctx = generation.context(models[folder], max_new_tokens=20, cache_mode=mode)
    prompts = prompts_of([6, 14, 8], seed=1)
    got = run_schedule(ctx, prompts, [0, 1, 2], arrivals=[0, 0, 2], slots=3, cancel=(1, 5))
    assert len(got[1]) == 6  # its first token from prefill, then 5 steps
    assert got[1] == alone(ctx, prompts[1], 1)[:6]
    assert got[0] == alone(ctx, prompts[0], 0)
    assert got[2] == alone(ctx, prompts[2], 2)


def test_admit_runs_rows_of_scattered_slots_together(models, oracle, prompts_of):
    """admit into slots 3, 0, 1 of a fresh in_place state (runs [0, 1] and [3]), in pieces."""
    ctx = generation.context(models["llama-genai"], max_new_tokens=10, prompt_steps="pieces")
    prompts = prompts_of([21, 5, 37], seed=1)
    state = generation.new_state(ctx, slots=4, capacity=64)
    state, first = generation.admit(ctx, state, [3, 0, 1], prompts, [0, 0, 0])
    rows = [[t] for t in first.token.tolist()]
    while state.live.any():
        state, out = generation.step(ctx, state)
        for row, slot in enumerate([3, 0, 1]):
            if out.token[slot] >= 0:
                rows[row].append(int(out.token[slot]))
    assert rows == [oracle.greedy("llama", p, 10) for p in prompts]


def test_state_buffers_are_reused_across_steps(models, prompts_of):
    """A step writes into the state's arrays; it does not replace them."""
    ctx = generation.context(models["llama-genai"], max_new_tokens=8)
    state = generation.new_state(ctx, slots=2, capacity=64)
    state = generation.insert(ctx, generation.prefill(ctx, prompts_of([5, 7], seed=1), [0, 1]), state, [0, 1])
    arrays = (state.tokens, state.lengths, state.next_input, state.cache.buffers["past_key_values.0.key"])
    lengths = state.lengths.copy()
    same, out = generation.step(ctx, state)
    assert same is state
    assert all(a is b for a, b in zip(arrays, (state.tokens, state.lengths, state.next_input,
                                                 state.cache.buffers["past_key_values.0.key"])))
    assert (state.lengths == lengths + 1).all()
    assert (out.token == state.tokens[[0, 1], state.lengths]).all()


def test_prefix_row_that_ends_at_its_first_token_takes_no_slot(models, prompts_of):
    ctx = generation.context(models["llama-genai"], max_new_tokens=1)
    state = generation.new_state(ctx, slots=2, capacity=32)
    prefix = generation.prefill(ctx, prompts_of([4, 6], seed=1), [0, 1])
    assert prefix.first.finished.all() and (prefix.first.token >= 0).all()
    state = generation.insert(ctx, prefix, state, [0, 1])
    assert not state.used.any()


def test_insert_refuses_a_used_slot(models, prompts_of):
    ctx = generation.context(models["llama-genai"], max_new_tokens=8)
    state = generation.new_state(ctx, slots=2, capacity=32)
    state = generation.insert(ctx, generation.prefill(ctx, prompts_of([4], seed=1), [0]), state, [0])
    with pytest.raises(ValueError, match=r"slots\[0\] = 0 is not a free slot"):
        generation.insert(ctx, generation.prefill(ctx, prompts_of([5], seed=1), [1]), state, [0])


@pytest.mark.parametrize("folder,mode", MODES, ids=[f"{f}-{m}" for f, m in MODES])
def test_streamed_steps_equal_the_multi_step_loop(models, folder, mode, prompts_of):
    """generate() without on_token runs greedy steps in a tight loop (`advance`); with on_token
    it steps one at a time. Same rows, eos stops included (eos set to tokens the rows produce)."""
    prompts = prompts_of([3, 8, 1, 13, 5, 21, 2], seed=4)
    plain = generation.context(models[folder], max_new_tokens=30, cache_mode=mode, eos_token_id=[])
    free_run = generation.generate(plain, prompts, seeds=[0] * 7)
    stops = sorted({row[len(row) // 2] for row in free_run})[:3]  # tokens that end some rows early
    ctx = generation.compile(generation.context(models[folder], max_new_tokens=30, cache_mode=mode,
                                                eos_token_id=stops), batch_size=4)
    streamed = [[] for _ in prompts]

    def on_token(event):
        for row, token in enumerate(event.token.tolist()):
            if token >= 0:
                streamed[row].append(token)

    rows = generation.generate(ctx, prompts, seeds=[0] * 7)
    assert generation.generate(ctx, prompts, seeds=[0] * 7, on_token=on_token) == rows == streamed
    assert any(len(r) < 30 for r in rows) and any(len(r) == 30 for r in rows)
    for row, full in zip(rows, free_run):
        assert full[:len(row)] == row
