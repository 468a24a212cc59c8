"""The `raymuter generate` command, run as a user runs it: a subprocess, text in, text out.

Invariant: what the command prints for a prompt is the tokenizer's decoding of the tokens the
API generates for that prompt's token ids; a bad model path is an error message and exit code 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import generation

REPO = Path(__file__).resolve().parents[2]


def raymuter(*args, cwd):
    """Run `python -m deployments.cli ...` (the `raymuter` console script's module) with the
    repository first on the import path, so this checkout runs whether or not the package is also
    installed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    return subprocess.run([sys.executable, "-m", "deployments.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def folder(test_models):
    return test_models["llama-optimum"]


@pytest.fixture(scope="module")
def tokenizer(folder):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def model(folder):
    return generation.load(folder, threads=1)


def expected_text(model, tokenizer, text, max_new_tokens):
    """The API's greedy tokens for `text`'s token ids, decoded."""
    ids = tokenizer.encode(text).ids
    ctx = generation.context(model, max_new_tokens=max_new_tokens)
    row = generation.generate(ctx, [ids], seeds=[0])[0]
    assert len(row) == max_new_tokens  # guard: a real continuation, not an eos at once
    return tokenizer.decode(row, skip_special_tokens=True)


def test_one_prompt_prints_its_continuation(folder, model, tokenizer, tmp_path):
    done = raymuter("generate", "--model", folder, "--max-new-tokens", 8, "ka lo mi", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    text = expected_text(model, tokenizer, "ka lo mi", 8)
    assert text.strip()
    assert done.stdout == text + "\n"
    assert "8 tokens in" in done.stderr


def test_two_prompts_print_both(folder, model, tokenizer, tmp_path):
    done = raymuter("generate", "--model", folder, "--max-new-tokens", 8, "ka lo mi", "mi lo",
                    cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    first = expected_text(model, tokenizer, "ka lo mi", 8)
    second = expected_text(model, tokenizer, "mi lo", 8)
    assert first != second
    assert done.stdout == f"--- ka lo mi\n{first}\n--- mi lo\n{second}\n"
    assert "16 tokens in" in done.stderr


def test_streamed_text_ends_with_the_whole_last_token(folder, model, tokenizer, tmp_path):
    """A byte-level token can leave a character incomplete; the stream holds such text back until
    the next token, and must still print it when generation ends (the whole decode shows it as
    U+FFFD, and so does the two-prompt output)."""
    ctx = generation.context(model, max_new_tokens=8)
    candidates = ["zz", "ka", "lo", "mi", "ka ka", "lo mi", "zz zz", "a b", "ion", "the"]
    ragged = None
    for text in candidates:
        row = generation.generate(ctx, [tokenizer.encode(text).ids], seeds=[0])[0]
        if tokenizer.decode(row, skip_special_tokens=True).endswith("\ufffd"):
            ragged = text
            break
    assert ragged is not None, "no candidate prompt ends in an incomplete character"
    done = raymuter("generate", "--model", folder, "--max-new-tokens", 8, ragged, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected_text(model, tokenizer, ragged, 8) + "\n"


def test_processor_settings_and_stop_strings(folder, model, tokenizer, tmp_path):
    done = raymuter("generate", "--model", folder, "--max-new-tokens", 8, "--repetition-penalty", 1.3,
                    "--set", "no_repeat_ngram_size=2", "--set", "bad_words_ids=[[5]]", "ka lo mi", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    ctx = generation.context(model, max_new_tokens=8, repetition_penalty=1.3, no_repeat_ngram_size=2,
                             bad_words_ids=[[5]])
    row = generation.generate(ctx, [tokenizer.encode("ka lo mi").ids])[0]
    assert done.stdout == tokenizer.decode(row, skip_special_tokens=True) + "\n"
    text = expected_text(model, tokenizer, "ka lo mi", 8)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    done = raymuter("generate", "--model", folder, "--max-new-tokens", 8, "--stop", stop, "ka lo mi", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == text[:text.index(stop)] + "\n"
    bad = raymuter("generate", "--model", folder, "--set", "no_repeat_ngram_size", "ka", cwd=tmp_path)
    assert bad.returncode == 2 and "--set takes NAME=JSON, not 'no_repeat_ngram_size'" in bad.stderr


def test_bad_model_path_exits_2_naming_it(tmp_path):
    missing = tmp_path / "no-such-model"
    done = raymuter("generate", "--model", missing, "hello", cwd=tmp_path)
    assert done.returncode == 2
    assert "error" in done.stderr
    assert str(missing) in done.stderr
    assert done.stdout == ""
    assert "Traceback" not in done.stderr


def test_bad_setting_exits_2_naming_it(folder, tmp_path):
    done = raymuter("generate", "--model", folder, "--top-p", 2, "--do-sample", "hello", cwd=tmp_path)
    assert done.returncode == 2
    assert "top_p must be a number in (0, 1] (1 turns it off), not 2.0" in done.stderr
    assert "Traceback" not in done.stderr


def test_constraint_flags_constrain_the_output(folder, model, tokenizer, tmp_path):
    import json

    schema = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "abc.lark").write_text('start: "<" /[a-c]{2}/ ">"')
    for flags, setting in [(["--json-schema", "schema.json"], {"json": schema}), (["--json"], {"json_object": True}),
                           (["--regex", "[a-f]{4}"], {"regex": "[a-f]{4}"}),
                           (["--choice", "yes", "--choice", "no"], {"choice": ["yes", "no"]}),
                           (["--grammar", "abc.lark"], {"grammar": 'start: "<" /[a-c]{2}/ ">"'})]:
        done = raymuter("generate", "--model", folder, "--max-new-tokens", 30, *flags, "ka lo mi", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        ctx = generation.context(model, max_new_tokens=30, structured_outputs=setting)
        row = generation.generate(ctx, [tokenizer.encode("ka lo mi").ids])[0]
        assert done.stdout == tokenizer.decode(row, skip_special_tokens=True) + "\n", flags
    assert json.loads(raymuter("generate", "--model", folder, "--max-new-tokens", 30, "--json-schema", "schema.json",
                               "ka", cwd=tmp_path).stdout)["n"] in range(10)
    missing = raymuter("generate", "--model", folder, "--json-schema", "nope.json", "ka", cwd=tmp_path)
    assert missing.returncode == 2 and "--json-schema: cannot read nope.json" in missing.stderr
    bad = raymuter("generate", "--model", folder, "--regex", "(", "ka", cwd=tmp_path)
    assert bad.returncode == 2 and "structured_outputs.regex:" in bad.stderr and "Traceback" not in bad.stderr
    both = raymuter("generate", "--model", folder, "--json", "--regex", "a", "ka", cwd=tmp_path)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_no_fuse_runs_the_export_as_exported(folder, tmp_path):
    fused = raymuter("generate", "--model", folder, "--max-new-tokens", "3", "x", cwd=tmp_path)
    exported = raymuter("generate", "--model", folder, "--max-new-tokens", "3", "--no-fuse", "x", cwd=tmp_path)
    assert fused.returncode == 0 and exported.returncode == 0, (fused.stderr, exported.stderr)
    assert "cache in_place" in fused.stderr and "cache append" in exported.stderr
    assert fused.stdout == exported.stdout  # the same greedy text either way


def test_the_precision_chosen_is_printed_with_why(folder, tokenizer, tmp_path):
    """auto on a tiny model stays float32 and says why (its weights are below the line where int8
    pays, or the CPU has no int8 dot products); --precision int8 prints int8 and gives the int8
    model's greedy text."""
    auto = raymuter("generate", "--model", folder, "--max-new-tokens", "3", "x", cwd=tmp_path)
    assert auto.returncode == 0, auto.stderr
    line = next(l for l in auto.stderr.splitlines() if "precision" in l)
    assert line.startswith("[raymuter] precision fp32 (auto asked): ") and (
        "below the 64 MiB" in line or "no int8 dot-product instructions" in line), line
    int8 = raymuter("generate", "--model", folder, "--max-new-tokens", "6", "--precision", "int8", "ka lo mi",
                    cwd=tmp_path)
    assert int8.returncode == 0, int8.stderr
    assert "[raymuter] precision int8 (int8 asked): asked for" in int8.stderr
    quantized = generation.load(folder, threads=1, precision="int8")
    assert int8.stdout == expected_text(quantized, tokenizer, "ka lo mi", 6) + "\n"
    wrong = raymuter("generate", "--model", folder, "--precision", "bf16", "x", cwd=tmp_path)
    assert wrong.returncode == 2 and "--precision: invalid choice: 'bf16'" in wrong.stderr
