"""The logits processors end to end: raymuter's tokens and log-probabilities against
transformers `generate()` on the same weights.

Invariants: with many processors set at once, greedy tokens equal transformers' for every row of
a batch whose prompts differ in length, in every cache mode; each token's log-probability is
within 1e-4 of `compute_transition_scores(normalize_logits=True)` (greedy and sampling); rows
with different settings share one batch and each still equals transformers with its own;
sampling through top_k / top_p / min_p / typical_p draws only tokens the processed distribution
allows, with its frequencies (chi-square); a user's processor applies where transformers applies
its `logits_processor`; a processor that cannot change the argmax leaves greedy output as it is.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from scipy import stats

import generation
from generation.logits.selection import log_softmax

MANY = dict(repetition_penalty=1.3, no_repeat_ngram_size=3, bad_words_ids=[[5], [7, 8]], min_new_tokens=4,
            sequence_bias=[[[9], -2.0], [[3, 4], 3.0]], suppress_tokens=[11, 12], begin_suppress_tokens=[13],
            exponential_decay_length_penalty=(6, 1.2), encoder_repetition_penalty=1.1,
            encoder_no_repeat_ngram_size=4, remove_invalid_values=True, renormalize_logits=True)
CASES = [("llama-optimum", "llama", "append"), ("llama-genai", "llama", "in_place"), ("gpt2-optimum", "gpt2", "append"),
         ("gpt2-grow", "gpt2", "grow")]


def repetitive_prompts():
    """Prompts that repeat themselves, so penalties and n-gram bans have work to do."""
    return [[5, 6, 7, 8, 9, 10], [20, 21], [30, 31, 32, 30, 31, 32, 30, 31, 3], [40]]


@pytest.fixture(scope="module")
def models(test_models, load_model):
    return lambda folder: load_model(test_models[folder])


def transformers_run(oracle, name, prompt, max_new, **kwargs):
    """transformers generate for one prompt alone: (new tokens without a final eos, transition
    scores of those tokens with normalize_logits=True)."""
    import torch

    model = oracle.model(name)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             pad_token_id=model.config.pad_token_id, output_scores=True,
                             return_dict_in_generate=True, **kwargs)
        scores = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    new, logprobs = out.sequences[0, len(prompt):].tolist(), scores[0].tolist()
    eos = model.generation_config.eos_token_id
    if new and new[-1] == eos:
        new, logprobs = new[:-1], logprobs[:-1]
    return new, logprobs


@pytest.mark.parametrize("folder, name, mode", CASES, ids=[c[2] + "-" + c[1] for c in CASES])
def test_many_processors_greedy_tokens_and_logprobs_equal_transformers(models, oracle, folder, name, mode):
    ctx = generation.context(models(folder), cache_mode=mode, max_new_tokens=12, token_logprobs=True, **MANY)
    prompts = repetitive_prompts()
    got = generation.generate(ctx, prompts, seeds=[0] * len(prompts))
    for prompt, row in zip(prompts, got):
        tokens, logprobs = transformers_run(oracle, name, prompt, 12, do_sample=False, **MANY)
        assert row.tokens == tokens
        np.testing.assert_allclose(row.logprobs, logprobs, atol=1e-4)


@pytest.mark.parametrize("settings", [
    dict(forced_bos_token_id=17, begin_suppress_tokens=[200, 17], forced_eos_token_id=[2]),
    dict(min_length=9, forced_eos_token_id=2, suppress_tokens=list(range(100, 400))),
    dict(no_repeat_ngram_size=1, repetition_penalty=0.7),
    dict(sequence_bias={(40, 41): 5.0, (41,): -1.5, (77,): 4.0}, bad_words_ids=[[2], [77, 78]]),
], ids=["forced", "min_length", "ngram1", "bias"])
def test_processor_combinations_equal_transformers(models, oracle, settings, prompts_of):
    ctx = generation.context(models("llama-optimum"), max_new_tokens=8, **settings)
    prompts = [[40], [41, 40, 41, 40], [77, 76, 77], prompts_of([13], seed=3)[0]]
    got = generation.generate(ctx, prompts, seeds=[0] * len(prompts))
    for prompt, row in zip(prompts, got):
        assert row == oracle.greedy("llama", prompt, 8, **settings), prompt


def test_generation_config_json_sets_the_processors(models, oracle, tmp_path):
    """The processors come from the model folder's generation_config.json, as transformers reads it."""
    source = models("llama-optimum").folder
    for f in source.iterdir():
        os.symlink(f, tmp_path / f.name)
    os.remove(tmp_path / "generation_config.json")
    config = dict(json.loads((source / "generation_config.json").read_text()), max_new_tokens=10,
                  repetition_penalty=1.5, no_repeat_ngram_size=2, bad_words_ids=[[5], [7, 8]],
                  suppress_tokens=[11, 12], renormalize_logits=True)
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    ctx = generation.context(generation.load(tmp_path, threads=1))
    assert ctx.settings.repetition_penalty == 1.5 and ctx.settings.bad_words_ids == ((5,), (7, 8))
    prompts = repetitive_prompts()
    settings = {k: config[k] for k in ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens")}
    for prompt, row in zip(prompts, generation.generate(ctx, prompts)):
        assert row == oracle.greedy("llama", prompt, 10, **settings)


def run_rows(ctx, prompts, settings, seeds, slots=None):
    """Each row with its own settings through the state verbs, in one batch: its new tokens
    (and log-probabilities with token_logprobs)."""
    state = generation.new_state(ctx, slots=slots or len(prompts), capacity=64)
    state, first = generation.admit(ctx, state, list(range(len(prompts))), prompts, seeds, settings=settings)
    done = first.finished.copy()
    while state.live_rows.size:
        state, out = generation.step(ctx, state)
        done |= out.finished
    from generation.core.state import row_logprobs, row_tokens

    rows = []
    for slot, prompt in enumerate(prompts):
        if not state.used[slot]:  # ended at its first token
            rows.append(([int(first.token[slot])] if first.token[slot] >= 0 else [],
                         [float(first.logprob[slot])] if first.logprob is not None and first.token[slot] >= 0 else []))
        else:
            rows.append((row_tokens(state, slot), row_logprobs(state, slot)[0] if ctx.token_logprobs else None))
    return rows


def test_rows_with_different_settings_share_a_batch(models, oracle):
    ctx = generation.context(models("llama-genai"), max_new_tokens=10, token_logprobs=True)
    per_row = [dict(repetition_penalty=1.4), dict(no_repeat_ngram_size=2, bad_words_ids=[[7, 8]]),
               dict(), dict(min_new_tokens=6, suppress_tokens=[100, 101], sequence_bias=[[[40], 2.5]]),
               dict(repetition_penalty=0.8, renormalize_logits=True)]
    prompts = repetitive_prompts() + [[40, 41, 40, 41]]
    settings = [ctx.with_settings(**s) for s in per_row]
    rows = run_rows(ctx, prompts, settings, [0] * len(prompts))
    for prompt, s, (tokens, logprobs) in zip(prompts, per_row, rows):
        want, want_logprobs = transformers_run(oracle, "llama", prompt, 10, do_sample=False, **s)
        assert tokens == want, s
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4)


def transformers_scores(oracle, name, prompt, tokens, **settings):
    """log_softmax of transformers' processed scores (its own `_get_logits_processor`, warpers
    included when sampling) at each of `tokens` after `prompt`."""
    import torch

    model = oracle.model(name)
    config = model.generation_config.__class__(**{**model.generation_config.to_dict(), **settings})
    config.max_length = len(prompt) + len(tokens) + 5
    model._prepare_special_tokens(config, device="cpu")
    processors = model._get_logits_processor(config, input_ids_seq_length=len(prompt),
                                             encoder_input_ids=torch.tensor([prompt]), device="cpu")
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    out = []
    for i, token in enumerate(tokens):
        at = len(prompt) + i
        scores = processors(ids[:, :at], logits[at - 1:at].clone())
        out.append(float(torch.log_softmax(scores, -1)[0, token]))
    return out


def test_sampled_logprobs_are_those_of_transformers_processed_scores(models, oracle):
    settings = dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.95, repetition_penalty=1.2,
                    no_repeat_ngram_size=3, min_p=0.02)
    ctx = generation.context(models("llama-optimum"), max_new_tokens=10, token_logprobs=True, **settings)
    prompts = repetitive_prompts()
    got = generation.generate(ctx, prompts, seeds=[11, 12, 13, 14])
    for prompt, row in zip(prompts, got):
        assert row.tokens
        want = transformers_scores(oracle, "llama", prompt, row.tokens, **settings)
        np.testing.assert_allclose(row.logprobs, want, atol=1e-4)
        assert np.isfinite(row.logprobs).all()  # a sampled token is never one the processors removed


def test_top_logprobs_and_raw_logprobs(models, oracle, prompts_of):
    model = models("llama-optimum")
    prompt = prompts_of([7], seed=3)[0]
    top = generation.context(model, max_new_tokens=6, top_logprobs=5, repetition_penalty=1.3)
    row = generation.generate(top, [prompt])[0]
    assert len(row.top_logprobs) == len(row.tokens) == len(row.logprobs)
    for token, logprob, best in zip(row.tokens, row.logprobs, row.top_logprobs):
        ids, values = zip(*best)
        assert ids[0] == token and values[0] == pytest.approx(logprob)  # greedy: the best one
        assert list(values) == sorted(values, reverse=True) and len(set(ids)) == 5
    raw = generation.context(model, max_new_tokens=6, token_logprobs=True, logprobs_of="raw", repetition_penalty=1.3)
    row_raw = generation.generate(raw, [prompt])[0]
    assert row_raw.tokens == row.tokens
    logits = oracle.logits("llama", prompt + row.tokens)
    want = [log_softmax(logits[len(prompt) - 1 + i][None])[0, t] for i, t in enumerate(row.tokens)]
    np.testing.assert_allclose(row_raw.logprobs, want, atol=1e-4)
    assert not np.allclose(row_raw.logprobs, row.logprobs, atol=1e-3)  # the penalty moved them


@pytest.mark.parametrize("settings", [
    dict(top_k=8), dict(top_p=0.6), dict(min_p=0.05),
    dict(typical_p=0.6), dict(top_k=12, top_p=0.8, repetition_penalty=1.5, temperature=0.7),
], ids=["top_k", "top_p", "min_p", "typical_p", "chat"])
def test_first_sampled_token_fits_the_processed_distribution(models, oracle, settings):
    settings = dict(dict(top_k=0), **settings, do_sample=True)
    ctx = generation.context(models("llama-optimum"), max_new_tokens=1, **settings)
    prompt, draws = [40, 41, 40, 41, 42], 3000
    got = generation.generate(ctx, [prompt] * draws, seeds=list(range(draws)))
    tokens = np.array([r[0] if r else 2 for r in got])
    import torch

    logits = oracle.logits("llama", prompt)[-1]
    model = oracle.model("llama")
    config = model.generation_config.__class__(**{**model.generation_config.to_dict(), **settings})
    model._prepare_special_tokens(config, device="cpu")
    processors = model._get_logits_processor(config, input_ids_seq_length=len(prompt),
                                             encoder_input_ids=torch.tensor([prompt]), device="cpu")
    probs = torch.softmax(processors(torch.tensor([prompt]), torch.from_numpy(logits)[None].clone()), -1)[0].numpy()
    allowed = np.flatnonzero(probs > 0)
    assert 2 <= allowed.size < 300, allowed.size
    assert np.isin(tokens, allowed).all()  # nothing outside the processed distribution, ever
    counts = np.array([(tokens == t).sum() for t in allowed])
    expected = probs[allowed].astype(np.float64) / probs[allowed].sum() * draws
    big = expected >= 5  # chi-square on the well-populated tokens, the rest pooled
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    if expected[-1] < 5:
        observed, expected = observed[:-1], expected[:-1]
    expected = expected / expected.sum() * observed.sum()
    expected[-1] = observed.sum() - expected[:-1].sum()
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_sampling_with_processors_is_seeded_and_batch_independent(models):
    ctx = generation.context(models("llama-genai"), max_new_tokens=12, do_sample=True, temperature=0.9,
                             repetition_penalty=1.3, no_repeat_ngram_size=2, top_p=0.9)
    prompts = repetitive_prompts()
    first = generation.generate(ctx, prompts, seeds=[1, 2, 3, 4])
    assert generation.generate(ctx, prompts, seeds=[1, 2, 3, 4]) == first
    for i, prompt in enumerate(prompts):
        assert generation.generate(ctx, [prompt], seeds=[i + 1])[0] == first[i]


class BanLastToken:
    """A user's processor: the row's last token may not come again at once (the seed's
    `(state, process)` form: state reads the row, process maps the batch's scores)."""

    @staticmethod
    def state(row):
        last = row["generated"][0] if row["generated"] else row["prompt"][-1]
        return np.array([last])

    @staticmethod
    def process(scores, states):
        out = scores.copy()
        out[np.arange(len(out)), states[:, 0]] = -np.inf
        return out


def test_custom_processor_applies_where_transformers_applies_its_logits_processor(models, oracle):
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class TorchBanLast(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[torch.arange(len(scores)), input_ids[:, -1]] = -float("inf")
            return scores

    # after the repetition penalty and before temperature: with sampling off, transformers appends
    # the user's processors after its own, which is the same place
    ctx = generation.context(models("llama-optimum"), max_new_tokens=10, repetition_penalty=1.2,
                             processors=[(BanLastToken.state, BanLastToken.process)])
    prompts = [[7, 7, 7], [300, 301]]
    for prompt, row in zip(prompts, generation.generate(ctx, prompts)):
        assert row == oracle.greedy("llama", prompt, 10, repetition_penalty=1.2,
                                    logits_processor=LogitsProcessorList([TorchBanLast()]))
        assert all(a != b for a, b in zip([prompt[-1]] + row, row))


def test_custom_processor_state_sees_prompt_and_generated_last_first(models):
    seen = []

    def state(row):
        seen.append((row["prompt"], row["generated"], row["vocab"]))
        return np.zeros(1)

    ctx = generation.context(models("llama-optimum"), max_new_tokens=3, processors=[(state, lambda s, _: s)])
    tokens = generation.generate(ctx, [[5, 6]])[0]
    assert seen[0] == ([5, 6], [], 1000)
    assert seen[-1] == ([5, 6], tokens[:2][::-1], 1000)


def test_argmax_keeping_processors_leave_greedy_unchanged(models, prompts_of):
    model = models("llama-genai")
    prompts = prompts_of([4, 9, 1], seed=3)
    plain = generation.generate(generation.context(model, max_new_tokens=8), prompts)
    for settings in (dict(renormalize_logits=True), dict(temperature=0.3, top_k=3, top_p=0.5, min_p=0.2, typical_p=0.5),
                     dict(epsilon_cutoff=0.01, eta_cutoff=0.01)):
        assert generation.generate(generation.context(model, max_new_tokens=8, **settings), prompts) == plain


def test_processed_rows_take_the_lean_path_only_when_nothing_processes(models):
    model = models("llama-genai")
    state = generation.new_state(generation.context(model, max_new_tokens=4), slots=1, capacity=16)
    ctx = generation.context(model, max_new_tokens=4)
    state, _ = generation.admit(ctx, state, [0], [[5, 6]], [0])
    assert state.fast
    penalised = generation.context(model, max_new_tokens=4, repetition_penalty=1.1)
    state = generation.new_state(penalised, slots=1, capacity=16)
    state, _ = generation.admit(penalised, state, [0], [[5, 6]], [0])
    assert state.processes and not state.fast
