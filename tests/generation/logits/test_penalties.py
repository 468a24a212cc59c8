"""OpenAI's frequency_penalty and presence_penalty (processors.frequency_presence_penalty): beyond
transformers' processors, applied as vLLM's `apply_penalties` applies them.

Invariants: each token among the row's new tokens (never its prompt) loses frequency x its count,
then presence, in float32, and no other score moves; rows of one batch each get their own
penalties (a row with both 0 is untouched); the penalties come right after the repetition
penalty and before the temperature; a row with penalties leaves the lean greedy loop, and one
without stays on it; the settings are checked (from -2 to 2, named); greedy tokens equal
transformers `generate` with a LogitsProcessor of the same formula, on a batch, in every cache
mode, and so do beam searches; sampled log-probabilities are those of transformers' processed
scores (the penalty before the temperature); a row with penalties beside others (greedy, seeded
sampling, beams) gets what it gets alone and leaves theirs as they are, under preemption,
chunked prefill, the prefix store, a constraint, prompt lookup and a draft model.
"""

from __future__ import annotations

import numpy as np
import pytest

import generation
from generation.engine.scheduler import Scheduler
from generation.logits.processors import frequency_presence_penalty
from generation.logits.row_settings import RowSettings, apply
from generation.params.settings import make_settings
from generation.params.checks import SettingError
from test_assisted import logged, spy  # noqa: F401  (spy: a fixture)
from test_beam import transformers_beams
from test_processors_generate import repetitive_prompts, transformers_run

F32 = np.float32
PENALTIES = dict(frequency_penalty=1.5, presence_penalty=0.5)


def rows_of(settings: list[dict], prompt_lengths: list[int], vocab: int) -> RowSettings:
    rows = RowSettings(len(settings), vocab)
    for i, (s, length) in enumerate(zip(settings, prompt_lengths)):
        rows.set_row(i, make_settings({}, s), length, 100)
    return rows


# -- the processor, on hand-built scores -----------------------------------------------------------------
def test_one_row_counts_its_new_tokens_only():
    scores = np.array([[1.0, 1.0, 1.0, 1.0, -np.inf]], F32)
    history = np.array([[0, 3, 1, 1, 1, 2, 4, 9]])  # prompt [0, 3]; new [1, 1, 1, 2, 4]; 9 is past the length
    kept = scores.copy()
    out = frequency_presence_penalty(scores, history, np.array([7]), np.array([2]), np.array([0.5], F32),
                                     np.array([0.25], F32))
    # token 1: 1 - 0.5 x 3 - 0.25; token 2: 1 - 0.5 - 0.25; 0 and 3 are the prompt's; -inf stays -inf
    np.testing.assert_array_equal(out, [[1.0, -0.75, 0.25, 1.0, -np.inf]])
    np.testing.assert_array_equal(scores, kept)  # never in place unless told
    assert frequency_presence_penalty(scores, history, np.array([2]), np.array([2]), np.array([0.5], F32),
                                      np.array([0.25], F32)).tolist() == kept.tolist()  # no new token yet


def test_a_batch_each_row_with_its_own_penalties():
    scores = np.array([[2.0, 2.0, 2.0], [2.0, 2.0, 2.0], [2.0, 2.0, 2.0], [0.5, -1.0, 3.0]], F32)
    history = np.array([[0, 0, 1, 0], [0, 0, 1, 0], [2, 2, 2, 2], [1, 2, 2, 2]])
    length, start = np.array([4, 4, 4, 3]), np.array([1, 1, 2, 1])
    frequency = np.array([1.0, 0.0, -0.5, 2.0], F32)
    presence = np.array([0.0, 0.0, 1.0, -2.0], F32)
    out = frequency_presence_penalty(scores, history, length, start, frequency, presence)
    np.testing.assert_array_equal(out, [[0.0, 1.0, 2.0],  # new [0, 1, 0]: 0 twice, 1 once
                                        [2.0, 2.0, 2.0],  # both off: untouched
                                        [2.0, 2.0, 2.0],  # new [2, 2]: 2 + 0.5 x 2 - 1
                                        [0.5, -1.0, 1.0]])  # new [2, 2]: 3 - 2 x 2 + 2
    for i in range(4):  # each row as it is alone
        one = slice(i, i + 1)
        np.testing.assert_array_equal(frequency_presence_penalty(scores[one], history[one], length[one], start[one],
                                                                 frequency[one], presence[one]), out[one])


def test_float32_arithmetic_as_vllm():
    """logits -= frequency x counts (float32), then -= presence: two roundings, in that order."""
    scores = np.array([[0.1, 16777216.0, 1.0]], F32)
    history = np.array([[0, 0, 0, 1]])
    frequency, presence = np.array([0.3], F32), np.array([0.7], F32)
    out = frequency_presence_penalty(scores, history, np.array([4]), np.array([0]), frequency, presence)
    assert out[0, 0] == (F32(0.1) - frequency[0] * F32(3)) - presence[0]
    assert out[0, 1] == (F32(16777216.0) - frequency[0]) - presence[0]
    assert out[0, 2] == F32(1.0)


def test_apply_puts_them_after_the_repetition_penalty():
    """Token 1 is in the prompt and new: the repetition penalty divides 3 by 2 first (vLLM's order:
    repetition over prompt and output, then frequency and presence over the output), then
    1.5 - 1 - 0.25; the reverse order would give (3 - 1.25) / 2."""
    rows = rows_of([dict(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.25)], [2], 4)
    history = np.array([[1, 3, 1]])
    out = apply(np.array([[3.0, 3.0, 3.0, 3.0]], F32), rows, history, np.array([3]), prompt_length=np.array([2]))
    np.testing.assert_array_equal(out, [[3.0, 0.25, 3.0, 1.5]])
    with pytest.raises(ValueError, match="prompt_length"):
        apply(np.ones((1, 4), F32), rows, history, np.array([3]))


def test_only_rows_with_penalties_leave_the_lean_path(test_models, load_model):
    assert not rows_of([{}, dict(repetition_penalty=1.0)], [1, 1], 8).processes()
    assert rows_of([{}, dict(presence_penalty=-0.1)], [1, 1], 8).processes()
    assert rows_of([dict(frequency_penalty=2)], [1], 8).processes()
    model = load_model(test_models["llama-genai"])
    for settings, fast in ((dict(frequency_penalty=0.0, presence_penalty=0.0), True), (PENALTIES, False)):
        ctx = generation.context(model, max_new_tokens=4, **settings)
        state = generation.new_state(ctx, slots=1, capacity=16)
        state, _ = generation.admit(ctx, state, [0], [[5, 6]], [0])
        assert state.fast == fast and state.processes != fast


@pytest.mark.parametrize("field", ["frequency_penalty", "presence_penalty"])
@pytest.mark.parametrize("value", [2.01, -3, float("nan"), "1", True])
def test_out_of_range_penalties_name_the_field_and_range(field, value):
    with pytest.raises(SettingError, match=rf"{field} must be a number in \[-2, 2\] \(0 turns it off\)") as caught:
        make_settings({}, {field: value})
    assert caught.value.setting == field
    assert make_settings({}, {field: -2}).__getattribute__(field) == -2.0  # the ends are allowed
    assert make_settings({field: 1}, {}).__getattribute__(field) == 1.0  # generation_config.json may set them


# -- against transformers, with a LogitsProcessor of the same formula --------------------------------------
def torch_penalties(prompt_length: int, frequency: float, presence: float):
    """transformers' form of the penalties: a LogitsProcessor over the tokens past the prompt."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class Penalties(LogitsProcessor):
        def __call__(self, input_ids, scores):
            new = input_ids[:, prompt_length:]
            counts = torch.zeros(scores.shape, dtype=torch.long).scatter_add_(1, new, torch.ones_like(new))
            scores = scores - frequency * counts
            return scores - presence * (counts > 0)

    return LogitsProcessorList([Penalties()])


CASES = [("llama-optimum", "llama", "append"), ("llama-genai", "llama", "in_place"), ("gpt2-grow", "gpt2", "grow")]


@pytest.mark.parametrize("folder, name, mode", CASES, ids=[c[2] + "-" + c[1] for c in CASES])
def test_greedy_equals_transformers_with_the_formula_as_its_processor(test_models, load_model, oracle, folder, name,
                                                                      mode):
    ctx = generation.context(load_model(test_models[folder]), cache_mode=mode, max_new_tokens=16, token_logprobs=True,
                             **PENALTIES)
    prompts = repetitive_prompts()
    got = generation.generate(ctx, prompts, seeds=[0] * len(prompts))  # one batch, prompts of different lengths
    plain = generation.generate(generation.context(ctx.model, cache_mode=mode, max_new_tokens=16), prompts)
    assert [row.tokens for row in got] != plain  # the penalties change the output: the test can fail
    for prompt, row in zip(prompts, got):
        tokens, logprobs = transformers_run(oracle, name, prompt, 16, do_sample=False,
                                            logits_processor=torch_penalties(len(prompt), **_floats(PENALTIES)))
        assert row.tokens == tokens
        np.testing.assert_allclose(row.logprobs, logprobs, atol=1e-4)


def _floats(settings):
    return {"frequency": settings["frequency_penalty"], "presence": settings["presence_penalty"]}


def test_with_the_repetition_penalty_and_negative_penalties(test_models, load_model, oracle):
    """Negative penalties favour what came before; the repetition penalty runs first in both (a
    user's processor comes after transformers' own)."""
    settings = dict(frequency_penalty=-0.75, presence_penalty=1.25, repetition_penalty=1.3)
    ctx = generation.context(load_model(test_models["llama-optimum"]), max_new_tokens=16, **settings)
    prompts = repetitive_prompts()
    for prompt, row in zip(prompts, generation.generate(ctx, prompts)):
        assert row == oracle.greedy("llama", prompt, 16, repetition_penalty=1.3,
                                    logits_processor=torch_penalties(len(prompt), -0.75, 1.25))


def test_sampled_logprobs_are_transformers_processed_scores(test_models, load_model, oracle):
    """The penalty before the temperature and top_k, as vLLM: the sampled tokens' log-probabilities
    (after every warper) are those of transformers' processors with the formula as its user
    processor, which it runs before its warpers."""
    import torch

    settings = dict(do_sample=True, temperature=0.5, top_k=30, top_p=0.95)
    ctx = generation.context(load_model(test_models["llama-optimum"]), max_new_tokens=12, token_logprobs=True,
                             **settings, **PENALTIES)
    prompts = repetitive_prompts()
    got = generation.generate(ctx, prompts, seeds=[21, 22, 23, 24])
    model = oracle.model("llama")
    for prompt, row in zip(prompts, got):
        config = model.generation_config.__class__(**{**model.generation_config.to_dict(), **settings})
        config.max_length = len(prompt) + len(row.tokens) + 5
        model._prepare_special_tokens(config, device="cpu")
        processors = model._get_logits_processor(config, input_ids_seq_length=len(prompt), device="cpu",
                                                 encoder_input_ids=torch.tensor([prompt]),
                                                 logits_processor=torch_penalties(len(prompt), **_floats(PENALTIES)))
        ids = torch.tensor([prompt + row.tokens])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        want = [float(torch.log_softmax(processors(ids[:, :at], logits[at - 1:at].clone()), -1)[0, token])
                for at, token in zip(range(len(prompt), len(prompt) + len(row.tokens)), row.tokens)]
        np.testing.assert_allclose(row.logprobs, want, atol=1e-4)
        assert len(set(row.tokens)) > 1


@pytest.mark.parametrize("folder, name, mode", CASES[:2], ids=[c[2] for c in CASES[:2]])
def test_beam_search_equals_transformers_with_the_formula_as_its_processor(test_models, load_model, oracle, folder,
                                                                           name, mode):
    """As every processor in a beam search: on the log-softmax of each beam's scores, each beam
    counting its own tokens."""
    settings = dict(num_beams=3, num_return_sequences=2, length_penalty=0.5)
    ctx = generation.context(load_model(test_models[folder]), cache_mode=mode, max_new_tokens=10, token_logprobs=True,
                             **settings, **PENALTIES)
    got = generation.beam_search(ctx, repetitive_prompts(), [0] * 4)
    plain = generation.beam_search(generation.context(ctx.model, cache_mode=mode, max_new_tokens=10, **settings),
                                   repetitive_prompts(), [0] * 4)
    assert [[h.tokens for h in row] for row in got] != [[h.tokens for h in row] for row in plain]
    for prompt, hypotheses in zip(repetitive_prompts(), got):
        want = transformers_beams(oracle, name, prompt, 10, **settings,
                                  logits_processor=torch_penalties(len(prompt), **_floats(PENALTIES)))
        assert [(h.tokens, round(h.score, 4)) for h in hypotheses] == [(t, round(s, 4)) for t, s, _ in want]
        for h, (_, _, logprobs) in zip(hypotheses, want):
            np.testing.assert_allclose(h.logprobs, logprobs, atol=1e-4)


# -- in a shared batch, and every way a row is decoded ----------------------------------------------------
def alone(ctx, prompt, seed, settings):
    scheduler = Scheduler(ctx, settings.get("num_beams", 1), 128)
    job = scheduler.job(prompt, seed, dict(settings))
    scheduler.add(job)
    while scheduler.busy:
        scheduler.step()
    return job


def result(job):
    return [h.tokens for h in job.hypotheses] if job.hypotheses else (job.reason, job.tokens)


def test_a_row_with_penalties_beside_others_gets_what_it_gets_alone(test_models, load_model, prompts_of):
    ctx = generation.context(load_model(test_models["llama-genai"]))
    prompts = prompts_of([5, 12, 3, 8, 6, 9], seed=4)
    sampling = dict(do_sample=True, temperature=0.8, top_k=40)
    settings = [dict(max_new_tokens=30, eos_token_id=[], **PENALTIES),
                dict(max_new_tokens=24, eos_token_id=[], **sampling),
                dict(max_new_tokens=20, eos_token_id=[], frequency_penalty=-1.0, **sampling),
                dict(max_new_tokens=26, eos_token_id=[]),
                dict(max_new_tokens=12, num_beams=3, presence_penalty=2.0),
                dict(max_new_tokens=18, eos_token_id=[], repetition_penalty=1.2, **sampling)]
    expected = [alone(ctx, p, i, s) for i, (p, s) in enumerate(zip(prompts, settings))]
    plain = [alone(ctx, p, i, {k: v for k, v in s.items() if not k.endswith("y_penalty")})
             for i, (p, s) in enumerate(zip(prompts, settings))]
    assert result(expected[0]) != result(plain[0]) and result(expected[2]) != result(plain[2])
    scheduler = Scheduler(ctx, 8, 128)
    jobs = [scheduler.job(p, i, dict(s)) for i, (p, s) in enumerate(zip(prompts, settings))]
    for job in jobs:
        scheduler.add(job)
    while scheduler.busy:
        scheduler.step()
    assert [result(j) for j in jobs] == [result(j) for j in expected]


def test_preemption_chunks_the_prefix_store_a_constraint_and_prompt_lookup(test_models, load_model, prompts_of):
    """The counts are the row's tokens: a row preempted and recomputed, run in chunks, or started
    from a cached prefix counts what it would alone; constraints apply after the penalties;
    prompt lookup verifies each candidate with the counts as of its position."""
    from generation.assisted.prompt_lookup import PromptLookup

    ctx = generation.context(load_model(test_models["llama-genai"]))
    shared = prompts_of([40], seed=7)[0]
    tails = prompts_of([9, 3, 30, 1, 17, 6], seed=8)
    prompts = [shared + tail if i in (1, 2, 4) else tail for i, tail in enumerate(tails)]  # 4 joins later
    prompts[5] = [40, 41, 42, 43] * 9  # it repeats: prompt lookup finds candidates
    base = dict(eos_token_id=[], **PENALTIES)
    settings = [dict(base, max_new_tokens=60), dict(base, max_new_tokens=50, do_sample=True, top_k=40),
                dict(base, max_new_tokens=40, structured_outputs={"regex": "[a-z ]{10,300}"}),
                dict(base, max_new_tokens=70, presence_penalty=-0.5), dict(base, max_new_tokens=45),
                dict(base, max_new_tokens=30, prompt_lookup_num_tokens=3, frequency_penalty=0.25)]
    expected = [alone(ctx, p, i, s) for i, (p, s) in enumerate(zip(prompts, settings))]
    budget = Scheduler(ctx, 4, 128).state.cache.footprint(4, 64)
    scheduler = Scheduler(ctx, 4, 128, kv_cache_bytes=budget, prefix_cache_bytes=1 << 30, prefill_chunk_tokens=8,
                          lookup=PromptLookup())
    jobs = [scheduler.job(p, i, dict(s)) for i, (p, s) in enumerate(zip(prompts, settings))]
    for job in jobs:
        scheduler.add(job)
    while scheduler.busy:
        scheduler.step()
    assert scheduler.preemptions > 0 and scheduler.state.prefix.hits > 0
    assert [(j.error, result(j)) for j in jobs] == [(None, result(j)) for j in expected]


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_prompt_lookup_verifies_with_the_counts_of_each_position(load_model, spy, sampling):
    """The shipped model copies its prompt, so candidates are kept; with the penalties on, the
    tokens are plain decoding's (greedy, and a seeded draw at each token index)."""
    from generation.default_model import FOLDER
    from test_assisted import grounded

    model = load_model(FOLDER / "genai")
    settings = dict(max_new_tokens=30, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.0,
                    do_sample=sampling, temperature=0.5, top_k=20)
    prompts = grounded(model)
    plain = generation.generate(generation.context(model, **settings), prompts, seeds=[3, 4, 5, 6])
    assert plain != generation.generate(generation.context(model, **dict(settings, frequency_penalty=0.0,
                                                                        presence_penalty=0.0)), prompts,
                                        seeds=[3, 4, 5, 6])
    ctx = generation.context(model, prompt_lookup_num_tokens=4, **settings)
    assert generation.generate(ctx, prompts, seeds=[3, 4, 5, 6]) == plain
    kept = [(a, c) for a, c in spy[-1].kept]
    assert sum(int(a.sum()) for a, _ in kept) > 0, "no candidate was kept: the test proves nothing"


def test_a_draft_model_gives_the_plain_tokens(test_models, load_model, monkeypatch):
    """The draft (the target's own weights, so it proposes what the target would without the
    penalties) proposes with no penalties; the target's verification applies them per position."""
    target, draft = load_model(test_models["llama-optimum"]), load_model(test_models["llama-genai"])
    prompts = repetitive_prompts()
    sampled = dict(PENALTIES, do_sample=True, temperature=0.7)
    plain = generation.generate(generation.context(target, max_new_tokens=24, **PENALTIES), prompts, seeds=[1] * 4)
    made = logged(monkeypatch)
    for k in (2, 4):
        ctx = generation.context(target, max_new_tokens=24, draft=draft, num_assistant_tokens=k, **PENALTIES)
        assert generation.generate(ctx, prompts, seeds=[1] * 4) == plain
        log = made[-1].log  # the draft's candidates: some kept, some rejected by the penalties
        assert sum(int(a.sum()) for a, _ in log) > 0 and any((a < c).any() for a, c in log)
    # speculative sampling keeps the target's distribution, not its tokens: seeded, and as alone
    ctx = generation.context(target, max_new_tokens=24, draft=draft, num_assistant_tokens=4, **sampled)
    got = generation.generate(ctx, prompts, seeds=[1] * 4)
    assert got == generation.generate(ctx, prompts, seeds=[1] * 4)
    assert got[2] == generation.generate(ctx, [prompts[2]], seeds=[1])[0]


def test_the_generate_command_takes_them(test_models, load_model, tmp_path):
    """`raymuter generate --presence-penalty --frequency-penalty`, as --repetition-penalty."""
    from test_cli import raymuter
    from tokenizers import Tokenizer

    folder = test_models["llama-optimum"]
    done = raymuter("generate", "--model", folder, "--max-new-tokens", 16, "--frequency-penalty", 1.5,
                    "--presence-penalty", 0.5, "the list", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tokenizer.encode("the list").ids
    row = generation.generate(generation.context(load_model(folder), max_new_tokens=16, **PENALTIES), [ids])[0]
    assert done.stdout == tokenizer.decode(row, skip_special_tokens=True) + "\n"
    plain = generation.generate(generation.context(load_model(folder), max_new_tokens=16), [ids])[0]
    assert row != plain
    bad = raymuter("generate", "--model", folder, "--presence-penalty", 3, "ka", cwd=tmp_path)
    assert bad.returncode != 0 and "presence_penalty must be a number in [-2, 2]" in bad.stderr
