"""The batching loop's contract (generation/engine/batcher.py): the loop in this process, the loop
in a child process and the serving tests' known-output fake each keep it, and the fake reaches
its requests through their public producer side only (emit, finish, settle, fail)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import generation
from generation.engine.batcher import SUBMIT_PARAMETERS, Batcher
from generation.engine.batching import ContinuousBatcher, Request
from generation.engine.process import EngineProcess

ROOT = Path(__file__).resolve().parents[3]


def takes_the_contract_s_submit(batcher_class) -> bool:
    return set(SUBMIT_PARAMETERS) <= set(inspect.signature(batcher_class.submit).parameters)


@pytest.mark.parametrize("batcher_class", [ContinuousBatcher, EngineProcess], ids=lambda c: c.__name__)
def test_each_loop_s_submit_takes_the_contract_s_arguments(batcher_class):
    assert takes_the_contract_s_submit(batcher_class)
    assert isinstance(inspect.getattr_static(batcher_class, "alive"), property)


def test_the_loop_in_process_is_a_batcher(test_models, load_model):
    ctx = generation.context(load_model(test_models["llama-genai"]), max_new_tokens=4)
    batcher = ContinuousBatcher(ctx, slots=2, capacity=64)
    try:
        assert isinstance(batcher, Batcher)
        done = batcher.submit([5, 6, 7], seed=1, priority=0, logprobs=False).result(timeout=60)
        assert done.tokens == generation.generate(ctx, [[5, 6, 7]], seeds=[1])[0]
        assert batcher.steps >= 1 and batcher.running == 0
    finally:
        batcher.close()
    assert not batcher.alive


def test_the_fake_is_a_batcher_and_uses_no_private_member_of_a_request():
    from deployments.fake import FakeBatcher, fake_tokens
    from generation.front import EngineOptions

    fake = FakeBatcher(EngineOptions(slots=2, max_waiting=64))
    try:
        assert isinstance(fake, Batcher) and takes_the_contract_s_submit(FakeBatcher)
        request = fake.submit([97, 98, 99], seed=3, priority=1)
        assert isinstance(request, Request)
        assert request.result(timeout=10).tokens == fake_tokens([97, 98, 99], 3, {}) and len(request.emitted) == 8
    finally:
        fake.close()
    private = set()
    for node in ast.walk(ast.parse((ROOT / "deployments" / "fake.py").read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                private.add(ast.unparse(node))
    assert not private
