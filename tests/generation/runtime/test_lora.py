"""Reading PEFT adapters, and the graph's projections (generation.runtime.lora).

Invariant: an adapter's modules, ranks and scalings are PEFT's own (its LoraModel's `scaling` per
module, rsLoRA and the rank / alpha patterns included), from float32 or bfloat16 weights; every
setting whose effect the engine does not apply is refused naming it; each layout's projections
read as the model's layers (q, k, v or q|k|v, o, gate and up or gate|up, down); a run of rows
without an adapter gives the logits of the graph without the rewrite, bit for bit, and a run
mixing places gives each row the logits it gets alone (rows grouped by place, read back per row).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from generation.runtime.lora.adapter import REFUSED, AdapterError, read_adapter, read_safetensors
from generation.runtime.lora.projections import find_projections


@pytest.fixture(scope="module")
def llama_adapters(test_models, tmp_path_factory):
    from model_builders.lora import build_adapters

    return build_adapters(test_models["hf/llama"], tmp_path_factory.mktemp("adapters"))


def test_modules_and_scalings_are_pefts(test_models, llama_adapters):
    from model_builders.lora import peft_model

    model = peft_model(test_models["hf/llama"], llama_adapters)
    for name, folder in llama_adapters.items():
        adapter = read_adapter(name, folder)
        theirs = {key.removeprefix("base_model.model."): module for key, module in model.named_modules()
                  if isinstance(getattr(module, "scaling", None), dict) and name in module.scaling}
        assert set(adapter.modules) == set(theirs)
        for key, weights in adapter.modules.items():
            assert weights.scale == pytest.approx(theirs[key].scaling[name], rel=1e-12), key
            np.testing.assert_array_equal(weights.a, theirs[key].lora_A[name].weight.detach().numpy())
            np.testing.assert_array_equal(weights.b, theirs[key].lora_B[name].weight.detach().numpy())
    a3 = read_adapter("a3", llama_adapters["a3"]).modules
    assert a3["model.layers.1.mlp.down_proj"].rank == 6 and a3["model.layers.1.self_attn.o_proj"].scale == 1.5
    assert not any(".layers.0." in key for key in a3)  # layers_to_transform [1]


def test_bfloat16_weights_read_as_their_values(llama_adapters, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bf16"
    shutil.copytree(llama_adapters["a1"], folder)
    tensors = load_file(folder / "adapter_model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, folder / "adapter_model.safetensors")
    read = read_safetensors(folder / "adapter_model.safetensors")
    for key, value in tensors.items():
        np.testing.assert_array_equal(read[key], value.to(torch.bfloat16).float().numpy())


@pytest.mark.parametrize("setting, value", [(k, v) for k, v in [
    ("use_dora", True), ("modules_to_save", ["lm_head"]), ("lora_bias", True), ("target_parameters", ["w"]),
    ("layer_replication", [[0, 1]]), ("alora_invocation_tokens", [5]), ("use_qalora", True),
    ("trainable_token_indices", [1]), ("use_bdlora", True)] if k in REFUSED] + [
    ("bias", "all"), ("peft_type", "IA3"), ("r", 0)])
def test_what_is_not_applied_is_refused_naming_it(llama_adapters, tmp_path, setting, value):
    folder = tmp_path / "edited"
    shutil.copytree(llama_adapters["a1"], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config[setting] = value
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=f"^{setting}"):
        read_adapter("x", folder)


def test_missing_files_and_embedding_targets_are_named(llama_adapters, tmp_path):
    with pytest.raises(AdapterError, match="lora_path .* has no adapter_config.json"):
        read_adapter("x", tmp_path)
    folder = tmp_path / "no-weights"
    shutil.copytree(llama_adapters["a1"], folder)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        read_adapter("x", folder)
    from safetensors.numpy import save_file

    folder = tmp_path / "embedding"
    shutil.copytree(llama_adapters["a1"], folder)
    save_file({"base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((4, 1000), np.float32)},
              folder / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="embedding's LoRA is not applied"):
        read_adapter("x", folder)


@pytest.mark.parametrize("folder, packed", [("llama-optimum/model.onnx", False), ("llama-genai/model.onnx", True),
                                            ("llama-merged/onnx/decoder_model_merged.onnx", False)])
def test_each_layouts_projections_read_as_the_layers(test_models, folder, packed):
    import onnx

    path = test_models[folder.split("/")[0]] / folder.split("/", 1)[1]
    config = json.loads((test_models["hf/llama"] / "config.json").read_text())
    found = find_projections(onnx.load(str(path), load_external_data=False), config)
    assert len(found) == (2 if "merged" in folder else 1)  # a merged decoder's two branches
    for _, nodes in found:
        keys = [p.key for _, p in nodes]
        attention = ["q_k_v"] if packed else ["q", "k", "v"]
        assert keys == [f"{layer}.{atoms}" for layer in (0, 1) for atoms in attention + ["o", "gate", "up", "down"]]
        assert {p.in_features for _, p in nodes if p.atoms == ("down",)} == {128}


def test_rows_without_an_adapter_run_the_graph_as_it_was(test_models, prompts_of):
    import onnx
    import onnxruntime as ort

    from generation.runtime.lora.bank import LoraBank
    from generation.runtime.lora.rewrite import add_lora

    path = test_models["llama-optimum"] / "model.onnx"
    config = json.loads((test_models["hf/llama"] / "config.json").read_text())
    plain = ort.InferenceSession(str(path))
    model = onnx.load(str(path))
    projections, _ = add_lora(model, config)
    rewritten = ort.InferenceSession(model.SerializeToString())
    ids = np.array(prompts_of((6, 6), seed=3), np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.tile(np.arange(6), (2, 1))}
    feeds.update({i.name: np.zeros((2, 2, 0, 16), np.float32) for i in plain.get_inputs() if i.name.startswith("past")})
    base = plain.run(["logits"], feeds)[0]
    bank = LoraBank(projections, 2, 4)
    np.testing.assert_array_equal(rewritten.run(["logits"], {**feeds, **bank.feeds(np.zeros(2, np.int64))})[0], base)


def test_a_run_groups_its_rows_by_place_and_each_row_gets_what_it_gets_alone(test_models, llama_adapters,
                                                                               prompts_of):
    """Rows at places 0, 3, 3, 1, 0 (place 2 holds an adapter no row uses): each place's rows are
    one group, padded to the largest, and each row's logits are those of the row run alone."""
    import onnx
    import onnxruntime as ort

    from generation.runtime.lora.bank import LoraBank
    from generation.runtime.lora.rewrite import ROWS, SLOTS, add_lora

    path = test_models["llama-optimum"] / "model.onnx"
    config = json.loads((test_models["hf/llama"] / "config.json").read_text())
    model = onnx.load(str(path))
    projections, _ = add_lora(model, config)
    session = ort.InferenceSession(model.SerializeToString())
    bank = LoraBank(projections, 3, 8)
    for place, name in zip((1, 2, 3), sorted(llama_adapters)):
        bank.load(read_adapter(name, llama_adapters[name]), place)
    places = np.array([0, 3, 3, 1, 0])
    feeds = bank.feeds(places)
    np.testing.assert_array_equal(feeds[ROWS], [[0, 4], [3, 0], [0, 0], [1, 2]])  # padding: row 0, read by none
    np.testing.assert_array_equal(feeds[SLOTS], [[0, 0], [3, 0], [3, 1], [1, 0], [0, 1]])
    none = bank.feeds(np.zeros(5, np.int64))  # no adapter: one group of one row, K = 0
    assert none[ROWS].shape == (1, 1) and none[f"lora.{projections[0].key}.a"].shape[2] == 0
    assert all(feeds[f"lora.{p.key}.a"].shape[0] == 4 for p in projections)
    ids = np.array(prompts_of((6,) * 5, seed=4), np.int64)

    def run(rows, at):
        inputs = {"input_ids": ids[rows], "attention_mask": np.ones_like(ids[rows]),
                  "position_ids": np.tile(np.arange(6), (len(rows), 1)), **bank.feeds(at)}
        inputs.update({i.name: np.zeros((len(rows), 2, 0, 16), np.float32) for i in session.get_inputs()
                       if i.name.startswith("past")})
        return session.run(["logits"], inputs)[0]

    together = run(list(range(5)), places)
    alone = np.concatenate([run([r], places[r:r + 1]) for r in range(5)])
    np.testing.assert_allclose(together, alone, rtol=0, atol=1e-5)
    for row in (1, 3):  # the adapter changes the row
        assert not np.allclose(together[row], run([row], np.array([0]))[0], atol=1e-3)


def test_a_hub_id_that_cannot_be_fetched_names_lora_path(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(AdapterError, match="^lora_path 'org/no-such-adapter' is not a local folder, and downloading"):
        read_adapter("x", "org/no-such-adapter")


def test_a_hub_adapter_is_fetched_once_when_known_not_again_when_placed(test_models, llama_adapters, monkeypatch):
    """A hub id is downloaded where the adapter is read and checked (a server's thread); taking a
    place (on the batching loop's thread) reads the folder that download gave."""
    import huggingface_hub
    import onnx

    from generation.runtime.lora.bank import LoraBank
    from generation.runtime.lora.registry import Adapters
    from generation.runtime.lora.rewrite import add_lora

    fetched = []

    def snapshot_download(repo_id, allow_patterns=None):
        fetched.append(repo_id)
        return str(llama_adapters["a1"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    config = json.loads((test_models["hf/llama"] / "config.json").read_text())
    projections, _ = add_lora(onnx.load(str(test_models["llama-optimum"] / "model.onnx")), config)
    adapters = Adapters(LoraBank(projections, 2, 8))
    adapters.add("x", "org/x-adapter")
    assert adapters.place("x") == 1 and adapters.known["x"].as_posix() == "org/x-adapter"
    assert fetched == ["org/x-adapter"]
