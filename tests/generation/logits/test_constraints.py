"""structured_outputs against transformers 4.57 generate with a LogitsProcessor that applies the
same library's (llguidance's) mask, rebuilt from each row's tokens at every step.

Invariants: constrained greedy and beam search give transformers' tokens (and beam scores and
log-probabilities) in every cache mode, and the constraint changed transformers' output; a
constrained row beside unconstrained ones gives each what it gives alone; sampled rows are
seeded and always valid; for random JSON schemas every output of a fixture and of the default
model parses and validates; a bad schema, regex or grammar is a SettingError naming
structured_outputs; a constraint unmet within the budget ends by length. A constraint over the
grammar budget is refused when it is checked, quickly, naming the budget's field and value; one
that leaves its row no token midway ends that row alone ("stop", with why), the others as alone.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import generation
from generation.params.checks import SettingError, _structured
from generation.logits import constraints

MODES = [("llama-optimum", "llama", "append"), ("llama-genai", "llama", "in_place"), ("gpt2-grow", "gpt2", "grow")]
PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21], [30, 31, 32, 30, 31, 32, 30, 31, 3]]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "ok", "tag"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                         "tag": {"type": "string", "maxLength": 6}}}
CONSTRAINTS = [
    pytest.param({"regex": "[a-f]{2,6}( [0-9]+)?"}, id="regex"),
    pytest.param({"choice": ["yes", "no", "maybe not"]}, id="choice"),
    pytest.param({"json": SCHEMA}, id="json"),
    pytest.param({"grammar": 'start: "(" item ("," item)* ")"\nitem: /[a-z]/ | start'}, id="grammar"),
]


@pytest.fixture(scope="module")
def models(test_models, load_model):
    return lambda folder: load_model(test_models[folder])


class GrammarMask:
    """A transformers LogitsProcessor: -inf where llguidance forbids the token after the row's
    generated tokens (a fresh matcher each call, from the tokens alone; a row holding a forbidden
    token is masked everywhere)."""

    def __init__(self, model, structured, prompt_length: int):
        import llguidance

        self.prompt_length = prompt_length
        grammars = constraints.Grammars(model.tokenizer_path, model.vocab_size, model_eos(model))
        self.tokenizer, self.grammar = grammars.tokenizer, constraints.grammar(_structured(structured))
        self.llguidance = llguidance

    def __call__(self, input_ids, scores):
        import llguidance.numpy as lnp
        import torch

        vocab = scores.shape[1]
        for r in range(len(input_ids)):
            matcher = self.llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)
            tokens = input_ids[r, self.prompt_length:].tolist()
            allowed = torch.zeros(vocab, dtype=torch.bool)
            if matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens):
                mask = lnp.allocate_token_bitmask(1, vocab)
                lnp.fill_next_token_bitmask(matcher, mask, 0)
                allowed = torch.from_numpy(np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[0, :vocab]
                                           .astype(bool))
            scores[r, ~allowed] = -float("inf")
        return scores


def model_eos(model) -> tuple[int, ...]:
    return generation.context(model).settings.eos_token_id


def hf_generate(oracle, name, model, prompt, max_new, structured=None, **settings):
    """transformers' (tokens without the final eos, [per-token log-probabilities], sequences_scores) for one prompt."""
    import torch
    from transformers import LogitsProcessorList

    hf = oracle.model(name)
    ids = torch.tensor([prompt])
    processors = LogitsProcessorList([GrammarMask(model, structured, len(prompt))] if structured else [])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                          pad_token_id=hf.config.pad_token_id, output_scores=True, return_dict_in_generate=True,
                          logits_processor=processors, **settings)
        beams = getattr(out, "beam_indices", None)
        transition = hf.compute_transition_scores(out.sequences, out.scores, beams, normalize_logits=True)
    eos = set(model_eos(model))
    rows = []
    for r in range(len(out.sequences)):
        steps = int((beams[r] >= 0).sum()) if beams is not None else out.sequences.shape[1] - len(prompt)
        tokens = out.sequences[r, len(prompt):len(prompt) + steps].tolist()
        logprobs = transition[r, :steps].tolist()
        while tokens and tokens[-1] in eos or tokens and tokens[-1] == hf.config.pad_token_id and beams is None:
            tokens, logprobs = tokens[:-1], logprobs[:-1]
        score = float(out.sequences_scores[r]) if beams is not None else None
        rows.append((tokens, logprobs, score))
    return rows


def valid(structured, text: str) -> bool:
    kind, value = next(iter(structured.items()))
    if kind == "regex":
        return re.fullmatch(value, text) is not None
    if kind == "choice":
        return text in value
    if kind == "json":
        import jsonschema

        jsonschema.validate(json.loads(text), value)
        return True
    return True


@pytest.mark.parametrize("folder, name, mode", MODES, ids=[m[2] for m in MODES])
@pytest.mark.parametrize("structured", CONSTRAINTS)
def test_constrained_greedy_equals_transformers_with_the_same_mask(models, oracle, folder, name, mode, structured):
    model = models(folder)
    ctx = generation.context(model, cache_mode=mode, max_new_tokens=24, token_logprobs=True,
                             structured_outputs=structured)
    got = generation.generate(ctx, PROMPTS)
    changed = False
    for prompt, row in zip(PROMPTS, got):
        (tokens, logprobs, _), = hf_generate(oracle, name, model, prompt, 24, structured)
        assert row.tokens == tokens, (prompt, structured)
        np.testing.assert_allclose(row.logprobs, logprobs, atol=1e-4)
        (plain, _, _), = hf_generate(oracle, name, model, prompt, 24)
        changed |= plain != tokens
    assert changed  # the mask decided transformers' tokens


@pytest.mark.parametrize("folder, name, mode", MODES, ids=[m[2] for m in MODES])
@pytest.mark.parametrize("structured", CONSTRAINTS[:3])
def test_constrained_beams_equal_transformers_with_the_same_mask(models, oracle, folder, name, mode, structured):
    model = models(folder)
    settings = dict(num_beams=3, num_return_sequences=2, length_penalty=1.0)
    ctx = generation.context(model, cache_mode=mode, max_new_tokens=12, token_logprobs=True,
                             structured_outputs=structured, **settings)
    got = generation.beam_search(ctx, PROMPTS[:2], [0, 0])
    for prompt, hypotheses in zip(PROMPTS[:2], got):
        theirs = hf_generate(oracle, name, model, prompt, 12, structured, **settings)
        assert [h.tokens for h in hypotheses] == [t for t, _, _ in theirs], (prompt, structured)
        for h, (_, logprobs, score) in zip(hypotheses, theirs):
            assert np.isclose(h.score, score, rtol=1e-5, atol=1e-4)
            np.testing.assert_allclose(h.logprobs, logprobs, atol=1e-4)


def test_a_constrained_row_beside_others_gives_what_it_gives_alone(models):
    model = models("llama-optimum")
    ctx = generation.context(model, max_new_tokens=16)
    rows = [dict(), dict(structured_outputs={"regex": "[a-c]+"}), dict(do_sample=True),
            dict(structured_outputs={"json": SCHEMA}, do_sample=True), dict(num_beams=2, structured_outputs={"choice": ["ab", "cd"]}),
            dict(prompt_lookup_num_tokens=3, structured_outputs={"regex": "([a-c] ?)+"}), dict(prompt_lookup_num_tokens=3)]
    from generation.assisted.prompt_lookup import PromptLookup
    from generation.engine.scheduler import Scheduler

    scheduler = Scheduler(ctx, slots=10, capacity=64, isolate=False, lookup=PromptLookup())
    jobs = [scheduler.job(PROMPTS[i % 3], seed=i, settings=s) for i, s in enumerate(rows)]
    for job in jobs:
        scheduler.add(job)
    while scheduler.busy:
        scheduler.step()
    for i, (job, s) in enumerate(zip(jobs, rows)):
        alone = Scheduler(ctx, slots=4, capacity=64, isolate=False)
        one = alone.job(PROMPTS[i % 3], seed=i, settings=s)
        alone.add(one)
        while alone.busy:
            alone.step()
        assert job.tokens == one.tokens, s
        if job.hypotheses:
            assert [h.tokens for h in job.hypotheses] == [h.tokens for h in one.hypotheses]


@pytest.mark.parametrize("structured", CONSTRAINTS)
def test_sampled_rows_are_seeded_and_valid(models, structured):
    model = models("llama-optimum")
    from generation.text.tokenizer import model_tokenizer

    tokenizer = model_tokenizer(model)
    ctx = generation.context(model, max_new_tokens=80, do_sample=True, temperature=3.0,
                             structured_outputs=structured)
    first = generation.generate(ctx, [PROMPTS[0]] * 12, seeds=list(range(12)))
    assert first == generation.generate(ctx, [PROMPTS[0]] * 12, seeds=list(range(12)))
    assert len({tuple(r) for r in first}) > 1
    for row in first:
        text = tokenizer.decode(row)
        if len(row) < 80:  # finished within the budget: the whole output is valid
            assert valid(structured, text), text


def test_a_constraint_unmet_within_the_budget_ends_by_length(models):
    ctx = generation.context(models("llama-optimum"), max_new_tokens=3)
    from generation.engine.scheduler import Scheduler

    scheduler = Scheduler(ctx, slots=2, capacity=32, isolate=False)
    job = scheduler.job(PROMPTS[0], settings=dict(structured_outputs={"regex": "[a-c]{10}"}))
    scheduler.add(job)
    while scheduler.busy:
        scheduler.step()
    assert job.reason == "length" and len(job.tokens) == 3


@pytest.mark.parametrize("value, message", [
    ({"jsn": {}}, "structured_outputs must be one of"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": [1]}, "structured_outputs.json must be a JSON schema"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be true"),
    ({"choice": []}, "structured_outputs.choice must be a list"),
    ({"regex": 5}, "structured_outputs.regex must be a non-empty string"),
    ({"grammar": "x" * 70000}, "at most 65536"),
    ({"json": {"type": "nonsense"}}, "structured_outputs.json: .*nonsense"),
    ({"regex": "("}, "structured_outputs.regex: .*unclosed group"),
    ({"grammar": "start: foo"}, 'structured_outputs.grammar: .*unknown name: "foo"'),
    ({"grammar": "root ::= ("}, "structured_outputs.grammar: the GBNF grammar does not parse: Expected '\\)'"),
    ({"grammar": "root ::= [a-"}, "structured_outputs.grammar: the GBNF grammar does not parse: Unexpected end"),
    ({"grammar": "root ::= foo"}, "structured_outputs.grammar: the GBNF grammar does not parse: Rule 'foo' not found"),
])
def test_a_bad_constraint_names_the_setting(models, value, message):
    ctx = generation.context(models("llama-optimum"), max_new_tokens=4)
    with pytest.raises(SettingError, match=message) as e:
        job(ctx, structured_outputs=value)
    assert e.value.setting == "structured_outputs"


def job(ctx, **settings):
    from generation.engine.scheduler import Scheduler

    return Scheduler(ctx, slots=1, capacity=16).job([5], settings=settings)


REPEATING = [[68, 69, 68, 69, 70, 68, 69, 68, 69, 70, 68, 69], [5, 6, 7, 5, 6, 7, 5, 6]]


def runs_of(ctx, prompts, seeds, monkeypatch):
    """(generate's rows, how many model runs its scheduler made)."""
    from generation.engine import scheduler

    count = [0]
    original = scheduler.Scheduler._run

    def counted(self, updates):
        count[0] += 1
        return original(self, updates)

    monkeypatch.setattr(scheduler.Scheduler, "_run", counted)
    rows = generation.generate(ctx, prompts, seeds=seeds)
    monkeypatch.setattr(scheduler.Scheduler, "_run", original)
    return rows, count[0]


@pytest.mark.parametrize("structured", CONSTRAINTS[:3])
def test_assisted_decoding_under_a_constraint_gives_the_plain_tokens_in_fewer_runs(models, structured, monkeypatch):
    """Prompt lookup (greedy and sampled) and a draft model (greedy: here the model itself) keep
    the constrained row's tokens; their candidates are the grammar's (prompt lookup's are cut at
    the first it forbids, a draft proposes under the row's mask), so the steps verify some."""
    model = models("llama-optimum")
    draft = generation.load(model.folder, spin_wait=False)
    for sample in (False, True):
        settings = dict(max_new_tokens=30, structured_outputs=structured, do_sample=sample)
        plain, plain_runs = runs_of(generation.context(model, **settings), REPEATING, [1, 2], monkeypatch)
        looked, looked_runs = runs_of(generation.context(model, prompt_lookup_num_tokens=4, **settings), REPEATING,
                                      [1, 2], monkeypatch)
        assert looked == plain and looked_runs <= plain_runs, sample
        drafted, drafted_runs = runs_of(generation.context(model, draft=draft, **settings), REPEATING, [1, 2],
                                        monkeypatch)
        if not sample:
            assert drafted == plain and drafted_runs < plain_runs
        else:  # speculative sampling: the target's distribution, other draws; seeded, and valid
            again, _ = runs_of(generation.context(model, draft=draft, **settings), REPEATING, [1, 2], monkeypatch)
            assert drafted == again
            from generation.text.tokenizer import model_tokenizer

            for row in drafted:
                if len(row) < 30:
                    assert valid(structured, model_tokenizer(model).decode(row))


def test_compiled_grammars_are_cached_by_content(models):
    ctx = generation.context(models("llama-optimum"))
    grammars = constraints.Grammars.of(ctx)
    assert grammars is constraints.Grammars.of(generation.context(ctx.model, max_new_tokens=3))
    a = grammars.matcher(_structured({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}))
    count = len(grammars._compiled)
    b = grammars.matcher(_structured({"json": '{"type": "object", "properties": {"a": {"type": "integer"}}}'}))
    assert len(grammars._compiled) == count and a is not b  # the same schema (as text here): one compile


def test_json_keeps_the_schemas_property_order(models):
    from generation.text.tokenizer import model_tokenizer

    model = models("llama-optimum")
    schema = {"type": "object", "additionalProperties": False, "required": ["zeta", "alpha"],
              "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "integer", "minimum": 0, "maximum": 9}}}
    ctx = generation.context(model, max_new_tokens=40, structured_outputs={"json": schema})
    text = model_tokenizer(model).decode(generation.generate(ctx, [PROMPTS[0]])[0])
    assert list(json.loads(text)) == ["zeta", "alpha"] and text.startswith('{"zeta": ')  # json.dumps' layout


SCHEMA_NAMES = ["alpha", "beta", "gamma", "delta"]


def random_schemas():
    from hypothesis import strategies as st

    leaf = st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 500)),
        st.just({"type": "boolean"}),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.builds(lambda values: {"enum": values}, st.lists(st.sampled_from(["red", "green", 7, None, True]),
                                                            min_size=1, max_size=3, unique=True)),
    )
    value = st.recursive(leaf, lambda inner: st.one_of(
        st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, inner, st.integers(0, 3)),
        st.builds(lambda props: {"type": "object", "properties": props, "required": sorted(props),
                                 "additionalProperties": False},
                  st.dictionaries(st.sampled_from(SCHEMA_NAMES), inner, min_size=1, max_size=3))), max_leaves=4)
    return st.builds(lambda props: {"type": "object", "properties": props, "required": sorted(props),
                                    "additionalProperties": False},
                     st.dictionaries(st.sampled_from(SCHEMA_NAMES), value, min_size=1, max_size=3))


@pytest.mark.parametrize("which", ["fixture", "default model"])
def test_random_schemas_give_outputs_that_validate(models, which):
    import jsonschema
    from hypothesis import HealthCheck, given, settings as hyp_settings

    from generation.text.tokenizer import model_tokenizer

    if which == "fixture":
        model = models("llama-optimum")
    else:
        from generation.default_model import default_model_path

        model = generation.load(default_model_path())
    tokenizer = model_tokenizer(model)

    @hyp_settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(random_schemas())
    def check(schema):
        for sample in (False, True):
            constrained = generation.context(model, max_new_tokens=160, structured_outputs={"json": schema},
                                             do_sample=sample)
            rows = generation.generate(constrained, [[5, 6, 7]], seeds=[len(json.dumps(schema))])
            text = tokenizer.decode(rows[0])
            jsonschema.validate(json.loads(text), schema)

    check()


def alternatives(count: int, gbnf: bool = False) -> str:
    """A grammar of `count` literal alternatives: Lark's, or GBNF's (which llguidance converts)."""
    return ("root ::= " if gbnf else "start: ") + " | ".join(f'"w{i}"' for i in range(count))


@pytest.mark.parametrize("value, limit", [
    ({"regex": "x{1000000}"}, "initial_lexer_fuel is 50000"),
    ({"regex": "(x{1000}){1000}"}, "initial_lexer_fuel is 50000"),
    ({"grammar": alternatives(6000)}, "max_grammar_size is 4096"),
    ({"grammar": alternatives(6000, gbnf=True)}, "max_grammar_size is 4096"),
    ({"grammar": alternatives(2500)}, "max_items_in_row is 2000"),  # within the size: its probe step meets the row
], ids=["x1000000", "x1000x1000", "lark-6000", "gbnf-6000", "lark-2500"])
def test_a_constraint_over_the_budget_is_refused_quickly_naming_the_limit(models, value, limit):
    import time

    ctx = generation.context(models("llama-optimum"), max_new_tokens=4)
    started = time.perf_counter()
    with pytest.raises(SettingError, match="over the grammar budget") as e:
        job(ctx, structured_outputs=value)
    assert time.perf_counter() - started < 1.0  # before: x{1000000} compiled, and its first step took 0.5 s
    assert e.value.setting == "structured_outputs" and f"grammar_budget.{limit}" in str(e.value)


@pytest.mark.parametrize("gbnf", [False, True], ids=["lark", "gbnf"])
def test_600_alternatives_are_within_the_budget_and_generate(models, gbnf):
    from generation.text.tokenizer import model_tokenizer

    model = models("llama-optimum")
    ctx = generation.context(model, max_new_tokens=8, structured_outputs={"grammar": alternatives(600, gbnf)})
    text = model_tokenizer(model).decode(generation.generate(ctx, [PROMPTS[0]])[0])
    assert re.fullmatch(r"w\d+", text) and int(text[1:]) < 600, text


def test_the_budget_is_the_contexts_and_checked_by_field(models):
    model = models("llama-optimum")
    small = generation.context(model, max_new_tokens=4, grammar_budget={"max_grammar_size": 500})
    with pytest.raises(SettingError, match="grammar_budget.max_grammar_size is 500"):
        job(small, structured_outputs={"grammar": alternatives(600)})
    job(generation.context(model, max_new_tokens=4), structured_outputs={"grammar": alternatives(600)})
    roomy = generation.context(model, max_new_tokens=4, grammar_budget={"initial_lexer_fuel": 1_000_000})
    job(roomy, structured_outputs={"regex": "x{30000}"})  # llguidance's default fuel takes it
    with pytest.raises(SettingError, match="grammar_budget.initial_lexer_fuel is 50000"):
        job(generation.context(model, max_new_tokens=4), structured_outputs={"regex": "x{30000}"})
    with pytest.raises(SettingError, match="grammar_budget.fuel is not a budget field") as e:
        generation.context(model, grammar_budget={"fuel": 1})
    assert e.value.setting == "grammar_budget"
    with pytest.raises(SettingError, match=r"grammar_budget.seconds must be a number in \(0, 3600\], not 0"):
        constraints.GrammarBudget.of({"seconds": 0})


def test_a_constraint_that_leaves_no_token_ends_its_row_alone(models):
    """Midway, a row's constraint meets a limit of its budget (a rule of 2500 alternatives after two
    letters: its probe step at the check passes the first) or the processors forbid all it allows
    (min_new_tokens and a complete choice: only eos may follow): the row ends there, "stop", with
    its tokens so far and why; the rows beside it (greedy, sampled, prompt lookup) get what they get
    alone. Before, the greedy row went on with token 0 to its budget and the sampled one failed."""
    from generation.assisted.prompt_lookup import PromptLookup
    from generation.engine.scheduler import Scheduler
    from generation.text.tokenizer import model_tokenizer

    model = models("llama-optimum")
    tokenizer = model_tokenizer(model)
    ctx = generation.context(model, max_new_tokens=12)
    wide = {"grammar": "start: /[a-c]/ /[a-c]/ (" + alternatives(2500).removeprefix("start: ") + ")"}
    complete = dict(structured_outputs={"choice": ["yes"]}, min_new_tokens=6)
    rows = [dict(structured_outputs=wide), dict(complete, do_sample=True), dict(), dict(do_sample=True),
            dict(complete, prompt_lookup_num_tokens=3),
            dict(prompt_lookup_num_tokens=3)]
    scheduler = Scheduler(ctx, slots=8, capacity=64, lookup=PromptLookup())
    jobs = [scheduler.job(PROMPTS[i % 3], seed=i, settings=s) for i, s in enumerate(rows)]
    for one in jobs:
        scheduler.add(one)
    while scheduler.busy:
        scheduler.step()
    budget = jobs[0]
    assert budget.reason == "stop" and budget.error is None and "met a limit of the grammar budget" in budget.note
    assert re.fullmatch("[a-c]{2}", tokenizer.decode(budget.tokens)), budget.tokens  # what it had: a valid prefix
    for done in (jobs[1], jobs[4]):
        assert done.reason == "stop" and tokenizer.decode(done.tokens) == "yes"
        assert "only eos may follow" in done.note
    for i in (2, 3, 5):
        alone = Scheduler(ctx, slots=2, capacity=64, lookup=PromptLookup())
        one = alone.job(PROMPTS[i % 3], seed=i, settings=rows[i])
        alone.add(one)
        while alone.busy:
            alone.step()
        assert jobs[i].reason == one.reason == "length" and jobs[i].tokens == one.tokens and jobs[i].note is None
