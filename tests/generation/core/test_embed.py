"""generation.core.embed: embeddings of a decoder model's feature-extraction export, pooled as its
sentence-transformers config says.

Invariants: one batched pass over padded prompts gives, for each prompt, transformers' hidden
states of that prompt alone pooled as the config names (last token normalized: Qwen3-Embedding's
pipeline; mean, not normalized), within 1e-4; `dimensions` keeps the first ones, normalized
again when the model normalizes; a folder without the config pools the last token, normalized
(vLLM's default); a pooling Raymuter does not do, or a generation export, is refused by name.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from generation.core.embed import embed, is_embedding_folder, load_embedder, pooling_of
from generation.runtime.model import ModelError
from generation.text.tokenizer import model_tokenizer

TEXTS = ["hello world", "The list type is a mutable sequence, and the tuple an immutable one. " * 3, "a",
         "dict maps keys to values"]


def expected(test_models, hf: str, ids: list[int], pooling: str, normalize: bool) -> np.ndarray:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(test_models[f"{hf}-optimum"].parent / "hf" / hf).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0].numpy()
    out = hidden[-1] if pooling == "last" else hidden.mean(0)
    return out / np.linalg.norm(out) if normalize else out


@pytest.mark.parametrize("key, hf, pooling, normalize", [("qwen2-embed", "qwen2", "last", True),
                                                          ("llama-embed", "llama", "mean", False)])
def test_a_batched_pass_equals_transformers_on_each_prompt_alone(test_models, embedding_models, key, hf, pooling,
                                                                  normalize):
    embedder = load_embedder(embedding_models[key], threads=1)
    assert (embedder.pooling, embedder.normalize) == (pooling, normalize)
    tokenizer = model_tokenizer(embedder)
    prompts = [tokenizer.encode(t).ids for t in TEXTS]
    got = embed(embedder, prompts)
    assert got.shape == (len(TEXTS), embedder.hidden_size) and got.dtype == np.float32
    for ids, vector in zip(prompts, got):
        np.testing.assert_allclose(vector, expected(test_models, hf, ids, pooling, normalize), atol=1e-4)
        np.testing.assert_allclose(embed(embedder, [ids])[0], vector, atol=1e-5)  # alone as in the batch
    short = embed(embedder, prompts, dimensions=8)
    first = got[:, :8] / np.linalg.norm(got[:, :8], axis=1, keepdims=True) if normalize else got[:, :8]
    np.testing.assert_allclose(short, first, atol=1e-5)
    with pytest.raises(ValueError, match="dimensions"):
        embed(embedder, prompts, dimensions=embedder.hidden_size + 1)


def test_the_pooling_comes_from_the_sentence_transformers_config(embedding_models, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(embedding_models["llama-embed"], folder)
    assert pooling_of(folder) == ("mean", False)
    (folder / "modules.json").unlink()
    assert pooling_of(folder) == ("last", True)  # no config: vLLM's default for decoder models
    shutil.copytree(embedding_models["llama-embed"] / "1_Pooling", folder / "1_Pooling", dirs_exist_ok=True)
    shutil.copy(embedding_models["llama-embed"] / "modules.json", folder / "modules.json")
    settings = json.loads((folder / "1_Pooling" / "config.json").read_text())
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({**settings, "pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(ModelError, match="pooling_mode_weightedmean_tokens is not supported"):
        load_embedder(folder, threads=1)


def test_a_generation_export_is_not_an_embedding_model(test_models, embedding_models):
    assert is_embedding_folder(embedding_models["qwen2-embed"]) and is_embedding_folder(embedding_models["llama-embed"])
    assert not is_embedding_folder(test_models["llama-optimum"])
    with pytest.raises(ModelError, match="no feature-extraction graph"):
        load_embedder(test_models["llama-optimum"], threads=1)
