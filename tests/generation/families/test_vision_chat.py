"""Chat conversations with images (`generation.tasks.image_chat`) equal transformers 4.57
`processor.apply_chat_template(..., tokenize=True)` + `generate` on the tiny Qwen2-VL and
Idefics3 models (tests/model_builders/vision.py: Qwen2-VL-2B-Instruct's and SmolVLM's chat templates):
the prompt ids (placeholders expanded, the processor's special-token rule), and greedy tokens
of a batch of 3 conversations holding 2, 0 and 1 images."""
from __future__ import annotations

import numpy as np
import pytest

NEW = 8
IMAGES = [np.random.default_rng(7).integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(20, 30), (41, 17), (9, 9)]]


def _text(text):
    return {"type": "text", "text": text}


def _image(i):
    return {"type": "image", "image": IMAGES[i]}


CONVERSATIONS = [
    [{"role": "user", "content": [_text("Compare "), _image(1)]},
     {"role": "assistant", "content": [_text("a cat")]},
     {"role": "user", "content": [_image(2), _text("and this?")]}],  # 2 images over two turns
    [{"role": "user", "content": [_text("hello there")]}],  # no image
    [{"role": "user", "content": [_image(0), _text("What is it?")]}],  # image first
]


@pytest.fixture(scope="module")
def paths(vision_paths):
    return vision_paths


def _qwen2vl_processor(folder):
    """Qwen2VLProcessor for the tiny model: its tokenizer class, and a stand-in video processor
    (the real one needs torchvision; images never touch it)."""
    import transformers as tf

    tokenizer = tf.Qwen2TokenizerFast.from_pretrained(folder)
    return tf.Qwen2VLProcessor(image_processor=tf.Qwen2VLImageProcessor.from_pretrained(folder), tokenizer=tokenizer,
                               video_processor=object.__new__(tf.BaseVideoProcessor),
                               chat_template=tokenizer.chat_template)


@pytest.fixture(scope="module", params=["qwen2vl", "idefics3"])
def family(request, paths, load_model):
    """(transformers model, processor, our model) of each vision-language family."""
    import torch
    import transformers as tf

    torch.set_num_threads(2)
    folder = paths[f"hf/{request.param}"]
    if request.param == "qwen2vl":
        hf = tf.Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        processor = _qwen2vl_processor(folder)
    else:
        hf = tf.Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        processor = tf.AutoProcessor.from_pretrained(folder)
    return hf, processor, load_model(paths[f"{request.param}-onnx"])


def _reference_inputs(processor, conversation):
    inputs = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                           return_dict=True, return_tensors="pt")
    inputs.pop("token_type_ids", None)
    return inputs


def test_chat_ids_equal_apply_chat_template(family):
    from generation.families.images import load_image
    from generation.families.vl_prompts import chat_ids, chat_images, preprocess

    hf, processor, model = family
    for conversation in CONVERSATIONS:
        images = [load_image(image) for image, _ in chat_images([conversation])[0]]
        ids = chat_ids(model, [conversation], preprocess(model, images))[0]
        ref = _reference_inputs(processor, conversation)["input_ids"][0].tolist()
        assert ids == ref


def test_image_chat_equals_transformers(family):
    import torch

    import generation
    from generation.tasks import image_chat

    hf, processor, model = family
    expected = []
    for conversation in CONVERSATIONS:
        inputs = _reference_inputs(processor, conversation)
        with torch.no_grad():
            out = hf.generate(**inputs, do_sample=False, max_new_tokens=NEW, pad_token_id=0)
        new = out[0, inputs["input_ids"].shape[1]:].tolist()
        expected.append(new[:-1] if new and new[-1] == 2 else new)
    assert len({tuple(e) for e in expected}) == len(expected)
    ctx = generation.context(model, max_new_tokens=NEW)
    assert [r.tokens for r in image_chat(ctx, CONVERSATIONS, seeds=[0, 1, 2])] == expected


def test_chat_errors(paths, load_model, test_models):
    import generation
    from generation.tasks import image_chat

    ctx = generation.context(load_model(paths["idefics3-onnx"]), max_new_tokens=2)
    user = [{"role": "user", "content": [{"type": "image", "url": "http://example.com/a.png"}]}]
    with pytest.raises(ValueError, match=r"conversations\[0\]\[0\].content\[0\]: an image part holds the image"):
        image_chat(ctx, [user])
    with pytest.raises(ValueError, match=r"conversations\[0\]\[0\].content\[1\] must be"):
        image_chat(ctx, [[{"role": "user", "content": [_text("a"), {"type": "audio"}]}]])
    with pytest.raises(ValueError, match=r"conversations\[1\]\[0\] must be a message"):
        image_chat(ctx, [CONVERSATIONS[1], [{"content": "x"}]])
    with pytest.raises(ValueError, match=r"conversations\[0\]\[0\].content\[0\] is not a readable image"):
        image_chat(ctx, [[{"role": "user", "content": [{"type": "image", "image": b"junk"}]}]])
    text_only = generation.context(load_model(test_models["llama-optimum"]), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"conversations\[0\]\[0\].content\[0\] is an image, but .* text-only"):
        image_chat(text_only, [CONVERSATIONS[2]])


def test_images_encoded_one_at_a_time_place_as_the_batch_does(family):
    """What a server's vision replica sends the decoder (each image encoded alone:
    vl_prompts.encode_image, then join_images and placed_images) gives the ids and image
    inputs of the images preprocessed and encoded together."""
    from generation.families.images import load_image
    from generation.families.vl_prompts import (chat_ids, chat_images, encode_image, image_inputs, join_images, placed_images,
                                       preprocess)

    _, _, model = family
    conversation = CONVERSATIONS[0]
    images = [load_image(image) for image, _ in chat_images([conversation])[0]]
    together = preprocess(model, images)
    ids = chat_ids(model, [conversation], together)[0]
    expected = image_inputs(model, [ids], together)
    parts = [encode_image(model, preprocess(model, [image])) for image in images]
    assert all(p.images.pixel_values.size == 0 for p in parts)  # the layout travels, not the pixels
    joined = join_images(parts)
    assert chat_ids(model, [conversation], joined)[0] == ids
    placed = placed_images(model, ids, joined, parts)
    np.testing.assert_allclose(placed.features[0], expected.features[0], rtol=1e-5, atol=1e-6)
    assert (placed.positions[0] is None) == (expected.positions[0] is None)
    if expected.positions[0] is not None:
        assert np.array_equal(placed.positions[0], expected.positions[0])
