"""generation.text.tool_calls: the tool-call format of a template family, tools through a template as
transformers renders them, calls read out of hand-written outputs of each family, and the
grammar that holds a constrained output to the tools' calls.

Invariants: every family's calls parse back to OpenAI calls (name, arguments as JSON text) with
the text around them as content, and text that only looks like a call stays text; a template
given tools renders as transformers' `apply_chat_template(tools=...)` renders it; the grammar
of tool_choice "required" or a named function lets through exactly the calls of the given
tools (and, under it, a tiny model writes a call that parses and whose arguments follow the
tool's schema).
"""

from __future__ import annotations

import json

import pytest

import generation
from generation.text import tool_calls as T

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]

# Templates of each family, written here in the style of the families' own (tools listed in the
# system turn, calls written back in the family's format, tool results as their own turn).
HERMES = (
    "{%- if tools %}<|im_start|>system\nYou may call tools:\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}\n</tools>\nReturn each call as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call>"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{%- for call in m.tool_calls %}<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
LLAMA3 = (
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\nRespond with {\"name\": function name, "
    "\"parameters\": dictionary of argument name and its value}.\n{%- for t in tools %}{{ t | tojson }}\n"
    "{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \"parameters\": "
    "{{ c.function.arguments | tojson }}}{%- endfor %}{%- else %}{{ m.content }}{%- endif %}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n{%- endif %}")
MISTRAL = (
    "{%- for m in messages %}{%- if m.role == 'user' %}[INST] {%- if tools and loop.last %}[AVAILABLE_TOOLS] "
    "{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}{{ m.content }}[/INST]{%- elif m.tool_calls %}"
    "[TOOL_CALLS] {{ m.tool_calls | map(attribute='function') | list | tojson }}</s>{%- elif m.role == 'tool' %}"
    "[TOOL_RESULTS] {{ m.content }}[/TOOL_RESULTS]{%- else %}{{ m.content }}</s>{%- endif %}{%- endfor %}")


@pytest.mark.parametrize("template, fmt", [(HERMES, "hermes"), (LLAMA3, "llama3_json"), (MISTRAL, "mistral"),
                                           ("{{ messages[0].content }}", "json"), (None, "json")])
def test_the_format_is_read_from_the_template(template, fmt):
    assert T.tool_format(template) == fmt


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "UTC"})]),
    ("hermes", '<tool_call>{"name":"get_time","arguments":"{\\"zone\\": \\"CET\\"}"}</tool_call>', None,
     [("get_time", {"zone": "CET"})]),  # arguments as JSON text, no newlines
    ("hermes", "No tools needed: it is sunny.", "No tools needed: it is sunny.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>', []),  # cut short: text
    ("hermes", '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', []),  # not one of the tools
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}', None,
     [("get_weather", {"city": "Rome", "days": 1})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}', None,
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "days": 3})]),
    ("llama3_json", 'The set {"a": 1} is not a call.', 'The set {"a": 1} is not a call.', []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "CET"}}, '
                '{"name": "get_weather", "arguments": {"city": "Paris", "days": 7}}]', None,
     [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Paris", "days": 7})]),
    ("mistral", "Nothing to call.", "Nothing to call.", []),
    ("json", '[{"name": "get_time", "arguments": {"zone": "UTC"}}]', None, [("get_time", {"zone": "UTC"})]),
    ("json", 'Sure: {"name": "get_weather", "arguments": {"city": "Bern", "days": 2}}', "Sure:",
     [("get_weather", {"city": "Bern", "days": 2})]),
])
def test_each_familys_calls_parse_back(fmt, text, content, calls):
    parsed = T.parse_calls(fmt, text, names=["get_weather", "get_time"])
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls


def test_tools_render_through_the_template_as_transformers_renders_them(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from generation.text.chat import render_chat

    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    from tokenizers import Tokenizer, models

    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))
    for template in (HERMES, LLAMA3, MISTRAL):
        fast.chat_template = template
        theirs = fast.apply_chat_template(T.template_messages(messages), tools=TOOLS, tokenize=False,
                                          add_generation_prompt=True)
        ours = render_chat(template, T.template_messages(messages), {}, True, {"tools": TOOLS})
        assert ours == theirs
        assert '"days": 2' in ours  # the arguments went in as an object, not as JSON text in a string


def test_bad_tools_and_arguments_name_their_field():
    with pytest.raises(T.ToolError) as e:
        T.check_tools([WEATHER, {"type": "function", "function": {"name": "bad name"}}])
    assert e.value.field == "tools.1.function.name"
    with pytest.raises(T.ToolError) as e:
        T.check_tools([WEATHER, WEATHER])
    assert e.value.field == "tools.1.function.name" and "twice" in str(e.value)
    with pytest.raises(T.ToolError) as e:
        T.check_tools([{"type": "retrieval"}])
    assert e.value.field == "tools.0"
    with pytest.raises(T.ToolError) as e:
        T.template_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}])
    assert e.value.field == "messages.0.tool_calls.0.function.arguments"
    with pytest.raises(T.ToolError) as e:
        T.tool_grammar("hermes", TOOLS, name="launch")
    assert e.value.field == "tool_choice"


def _matcher(model, grammar):
    import llguidance

    from generation.logits.constraints import Grammars

    grammars = Grammars(model.tokenizer_path, model.vocab_size, (2,))
    return llguidance, llguidance.LLMatcher(grammars.tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar),
                                            log_level=0), grammars.tokenizer


@pytest.mark.parametrize("fmt", T.FORMATS)
def test_the_grammar_takes_the_tools_calls_and_nothing_else(test_models, fmt):
    model = generation.load(test_models["llama-optimum"])
    good = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>',
            "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}',
            "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]',
            "json": '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'}[fmt]
    for grammar, text, takes in [
        (T.tool_grammar(fmt, TOOLS), good, True),
        (T.tool_grammar(fmt, TOOLS, name="get_weather"), good, True),
        (T.tool_grammar(fmt, TOOLS, name="get_time"), good, False),  # another function than the one named
        (T.tool_grammar(fmt, TOOLS), good.replace('"days": 2', '"days": 9'), False),  # outside its schema
        (T.tool_grammar(fmt, TOOLS), "It is sunny.", False),  # text, not a call
    ]:
        _, matcher, tokenizer = _matcher(model, grammar)
        ids = tokenizer.tokenize_str(text)
        accepted = matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()
        assert accepted == takes, (fmt, text)
    parsed = T.parse_calls(fmt, good, names=["get_weather", "get_time"])
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Oslo", "days": 2})]


@pytest.mark.parametrize("fmt", T.FORMATS)
def test_a_model_under_the_grammar_writes_calls_that_parse_and_follow_the_schema(test_models, fmt):
    import jsonschema

    from generation.text.tokenizer import model_tokenizer

    model = generation.load(test_models["llama-optimum"])
    finished = 0
    for name, parallel in [(None, True), ("get_time", False), ("get_weather", False)]:
        grammar = T.tool_grammar(fmt, TOOLS, name=name, parallel=parallel)
        ctx = generation.context(model, max_new_tokens=120, structured_outputs={"grammar": grammar})
        for seed in range(3):
            rows = generation.generate(generation.context(model, max_new_tokens=120, do_sample=True,
                                                          structured_outputs={"grammar": grammar}), [[5, 6, 7]],
                                       seeds=[seed]) if seed else generation.generate(ctx, [[5, 6, 7]])
            text = model_tokenizer(model).decode(rows[0])
            if len(rows[0]) == 120:
                continue  # the budget ran out inside a call (a random model writes long strings)
            finished += 1
            parsed = T.parse_calls(fmt, text, names=["get_weather", "get_time"])
            assert parsed.calls and parsed.content is None, (fmt, text)
            for call in parsed.calls:
                assert name in (None, call.name)
                tool = next(t for t in TOOLS if t["function"]["name"] == call.name)
                jsonschema.validate(json.loads(call.arguments), tool["function"]["parameters"])
            assert parallel or len(parsed.calls) == 1
    assert finished >= 5  # most runs end their calls within the budget (the arguments' strings are short)


ARGUMENTS = '{"city": "Oslo", "days": 2}'
ONE_CALL = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": ' + ARGUMENTS + '}\n</tool_call>',
            "llama3_json": '{"name": "get_weather", "parameters": ' + ARGUMENTS + '}',
            "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + ARGUMENTS + '}]',
            "json": '{"name": "get_weather", "arguments": ' + ARGUMENTS + '}'}


@pytest.mark.parametrize("fmt", T.FORMATS)
def test_a_forced_call_cut_anywhere_is_the_call_as_far_as_written(fmt):
    """Cut after any character, an output held to one call of get_weather is that call: its
    name, and its arguments' text a prefix of the whole call's (as OpenAI returns a call that
    max_tokens cut), never content."""
    whole = ONE_CALL[fmt]
    for end in range(1, len(whole) + 1):
        for forced in ("get_weather", None):
            parsed = T.cut_calls(fmt, whole[:end], ["get_weather", "get_time"], forced)
            name_known = forced or '"name": "get_w' in whole[:end]
            if not name_known:  # "get_" names either tool: the text stays text
                assert not parsed.calls and parsed.content == whole[:end]
                continue
            assert parsed.content is None and len(parsed.calls) == 1, (whole[:end], parsed)
            assert parsed.calls[0].name == "get_weather" and ARGUMENTS.startswith(parsed.calls[0].arguments)
    assert T.cut_calls(fmt, "", ["get_weather"], "get_weather").calls == []  # no token: no call begun


def test_parallel_calls_cut_keep_the_whole_ones_and_the_cut_one():
    first = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
    names = ["get_weather", "get_time"]
    assert T.cut_calls("hermes", first[:-14], names).calls == [T.ToolCall("get_time", '{"zone": "UTC"}')]
    assert T.cut_calls("hermes", first + '<tool_call>\n{"name": "get_', names).calls == \
        [T.ToolCall("get_time", '{"zone": "UTC"}')]  # the second's name not known yet
    assert T.cut_calls("hermes", first + '<tool_call>\n{"name": "get_w', names).calls == \
        [T.ToolCall("get_time", '{"zone": "UTC"}'), T.ToolCall("get_weather", "")]
    cut = '[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": {"city": "O'
    assert T.cut_calls("json", cut, names).calls == [T.ToolCall("get_time", '{"zone": "UTC"}'),
                                                     T.ToolCall("get_weather", '{"city": "O')]
