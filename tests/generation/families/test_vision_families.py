"""Each vision-language family's image-text-to-text equals transformers 4.57 on its tiny random
model: greedy tokens for prompts with 0, 1 and 2 images of different sizes alone and in batches
(whole or in power-of-two pieces that cut through an image), and beam search.  The families'
prompts and transformers references are those of test_vision.py (Qwen2-VL) and test_idefics3.py
(Idefics3), which hold each family's own tests."""
from __future__ import annotations

from typing import NamedTuple

import pytest
import test_idefics3
import test_vision


class Family(NamedTuple):
    hf: tuple  # (transformers model, its processor)
    model: object  # ours
    prompts: list
    reference: object  # reference(hf, prompts, **generate_kwargs) -> new tokens of each prompt alone
    context: object  # context(model, **settings) -> a generation context of the family's test length


@pytest.fixture(scope="module", params=["qwen2vl", "idefics3"])
def family(request, vision_paths, load_model) -> Family:
    tests = {"qwen2vl": test_vision, "idefics3": test_idefics3}[request.param]
    return Family(request.getfixturevalue(f"{request.param}_hf"), load_model(vision_paths[f"{request.param}-onnx"]),
                  tests.PROMPTS, tests._hf_generate, tests._context)


def test_greedy_alone_equals_transformers(family):
    from generation.tasks import image_text_to_text

    ref = family.reference(family.hf, family.prompts)
    assert len({tuple(r) for r in ref}) == len(ref)  # the images change the output
    for prompt, expected in zip(family.prompts, ref):
        assert image_text_to_text(family.context(family.model), [prompt], seeds=[0])[0].tokens == expected


@pytest.mark.parametrize("steps", ["whole", "pieces"])
def test_greedy_batch_equals_transformers(family, steps):
    """Batches of 3 prompts holding 2, 0 and 1 images (and 1, 2, 1): a row's features follow
    those of the rows before it; 'pieces' cuts the prompts through their images (Qwen2-VL's
    29-token prompt runs as 16 + 8 + 4 + 1)."""
    from generation.tasks import image_text_to_text

    ref = family.reference(family.hf, family.prompts)
    for order in ([2, 0, 1], [1, 2, 3]):
        out = image_text_to_text(family.context(family.model, prompt_steps=steps), [family.prompts[i] for i in order],
                                 seeds=[0, 1, 2])
        assert [r.tokens for r in out] == [ref[i] for i in order]


def test_beam_search_equals_transformers(family):
    from generation.tasks import image_text_to_text

    batch = [family.prompts[2], family.prompts[0], family.prompts[1]]
    out = image_text_to_text(family.context(family.model, num_beams=3), batch, seeds=[0, 1, 2])
    assert [r.tokens for r in out] == family.reference(family.hf, batch, num_beams=3)
