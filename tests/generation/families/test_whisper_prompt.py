"""Whisper's decoder prompt from every source transformers 4.57 reads, table-driven: one
generation_config.json (and config.json) per combination, with language and task arguments.

Each case is a model folder of the tiny Whisper's graphs with that config; the prompt is the one
transformers' own generate builds (`_retrieve_init_tokens`, recorded during the call), and the
tokens (and segments, with timestamps and long-form) equal transformers generate. Every case
changes transformers' prompt from the base case's, so a case that reads a source wrongly fails.
Cases transformers refuses are refused here too, naming the setting.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

import generation
from generation import tasks
from generation.families.whisper import speech
from test_whisper_windows import hf_features, hf_rows

EN, ZH, DE = 885, 886, 887
TRANSLATE, TRANSCRIBE, NO_TIMESTAMPS = 893, 894, 898
EOT = 883

# (id, changes to generation_config.json (None: remove the key), changes to config.json, arguments)
CASES = [
    ("base", {}, {}, {}),
    ("language-code", {}, {}, dict(language="es")),
    ("language-token", {}, {}, dict(language="<|fr|>")),
    ("language-name", {}, {}, dict(language="Russian")),
    ("language-alias", {}, {}, dict(language="castilian")),
    ("task-argument", {}, {}, dict(task="translate")),
    ("per-row-languages", {}, {}, dict(language=["de", "fr", "english"])),
    ("config-language", dict(language="fr"), {}, {}),
    ("config-and-argument-disagree", dict(language="fr", task="translate"), {}, dict(language="ko")),
    ("config-task", dict(task="translate"), {}, {}),
    ("config-task-argument-task", dict(task="translate"), {}, dict(task="transcribe", language="es")),
    ("forced-full", dict(forced_decoder_ids=[[1, DE], [2, TRANSLATE], [3, NO_TIMESTAMPS]]), {}, {}),
    ("forced-language-only", dict(forced_decoder_ids=[[1, ZH]]), {}, {}),
    ("forced-replaced-by-language", dict(forced_decoder_ids=[[1, ZH], [2, TRANSLATE]]), {}, dict(language="en")),
    ("forced-ignored-with-task-argument", dict(forced_decoder_ids=[[1, ZH], [2, TRANSCRIBE]]), {}, dict(task="translate")),
    ("no-forced", dict(forced_decoder_ids=None), {}, {}),
    ("forced-in-config-json", dict(forced_decoder_ids=None), dict(forced_decoder_ids=[[1, EN], [2, TRANSLATE]]), {}),
    ("forced-not-from-1", dict(forced_decoder_ids=[[2, TRANSLATE]]), {}, {}),
    ("no-notimestamps-token", dict(no_timestamps_token_id=None, forced_decoder_ids=None), {}, dict(language="ja")),
    ("english-only", dict(lang_to_id=None, task_to_id=None, is_multilingual=False,
                          forced_decoder_ids=[[1, NO_TIMESTAMPS]]), {}, {}),
    ("outdated-no-multilingual-flag", dict(lang_to_id=None, task_to_id=None, is_multilingual=None,
                                           forced_decoder_ids=None), {}, {}),
]

# (id, config changes, arguments, the setting named): transformers raises on each too
REFUSED = [
    ("unknown-language", {}, dict(language="xx"), "language"),
    ("language-not-in-model", {}, dict(language="italian"), "language"),
    ("unknown-task", {}, dict(task="summarise"), "task"),
    ("english-only-with-language", dict(is_multilingual=False), dict(language="de"), "language"),
    ("english-only-with-task", dict(is_multilingual=False), dict(task="translate"), "task"),
    ("no-lang-to-id-with-language", dict(lang_to_id=None), dict(language="de"), "language"),
    ("languages-count", {}, dict(language=["de", "fr"]), "language"),
    ("languages-holding-none", {}, dict(language=["de", None, "fr"]), "language"),
]


@pytest.fixture(scope="module")
def hf(whisper_hf):
    return whisper_hf


def changed(config: dict, changes: dict) -> dict:
    out = copy.deepcopy(config)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


@pytest.fixture(scope="module")
def base(s2s):
    folder = s2s["whisper-optimum"]
    return folder, json.loads((folder / "generation_config.json").read_text()), json.loads(
        (folder / "config.json").read_text())


@pytest.fixture(scope="module")
def folders(base, tmp_path_factory):
    """A model folder per case: the fixture's files linked, its configs changed."""
    folder, generation_config, config = base
    out = {}
    for name, gen_changes, config_changes, _ in CASES + [(r[0], r[1], {}, r[2]) for r in REFUSED]:
        case = tmp_path_factory.mktemp(f"whisper-{name}")
        for f in folder.iterdir():
            if f.name not in ("generation_config.json", "config.json"):
                (case / f.name).symlink_to(f)
        (case / "generation_config.json").write_text(json.dumps(changed(generation_config, gen_changes)))
        (case / "config.json").write_text(json.dumps(changed(config, config_changes)))
        out[name] = case
    return out


def hf_generate(hf, folder, clips, **arguments):
    """transformers generate with the folder's configs: (its prompts, tokens, segments or None)."""
    import torch
    import transformers

    model, extractor = hf
    generation_config = transformers.GenerationConfig.from_dict(
        json.loads((folder / "generation_config.json").read_text()))
    forced = json.loads((folder / "config.json").read_text()).get("forced_decoder_ids")
    kept = model.generation_config, getattr(model.config, "forced_decoder_ids", None)
    prompts = []
    retrieve = model._retrieve_init_tokens

    def recorded(*args, **kwargs):
        out = retrieve(*args, **kwargs)
        prompts.extend(out.tolist())
        return out

    settings = dict(arguments)
    features = hf_features(extractor, clips, settings)
    model.generation_config, model.config.forced_decoder_ids = generation_config, forced
    model._retrieve_init_tokens = recorded
    try:
        with torch.no_grad():
            out = model.generate(features, return_segments=True, **settings)
    finally:
        model.generation_config, model.config.forced_decoder_ids = kept
        del model._retrieve_init_tokens
    return prompts, hf_rows(out, len(clips))


def clips(count: int = 3, seconds: float = 1.0):
    rng = np.random.default_rng(7)
    return [(rng.standard_normal(int(seconds * 16000)) * s).astype(np.float32) for s in (0.1, 0.5, 1.0)[:count]]


def our_prompts(model, clip_list, timestamps=False, **arguments):
    ctx = generation.context(model)
    features = generation.families.whisper.audio.whisper_features(clip_list, chunk_seconds=2)
    encoder = generation.runtime.encoders.encode_audio(model, features.features[..., :200])
    return speech.whisper_prompts(ctx, encoder, timestamps=timestamps, **arguments)


@pytest.fixture(scope="module")
def base_prompts(hf, folders):
    return hf_generate(hf, folders["base"], clips(), max_new_tokens=4)[0]


@pytest.mark.parametrize("name, gen_changes, config_changes, arguments", CASES, ids=[c[0] for c in CASES])
def test_prompt_and_tokens_equal_transformers(name, gen_changes, config_changes, arguments, folders, hf,
                                              load_model, base_prompts):
    folder = folders[name]
    model = load_model(folder)
    expected_prompts, expected = hf_generate(hf, folder, clips(), max_new_tokens=8, **arguments)
    assert our_prompts(model, clips(), **arguments) == expected_prompts
    if name != "base":
        assert expected_prompts != base_prompts, "the case does not change transformers' prompt"
    got = tasks.speech_to_text(generation.context(model, max_new_tokens=8), clips(), **arguments)
    assert [r.tokens for r in got] == [tokens for tokens, _ in expected]


# cases whose prompt changes with timestamps on (the no-timestamps token dropped or never added)
TIMESTAMPED = ["base", "language-code", "forced-full", "config-task", "english-only", "per-row-languages"]


@pytest.mark.parametrize("name", TIMESTAMPED)
def test_timestamps_and_segments_equal_transformers(name, folders, hf, load_model):
    folder = folders[name]
    arguments = next(c[3] for c in CASES if c[0] == name)
    model = load_model(folder)
    expected_prompts, expected = hf_generate(hf, folder, clips(), return_timestamps=True, max_new_tokens=8,
                                             **arguments)
    assert our_prompts(model, clips(), timestamps=True, **arguments) == expected_prompts
    assert NO_TIMESTAMPS not in expected_prompts[0]
    got = tasks.speech_to_text(generation.context(model, max_new_tokens=8), clips(), return_timestamps=True,
                               **arguments)
    assert [(r.tokens, [(s.start, s.end, s.tokens) for s in r.segments]) for r in got] == expected


@pytest.mark.parametrize("name", ["config-language", "forced-full", "english-only", "no-forced"])
def test_long_form_equals_transformers(name, folders, hf, load_model):
    """A 5 s clip (three windows of the tiny model) beside a short one."""
    folder = folders[name]
    arguments = next(c[3] for c in CASES if c[0] == name)
    model = load_model(folder)
    long = clips(2, 5.0)[:1] + clips(1, 0.7)
    expected_prompts, expected = hf_generate(hf, folder, long, return_timestamps=True, max_new_tokens=6, **arguments)
    got = tasks.speech_to_text(generation.context(model, max_new_tokens=6), long, return_timestamps=True, **arguments)
    assert [(r.tokens, [(s.start, s.end, s.tokens) for s in r.segments]) for r in got] == expected
    assert len(expected[0][1]) > 1


@pytest.mark.parametrize("name, gen_changes, arguments, setting", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_as_transformers_refuses(name, gen_changes, arguments, setting, folders, hf, load_model):
    folder = folders[name]
    with pytest.raises((ValueError, TypeError, KeyError)):
        hf_generate(hf, folder, clips(), max_new_tokens=2, **arguments)
    with pytest.raises(ValueError) as raised:
        tasks.speech_to_text(generation.context(load_model(folder), max_new_tokens=2), clips(), **arguments)
    assert getattr(raised.value, "setting", None) == setting, raised.value
