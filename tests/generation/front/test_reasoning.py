"""Reasoning output (generation/front/reasoning.py): a thinking model's reasoning told apart from
its answer, on text as it streams (markers split across pieces held back, never shown), from the
chat template's markers; and through the front on a tiny model whose template thinks, its output
held to a thinking answer by a grammar."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from generation.front import Delta, EngineFront, EngineOptions, EngineRequest, Finish
from generation.front.reasoning import PARSERS, ReasoningSplit, opened_in, parser_for

THINK = PARSERS["think"]


def split_all(pieces, inside=False, parser=THINK):
    split = ReasoningSplit(parser, inside)
    out = [split.add(p) for p in pieces] + [split.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out), out


@pytest.mark.parametrize("cut", range(1, 20))
def test_a_split_is_the_same_wherever_the_pieces_break(cut):
    text = "<think>let me see</think>Four."
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    reasoning, content, out = split_all(pieces)
    assert (reasoning, content) == ("let me see", "Four.")
    assert not any("<" in r or "<" in c for r, c in out)  # no piece of a marker ever goes out


def test_a_template_that_opened_the_block_starts_inside():
    assert split_all(["a</think>b"], inside=True)[:2] == ("a", "b")
    assert split_all(["no markers at all"])[:2] == ("", "no markers at all")


def test_a_block_never_closed_is_all_reasoning():
    assert split_all(["still thinking"], inside=True)[:2] == ("still thinking", "")
    assert split_all(["<think>cut sh", "ort"])[:2] == ("cut short", "")


def test_a_markers_start_that_never_completes_is_text():
    assert split_all(["2 <", "3 <thi"])[:2] == ("", "2 <3 <thi")


def test_the_parser_comes_from_the_template_or_its_name():
    assert parser_for("{{ '<think>\\n' }}") is THINK
    assert parser_for("[THINK]") is PARSERS["mistral"]
    assert parser_for("{{ messages }}") is None and parser_for(None) is None
    assert parser_for("<think>", "none") is None and parser_for(None, "think") is THINK
    with pytest.raises(ValueError, match="reasoning_parser: one of auto, none"):
        parser_for(None, "deepseek")


def test_the_prompt_says_whether_the_block_is_open():
    assert opened_in("<|im_start|>assistant\n<think>\n", THINK)
    assert not opened_in("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)  # enable_thinking false
    assert not opened_in("<|im_start|>assistant\n", THINK)


# -- through the front ---------------------------------------------------------------------------
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% if enable_thinking is not defined or enable_thinking %}"
            "<think>{% else %}<think></think>{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def thinking(test_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(test_models["llama-genai"], folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    front = EngineFront.from_model(folder, EngineOptions(slots=2, threads=1), max_new_tokens=40)
    yield front
    front.close()


def run(front, **request):
    async def events():
        return [e async for e in front.stream(EngineRequest(**request))]
    return asyncio.run(events())


def texts(events):
    return ("".join(e.reasoning for e in events if isinstance(e, (Delta, Finish))),
            "".join(e.text for e in events if isinstance(e, (Delta, Finish))))


@pytest.mark.parametrize("thinks, output, reasoning, answer", [
    (True, "ab c</think>the answer", "ab c", "the answer"),  # the template opened the block
    (False, "<think>x</think>y", "x", "y"),  # enable_thinking false: closed in the prompt; the output opens one
    (False, "just y", "", "just y"),
])
def test_the_fronts_chat_splits_reasoning_from_the_answer(thinking, thinks, output, reasoning, answer):
    grammar = 'root ::= "' + output.replace('"', '\\"') + '"'
    events = run(thinking, messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={"enable_thinking": thinks},
                 settings={"structured_outputs": {"grammar": grammar}})
    assert texts(events) == (reasoning, answer)
    assert events[-1].finish_reason == "stop"


def test_a_prompt_is_never_split(thinking):
    events = run(thinking, prompt="<think>", settings={"structured_outputs": {"grammar": 'root ::= "a</think>b"'}})
    assert texts(events) == ("", "a</think>b")  # completions are text; reasoning is a chat's


def test_no_parser_leaves_the_text_whole(test_models, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(test_models["llama-genai"], folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    front = EngineFront.from_model(folder, EngineOptions(slots=1, threads=1, reasoning_parser="none"),
                                   max_new_tokens=40)
    try:
        events = run(front, messages=[{"role": "user", "content": "hi"}],
                     settings={"structured_outputs": {"grammar": 'root ::= "a</think>b"'}})
        assert texts(events) == ("", "a</think>b")
    finally:
        front.close()
