"""Assisted decoding with prompt lookup.

Invariants: greedy output with prompt lookup equals plain greedy for K in {1, 2, 4, 8} in every
cache mode, on batches whose rows keep different numbers of candidates in one step; with
processors on too, and no candidate they forbid is ever proposed; sampling rows give the plain
sampled tokens of the same seed (each position draws its token index's number); a verify step
whose candidates are all rejected, rewound, then continued equals an uninterrupted run; the
largest n-gram wins, then the earliest match; the tokens equal transformers' prompt lookup.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import generation
from generation.assisted.verify import accept_greedy, verify
from generation.assisted.budget import CostAware
from generation.assisted.prompt_lookup import PromptLookup, forbidden_cut, lookup

MODES = [("llama-genai", "in_place"), ("llama-optimum", "append"), ("gpt2-grow", "grow"), ("llama-genai", "grow")]
# the shipped default model is trained: it copies spans of its prompt, as prompt lookup needs
# (the random-weight test models never repeat themselves); both of its graphs, every mode
DEFAULT = [("genai", "in_place"), ("genai", "grow"), ("merged", "append"), ("merged", "grow")]
GREEDY = dict(do_sample=False, repetition_penalty=1.0)
TEXT = ("Return a new sorted list from the items in iterable. The key argument specifies a function of one "
        "argument that is used to extract a comparison key from each element. The reverse argument is a boolean.")


@pytest.fixture(scope="module")
def models(test_models, load_model):
    return {f: load_model(test_models[f]) for f in {f for f, _ in MODES}}


@pytest.fixture(scope="module")
def default(load_model):
    from generation.default_model import FOLDER

    return {"genai": load_model(FOLDER / "genai"), "merged": load_model(FOLDER)}


def grounded(model):
    """Prompts of different lengths that the model continues by copying their earlier text, by
    different amounts (so rows keep different counts in one step)."""
    from generation.text.tokenizer import model_tokenizer

    ids = model_tokenizer(model).encode(TEXT).ids
    return [ids + ids[:12], ids[:30] + ids[:8], ids[5:] + ids[5:20], ids[:9]]


def take_tokens(got: list[list[int]], outs) -> None:
    """Each row's new tokens of a step's StepTokens (one per position), in order, into got[b]."""
    for out in outs:
        for b, row in enumerate(got):
            if out.token[b] >= 0:
                row.append(int(out.token[b]))


class Spy:
    """A candidate generator that records what the one it wraps proposed and what was kept."""

    def __init__(self, inner):
        self.inner, self.proposed, self.kept = inner, [], []

    def propose(self, state, rows, room, allowed=None):
        ids, counts, probs = self.inner.propose(state, rows, room, allowed)
        self.proposed.append((state.tokens[rows].copy(), state.lengths[rows] + 1, ids.copy(), counts.copy()))
        return ids, counts, probs

    def accepted(self, rows, accepted, counts):
        self.kept.append((accepted.copy(), np.minimum(counts, 1 << 30)))


@pytest.fixture
def spy(monkeypatch):
    """Route generate()'s candidate generator through a Spy; `spy.last` is the last one made."""
    module = importlib.import_module("generation.engine.generate")
    made = []

    def wrapped(ctx):
        inner = module.__dict__["_original_candidates_for"](ctx)
        if inner is None:
            return None
        if isinstance(inner, CostAware):  # these tests check every proposal's verification, not which pay
            inner = inner.inner
        made.append(Spy(inner))
        return made[-1]
    monkeypatch.setitem(module.__dict__, "_original_candidates_for", module.candidates_for)
    monkeypatch.setattr(module, "candidates_for", wrapped)
    return made


def test_lookup_prefers_the_longest_ngram_then_the_earliest_match():
    tokens = np.array([[7, 2, 9, 4, 1, 2, 3, 8, 1, 2],    # the bigram (1, 2) at 4 wins over the earlier unigram 2 at 1
                       [7, 1, 9, 4, 1, 5, 3, 8, 6, 1],    # unigram 1: at 1 and at 4, the earliest wins
                       [5, 6, 7, 8, 9, 10, 11, 12, 13, 14],  # no earlier occurrence: nothing
                       [3, 5, 3, 5, 0, 0, 0, 0, 0, 0]])   # (3, 5) at 0, its continuation reaches the row's end
    ids, counts = lookup(tokens, np.array([10, 10, 10, 4]), 2, np.array([4, 4, 4, 4]))
    assert counts.tolist() == [4, 4, 0, 4]  # a continuation may run into the row's last tokens, then repeat them
    assert ids[0].tolist() == [3, 8, 1, 2] and ids[1].tolist() == [9, 4, 1, 5] and ids[3].tolist() == [3, 5, 3, 5]
    ids, counts = lookup(tokens, np.array([10, 10, 10, 4]), 1, np.array([2, 1, 0, 3]))  # unigrams only; per-row caps
    assert counts.tolist() == [2, 1, 0, 3] and ids[0, :2].tolist() == [9, 4] and ids[1, :1].tolist() == [9]
    assert ids[3].tolist() == [3, 5, 3]  # 5 at 1, followed by the row's last two tokens


def test_accept_greedy_and_forbidden_cut():
    cand = np.array([[4, 5, 6], [4, 5, 6], [7, -1, -1], [-1, -1, -1]])
    target = np.array([[4, 5, 6, 9], [4, 8, 6, 9], [1, 2, 3, 4], [5, 0, 0, 0]])
    assert accept_greedy(cand, np.array([3, 3, 1, 0]), target).tolist() == [3, 1, 0, 0]
    assert accept_greedy(cand, np.array([2, 3, 1, 0]), target).tolist() == [2, 1, 0, 0]  # the count caps it
    cut = forbidden_cut(cand, np.array([3, 3, 1, 0]), lambda j, rows: cand[rows, j] != 5)
    assert cut.tolist() == [1, 1, 1, 0]


@pytest.mark.parametrize("layout,mode", DEFAULT, ids=[f"{f}-{m}" for f, m in DEFAULT])
def test_greedy_equals_plain_for_every_k(default, layout, mode, spy):
    model = default[layout]
    prompts = grounded(model)
    plain = generation.generate(generation.context(model, max_new_tokens=30, cache_mode=mode, **GREEDY), prompts,
                                seeds=[0] * 4)
    for k in (1, 2, 4, 8):
        ctx = generation.context(model, max_new_tokens=30, cache_mode=mode, prompt_lookup_num_tokens=k, **GREEDY)
        assert generation.generate(ctx, prompts, seeds=[0] * 4) == plain, k
        kept = [a for a, _ in spy[-1].kept]
        assert sum(int(a.sum()) for a in kept) > 0, "no candidate was ever kept: the test proves nothing"
        assert any(len(set(a.tolist())) > 1 for a in kept), "rows never kept different counts in one step"


@pytest.mark.parametrize("layout,mode", DEFAULT[::2], ids=[f"{f}-{m}" for f, m in DEFAULT[::2]])
def test_processors_apply_at_every_verified_position(default, layout, mode, spy):
    model = default[layout]
    prompts = grounded(model)
    flat = [t for row in prompts for t in row]
    banned = max(set(flat), key=flat.count)  # the token the prompts repeat most
    settings = dict(repetition_penalty=1.05, no_repeat_ngram_size=8, bad_words_ids=[[banned]], min_new_tokens=5,
                    max_new_tokens=30, cache_mode=mode, do_sample=False)
    plain = generation.generate(generation.context(model, **settings), prompts, seeds=[0] * 4)
    ctx = generation.context(model, prompt_lookup_num_tokens=4, **settings)
    assert generation.generate(ctx, prompts, seeds=[0] * 4) == plain
    proposals = spy[-1].proposed
    assert sum(int(a.sum()) for a, _ in spy[-1].kept) > 0
    assert any(banned in row[:n].tolist() for tokens, count, _, _ in proposals for row, n in zip(tokens, count)), \
        "the banned token was never in a row: the test proves nothing"
    for _, _, ids, counts in proposals:
        proposed = ids[np.arange(ids.shape[1]) < counts[:, None]]
        assert banned not in proposed.tolist()


def test_sampling_gives_the_plain_tokens_of_the_seed(default, spy):
    model = default["merged"]
    settings = dict(max_new_tokens=30, do_sample=True, temperature=0.5, top_k=20, repetition_penalty=1.0)
    prompts = grounded(model)
    seeds = [3, 4, 5, 6]
    plain = generation.generate(generation.context(model, **settings), prompts, seeds=seeds)
    ctx = generation.context(model, prompt_lookup_num_tokens=4, **settings)
    assert generation.generate(ctx, prompts, seeds=seeds) == plain
    assert sum(int(a.sum()) for a, _ in spy[-1].kept) > 0
    other = generation.generate(ctx, prompts, seeds=[7, 4, 5, 6])
    assert other[1:] == plain[1:] and other[0] != plain[0]  # a row's tokens are its own seed's


class Scripted:
    """Candidates from the plain output, wrong at chosen places: row b's candidate j is wrong
    when (b + j + step) % 3 == 2, so rows keep 0 to K of them, differently in each step; half
    the rows have none in a step."""

    def __init__(self, plain, k):
        self.plain, self.k, self.steps, self.kept = plain, k, 0, []

    def propose(self, state, rows, room, allowed=None):
        ids = np.full((len(rows), self.k), 0, np.int64)
        for i, b in enumerate(rows.tolist()):
            done = int(state.lengths[b] + 1 - state.prompt_length[b])
            ahead = self.plain[b][done:done + self.k]
            ids[i, :len(ahead)] = ahead
            ids[i, [j for j in range(self.k) if (b + j + self.steps) % 3 == 2]] = 1
        counts = np.where((rows + self.steps) % 4 < 2, 0, np.minimum(room, self.k))  # some rows have none
        self.steps += 1
        return ids, counts, None

    def accepted(self, rows, accepted, counts):
        self.kept.append(accepted.copy())


@pytest.mark.parametrize("folder,mode", MODES, ids=[f"{f}-{m}" for f, m in MODES])
def test_rows_keep_different_counts_in_every_mode(models, folder, mode, monkeypatch):
    ctx = generation.context(models[folder], max_new_tokens=24, cache_mode=mode)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [15, 16, 17, 18], [19, 20]]
    plain = generation.generate(ctx, prompts, seeds=[0] * 5)
    module = importlib.import_module("generation.engine.generate")
    for k in (1, 2, 4, 8):
        scripted = Scripted(plain, k)
        monkeypatch.setattr(module, "candidates_for", lambda ctx: scripted)
        assert generation.generate(ctx, prompts, seeds=[0] * 5) == plain, k
        assert any(len(set(a.tolist())) > 1 for a in scripted.kept) and max(a.max() for a in scripted.kept) >= min(k, 2)


class Random:
    """Candidates that are random tokens: (almost) always rejected."""

    def __init__(self, k, seed=0):
        self.k, self.rng = k, np.random.default_rng(seed)

    def propose(self, state, rows, room, allowed=None):
        return self.rng.integers(3, 1000, (len(rows), self.k)), np.minimum(room, self.k), None

    def accepted(self, rows, accepted, counts):
        pass


@pytest.mark.parametrize("folder,mode", MODES, ids=[f"{f}-{m}" for f, m in MODES])
def test_rewind_then_continue_equals_an_uninterrupted_run(models, folder, mode):
    ctx = generation.context(models[folder], max_new_tokens=24, cache_mode=mode)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [15, 16, 17, 18]]
    plain = generation.generate(ctx, prompts, seeds=[0] * 4)
    state = generation.new_state(ctx, slots=4, capacity=64)
    state, first = generation.admit(ctx, state, [0, 1, 2, 3], prompts, [0] * 4)
    got = [[t] for t in first.token.tolist()]
    for step_no in range(23):
        if step_no % 3 == 1:  # a verify step whose candidates are rejected and rolled back
            state, outs = verify(ctx, state, Random(5, step_no))
        else:
            state, out = generation.step(ctx, state)
            outs = [out]
        take_tokens(got, outs)
        if not state.live.any():
            break
    assert [g[:len(p)] for g, p in zip(got, plain)] == plain


def test_limits_eos_streaming_and_logprobs(default):
    model = default["genai"]
    prompts = grounded(model)
    copied = generation.generate(generation.context(model, max_new_tokens=30, **GREEDY), prompts, seeds=[0] * 4)
    for settings in (dict(max_new_tokens=7), dict(max_new_tokens=30, eos_token_id=[2, copied[3][6]]),
                     dict(max_new_tokens=12, min_new_tokens=3, do_sample=True, top_k=10)):
        settings = {**GREEDY, **settings}
        plain_ctx = generation.context(model, token_logprobs=True, top_logprobs=2, **settings)
        ctx = generation.context(model, token_logprobs=True, top_logprobs=2, prompt_lookup_num_tokens=8, **settings)
        plain = generation.generate(plain_ctx, prompts, seeds=[0] * 4)
        streamed = [[] for _ in prompts]

        def on_token(out):
            for i, t in enumerate(out.token.tolist()):
                if t >= 0:
                    streamed[i].append(t)
        got = generation.generate(ctx, prompts, seeds=[0] * 4, on_token=on_token)
        assert [g.tokens for g in got] == [p.tokens for p in plain] == streamed
        for g, p in zip(got, plain):
            np.testing.assert_allclose(g.logprobs, p.logprobs, atol=1e-5)
            assert [[i for i, _ in top] for top in g.top_logprobs] == [[i for i, _ in top] for top in p.top_logprobs]


def test_equals_transformers_prompt_lookup(default):
    import torch
    import transformers

    from generation.default_model import FOLDER

    model = default["merged"]
    prompt = grounded(model)[0]
    ours = generation.generate(generation.context(model, max_new_tokens=20, prompt_lookup_num_tokens=3, **GREEDY),
                               [prompt], seeds=[0])[0]
    reference = transformers.AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, prompt_lookup_num_tokens=3,
                                 do_sample=False, repetition_penalty=1.0)
    theirs = out[0, len(prompt):].tolist()
    assert ours == (theirs[:-1] if theirs[-1:] == [2] else theirs)


@pytest.mark.parametrize("overrides,field", [(dict(prompt_lookup_num_tokens=0), "prompt_lookup_num_tokens"),
                                             (dict(prompt_lookup_num_tokens=2, max_matching_ngram_size=-1),
                                              "max_matching_ngram_size"),
                                             (dict(prompt_lookup_num_tokens="4"), "prompt_lookup_num_tokens")])
def test_bad_settings_name_the_field(models, overrides, field):
    with pytest.raises(ValueError, match=field):
        generation.context(models["llama-optimum"], **overrides)


def test_beams_refuse_prompt_lookup(models):
    ctx = generation.context(models["llama-optimum"], num_beams=2, prompt_lookup_num_tokens=3, max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        generation.generate(ctx, [[5, 6, 7]], seeds=[0])


def test_prompt_lookup_class_validates():
    with pytest.raises(ValueError, match="max_matching_ngram_size"):
        PromptLookup(3, 0)


# --- a draft model -------------------------------------------------------------------------
# llama-genai and llama-optimum hold the same weights (hf/llama): one is a perfect draft of the
# other; gpt2-grow and qwen2-optimum are other random models with the same tokenizer.
DRAFTS = [("llama-genai", "in_place"), ("llama-genai", "grow"), ("llama-optimum", "append")]


@pytest.fixture(scope="module")
def drafts(test_models, load_model):
    return {f: load_model(test_models[f]) for f in ("llama-genai", "llama-optimum", "gpt2-grow", "qwen2-optimum")}


def logged(monkeypatch, wrong=False):
    """Route generate()'s draft through a recorder of its (accepted, counts); with `wrong`, the
    draft's candidate j of row b is replaced by token 1 when (b + j + step) % 3 == 2, so rows
    keep part of what the draft proposed and its cache must roll back."""
    module = importlib.import_module("generation.engine.generate")
    original, made = module.candidates_for, []

    def wrapped(ctx):
        draft = original(ctx)
        propose, accepted = draft.propose, draft.accepted
        draft.log, draft.steps = [], 0

        def spoiled(state, rows, room, allowed=None):
            ids, counts, probs = propose(state, rows, room, allowed)
            if wrong:
                b, j = np.meshgrid(rows, np.arange(ids.shape[1]), indexing="ij")
                ids = np.where((b + j + draft.steps) % 3 == 2, 1, ids)
            draft.steps += 1
            return ids, counts, probs

        def record(rows, a, c):
            draft.log.append((a.copy(), c.copy()))
            run = draft._run
            accepted(rows, a, c)
            if run is not None:  # the draft's cache keeps exactly its tokens the target kept
                _, lengths, width = run
                assert (draft.state.lengths[rows] == lengths + 1 + np.minimum(a, width - 1)).all()
        draft.propose, draft.accepted = spoiled, record
        made.append(draft)
        return draft
    monkeypatch.setattr(module, "candidates_for", wrapped)
    return made


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [15, 16, 17, 18], [19, 20]]


@pytest.mark.parametrize("target_mode", ["append", "grow"])
@pytest.mark.parametrize("folder,mode", DRAFTS, ids=[f"{f}-{m}" for f, m in DRAFTS])
def test_a_draft_identical_to_the_target_accepts_everything(drafts, folder, mode, target_mode, monkeypatch):
    target = drafts["llama-optimum"]
    plain = generation.generate(generation.context(target, max_new_tokens=24, cache_mode=target_mode), PROMPTS,
                                seeds=[0] * 5)
    made = logged(monkeypatch)
    for k, schedule in ((1, "constant"), (2, "constant"), (4, "constant"), (8, "constant"), (2, "heuristic")):
        ctx = generation.context(target, max_new_tokens=24, cache_mode=target_mode, draft=drafts[folder],
                                 draft_cache_mode=mode, num_assistant_tokens=k, num_assistant_tokens_schedule=schedule)
        assert generation.generate(ctx, PROMPTS, seeds=[0] * 5) == plain
        log = made[-1].log
        assert all((a == c).all() for a, c in log) and sum(int(c.sum()) for _, c in log) > 0
        widths = [int(c.max()) for _, c in log]
        if schedule == "constant":  # k each step (fewer only where the rows' room ends)
            assert widths[:2] == [k, k] and max(widths) == k
        else:  # +2 after all were kept
            assert widths[:3] == [2, 4, 6]


@pytest.mark.parametrize("folder,mode", DRAFTS + [("gpt2-grow", "grow")], ids=lambda v: str(v))
def test_a_partly_wrong_draft_rolls_back_and_gives_the_plain_output(drafts, folder, mode, monkeypatch):
    target = drafts["llama-optimum"]
    plain = generation.generate(generation.context(target, max_new_tokens=24), PROMPTS, seeds=[0] * 5)
    made = logged(monkeypatch, wrong=True)
    ctx = generation.context(target, max_new_tokens=24, draft=drafts[folder], draft_cache_mode=mode,
                             num_assistant_tokens=4, num_assistant_tokens_schedule="heuristic")
    assert generation.generate(ctx, PROMPTS, seeds=[0] * 5) == plain
    kept = [a for a, _ in made[-1].log]
    if folder != "gpt2-grow":  # the right draft's rows keep different counts, the random one's none
        assert any(len(set(a.tolist())) > 1 for a in kept) and max(int(a.max()) for a in kept) >= 2


@pytest.mark.parametrize("folder", ["gpt2-grow", "qwen2-optimum"])
def test_a_random_draft_still_gives_the_plain_output(drafts, folder):
    target = drafts["llama-genai"]
    plain = generation.generate(generation.context(target, max_new_tokens=20), PROMPTS, seeds=[1] * 5)
    ctx = generation.context(target, max_new_tokens=20, draft=drafts[folder], num_assistant_tokens=5)
    assert generation.generate(ctx, PROMPTS, seeds=[1] * 5) == plain


def test_speculative_sampling_keeps_the_target_distribution():
    """Hand-built p and q: the first token out of the rule (a kept candidate, or the residual
    draw at the first rejection) follows p exactly, whatever q (chi-square, 40000 draws)."""
    from scipy import stats

    from generation.assisted.verify import speculative_accept

    rng = np.random.default_rng(0)
    n, vocab = 40000, 4
    p_row = np.array([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])
    q_row = np.array([[0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7]])
    p, q = np.broadcast_to(p_row, (n, 3, vocab)), np.broadcast_to(q_row, (n, 2, vocab))
    candidates = np.stack([rng.choice(vocab, n, p=q_row[j]) for j in range(2)], axis=1)
    accepted, nxt = speculative_accept(candidates, np.full(n, 2), p, q, rng.random((n, 2)), rng.random((n, 3)))
    first = np.where(accepted > 0, candidates[:, 0], nxt)
    assert stats.chisquare(np.bincount(first, minlength=vocab), n * p_row[0]).pvalue > 1e-3
    second = np.where(accepted > 1, candidates[:, 1], nxt)[accepted >= 1]  # given the first was kept
    assert stats.chisquare(np.bincount(second, minlength=vocab), len(second) * p_row[1]).pvalue > 1e-3
    assert 0 < (accepted == 0).mean() < 1 and (accepted == 2).any()  # both branches ran
    wrong = speculative_accept(candidates, np.full(n, 2), p, q, np.zeros((n, 2)), rng.random((n, 3)))[0]
    assert (np.where(wrong > 0, candidates[:, 0], 0) == 0).mean() > 0.35  # accepting everything would distort


def test_sampling_with_a_draft_is_seeded_and_has_the_target_distribution(drafts):
    """Same seeds, same tokens; the first verified token (the second new one) of 600 rows of
    one prompt with a draft identical to the target (it is kept whenever drawn) against plain
    sampling (chi-square on the tokens' counts)."""
    from scipy import stats

    target = drafts["llama-optimum"]
    settings = dict(do_sample=True, top_k=4, temperature=1.0, max_new_tokens=3)
    ctx = generation.context(target, draft=drafts["llama-genai"], num_assistant_tokens=2, **settings)
    seeds = list(range(600))
    ours = generation.generate(ctx, [PROMPTS[1]] * 600, seeds=seeds)
    assert generation.generate(ctx, [PROMPTS[1]] * 600, seeds=seeds) == ours
    plain = generation.generate(generation.context(target, **settings), [PROMPTS[1]] * 600, seeds=[s + 10**6 for s in seeds])
    a, b = [[row[:2] for row in rows] for rows in (ours, plain)]
    keys = sorted({tuple(x) for x in a + b})
    table = np.array([[a.count(list(k)) for k in keys], [b.count(list(k)) for k in keys]])
    table = table[:, table.sum(axis=0) >= 10]
    assert table.shape[1] >= 3 and stats.chi2_contingency(table).pvalue > 1e-3


def test_draft_settings_are_checked(drafts, default):
    with pytest.raises(ValueError, match="draft"):
        generation.context(drafts["llama-optimum"], draft=default["merged"])  # 4096 ids against 1000
    with pytest.raises(ValueError, match="num_assistant_tokens"):
        generation.context(drafts["llama-optimum"], draft=drafts["llama-genai"], num_assistant_tokens=0)
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule"):
        generation.context(drafts["llama-optimum"], num_assistant_tokens_schedule="sometimes")


def test_a_draft_with_logprobs_gives_the_plain_sampled_tokens(drafts):
    """Log-probabilities are those of the target's own draws: the draft then proposes greedily
    and sampling rows keep what equals their plain draw."""
    settings = dict(do_sample=True, top_k=4, max_new_tokens=12, token_logprobs=True)
    plain = generation.generate(generation.context(drafts["llama-optimum"], **settings), PROMPTS, seeds=[5] * 5)
    ctx = generation.context(drafts["llama-optimum"], draft=drafts["llama-genai"], num_assistant_tokens=3, **settings)
    got = generation.generate(ctx, PROMPTS, seeds=[5] * 5)
    assert [g.tokens for g in got] == [p.tokens for p in plain]
    for g, p in zip(got, plain):
        np.testing.assert_allclose(g.logprobs, p.logprobs, atol=1e-5)


def test_rows_of_one_state_with_their_own_lookup_settings(default):
    """The decode-state verbs: rows admitted with their own prompt_lookup_num_tokens and
    max_matching_ngram_size (none for one row, which then never gets a candidate), one joining
    a running batch, step by `verify`: each row equals its plain greedy tokens."""
    model = default["genai"]
    ctx = generation.context(model, max_new_tokens=30, **GREEDY)
    prompts = grounded(model)
    plain = generation.generate(ctx, prompts, seeds=[0] * 4)
    settings = [ctx.with_settings(prompt_lookup_num_tokens=k, max_matching_ngram_size=n)
                for k, n in ((4, 2), (None, None), (2, 1), (8, 3))]
    proposed = []

    class Recording(PromptLookup):
        def propose(self, state, rows, room, allowed=None):
            ids, counts, probs = super().propose(state, rows, room, allowed)
            proposed.append(dict(zip(rows.tolist(), counts.tolist())))
            return ids, counts, probs

    state = generation.new_state(ctx, slots=4, capacity=96)
    state, first = generation.admit(ctx, state, [0, 1, 2], prompts[:3], [0] * 3, settings=settings[:3])
    got = [[t] if t >= 0 else [] for t in first.token.tolist()] + [[]]
    for step_no in range(40):
        if step_no == 3:
            state, late = generation.admit(ctx, state, [3], prompts[3:], [0], settings=settings[3:])
            got[3].append(int(late.token[0]))
        state, outs = verify(ctx, state, Recording())
        take_tokens(got, outs)
        if not state.live.any():
            break
    assert got == plain
    assert all(counts.get(1, 0) == 0 for counts in proposed)  # the row without prompt lookup
    assert sum(counts.get(3, 0) for counts in proposed) > 0 and sum(counts.get(2, 0) for counts in proposed) > 0
    assert max(counts.get(2, 0) for counts in proposed) <= 2  # its own prompt_lookup_num_tokens


def test_more_prompts_than_slots(drafts, default):
    """Rows that end free their slots for later prompts: a draft's slot then holds another row
    (it notices by the tokens), and every prompt still gets its plain tokens."""
    target = drafts["llama-optimum"]
    plain = generation.generate(generation.context(target, max_new_tokens=20), PROMPTS * 2, seeds=[0] * 10)
    for draft in (drafts["llama-genai"], drafts["gpt2-grow"]):
        ctx = generation.compile(generation.context(target, max_new_tokens=20, draft=draft, num_assistant_tokens=3), 3)
        assert generation.generate(ctx, PROMPTS * 2, seeds=[0] * 10) == plain
    prompts = grounded(default["genai"]) * 2
    plain = generation.generate(generation.context(default["genai"], max_new_tokens=30, **GREEDY), prompts, seeds=[0] * 8)
    ctx = generation.compile(generation.context(default["genai"], max_new_tokens=30, prompt_lookup_num_tokens=5,
                                                **GREEDY), 3)
    assert generation.generate(ctx, prompts, seeds=[0] * 8) == plain


@pytest.mark.parametrize("folder,mode", DRAFTS, ids=[f"{f}-{m}" for f, m in DRAFTS])
def test_a_draft_slot_reused_by_a_row_sharing_a_prefix(drafts, folder, mode):
    """A later row whose prompt begins as an earlier row of its slot did: the draft keeps the
    shared prefix of its cache, runs the rest, and (identical to the target) still has every
    candidate kept."""
    target = drafts["llama-optimum"]
    prompts = [[5, 6, 7, 8], [5, 6, 30, 31, 32, 33, 34]]
    plain = generation.generate(generation.context(target, max_new_tokens=12), prompts, seeds=[0, 0])
    ctx = generation.compile(generation.context(target, max_new_tokens=12, draft=drafts[folder], draft_cache_mode=mode,
                                                num_assistant_tokens=3), 1)
    module = importlib.import_module("generation.engine.generate")
    made = []
    original = module.candidates_for

    def wrapped(c):
        made.append(original(c))
        accepted = made[-1].accepted
        made[-1].log = []
        made[-1].accepted = lambda rows, a, n: (made[-1].log.append((a.copy(), n.copy())), accepted(rows, a, n))
        return made[-1]
    module.candidates_for = wrapped
    try:
        assert generation.generate(ctx, prompts, seeds=[0, 0]) == plain
    finally:
        module.candidates_for = original
    assert all((a == n).all() for a, n in made[-1].log) and len(made[-1].log) >= 4
