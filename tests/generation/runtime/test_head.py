"""The LM head only where logits are read (generation.runtime.head).

Invariants: a decoder whose logits are a MatMul at the top of its graph (a genai build, a fused
rewrite, a plain Optimum export) loads with a `logits_positions` input; fed every position its
logits are the graph's own, fed some positions they are those rows; a prompt's run computes its
last row only (its logits are [n, 1, V]), while prompt log-probabilities and candidate
verification still read every position; a merged decoder is cut in both branches of its If; a
graph whose head cannot be cut (int8 dynamic quantization, whose scale spans every position)
loads as it is, the reason in the log. Tokens equal transformers' in every test of
core/test_greedy_oracle.py and search/test_beam.py, which load these graphs.
"""

from __future__ import annotations

import logging

import numpy as np
import onnxruntime as ort
import pytest

import generation
from generation.runtime import fusion, head

CUT = ["llama-genai", "qwen2-genai", "llama-optimum", "gpt2-optimum", "gpt2-grow", "llama-merged"]


def _plain_session(path):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _feeds(session, ids, graph):
    names = {i.name for i in session.get_inputs()}
    n, width = ids.shape
    feeds = {"input_ids": ids, "attention_mask": np.ones((n, width), np.int64)}
    if "position_ids" in names:
        feeds["position_ids"] = np.tile(np.arange(width), (n, 1))
    if "use_cache_branch" in names:
        feeds["use_cache_branch"] = np.array([False])
    for e in graph.cache:
        feeds[e.past] = np.zeros((n, e.heads, 0, e.head_dim), graph.cache_dtype)
    return {k: v.astype(graph.dtype(k)) if k in graph.input_dtypes and v.dtype != graph.dtype(k) else v
            for k, v in feeds.items() if k in names}


@pytest.mark.parametrize("folder", CUT)
def test_positions_pick_rows_of_the_graphs_logits(test_models, load_model, folder):
    model = load_model(test_models[folder])
    assert model.graph.has_logits_positions
    original = _plain_session(model.decoder_path)  # the file as written: logits at every position
    ids = np.random.default_rng(1).integers(3, 200, (2, 9))
    want = original.run(["logits"], _feeds(original, ids, model.graph))[0]
    feeds = _feeds(model.session, ids, model.graph)
    every = model.session.run(["logits"], {**feeds, "logits_positions": np.tile(np.arange(9), (2, 1))})[0]
    np.testing.assert_allclose(every, want, atol=1e-5)
    picked = model.session.run(["logits"], {**feeds, "logits_positions": np.array([[8], [3]])})[0]
    assert picked.shape == (2, 1, want.shape[-1])
    np.testing.assert_allclose(picked[:, 0], want[[0, 1], [8, 3]], atol=1e-5)


def test_fused_rewrite_is_cut_too(test_models, load_model):
    model = load_model(test_models["llama-optimum"], fuse=True)
    assert model.fused_from is not None and model.graph.has_logits_positions


def test_a_merged_decoder_is_cut_in_both_branches(test_models):
    """Both branches of the If end in the LM head: each gets its GatherND, over the outer input."""
    rewritten, reason = head.head_positions(test_models["llama-merged"] / "onnx" / "decoder_model_merged.onnx")
    assert reason is None
    branches = [a.g for n in rewritten.graph.node if n.op_type == "If" for a in n.attribute]
    cuts = [[n.input[0] for n in b.node if n.op_type == "Unsqueeze" and n.name.startswith("/logits_positions")]
            for b in branches]
    assert len(branches) == 2 and cuts == [["logits_positions"], ["logits_positions"]]


def test_an_int8_head_keeps_every_position(test_models, caplog):
    """int8 dynamic quantization scales the head's input by its largest value over every
    position: picking rows first would change the logits, so the head stays whole."""
    with caplog.at_level(logging.INFO, logger="generation.runtime.session"):
        model = generation.load(test_models["llama-merged"], variant="quantized", threads=1, fuse=False)
    assert not model.graph.has_logits_positions
    assert "computes logits at every position: its logits come from" in caplog.text
    assert "not a MatMul (in the If's" in caplog.text


class Recorder:
    """The decoder session, recording the logits shape of every run."""

    def __init__(self, session):
        self.session, self.shapes = session, []

    def run(self, names, feeds):
        out = self.session.run(names, feeds)
        self.shapes.append(out[0].shape)
        return out

    def __getattr__(self, name):
        return getattr(self.session, name)


@pytest.mark.parametrize("folder", ["llama-optimum", "gpt2-grow"])
def test_a_prompt_run_computes_its_last_row_only(test_models, load_model, oracle, folder):
    """The append and grow modes' prefill (cache.prefill): [n, 1, V] logits, tokens as transformers."""
    model = load_model(test_models[folder])
    name = folder.split("-")[0]
    prompts = [[5, 9, 13, 2, 44, 31, 7], [8, 3, 3, 21]]
    recorder = Recorder(model.session)
    from generation.cache.prefill import run_prompts

    mode = model.graph.native_mode
    found = run_prompts(recorder, model.graph, mode, "whole", prompts, 0, 1 << 20)
    assert all(shape[1] == 1 for shape in recorder.shapes) and recorder.shapes
    for j, prompt in enumerate(prompts):
        want = oracle.logits(name, prompt)[-1]
        np.testing.assert_allclose(found.last_logits[j], want, atol=1e-4)


def test_in_place_prompts_compute_their_last_rows_only(test_models, load_model, oracle):
    """in_place's prefill into the slots (whole and in pieces) keeps [n, 1, V] logits; the
    next tokens are transformers'."""
    model = load_model(test_models["llama-genai"])
    prompts = [list(range(3, 40)), [7, 8, 9], list(range(50, 61))]
    for steps in ("whole", "pieces"):
        ctx = generation.compile(generation.context(model, max_new_tokens=1, do_sample=False, prompt_steps=steps,
                                                    eos_token_id=[]), batch_size=3)
        state = generation.new_state(ctx, slots=3, capacity=64)
        state, first = generation.admit(ctx, state, [0, 1, 2], prompts, seeds=[0, 0, 0])
        vocab = model.graph.vocab_size
        assert state.cache._prompt_logits.size == 3 * vocab  # the first run's three last rows, never S rows
        want = [int(oracle.logits("llama", p)[-1].argmax()) for p in prompts]
        assert first.token.tolist() == want


def test_prompt_logprobs_still_read_every_position(test_models, load_model, oracle):
    """Scoring a prompt reads every position's logits: the run feeds them all."""
    model = load_model(test_models["llama-optimum"])
    prompt = [5, 9, 13, 2, 44, 31, 7]
    ctx = generation.context(model, max_new_tokens=1, do_sample=False)
    from generation.logits.prompt_logprobs import prompt_logprobs

    got = prompt_logprobs(ctx, prompt).logprob
    logits = oracle.logits("llama", prompt).astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    want = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    expected = [want[i - 1, prompt[i]] for i in range(1, len(prompt))]
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_the_probe_feeds_every_position(test_models, load_model):
    """The fusion's probe runs a cut source session as it runs the fused graph."""
    model = load_model(test_models["llama-genai"])
    out = fusion._run_probe(model.session, model.graph, np.arange(3, 10), steps=1)
    assert out[0].shape == (7, model.graph.vocab_size) and out[1].shape == (1, model.graph.vocab_size)
