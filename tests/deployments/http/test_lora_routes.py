"""LoRA adapters over HTTP (vLLM's interface): `model` naming an adapter, /v1/models listing the
adapters with their parent, /v1/load_lora_adapter and /v1/unload_lora_adapter, through the `openai`
client on the app's routes (one Decoder of the tiny Llama, in this process).

Invariant: a completion or chat whose `model` names an adapter gets PEFT's greedy tokens for that
adapter, the base model's name gets the base model's; an adapter loaded at run time is listed and
served, and once unloaded is a 404 naming `model`; a bad load is a 400 naming lora_path (or
lora_name), an unknown unload a 404 naming lora_name; the decoder's metrics count requests and
tokens by adapter.
"""

from __future__ import annotations

import asyncio

import pytest
from app_routes import app_routes

MAX_NEW = 8


@pytest.fixture(scope="module")
def adapters(test_models, tmp_path_factory):
    from model_builders.lora import build_adapters

    return build_adapters(test_models["hf/llama"], tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def peft(test_models, adapters):
    from model_builders.lora import peft_model

    return peft_model(test_models["hf/llama"], adapters)


def peft_tokens(model, prompt: list[int], adapter: str | None) -> str:
    """PEFT's greedy answer to `prompt` with `adapter` (None: the base), as text."""
    import torch
    from transformers import AutoTokenizer

    ids = torch.tensor([prompt])
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        else:
            model.set_adapter(adapter)
            out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    tokenizer = AutoTokenizer.from_pretrained(model.peft_config[next(iter(model.peft_config))].base_model_name_or_path)
    return tokenizer.decode(out[0, len(prompt):].tolist(), skip_special_tokens=True)


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
def test_adapters_are_served_listed_loaded_and_unloaded(test_models, adapters, peft, prompts_of, engine_process):
    import openai

    config = {"model": str(test_models["llama-optimum"]), "name": "tiny", "slots": 4, "threads": 1,
              "lora_modules": {"a1": str(adapters["a1"]), "a2": str(adapters["a2"])}, "max_loras": 3,
              "max_lora_rank": 8, "engine_process": engine_process}
    prompts = prompts_of((5, 3, 7), seed=4)
    with app_routes(config) as (client, decoder):
        async def run():
            async with client() as http:
                api = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)

                async def tokens(model: str, prompt: list[int]) -> str:
                    answer = await api.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW,
                                                          temperature=0, extra_body={"ignore_eos": True})
                    assert answer.model == model and answer.usage.completion_tokens == MAX_NEW
                    return answer.choices[0].text

                listed = await api.models.list()
                assert [(m.id, getattr(m, "parent", None)) for m in listed.data] == [
                    ("tiny", None), ("a1", "tiny"), ("a2", "tiny")]
                for model, prompt, adapter in (("a1", prompts[0], "a1"), ("tiny", prompts[1], None),
                                               ("a2", prompts[2], "a2")):
                    assert await tokens(model, prompt) == peft_tokens(peft, prompt, adapter), model
                assert len({peft_tokens(peft, prompts[0], a) for a in ("a1", "a2", None)}) == 3  # they differ
                results = await asyncio.gather(*(tokens(m, prompts[0]) for m in ("a1", "a2", "tiny", "a1")))
                assert results == [peft_tokens(peft, prompts[0], a) for a in ("a1", "a2", None, "a1")]

                with pytest.raises(openai.NotFoundError) as e:
                    await tokens("a3", prompts[0])
                assert e.value.body["param"] == "model"
                loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "a3",
                                                                        "lora_path": str(adapters["a3"])})
                assert loaded.status_code == 200 and "a3" in loaded.text
                assert "a3" in [m.id for m in (await api.models.list()).data]
                assert await tokens("a3", prompts[1]) == peft_tokens(peft, prompts[1], "a3")

                for body, status, param in (({"lora_name": "x", "lora_path": "/nowhere"}, 400, "lora_path"),
                                            ({"lora_name": "a3", "lora_path": str(adapters["a3"])}, 400, "lora_name"),
                                            ({"lora_name": ""}, 400, "lora_name")):
                    answer = await http.post("/v1/load_lora_adapter", json=body)
                    assert (answer.status_code, answer.json()["error"]["param"]) == (status, param), body
                unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
                assert unloaded.status_code == 200
                with pytest.raises(openai.NotFoundError):
                    await tokens("a3", prompts[1])
                missing = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
                assert (missing.status_code, missing.json()["error"]["param"]) == (404, "lora_name")
                chat = await api.chat.completions.create(model="a2", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=4)
                assert chat.model == "a2" and chat.choices[0].message.content is not None
                decoder.unload_adapter("a2")  # as another ingress replica would: this one's card still lists it
                with pytest.raises(openai.NotFoundError) as e:
                    await tokens("a2", prompts[0])
                assert e.value.body["param"] == "model" and "a2" in e.value.body["message"]

        asyncio.run(run())
        metrics = decoder.metrics()
        assert 'raymuter:lora_requests_total{lora_name="a1",model_name="tiny"} 3.0' in metrics
        assert 'raymuter:lora_generation_tokens_total{lora_name="a3",model_name="tiny"} 8.0' in metrics
        assert 'raymuter:lora_adapter_loads_total{model_name="tiny"} 1.0' in metrics


def test_a_server_without_adapters_refuses_them_by_name(test_models):
    config = {"model": str(test_models["llama-optimum"]), "name": "tiny", "slots": 2, "threads": 1}
    with app_routes(config) as (client, _):
        async def run():
            async with client() as http:
                answer = await http.post("/v1/completions", json={"model": "a1", "prompt": "hi", "max_tokens": 2})
                assert (answer.status_code, answer.json()["error"]["param"]) == (404, "model")
                answer = await http.post("/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": "/x"})
                assert answer.status_code == 400 and "max_loras" in answer.json()["error"]["message"]

        asyncio.run(run())


def test_a_decoder_replica_reads_an_adapter_from_the_path_its_request_brings(test_models, adapters, peft, prompts_of):
    """A run-time load reaches one decoder replica; the others learn the adapter from the first
    request that names it (GenerateRequest.adapter_path, from the ingress's shared names): read
    then, PEFT's tokens; a changed path is read anew; a path this replica cannot read is a 400
    naming model, and the next request still runs; a third adapter in two places evicts the least
    recently used (the metrics count loads, residents and evictions). A request of an adapter
    known at its path reads nothing."""
    from deployments.app import Decoder
    from deployments.schema import GenerateRequest

    config = {"model": str(test_models["llama-optimum"]), "name": "tiny", "slots": 4, "threads": 1,
              "max_loras": 2, "max_lora_rank": 8}
    decoder = Decoder.func_or_class(config)
    prompt = prompts_of((6,), seed=9)[0]
    settings = {"max_new_tokens": MAX_NEW, "do_sample": False, "eos_token_id": []}

    def ask(name: str, path: str | None):
        request = GenerateRequest(prompt=prompt, settings={**settings, "adapter": name}, adapter_path=path)
        return asyncio.run(decoder.generate(request))

    try:
        out = ask("x", str(adapters["a1"]))
        assert out.finish.finish_reason == "length", out.finish
        assert out.text == peft_tokens(peft, prompt, "a1")
        reads = []
        know = decoder.generator.know_adapter
        decoder.generator.know_adapter = lambda *a: reads.append(a) or know(*a)
        assert ask("x", str(adapters["a1"])).text == out.text
        assert reads == []  # known at that path: no read, no hop to a thread
        assert ask("x", str(adapters["a3"])).text == peft_tokens(peft, prompt, "a3")  # the name now means another
        assert reads == [("x", str(adapters["a3"]))]
        refused = ask("y", "/nowhere/adapter")
        assert refused.finish.finish_reason == "rejected" and refused.finish.field == "model", refused.finish
        unknown = ask("z", None)  # no path and never loaded here: refused by name
        assert unknown.finish.finish_reason == "rejected" and unknown.finish.field == "settings.adapter"
        assert ask("x", str(adapters["a3"])).text == peft_tokens(peft, prompt, "a3")
        assert ask("w", str(adapters["a2"])).text == peft_tokens(peft, prompt, "a2")  # the second place
        assert ask("v", str(adapters["a1"])).text == peft_tokens(peft, prompt, "a1")  # x, least recent, leaves
        metrics = decoder.metrics()
        assert 'raymuter:lora_adapter_loads_total{model_name="tiny"} 4.0' in metrics
        assert 'raymuter:lora_adapters_resident{model_name="tiny"} 2.0' in metrics
        assert 'raymuter:lora_adapter_evictions_total{model_name="tiny"} 1.0' in metrics
    finally:
        decoder.__del__()
