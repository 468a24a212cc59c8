"""The OpenAI request shapes (deployments/http/openai.py), their mapping onto generation settings
(to_decoder.py) and the response bodies (answers.py).

Invariants: OpenAI fields map onto transformers' settings (temperature 0 is greedy), Raymuter's
own fields pass through, and every bad body is an ApiError whose OpenAI-shaped body names the
field; the settings a request yields are accepted by the engine.
"""

from __future__ import annotations

import pytest

import generation
from deployments.http.answers import completion_choice, completion_logprobs, completion_response, usage
from deployments.http.openai import ApiError, ChatCompletionRequest, CompletionRequest
from deployments.http.to_decoder import for_request, settings_of, wants_logprobs
from deployments.http.validation import check_json, field_path, parse


def test_openai_fields_map_onto_settings():
    request = parse(CompletionRequest, dict(model="m", prompt="hi", max_tokens=12, temperature=0.7, top_p=0.9,
                                            stop=["\n"], seed=3, repetition_penalty=1.2, num_beams=1, top_k=5,
                                            sequence_bias=[[[5, 6], -1.0]]))
    assert settings_of(request) == dict(max_new_tokens=12, do_sample=True, temperature=0.7, top_p=0.9,
                                        stop_strings=["\n"], repetition_penalty=1.2, num_beams=1, top_k=5,
                                        sequence_bias=[[[5, 6], -1.0]])
    assert settings_of(parse(CompletionRequest, dict(model="m", prompt=[1, 2], temperature=0))) == dict(do_sample=False)
    # OpenAI's penalties are the engine's settings of those names; left out, the model's (or server's) default
    penalised = parse(CompletionRequest, dict(model="m", prompt="a", presence_penalty=0.0, frequency_penalty=-1.5))
    assert settings_of(penalised) == dict(presence_penalty=0.0, frequency_penalty=-1.5)


def test_the_settings_are_the_engines(test_models, load_model):
    ctx = generation.context(load_model(test_models["llama-optimum"]), max_new_tokens=4)
    request = parse(ChatCompletionRequest, dict(model="m", messages=[{"role": "user", "content": "hi"}],
                                                temperature=0.5, top_p=0.8, no_repeat_ngram_size=2, stop="x"))
    settings = ctx.with_settings(**settings_of(request))
    assert settings.do_sample and settings.top_p == 0.8 and settings.stop_strings == ("x",)


@pytest.mark.parametrize("body, field, message", [
    (dict(prompt="hi"), "model", "Field required"),
    (dict(model="m", prompt="hi", max_tokens=-1), "max_tokens", "greater than or equal to 0"),
    (dict(model="m", prompt="hi", temperature=3), "temperature", "less than or equal to 2"),
    (dict(model="m", prompt="hi", top_p=0), "top_p", "greater than 0"),
    (dict(model="m", prompt="hi", n=17), "n", "less than or equal to 16"),
    (dict(model="m", prompt="hi", presence_penalty=2.5), "presence_penalty", "less than or equal to 2"),
    (dict(model="m", prompt="hi", frequency_penalty=-3), "frequency_penalty", "greater than or equal to -2"),
    (dict(model="m", prompt="hi", frobnicate=1), "frobnicate", "unknown field 'frobnicate'"),
    (dict(model="m", prompt="hi", top_logprobs=50), "top_logprobs", "less than or equal to 20"),
])
def test_bad_bodies_name_the_field(body, field, message):
    with pytest.raises(ApiError) as caught:
        parse(CompletionRequest, body)
    error = caught.value
    assert error.status == 400 and error.param == field and message in error.message
    assert error.body()["error"]["param"] == field and error.body()["error"]["type"] == "invalid_request_error"


def test_logprobs_checks():
    assert wants_logprobs(parse(ChatCompletionRequest, dict(model="m", messages=[{"role": "user", "content": "a"}],
                                                            logprobs=True, top_logprobs=3))) == 3
    assert wants_logprobs(parse(CompletionRequest, dict(model="m", prompt="a", logprobs=2))) == 2
    assert wants_logprobs(parse(CompletionRequest, dict(model="m", prompt="a", logprobs=0))) == 0  # its own only
    assert wants_logprobs(parse(CompletionRequest, dict(model="m", prompt="a"))) is None
    with pytest.raises(ApiError, match="top_logprobs: needs logprobs set"):
        wants_logprobs(parse(CompletionRequest, dict(model="m", prompt="a", top_logprobs=2)))


def test_response_shapes():
    body = completion_response("cmpl-1", "m", [completion_choice(0, "hello", "length", None, False)], usage(3, 5),
                               "fp_1")
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "hello"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["system_fingerprint"] == "fp_1" and body["choices"][0]["finish_reason"] == "length"
    chat = completion_response("chat-1", "m", [completion_choice(0, "hi", "cancelled", None, True)], usage(2, 1),
                               "fp_1", chat=True)
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert chat["choices"][0]["finish_reason"] == "stop" and chat["object"] == "chat.completion"


def test_raymuter_fields_for_prompt_lookup_ignore_eos_and_logit_bias():
    request = parse(CompletionRequest, dict(model="m", prompt="a", prompt_lookup_num_tokens=4, max_matching_ngram_size=3,
                                            ignore_eos=True, logit_bias={"7": -5.0}))
    assert settings_of(request) == dict(prompt_lookup_num_tokens=4, max_matching_ngram_size=3, eos_token_id=[],
                                        sequence_bias=[[[7], -5.0]])
    with pytest.raises(ApiError) as caught:
        parse(CompletionRequest, dict(model="m", prompt="a", logit_bias={"x": 1.0}))
    assert caught.value.param == "logit_bias.x"  # the key itself is named


def test_vllm_fields_map_onto_settings():
    request = parse(CompletionRequest, dict(model="m", prompt="a", min_tokens=3, top_k=-1, stop_token_ids=[5, 6]))
    assert settings_of(request) == dict(min_new_tokens=3, top_k=0)  # stop_token_ids go to the decoder, beside eos
    chat = parse(ChatCompletionRequest, dict(model="m", messages=[{"role": "user", "content": "a"}],
                                             chat_template_kwargs={"enable_thinking": False}))
    assert chat.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize("body, field", [
    (dict(store=True, metadata={"a": "b"}, user="u", service_tier="auto", parallel_tool_calls=False,
          response_format={"type": "text"}, tool_choice="none"), None),
    (dict(response_format={"type": "json_schema"}), "response_format"),  # without its schema
    (dict(guided_regex="a+", response_format={"type": "json_object"}), "guided_regex"),  # one constraint only
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (dict(suffix="x"), "suffix"),
    (dict(best_of=3), "best_of"),
])
def test_fields_that_do_not_change_the_output_are_accepted_and_the_others_refused(body, field):
    base = dict(model="m", prompt="a")
    if field is None:
        parse(CompletionRequest, {**base, **body})
        return
    with pytest.raises(ApiError) as caught:
        parse(CompletionRequest, {**base, **body})
    assert caught.value.param == field or caught.value.message.startswith(field), caught.value.message


@pytest.mark.parametrize("body, field", [
    (dict(stop=5), "stop"),  # no union tag ('stop.str')
    (dict(stop=["x" * 300]), "stop.0"),
    (dict(prompt=[1, "a"]), "prompt"),  # no member of the union fits: the field itself
    (dict(seed=2**64), "seed"),
    (dict(top_k=2**64), "top_k"),
    (dict(no_repeat_ngram_size=2**64), "no_repeat_ngram_size"),
    (dict(max_matching_ngram_size=10**6), "max_matching_ngram_size"),
    (dict(exponential_decay_length_penalty=[2**64, 1.5]), "exponential_decay_length_penalty.0"),
    (dict(bad_words_ids=[[1] * 1000]), "bad_words_ids.0"),
    (dict(logit_bias={"5": 1000}), "logit_bias.5"),
    (dict(prompt=["a"] * 65), "prompt"),
])
def test_bounds_name_the_field_without_type_suffixes(body, field):
    with pytest.raises(ApiError) as caught:
        parse(CompletionRequest, {"model": "m", "prompt": "a", **body})
    assert caught.value.param == field, caught.value.message
    assert caught.value.message.startswith(f"{field}: ")


def test_chat_content_parts_name_their_path():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}]
    with pytest.raises(ApiError) as caught:
        parse(ChatCompletionRequest, dict(model="m", messages=messages))
    assert caught.value.param == "messages.0.content.1"
    with pytest.raises(ApiError) as caught:
        parse(ChatCompletionRequest, dict(model="m", messages=[{"role": "user", "content": [{"type": "audio"}]}]))
    assert caught.value.param == "messages.0.content.0.type"
    assert field_path(("messages", 0, "content", "list[ContentPart]", 1, "image_url", "ImageURL", "url")) == \
        "messages.0.content.1.image_url.url"


def test_deep_or_broken_unicode_bodies_are_refused_by_path():
    deep: dict = {"x": 1}
    for _ in range(100):
        deep = {"a": [deep]}
    with pytest.raises(ApiError, match="nested more than"):
        check_json({"model": "m", "metadata": deep})
    with pytest.raises(ApiError) as caught:
        check_json({"model": "m", "messages": [{"role": "user", "content": "a\ud800"}]})
    assert caught.value.param == "messages.0.content"
    check_json({"prompt": "ordinary ✓"})


def test_engine_refusals_name_the_requests_own_field():
    request = parse(CompletionRequest, dict(model="m", prompt=["a", "b"], logit_bias={"5": 1.0}, stop="x"))
    # the engine front's refusal carries what it says of the field (its predicate) as data
    mapped = for_request(ApiError(400, "sequence_bias names token id 5000, outside this model's vocabulary",
                                  param="settings.sequence_bias",
                                  predicate=" names token id 5000, outside this model's vocabulary"), request)
    assert mapped.param == "logit_bias" and mapped.message.startswith("logit_bias names token id 5000")
    assert for_request(ApiError(400, "stop_strings must ...", param="settings.stop_strings"), request).param == "stop"
    assert for_request(ApiError(400, "too long", param="prompt"), request, 1).param == "prompt.1"
    chat = parse(ChatCompletionRequest, dict(model="m", messages=[{"role": "user", "content": "a"}], max_tokens=5))
    assert for_request(ApiError(400, "x", param="prompt"), chat).param == "messages"
    assert for_request(ApiError(400, "max_new_tokens must", param="settings.max_new_tokens"), chat).param == "max_tokens"
    assert for_request(ApiError(400, "top_k must", param="settings.top_k"), chat).param == "top_k"


def test_completion_logprobs_offsets_run_on_and_the_first_prompt_token_has_none():
    from generation.front.output import TokenText

    tokens = [TokenText(1, "ab", None), TokenText(3, "c", -1.0, [(3, "c", -1.0)])]
    out = completion_logprobs(tokens, chat=False, offset=5)
    assert out["text_offset"] == [5, 7] and out["token_logprobs"] == [None, -1.0]
    assert out["top_logprobs"] == [None, {"c": -1.0}]


def test_template_variables_render_as_transformers_passes_them(test_models):
    from transformers import AutoTokenizer

    from generation.text.chat import render_chat, special_tokens

    folder = test_models["llama-optimum"]
    template = ("{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
                "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}{% endfor %}")
    messages = [{"role": "user", "content": "hi"}]
    hf = AutoTokenizer.from_pretrained(folder)
    for variables in ({}, {"enable_thinking": False}, {"enable_thinking": True}, {"bos_token": "<x>"}):
        ours = render_chat(template, messages, special_tokens(folder), True, variables)
        assert ours == hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                              add_generation_prompt=True, **variables), variables
    assert render_chat(template, messages, special_tokens(folder), True, {"enable_thinking": False}).startswith("/no_think")


@pytest.mark.parametrize("body, expected, field", [
    (dict(response_format={"type": "json_object"}), {"json_object": True}, "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"},
                                                                    "strict": True}}),
     {"json": {"type": "object"}}, "response_format"),
    (dict(structured_outputs={"regex": "a+"}), {"regex": "a+"}, "structured_outputs"),
    (dict(structured_outputs={"choice": ["x", "y"]}), {"choice": ["x", "y"]}, "structured_outputs"),
    (dict(structured_outputs={"json": {"type": "array"}}), {"json": {"type": "array"}}, "structured_outputs"),
    (dict(guided_json='{"type": "object"}'), {"json": '{"type": "object"}'}, "guided_json"),
    (dict(guided_regex="[0-9]+"), {"regex": "[0-9]+"}, "guided_regex"),
    (dict(guided_choice=["a"]), {"choice": ["a"]}, "guided_choice"),
    (dict(guided_grammar='start: "a"'), {"grammar": 'start: "a"'}, "guided_grammar"),
])
def test_each_constraint_field_maps_onto_structured_outputs(body, expected, field):
    from deployments.http.to_decoder import field_of

    request = parse(CompletionRequest, dict(model="m", prompt="a", **body))
    assert settings_of(request) == {"structured_outputs": expected}
    assert field_of(request, "structured_outputs") == field  # an engine error names the request's own field
    chat = parse(ChatCompletionRequest, dict(model="m", messages=[{"role": "user", "content": "a"}], **body))
    assert settings_of(chat) == {"structured_outputs": expected}


@pytest.mark.parametrize("body, field", [
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
    (dict(structured_outputs={}), "structured_outputs"),
    (dict(structured_outputs={"regexp": "a"}), "structured_outputs.regexp"),
    (dict(guided_choice=[]), "guided_choice"),
    (dict(response_format={"type": "json_object", "json_schema": {"schema": {}}}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}),
     "response_format.json_schema.name"),
])
def test_a_malformed_constraint_is_refused_naming_its_field(body, field):
    with pytest.raises(ApiError) as caught:
        parse(CompletionRequest, dict(model="m", prompt="a", **body))
    assert caught.value.param == field, caught.value.message


def test_a_client_closing_an_n_choice_stream_closes_every_choice_cleanly():
    """n > 1 streams merged: closed after the first event (the client left), each choice's stream
    closes after its pump has stopped (closing one a pump was still reading raised 'aclose():
    asynchronous generator is already running' in the route, and the replica logged it)."""
    import asyncio

    from deployments.http.assembly import merged_streams

    closed = []

    async def choice(i):
        try:
            for k in range(1000):
                await asyncio.sleep(0.001)
                yield f"{i}.{k}"
        finally:
            closed.append(i)

    async def run():
        streams = [choice(i) for i in range(3)]
        firsts = [await s.__anext__() for s in streams]
        merged = merged_streams(firsts, streams)
        got = [await merged.__anext__() for _ in range(4)]
        await merged.aclose()
        for stream in streams:
            await stream.aclose()  # raised RuntimeError before
        return got

    got = asyncio.run(run())
    assert [item for _, item in got[:3]] == ["0.0", "1.0", "2.0"] and sorted(closed) == [0, 1, 2]
