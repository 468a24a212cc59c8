"""LoRA adapters with two decoder replicas on the session's Ray (the tiny Llama, `--lora-modules`
one adapter, two more loaded at run time through the HTTP route).

Invariants: an adapter loaded through the route (which reaches one decoder replica) is served by
either replica with PEFT's tokens (a replica that did not get the load reads it from the path its
first request brings); once a replica holds an adapter, the adapter's requests go to it (Serve's
model multiplexing under the prefix router), and two adapters new to both replicas go one to each;
an unloaded adapter is a 404 naming `model`.
"""

from __future__ import annotations

import time

import pytest

from deployments.schema import GenerateRequest

MAX_NEW = 6


@pytest.fixture(scope="module")
def lora_app(serve_apps, test_models, tmp_path_factory):
    from ray import serve

    import deployments.app as app
    from model_builders.lora import build_adapters, peft_model

    adapters = build_adapters(test_models["hf/llama"], tmp_path_factory.mktemp("adapters"))
    cfg = app.AppConfig(model=str(test_models["llama-optimum"]), name="tiny", slots=4, threads=1,
                        lora_modules={"a1": str(adapters["a1"])}, max_loras=2, max_lora_rank=8)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(app, "Decoder", app.Decoder.options(num_replicas=2))
        handle = serve.run(app.application(cfg, "text"), name="lora", route_prefix="/lora")
    yield handle, f"{serve_apps.url}/lora", adapters, peft_model(test_models["hf/llama"], adapters)
    serve.delete("lora", _blocking=False)


def peft_text(model, prompt: list[int], adapter: str) -> str:
    import torch
    from transformers import AutoTokenizer

    model.set_adapter(adapter)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    tokenizer = AutoTokenizer.from_pretrained(model.peft_config[adapter].base_model_name_or_path)
    return tokenizer.decode(out[0, len(prompt):].tolist(), skip_special_tokens=True)


def test_two_decoder_replicas_serve_run_time_adapters_where_they_are_held(lora_app, prompts_of):
    import httpx
    import openai

    handle, url, adapters, peft = lora_app
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    first, second = prompts_of((30, 28), seed=12)  # long enough for the router's blocks (64 characters)
    for name in ("a3", "a2"):
        answer = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapters[name])},
                            timeout=120)
        assert answer.status_code == 200, answer.text
    assert [(m.id, getattr(m, "parent", None)) for m in api.models.list().data] == [
        ("tiny", None), ("a1", "tiny"), ("a3", "tiny"), ("a2", "tiny")]

    for name in ("a3", "a2", "a1"):  # the openai client: PEFT's tokens, whichever replica answers
        answer = api.completions.create(model=name, prompt=first, max_tokens=MAX_NEW, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert answer.model == name and answer.choices[0].text == peft_text(peft, first, name), name
        time.sleep(0.5)  # the replica reports what it holds (every 0.1 s), the router learns it

    where: dict[str, set] = {}
    for name in ("a3", "a2", "a1") * 3:  # the handle API, the adapter named in the settings
        out = handle.generate.remote(GenerateRequest(prompt=second, settings={
            "adapter": name, "max_new_tokens": MAX_NEW, "do_sample": False, "eos_token_id": []})).result(timeout_s=120)
        assert out.finish.finish_reason == "length", out.finish
        assert out.text == peft_text(peft, second, name), name
        where.setdefault(name, set()).add(out.finish.replica)
    assert all(len(replicas) == 1 for replicas in where.values()), where  # each adapter's requests: its replica
    assert where["a3"] != where["a2"], where  # new to both: one to each (the fewest adapters first)

    answer = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a3"}, timeout=60)
    assert answer.status_code == 200, answer.text
    with pytest.raises(openai.NotFoundError) as e:
        api.completions.create(model="a3", prompt=first, max_tokens=2)
    assert e.value.body["param"] == "model"
    answer = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(adapters["a2"])},
                        timeout=60)
    assert (answer.status_code, answer.json()["error"]["param"]) == (400, "lora_name")
