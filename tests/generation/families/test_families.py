"""generation.families: one place decides what a model folder is, and each family is a module
with one contract (KIND, detect, prepare, encode).

Invariants: every fixture folder is the family it was built as, read from config.json and file
names alone (nothing loaded), and a loaded model carries the same family; a folder's kind (what
a server deploys for it) is its family's KIND; a vision family needs its vision encoder; a task
given a model of another family says which it takes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import generation
from generation import families, tasks

FIXTURES = [  # (fixture set, folder, family, kind)
    ("text", "llama-optimum", "text", "text"),
    ("text", "llama-genai", "text", "text"),  # an onnxruntime-genai folder: no config.json
    ("text", "gpt2-optimum", "text", "text"),
    ("s2s", "marian-optimum", "seq2seq", "encoder-decoder"),
    ("s2s", "t5-optimum", "seq2seq", "encoder-decoder"),
    ("s2s", "bart-optimum", "seq2seq", "encoder-decoder"),
    ("s2s", "whisper-optimum", "whisper", "encoder-decoder"),
    ("vision", "vit-gpt2-optimum", "vit_gpt2", "encoder-decoder"),
    ("vision", "qwen2vl-onnx", "qwen2_vl", "vision"),
    ("vision", "idefics3-onnx", "idefics3", "vision"),
]


@pytest.mark.parametrize("name", families.FAMILIES)
def test_every_family_module_answers_the_contract(name):
    """Each module holds the Family protocol of families/contract.py: its KIND, detect and
    prepare, an encoder or None, and the hooks the engine's layers reach it through."""
    from generation.runtime.hooks import Hooks

    module = families.module(name)
    assert module.KIND in families.KINDS
    assert callable(module.detect) and callable(module.prepare)
    assert module.encode is None or callable(module.encode)
    assert isinstance(module.HOOKS, Hooks)
    assert (module.HOOKS.timestamps is None) == (module.HOOKS.timestamp_rules is None)


@pytest.fixture(scope="module")
def folders(test_models, s2s, vision_paths):
    return {"text": test_models, "s2s": s2s, "vision": vision_paths}


@pytest.mark.parametrize("where, name, family, kind", FIXTURES, ids=[f[1] for f in FIXTURES])
def test_a_folder_is_the_family_it_was_built_as(folders, where, name, family, kind):
    folder = folders[where][name]
    assert families.source_family(folder) == family
    assert families.kind(folder) == kind == families.module(family).KIND


@pytest.mark.parametrize("where, name", [("text", "llama-optimum"), ("s2s", "whisper-optimum"),
                                         ("vision", "qwen2vl-onnx"), ("vision", "idefics3-onnx"),
                                         ("vision", "vit-gpt2-optimum")])
def test_a_loaded_model_carries_its_family(folders, where, name):
    folder = folders[where][name]
    model = generation.load(folder)
    assert model.family == families.source_family(folder)
    assert model.hooks is families.family(model).HOOKS  # what the engine's layers call for it


def test_config_json_and_file_names_alone_decide(tmp_path, vision_paths):
    (tmp_path / "config.json").write_text(json.dumps({"is_encoder_decoder": True}))
    assert families.source_family(tmp_path) == "seq2seq"  # nothing else in the folder: nothing is loaded
    config = json.loads((vision_paths["idefics3-onnx"] / "config.json").read_text())
    folder = tmp_path / "idefics3"
    (folder / "onnx").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    assert families.source_family(folder) == "text"  # a vision family needs its vision encoder
    (folder / "onnx" / "vision_encoder_q4.onnx").write_bytes(b"")
    assert families.source_family(folder) == "idefics3"
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "qwen2_vl"}))
    assert families.source_family(folder) == "qwen2_vl"
    with pytest.raises(ValueError, match="no model family 'llava'"):
        families.module("llava")


@pytest.mark.parametrize("name", families.FAMILIES)
def test_every_family_keeps_the_contract(name):
    family = families.module(name)
    assert family.KIND in families.KINDS
    assert callable(family.detect) and callable(family.prepare)
    assert family.encode is None if family.KIND == "text" else callable(family.encode)
    if family.KIND == "vision":  # what vl_prompts asks of a vision family
        for verb in ("preprocess", "image_features", "positions", "join_grids", "prepare_conversations"):
            assert callable(getattr(family, verb)), verb
    assert families.FAMILIES[-1] == "text" and family.detect({}, []) == (name == "text")  # the fallback, last


def test_a_task_says_which_family_it_takes(test_models, s2s):
    text = generation.context(generation.load(test_models["llama-optimum"]), max_new_tokens=2)
    with pytest.raises(ValueError, match="text_to_text takes an encoder-decoder text model .* is a text model"):
        tasks.text_to_text(text, ["hello"])
    marian = generation.context(generation.load(s2s["marian-optimum"]), max_new_tokens=2)
    with pytest.raises(ValueError, match="speech_to_text takes a Whisper model;.* is a seq2seq model"):
        tasks.speech_to_text(marian, [np.zeros(16000, np.float32)])
    with pytest.raises(ValueError, match="image_to_text takes a vision-encoder-decoder"):
        tasks.image_to_text(marian, [np.zeros((8, 8, 3), np.uint8)])


def test_the_text_family_prepares_texts_and_ids(test_models):
    ctx = generation.context(generation.load(test_models["llama-optimum"]), max_new_tokens=2)
    from generation.text.tokenizer import model_tokenizer

    prepared = families.family(ctx.model).prepare(ctx, ["hello there", [1, 2, 3]])
    assert prepared.prompts == [model_tokenizer(ctx.model).encode("hello there").ids, [1, 2, 3]]
    assert prepared.encoder is None
    with pytest.raises(ValueError, match="prompts"):
        families.family(ctx.model).prepare(ctx, [])


def test_the_seq2seq_family_prepares_what_text_to_text_decodes(s2s):
    ctx = generation.context(generation.load(s2s["marian-optimum"]), max_new_tokens=4)
    family = families.family(ctx.model)
    prepared = family.prepare(ctx, [[5, 6, 7], [8, 9]])
    start = family.decoder_start(ctx)
    assert prepared.prompts == [[start], [start]]
    rows = generation.generate(ctx, prepared.prompts, encoder=prepared.encoder)
    assert [r.tokens if hasattr(r, "tokens") else r for r in rows] == [r.tokens for r in tasks.text_to_text(ctx, [[5, 6, 7], [8, 9]])]
