"""Build the project's test models: tiny random-weight Hugging Face models and their ONNX
exports in every layout the engine must serve.  Nothing is downloaded; everything is built
from a ``transformers`` config with random weights.

Layouts (keys of :data:`MODEL_DIRS`, relative folders under the cache folder):

``hf/llama``, ``hf/qwen2``, ``hf/gpt2``
    torch models (``save_pretrained``) + tokenizer: the oracle.
``llama-optimum``, ``qwen2-optimum``, ``gpt2-optimum``
    ``optimum`` ``text-generation-with-past`` export: root ``model.onnx`` with ``position_ids``.
``gpt2-grow``
    root ``model.onnx`` WITHOUT ``position_ids`` (positions come from the cache length).
``llama-merged``
    transformers.js / onnx-community layout: ``onnx/decoder_model_merged.onnx``
    (``use_cache_branch`` bool[1] + one If node), ``onnx/decoder_model_merged_quantized.onnx``
    (int8 dynamic quantization) and ``onnx/decoder_model_merged_fp16.onnx`` (float16 weights
    and float16 past / present / logits).
``llama-genai``, ``qwen2-genai``
    ``onnxruntime_genai.models.builder -p fp32 -e cpu``: ``model.onnx`` + ``model.onnx.data`` +
    ``genai_config.json`` + tokenizer files, exactly as the builder writes them (no config.json).

Encoder-decoders (keys of :data:`SEQ2SEQ_DIRS`, relative folders under the SIBLING folder
``<cache folder>-seq2seq``, built by the same build; ``ensure_test_models(seq2seq=True)``).
d_model 64, 2 encoder + 2 decoder layers, 4 heads of 16, vocab 1000, random weights as in
:data:`SEQ2SEQ_INIT` (greedy output depends on the source):

``hf/marian``, ``hf/t5``, ``hf/bart``, ``hf/whisper``
    ``MarianMTModel``, ``T5ForConditionalGeneration`` (flan-t5 style: gated-gelu, untied),
    ``BartForConditionalGeneration``, ``WhisperForConditionalGeneration`` (``save_pretrained``)
    + ``tokenizer.json`` (see :func:`build_seq2seq_tokenizer`) + ``generation_config.json`` as
    ``save_pretrained`` writes it: ``decoder_start_token_id``, ``eos_token_id``,
    ``pad_token_id`` and, Marian / BART, ``forced_eos_token_id``:

    * marian: decoder_start 999 (= pad), eos 0 (= bos, unused), pad 999, forced_eos 0,
      ``<unk>`` 1; sources end with ``</s>``.
    * t5: decoder_start 0 (= pad), eos 1, pad 0, ``<unk>`` 2; sources end with ``</s>``.
    * bart: decoder_start 2 (= eos), eos 2, pad 1, forced_eos 2, bos 0; sources are
      ``<s> ... </s>``.
    * whisper: decoder_start 884 ``<|startoftranscript|>``, eos = pad = bos 883
      ``<|endoftext|>``, languages 885-892, translate 893, transcribe 894, notimestamps 898,
      timestamps ``<|0.00|>`` .. ``<|2.00|>`` 899-999 (:data:`WHISPER_IDS`).

    Whisper is the TINY shape: ``max_source_positions=100``, 200 log-mel frames (2 s; encoder
    input ``[B, 80, 200]``, output ``[B, 100, 64]``), where a real Whisper takes 3000 frames
    (30 s, ``[B, 80, 3000]`` -> 1500 positions).  Its folder also has
    ``preprocessor_config.json`` (``WhisperFeatureExtractor``, ``chunk_length=2``,
    ``n_samples=32000``, ``nb_max_frames=200``) and a ``WhisperTokenizerFast``; its
    generation config has the fields of real multilingual checkpoints (``forced_decoder_ids``
    ``[[1, None], [2, <|transcribe|>]]``, ``is_multilingual``, ``lang_to_id`` (8 languages,
    en zh de es ru ko fr ja), ``task_to_id``, ``no_timestamps_token_id``,
    ``prev_sot_token_id``, ``suppress_tokens``, ``begin_suppress_tokens``,
    ``max_initial_timestamp_index``, ``alignment_heads``) so ``generate()`` runs offline with
    ``language=`` / ``task=`` / ``return_timestamps=`` and language detection.
``marian-optimum``, ``t5-optimum``, ``bart-optimum``, ``whisper-optimum``
    ``optimum-cli export onnx --task text2text-generation-with-past`` (Whisper:
    ``automatic-speech-recognition-with-past --nb_max_frames 200``): ``encoder_model.onnx`` +
    ``decoder_model_merged.onnx`` + the HF folder's config / generation config / tokenizer /
    preprocessor files.  (optimum also leaves the two unmerged decoders next to the merged one;
    they are removed here: one layout per folder.)
``marian-js``
    transformers.js layout of the same export: ``onnx/encoder_model.onnx`` +
    ``onnx/decoder_model_merged.onnx``, meta files at the root.
``marian-unmerged``
    ``encoder_model.onnx`` + ``decoder_model.onnx`` (first step) +
    ``decoder_with_past_model.onnx`` (later steps), as optimum writes them before merging (all
    it writes with ``--no-post-process``).

Encoder-decoder graph names (N = 0, 1; B batch, S source length, T new decoder tokens, P past
decoder length; heads 4, head_dim 16; everything float32 / int64, feed by NAME):

* ``encoder_model.onnx``: in ``input_ids [B, S]``, ``attention_mask [B, S]`` (Whisper:
  ``input_features [B, 80, 200]``, no mask); out ``last_hidden_state [B, S, 64]`` (Whisper
  ``[B, 100, 64]``).
* ``decoder_model_merged.onnx``: in ``encoder_attention_mask [B, S]`` (not Whisper),
  ``input_ids [B, T]``, ``encoder_hidden_states [B, S, 64]``,
  ``past_key_values.N.decoder.key/.value [B, 4, P, 16]``,
  ``past_key_values.N.encoder.key/.value [B, 4, S, 16]``, ``use_cache_branch bool[1]``; out
  ``logits [B, T, 1000]``, ``present.N.decoder.key/.value [B, 4, P+T, 16]``,
  ``present.N.encoder.key/.value [B, 4, S, 16]``.  Step 0: ``use_cache_branch=[False]`` and
  zero-length pasts (``[B, 4, 0, 16]``, the encoder ones too); later steps ``[True]``, the
  decoder presents fed back and the STEP-0 encoder presents kept: with ``[True]`` the
  ``present.N.encoder.*`` outputs are dummies.
* ``decoder_model.onnx``: in ``encoder_attention_mask``, ``input_ids``,
  ``encoder_hidden_states``; out as the merged decoder.
* ``decoder_with_past_model.onnx``: in ``encoder_attention_mask``, ``input_ids``, all
  ``past_key_values.N.*`` (NO ``encoder_hidden_states``); out ``logits`` (its T dim is named
  ``"1"``) and ``present.N.decoder.*`` only.

Entry points:

* :func:`ensure_test_models` -> ``dict[str, Path]``: cached build (see its docstring);
  ``seq2seq=True`` adds the encoder-decoders.
* :func:`build_all` builds everything into a folder, in this process (heavy imports).
* ``python tests/model_builders.py [--root DIR]``: ensure the cache, print the paths as JSON.

This module has no import-time side effects and imports torch / transformers / onnx lazily.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

SEED = 0
INIT_RANGE = 0.3
PERTURB = 0.1
TINY_VOCAB = 1000
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
MAX_IR_VERSION = 10  # onnx 1.23 writes IR 14 by default; onnxruntime reads at most ~13

#: key -> folder relative to the cache folder
MODEL_DIRS = {
    "hf/llama": "hf/llama",
    "hf/qwen2": "hf/qwen2",
    "hf/gpt2": "hf/gpt2",
    "llama-optimum": "llama-optimum",
    "qwen2-optimum": "qwen2-optimum",
    "gpt2-optimum": "gpt2-optimum",
    "gpt2-grow": "gpt2-grow",
    "llama-merged": "llama-merged",
    "llama-genai": "llama-genai",
    "qwen2-genai": "qwen2-genai",
}

#: encoder-decoder key -> folder relative to the SEQ2SEQ cache folder (:func:`seq2seq_folder`)
SEQ2SEQ_DIRS = {
    "hf/marian": "hf/marian",
    "hf/t5": "hf/t5",
    "hf/bart": "hf/bart",
    "hf/whisper": "hf/whisper",
    "marian-optimum": "marian-optimum",
    "t5-optimum": "t5-optimum",
    "bart-optimum": "bart-optimum",
    "whisper-optimum": "whisper-optimum",
    "marian-js": "marian-js",
    "marian-unmerged": "marian-unmerged",
}

#: packages whose versions are part of the cache key
VERSIONED_PACKAGES = ("torch", "transformers", "optimum", "optimum-onnx", "onnx", "onnxruntime",
                      "onnxruntime-genai", "tokenizers", "onnxscript")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
META_FILES = ("config.json", "generation_config.json") + TOKENIZER_FILES + ("chat_template.jinja",)

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------
def tiny_config(kind: str):
    """transformers config of the tiny ``kind`` model (llama, qwen2, gpt2) and its model class."""
    import transformers as tf

    common = dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    if kind == "llama":
        return tf.LlamaForCausalLM, tf.LlamaConfig(
            vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False, initializer_range=INIT_RANGE, **common)
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM, tf.Qwen2Config(
            vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False, max_window_layers=2, use_sliding_window=False,
            initializer_range=INIT_RANGE, **common)
    if kind == "gpt2":
        return tf.GPT2LMHeadModel, tf.GPT2Config(
            vocab_size=TINY_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
            initializer_range=INIT_RANGE, **common)
    raise ValueError(f"unknown tiny model kind {kind!r}")


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------
def _tiny_corpus(n=20000, seed=0):
    import random

    rnd = random.Random(seed)
    syl = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "an", "el", "or", "is", "qu", "ve",
           "the", "and", "ing", "ion", "er", "st", "th", "ou", "in", "re"]
    words = ["".join(rnd.choice(syl) for _ in range(rnd.randint(1, 4))) for _ in range(3000)]
    for _ in range(n // 20):
        yield (" ".join(rnd.choice(words) for _ in range(20)) + rnd.choice([".", "!", "?", ","])
               + f" {rnd.randint(0, 999)}")


def build_tokenizer(vocab_size: int = TINY_VOCAB, corpus=None):
    """Deterministic byte-level BPE trained locally, as a ``PreTrainedTokenizerFast``.

    ids: ``<pad>`` = 0, ``<s>`` = 1, ``</s>`` = 2; the post-processor prepends ``<s>``.
    If the corpus cannot fill ``vocab_size``, filler tokens ``<extra_N>`` pad it exactly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus if corpus is not None else _tiny_corpus(), trainer=trainer)
    n = tok.get_vocab_size()
    if n < vocab_size:
        tok.add_tokens([f"<extra_{i}>" for i in range(vocab_size - n)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS_ID)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    assert fast.convert_tokens_to_ids(["<pad>", "<s>", "</s>"]) == [PAD_ID, BOS_ID, EOS_ID]
    assert len(fast) == vocab_size, (len(fast), vocab_size)
    return fast


# --------------------------------------------------------------------------------------------
# HF models
# --------------------------------------------------------------------------------------------
def build_hf_model(model_cls, config, out, tokenizer, *, init_range=None, perturb=None,
                   seed=SEED) -> int:
    """Random-weight model from ``config`` -> ``save_pretrained(out)`` with ``tokenizer``.

    ``init_range`` overrides ``config.initializer_range``; ``perturb`` adds N(0, perturb) to
    every parameter (HF inits biases to 0 and norms to 1, which would hide bias/norm bugs).
    Returns the parameter count.
    """
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    if init_range is not None:
        config.initializer_range = init_range
    model = model_cls(config).eval()
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * perturb)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                               eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    out = Path(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def build_tiny_hf(kind, out, tokenizer) -> int:
    cls, cfg = tiny_config(kind)
    return build_hf_model(cls, cfg, out, tokenizer, init_range=INIT_RANGE, perturb=PERTURB)


def copy_meta(src, dst):
    """Copy config / generation config / tokenizer files of an HF folder into ``dst``."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in META_FILES:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, dst / name)


# --------------------------------------------------------------------------------------------
# encoder-decoder models (Marian, T5, BART, Whisper)
# --------------------------------------------------------------------------------------------
#: (init_std, N(0, perturb) noise) of the encoder-decoders, untied input/output embeddings
#: (T5: its own init, initializer_factor 1.0).  Tiny random encoder-decoders with tied
#: embeddings or init 0.3 collapse: greedy repeats one token whatever the source (BART at
#: init <= 0.05 tied emits eos at once).  With these, greedy over 20 steps gives 10-20
#: distinct tokens per row and rows that differ within a few steps for different sources.
SEQ2SEQ_INIT = {"marian": (0.05, 0.05), "t5": (None, 0.05), "bart": (0.05, 0.05),
                "whisper": (0.1, 0.05)}
#: Whisper: the proj_out rows of the timestamp tokens are scaled by this so that, as a trained
#: Whisper, the tiny model does not emit timestamps unless ``return_timestamps`` forces them
#: (transformers 4.57 re-runs generate on the rest of the window after a timestamp pair, even
#: for short-form audio without ``return_timestamps``).
WHISPER_TIMESTAMP_SCALE = 0.1
SEQ2SEQ_KINDS = ("marian", "t5", "bart", "whisper")

#: Whisper tiny layout: 200 log-mel frames (2 s at hop 160 / 16 kHz) instead of 3000 (30 s)
WHISPER_FRAMES = 200
WHISPER_LANGS = ("en", "zh", "de", "es", "ru", "ko", "fr", "ja")  # LANGUAGES order: id = sot+1+i
WHISPER_N_TIMESTAMPS = WHISPER_FRAMES // 2 + 1  # <|0.00|> .. <|2.00|>, 0.02 s per encoder frame

# special token ids of the tiny encoder-decoders (all vocabularies have TINY_VOCAB ids)
MARIAN_IDS = dict(eos=0, unk=1, pad=TINY_VOCAB - 1, decoder_start=TINY_VOCAB - 1)
T5_IDS = dict(pad=0, eos=1, unk=2, decoder_start=0)
BART_IDS = dict(bos=0, pad=1, eos=2, unk=3, mask=TINY_VOCAB - 1, decoder_start=2)


def _whisper_ids():
    """Token ids of the tiny Whisper, laid out like the real multilingual vocabulary:
    byte-level BPE, then <|endoftext|>, <|startoftranscript|>, languages, <|translate|>,
    <|transcribe|>, <|startoflm|>, <|startofprev|>, <|nospeech|>, <|notimestamps|>, and the
    timestamp tokens <|0.00|> .. <|2.00|> up to the end of the vocabulary."""
    n_special = 2 + len(WHISPER_LANGS) + 6
    eot = TINY_VOCAB - n_special - WHISPER_N_TIMESTAMPS  # = the number of BPE tokens
    ids = dict(eot=eot, sot=eot + 1)
    ids["langs"] = {f"<|{c}|>": eot + 2 + i for i, c in enumerate(WHISPER_LANGS)}
    nxt = eot + 2 + len(WHISPER_LANGS)
    for name in ("translate", "transcribe", "startoflm", "startofprev", "nospeech",
                 "notimestamps"):
        ids[name] = nxt
        nxt += 1
    ids["timestamp_begin"] = nxt
    assert nxt + WHISPER_N_TIMESTAMPS == TINY_VOCAB, (nxt, WHISPER_N_TIMESTAMPS)
    return ids


WHISPER_IDS = _whisper_ids()


def seq2seq_config(kind: str):
    """transformers config of the tiny encoder-decoder ``kind`` and its model class."""
    import transformers as tf

    common = dict(vocab_size=TINY_VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                  decoder_ffn_dim=128, init_std=SEQ2SEQ_INIT.get(kind, (None,))[0],
                  tie_word_embeddings=False)
    if kind == "marian":
        i = MARIAN_IDS
        return tf.MarianMTModel, tf.MarianConfig(
            max_position_embeddings=256, pad_token_id=i["pad"], eos_token_id=i["eos"],
            bos_token_id=i["eos"], decoder_start_token_id=i["decoder_start"],
            forced_eos_token_id=i["eos"], scale_embedding=True,
            share_encoder_decoder_embeddings=True, **common)
    if kind == "bart":
        i = BART_IDS
        return tf.BartForConditionalGeneration, tf.BartConfig(
            max_position_embeddings=256, pad_token_id=i["pad"], bos_token_id=i["bos"],
            eos_token_id=i["eos"], decoder_start_token_id=i["decoder_start"],
            forced_eos_token_id=i["eos"], forced_bos_token_id=None, **common)
    if kind == "t5":  # flan-t5 style: gated-gelu, untied lm_head
        i = T5_IDS
        return tf.T5ForConditionalGeneration, tf.T5Config(
            vocab_size=TINY_VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
            num_decoder_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
            tie_word_embeddings=False, initializer_factor=1.0,
            decoder_start_token_id=i["decoder_start"], pad_token_id=i["pad"],
            eos_token_id=i["eos"])
    if kind == "whisper":
        w = WHISPER_IDS
        return tf.WhisperForConditionalGeneration, tf.WhisperConfig(
            num_mel_bins=80, max_source_positions=WHISPER_FRAMES // 2, max_target_positions=128,
            pad_token_id=w["eot"], bos_token_id=w["eot"], eos_token_id=w["eot"],
            decoder_start_token_id=w["sot"], begin_suppress_tokens=None, suppress_tokens=None,
            **common)
    raise ValueError(f"unknown tiny encoder-decoder kind {kind!r}")


SEQ2SEQ_INPUT_NAMES = ["input_ids", "attention_mask"]  # no token_type_ids


def build_seq2seq_tokenizer(kind: str, corpus=None):
    """Tokenizer of the tiny encoder-decoder ``kind``, trained locally (< 1 s), TINY_VOCAB ids,
    special tokens where the real checkpoints have them:

    * marian: metaspace BPE (sentencepiece-like), ``</s>`` 0, ``<unk>`` 1, ``<pad>`` last;
      ``$A </s>``.
    * t5: metaspace BPE, ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, ``<extra_id_N>`` fill the
      end of the vocabulary; ``$A </s>``.
    * bart: byte-level BPE, ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3, ``<mask>`` last;
      ``<s> $A </s>``.
    * whisper: byte-level BPE then the Whisper special and timestamp tokens
      (:data:`WHISPER_IDS`), a ``WhisperTokenizerFast`` (prefix tokens, ``output_offsets``).

    All BPE: deterministic (the ``tokenizers`` Unigram trainer is not, even single-threaded).
    """
    from tokenizers import (Tokenizer, decoders, models, normalizers, pre_tokenizers,
                            processors, trainers)
    from transformers import PreTrainedTokenizerFast

    corpus = list(corpus if corpus is not None else _tiny_corpus())

    def fill(tok, n, fmt):
        have = tok.get_vocab_size()
        if have < n:
            tok.add_tokens([fmt.format(i) for i in range(n - have)])
        assert tok.get_vocab_size() == n, (tok.get_vocab_size(), n)

    if kind in ("marian", "t5"):
        i = MARIAN_IDS if kind == "marian" else T5_IDS
        meta = dict(replacement="\u2581", prepend_scheme="always")
        specials = ["</s>", "<unk>"] if kind == "marian" else ["<pad>", "</s>", "<unk>"]
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - 1 if kind == "marian" else 900,
                                      special_tokens=specials, show_progress=False)
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace(**meta)
        tok.decoder = decoders.Metaspace(**meta)
        tok.train_from_iterator(corpus, trainer=trainer)
        if kind == "marian":
            fill(tok, TINY_VOCAB - 1, "<extra_{}>")
            tok.add_special_tokens(["<pad>"])
        else:
            fill(tok, TINY_VOCAB, "<extra_id_{}>")
        tok.post_processor = processors.TemplateProcessing(
            single="$A </s>", pair="$A $B </s>" if kind == "marian" else "$A </s> $B </s>",
            special_tokens=[("</s>", i["eos"])])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>",
                                       pad_token="<pad>", model_input_names=SEQ2SEQ_INPUT_NAMES)
        assert fast.convert_tokens_to_ids(["</s>", "<unk>", "<pad>"]) == [
            i["eos"], i["unk"], i["pad"]]
    elif kind == "bart":
        i = BART_IDS
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - 1,
                                      special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(corpus, trainer=trainer)
        fill(tok, TINY_VOCAB - 1, "<extra_{}>")
        tok.add_special_tokens(["<mask>"])
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
            special_tokens=[("<s>", i["bos"]), ("</s>", i["eos"])])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                       unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
                                       model_input_names=SEQ2SEQ_INPUT_NAMES)
        assert fast.convert_tokens_to_ids(["<s>", "<pad>", "</s>", "<unk>", "<mask>"]) == [
            i["bos"], i["pad"], i["eos"], i["unk"], i["mask"]]
    elif kind == "whisper":
        from transformers import WhisperTokenizerFast

        w = WHISPER_IDS
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=w["eot"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(corpus, trainer=trainer)
        fill(tok, w["eot"], "<extra_{}>")
        specials = (["<|endoftext|>", "<|startoftranscript|>"] + list(w["langs"])
                    + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>",
                       "<|nospeech|>", "<|notimestamps|>"])
        fast = WhisperTokenizerFast(tokenizer_object=tok, unk_token="<|endoftext|>",
                                    bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                    pad_token="<|endoftext|>",
                                    additional_special_tokens=specials[1:])
        # timestamps: plain added tokens (not special), as in the real tokenizer
        fast.add_tokens([f"<|{0.02 * k:.2f}|>" for k in range(WHISPER_N_TIMESTAMPS)])
        fast.set_prefix_tokens()  # post-processor: <|startoftranscript|> <|notimestamps|> $A eot
        ids = fast.convert_tokens_to_ids(specials)
        assert ids == list(range(w["eot"], w["timestamp_begin"])), ids
        assert fast.all_special_ids[-1] + 1 == w["timestamp_begin"]  # decode(output_offsets=..)
        assert fast.convert_tokens_to_ids("<|0.00|>") == w["timestamp_begin"]
    else:
        raise ValueError(f"unknown tiny encoder-decoder kind {kind!r}")
    assert len(fast) == TINY_VOCAB, (kind, len(fast))
    return fast


def whisper_generation_config(tokenizer, config):
    """``GenerationConfig`` with the fields real (multilingual) Whisper checkpoints carry, in
    the tiny model's ids: ``generate()`` needs ``decoder_start_token_id``, ``lang_to_id`` /
    ``task_to_id`` / ``is_multilingual`` (``language=`` / ``task=`` and language detection),
    ``no_timestamps_token_id`` (``return_timestamps``), ``forced_decoder_ids`` (the legacy
    default prompt: language detected, transcribe), ``suppress_tokens`` and
    ``begin_suppress_tokens``."""
    from transformers import GenerationConfig

    w = WHISPER_IDS
    ids = tokenizer.convert_tokens_to_ids
    # real suppress_tokens: symbols / punctuation tokens, then the control tokens
    symbols = [ids(c) for c in '"#()*+/:;<=>@[\\]^_`{|}~']
    control = [w["sot"], w["translate"], w["transcribe"], w["startoflm"], w["startofprev"],
               w["nospeech"]]
    return GenerationConfig(
        bos_token_id=w["eot"], eos_token_id=w["eot"], pad_token_id=w["eot"],
        decoder_start_token_id=w["sot"],
        forced_decoder_ids=[[1, None], [2, w["transcribe"]]],
        is_multilingual=True, lang_to_id=dict(w["langs"]),
        task_to_id={"transcribe": w["transcribe"], "translate": w["translate"]},
        no_timestamps_token_id=w["notimestamps"], prev_sot_token_id=w["startofprev"],
        max_initial_timestamp_index=50, return_timestamps=False,
        suppress_tokens=sorted(set(symbols + control)),
        begin_suppress_tokens=[ids("\u0120"), w["eot"]],  # "Ġ" (a lone space) and eot
        alignment_heads=[[1, 0], [1, 2]], max_length=config.max_target_positions)


def build_seq2seq_hf(kind, out, *, seed=SEED) -> int:
    """Tiny random encoder-decoder ``kind`` -> ``save_pretrained(out)`` + tokenizer (+ the
    Whisper feature extractor's ``preprocessor_config.json``).  Returns the parameter count.

    The generation config is what ``save_pretrained`` writes from the model config (Marian /
    BART: ``forced_eos_token_id`` moves there), plus, for Whisper, the fields of
    :func:`whisper_generation_config`.
    """
    import torch

    cls, cfg = seq2seq_config(kind)
    tok = build_seq2seq_tokenizer(kind)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # not the fixed sinusoidal positions (Marian, Whisper encoder)
                p.add_(torch.randn_like(p) * SEQ2SEQ_INIT[kind][1])
    if kind == "bart":
        # BART's encoder / decoder embed_tokens share model.shared's Parameter; save_pretrained
        # stores it once and from_pretrained re-ties them only when tie_word_embeddings is True,
        # so untied BART would load them as NEW random weights: store separate equal copies.
        for emb in (model.model.encoder.embed_tokens, model.model.decoder.embed_tokens):
            emb.weight = torch.nn.Parameter(model.model.shared.weight.detach().clone())
    out = Path(out)
    if kind == "whisper":
        from transformers import WhisperFeatureExtractor

        model.generation_config = whisper_generation_config(tok, cfg)
        with torch.no_grad():
            model.proj_out.weight[WHISPER_IDS["timestamp_begin"]:] *= WHISPER_TIMESTAMP_SCALE
        # 2 s windows: n_samples 32000 -> nb_max_frames 200 (a real Whisper: 30 s, 3000)
        WhisperFeatureExtractor(feature_size=cfg.num_mel_bins, sampling_rate=16000,
                                hop_length=160, chunk_length=WHISPER_FRAMES // 100,
                                n_fft=400).save_pretrained(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def copy_hf_files(src, dst):
    """Copy every file of an HF folder but the weights (config, generation config, tokenizer,
    preprocessor config) into ``dst``."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and f.suffix not in (".safetensors", ".bin"):
            shutil.copy2(f, dst / f.name)


def export_seq2seq(kind, hf_dir, root, tmp_dir) -> list[str]:
    """optimum export of the tiny encoder-decoder ``kind`` into its layouts under ``root``;
    returns the keys written.

    ONE ``optimum-cli export onnx --task text2text-generation-with-past`` (Whisper:
    ``automatic-speech-recognition-with-past --nb_max_frames 200``) writes
    ``encoder_model.onnx``, ``decoder_model.onnx``, ``decoder_with_past_model.onnx`` and, by its
    post-processing, ``decoder_model_merged.onnx``; the files are then sorted into layouts:
    ``<kind>-optimum`` (encoder + merged) and, for Marian, ``marian-js`` (``onnx/`` encoder +
    merged) and ``marian-unmerged`` (encoder + the two decoders).  (``--no-post-process``
    would write the two decoders only.)  Validation is off: the tests compare with torch.
    """
    from optimum.exporters.onnx import main_export

    tmp = Path(tmp_dir) / f"export-{kind}"
    task = ("automatic-speech-recognition-with-past" if kind == "whisper"
            else "text2text-generation-with-past")
    shapes = {"nb_max_frames": WHISPER_FRAMES} if kind == "whisper" else {}
    main_export(str(hf_dir), output=str(tmp), task=task, library_name="transformers",
                local_files_only=True, do_validation=False, **shapes)

    def layout(dst, onnx_files, sub=""):
        copy_hf_files(hf_dir, dst)
        (dst / sub).mkdir(parents=True, exist_ok=True)
        for name in onnx_files:
            shutil.copy2(tmp / name, dst / sub / name)

    merged = ("encoder_model.onnx", "decoder_model_merged.onnx")
    layout(root / f"{kind}-optimum", merged)
    keys = [f"{kind}-optimum"]
    if kind == "marian":
        layout(root / "marian-js", merged, "onnx")
        layout(root / "marian-unmerged",
               ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx"))
        keys += ["marian-js", "marian-unmerged"]
    shutil.rmtree(tmp)
    return keys


# --------------------------------------------------------------------------------------------
# ONNX helpers
# --------------------------------------------------------------------------------------------
def cap_ir_version(path, max_ir=MAX_IR_VERSION):
    """Rewrite ``path`` with ``ir_version = max_ir`` if it was saved with a newer IR version."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    if m.ir_version > max_ir:
        m.ir_version = max_ir
        onnx.save(m, str(path))


def export_optimum(hf_dir, out, task="text-generation-with-past"):
    """``optimum-cli export onnx --task text-generation-with-past`` through the Python API."""
    from optimum.exporters.onnx import main_export

    main_export(str(hf_dir), output=str(out), task=task, library_name="transformers",
                local_files_only=True)


def export_decoder_dynamo(hf_dir, out, *, position_ids=True, past=True):
    """``torch.onnx.export(dynamo=True)`` of a decoder-only model, optimum naming.

    inputs: input_ids, attention_mask, [position_ids], [past_key_values.N.key/.value]
    outputs: logits, present.N.key/.value.  ``past=False`` gives the first-step graph (no
    past inputs, still outputs present.*), for :func:`merge_decoders`.  ``position_ids=False``
    gives the "grow" layout (positions derived from the past length).
    (TorchScript export dies on transformers 4.57's vmap masks; dynamo works.)
    """
    import torch
    import transformers as tf
    from transformers import DynamicCache

    class Wrapper(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model
            self.n = model.config.num_hidden_layers

        def forward(self, input_ids, attention_mask, *rest):
            if position_ids:
                pos, pkv = rest[0], rest[1:]
            else:
                pos, pkv = None, rest
            cache = DynamicCache()
            if past:
                for i in range(self.n):
                    cache.update(pkv[2 * i], pkv[2 * i + 1], i)
            o = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                           past_key_values=cache, use_cache=True)
            res = [o.logits]
            for i in range(self.n):
                res += [o.past_key_values.layers[i].keys, o.past_key_values.layers[i].values]
            return tuple(res)

    model = tf.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    cfg = model.config
    n_layers = cfg.num_hidden_layers
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(0)
    B, T, P = 2, 4, (3 if past else 0)
    ids = torch.randint(3, cfg.vocab_size, (B, T), generator=g)
    am = torch.ones(B, P + T, dtype=torch.long)
    pos = torch.arange(P, P + T).expand(B, T)
    pkv = [torch.randn(B, n_kv, P, hd, generator=g) for _ in range(2 * n_layers)] if past else []
    in_names = ["input_ids", "attention_mask"] + (["position_ids"] if position_ids else [])
    out_names = ["logits"]
    for i in range(n_layers):
        for kv in ("key", "value"):
            if past:
                in_names.append(f"past_key_values.{i}.{kv}")
            out_names.append(f"present.{i}.{kv}")
    bs = torch.export.Dim("batch_size", min=1, max=64)
    sl = torch.export.Dim("sequence_length", min=1, max=1024)
    pl = torch.export.Dim("past_sequence_length", min=0, max=1024)
    tl = torch.export.Dim("total_sequence_length", min=1, max=2048)
    rest = ([{0: bs, 1: sl}] if position_ids else []) + [{0: bs, 2: pl}] * len(pkv)
    args = (ids, am) + ((pos,) if position_ids else ()) + tuple(pkv)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        prog = torch.onnx.export(Wrapper(model), args, None, dynamo=True, input_names=in_names,
                                 output_names=out_names,
                                 dynamic_shapes=({0: bs, 1: sl}, {0: bs, 1: tl}, tuple(rest)),
                                 opset_version=18, optimize=True, verbose=False)
    prog.save(str(out), external_data=False)
    cap_ir_version(out)


def merge_decoders(no_past_path, with_past_path, out_path):
    """Merge a no-past and a with-past decoder into ONE graph with ``use_cache_branch`` bool[1]
    and an If node (then = with-past, else = no-past): the optimum / transformers.js
    ``decoder_model_merged.onnx`` layout.  Weights are stored once per branch (tiny models).
    (optimum.onnx.merge_decoders refuses torch.onnx.export graphs: present.* dim names differ.)
    """
    import onnx
    from onnx import helper

    m1, m2 = onnx.load(str(no_past_path)), onnx.load(str(with_past_path))
    names1 = [o.name for o in m1.graph.output]
    names2 = [o.name for o in m2.graph.output]
    assert names1 == names2, (names1, names2)
    outer_inputs = [i.name for i in m2.graph.input]
    assert {i.name for i in m1.graph.input} <= set(outer_inputs)

    def branch(model, prefix):
        g = onnx.GraphProto()
        g.CopyFrom(model.graph)
        keep = set(outer_inputs)

        def rn(name):
            return name if (not name or name in keep) else prefix + name

        for n in g.node:
            n.name = prefix + n.name
            n.input[:] = [rn(x) for x in n.input]
            n.output[:] = [rn(x) for x in n.output]
        for init in g.initializer:
            init.name = rn(init.name)
        for vi in g.value_info:
            vi.name = rn(vi.name)
        outs = []
        for o in g.output:
            o2 = onnx.ValueInfoProto()
            o2.CopyFrom(o)
            o2.name = rn(o.name)
            outs.append(o2)
        del g.output[:]
        g.output.extend(outs)
        del g.input[:]
        g.name = prefix.strip("_/") or "branch"
        return g

    then_g = branch(m2, "with_past/")
    else_g = branch(m1, "no_past/")
    outer_outs = []
    for o in m2.graph.output:
        v = onnx.ValueInfoProto()
        v.CopyFrom(o)
        if o.name.startswith("present"):
            v.type.tensor_type.shape.dim[2].dim_param = "total_sequence_length"
        outer_outs.append(v)
    if_node = helper.make_node("If", ["use_cache_branch"], names2, name="optimum::if",
                               then_branch=then_g, else_branch=else_g)
    ucb = helper.make_tensor_value_info("use_cache_branch", onnx.TensorProto.BOOL, [1])
    graph = helper.make_graph([if_node], "merged", list(m2.graph.input) + [ucb], outer_outs)
    opsets = {o.domain: o.version for o in list(m1.opset_import) + list(m2.opset_import)}
    model = helper.make_model(graph, producer_name="raymuter-tests",
                              opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    model.ir_version = min(max(m1.ir_version, m2.ir_version), MAX_IR_VERSION)
    onnx.checker.check_model(model)
    onnx.save(model, str(out_path))


def quantize_int8(src, dst):
    """int8 dynamic quantization of the weights (MatMulInteger), If subgraphs included."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8,
                     extra_options={"EnableSubgraph": True})
    cap_ir_version(dst)


def quantize_q4(src, dst, block_size=32):
    """4-bit weights (MatMulNBits, symmetric, blocks of 32), If subgraphs included, as
    transformers.js makes its ``*_q4.onnx`` exports (onnxruntime's MatMulNBitsQuantizer)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(src)), block_size=block_size, is_symmetric=True)
    quantizer.process()
    model = quantizer.model.model
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    onnx.save(model, str(dst), save_as_external_data=Path(src).stat().st_size > 2**30)


def convert_fp16(src, dst):
    """float16 weights AND float16 graph inputs/outputs (past, present, logits), as in
    transformers.js ``*_fp16.onnx`` exports; integer / bool inputs are unchanged."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    m = onnx.load(str(src))
    m16 = convert_float_to_float16(m, keep_io_types=False)
    m16.ir_version = min(m.ir_version, MAX_IR_VERSION)
    onnx.save(m16, str(dst))


def genai_command(hf_dir, out, cache_dir):
    return [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir),
            "-o", str(out), "-p", "fp32", "-e", "cpu", "-c", str(cache_dir)]


def run_logged(cmd, log_path, env=None):
    """Run ``cmd`` with stdout/stderr into ``log_path``; raise with the log tail on failure."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env if env is not None else offline_env()).returncode
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"command failed (rc={rc}): {' '.join(cmd)}\n--- {log_path} ---\n{tail}")


def build_genai(hf_dir, out, work_dir):
    """``python -m onnxruntime_genai.models.builder -i HF -o OUT -p fp32 -e cpu -c CACHE``."""
    work_dir = Path(work_dir)
    cache = work_dir / f"genai-cache-{Path(out).name}"
    try:
        run_logged(genai_command(hf_dir, out, cache), work_dir / f"{Path(out).name}.log")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def offline_env():
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


# --------------------------------------------------------------------------------------------
# whole build
# --------------------------------------------------------------------------------------------
def _stderr_progress(msg):
    print(msg, file=sys.stderr, flush=True)


def build_all(root, progress=_stderr_progress, seq2seq_root=None) -> dict[str, Path]:
    """Build every test model into ``root`` (not atomic; see :func:`ensure_test_models`), the
    encoder-decoders (:data:`SEQ2SEQ_DIRS`) into ``seq2seq_root`` (default: ``root`` too).

    Runs in this process (imports torch, transformers, optimum, onnx); the two genai builds
    run as subprocesses in parallel with the torch exports.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    s2s = Path(seq2seq_root) if seq2seq_root is not None else root
    s2s.mkdir(parents=True, exist_ok=True)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    for k, v in offline_env().items():
        os.environ.setdefault(k, v)
    lock = threading.Lock()

    def report(key, t0, extra=""):
        with lock:
            progress(f"[test-models] {key:<16} {time.time() - t0:6.1f}s{extra}")

    @contextlib.contextmanager
    def step(key, extra=""):
        t0 = time.time()
        yield
        report(key, t0, extra)

    t0 = time.time()
    import torch  # (timed here: the import dominates the first step)

    # one intra-op thread: the models are tiny, and on a busy 2-core machine a 2-thread OpenMP
    # pool waits for a time slice on every op (encoder-decoder exports 1.6-2.1 s -> 0.8-1.0 s)
    torch.set_num_threads(1)

    tok = build_tokenizer(TINY_VOCAB)
    for kind in ("llama", "qwen2", "gpt2"):
        n = build_tiny_hf(kind, root / "hf" / kind, tok)
        report(f"hf/{kind}", t0, f"  ({n} params)")
        t0 = time.time()

    # genai builds: subprocesses (own torch import), one after the other, in a thread, so
    # they overlap with the single-threaded torch exports below.
    genai_errors = []

    def genai_thread():
        for kind in ("llama", "qwen2"):
            t1 = time.time()
            try:
                build_genai(root / "hf" / kind, root / f"{kind}-genai", logs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                genai_errors.append(e)
                return
            report(f"{kind}-genai", t1)

    th = threading.Thread(target=genai_thread, name="genai-builder", daemon=True)
    th.start()
    try:
        for kind in ("llama", "qwen2", "gpt2"):
            with step(f"{kind}-optimum"):
                export_optimum(root / "hf" / kind, root / f"{kind}-optimum")

        with step("gpt2-grow"):
            export_decoder_dynamo(root / "hf" / "gpt2", root / "gpt2-grow" / "model.onnx",
                                  position_ids=False)
            copy_meta(root / "hf" / "gpt2", root / "gpt2-grow")

        with step("llama-merged"):
            d = root / "llama-merged"
            onnx_dir = d / "onnx"
            tmp = root / "tmp-merged"
            export_decoder_dynamo(root / "hf" / "llama", tmp / "decoder_model.onnx", past=False)
            export_decoder_dynamo(root / "hf" / "llama", tmp / "decoder_with_past_model.onnx")
            onnx_dir.mkdir(parents=True, exist_ok=True)
            merged = onnx_dir / "decoder_model_merged.onnx"
            merge_decoders(tmp / "decoder_model.onnx", tmp / "decoder_with_past_model.onnx", merged)
            shutil.rmtree(tmp)
            quantize_int8(merged, onnx_dir / "decoder_model_merged_quantized.onnx")
            convert_fp16(merged, onnx_dir / "decoder_model_merged_fp16.onnx")
            copy_meta(root / "hf" / "llama", d)

        for kind in SEQ2SEQ_KINDS:  # encoder-decoders: 0.1 s + one ~1 s export each
            t0 = time.time()
            n = build_seq2seq_hf(kind, s2s / "hf" / kind)
            report(f"hf/{kind}", t0, f"  ({n} params)")
            t0 = time.time()
            keys = export_seq2seq(kind, s2s / "hf" / kind, s2s, s2s / "tmp-export")
            report(f"{kind}-optimum", t0, f"  ({', '.join(keys)})")
        shutil.rmtree(s2s / "tmp-export", ignore_errors=True)
    finally:
        th.join()
    if genai_errors:
        raise genai_errors[0]

    paths = {k: root / v for k, v in MODEL_DIRS.items()}
    paths.update({k: s2s / v for k, v in SEQ2SEQ_DIRS.items()})
    missing = [k for k, p in paths.items() if not p.is_dir()]
    if missing:
        raise RuntimeError(f"build finished without {missing}")
    for f in sorted(set(root.rglob("*.onnx")) | set(s2s.rglob("*.onnx"))):
        cap_ir_version(f)
    return paths


# --------------------------------------------------------------------------------------------
# cache
# --------------------------------------------------------------------------------------------
def package_versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in VERSIONED_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def cache_key() -> str:
    """Hash of this file's source text and the versions of the packages that build the models."""
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    h.update(json.dumps(package_versions(), sort_keys=True).encode())
    h.update(f"python {sys.version_info[0]}.{sys.version_info[1]}".encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    env = os.environ.get("RAYMUTER_TEST_MODELS")
    return (Path(env).expanduser().absolute() if env
            else Path.home() / ".cache" / "raymuter" / "test-models")


def seq2seq_folder(folder) -> Path:
    """The encoder-decoders' folder next to a build folder: ``<folder>-seq2seq``.  (A sibling,
    not a subfolder: the decoder-only folder holds exactly the :data:`MODEL_DIRS` models.)"""
    folder = Path(folder)
    return folder.with_name(folder.name + "-seq2seq")


def _complete(folder: Path) -> bool:
    s2s = seq2seq_folder(folder)
    return ((folder / "manifest.json").is_file()
            and all((folder / v).is_dir() for v in MODEL_DIRS.values())
            and (s2s / "manifest.json").is_file()
            and all((s2s / v).is_dir() for v in SEQ2SEQ_DIRS.values()))


def ensure_test_models(root=None, *, progress=_stderr_progress,
                       seq2seq=False, vision=False) -> dict[str, Path]:
    """Paths of all test models (keys of :data:`MODEL_DIRS`, plus those of
    :data:`SEQ2SEQ_DIRS` with ``seq2seq=True``), building them only when missing.
    ``vision=True`` adds the vision-language models (``vision_builders.VISION_DIRS``: their own
    build, on demand, into the sibling ``<vision key>-vision``; see tests/vision_builders.py).

    Cache folder: ``$RAYMUTER_TEST_MODELS`` (else ``~/.cache/raymuter/test-models``) /
    :func:`cache_key`, the encoder-decoders in its sibling ``<cache_key>-seq2seq``; ONE build
    makes both.  The build runs in ONE worker subprocess (``python model_builders.py
    --build-into TMP``) into temporary sibling folders that are renamed into place when
    complete, under an ``fcntl`` lock so concurrent processes build once.  A failed build
    leaves its log at ``<cache root>/<key>.failed.log`` and raises ``RuntimeError``.
    """
    import fcntl

    base = Path(root).expanduser().absolute() if root is not None else cache_root()
    key = cache_key()
    final = base / key
    paths = {k: final / v for k, v in MODEL_DIRS.items()}
    if seq2seq:
        paths.update({k: seq2seq_folder(final) / v for k, v in SEQ2SEQ_DIRS.items()})
    if vision:
        paths.update(_vision_builders().ensure_vision_models(base, progress))
    if _complete(final):
        return paths
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f".{key}.lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        try:
            if _complete(final):  # built by another process while we waited
                return paths
            # we hold the lock: any leftover temp folder of this key is from a dead build
            for stale in base.glob(f".{key}.building-*"):
                shutil.rmtree(stale, ignore_errors=True)
            for old in (final, seq2seq_folder(final)):
                if old.exists():  # incomplete (files deleted by hand?): rebuild
                    shutil.rmtree(old)
            tmp = base / f".{key}.building-{os.getpid()}"
            tmp.mkdir()
            t0 = time.time()
            progress(f"[test-models] building into {final} (cache miss)")
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--build-into", str(tmp)],
                stdin=subprocess.DEVNULL, env=offline_env(), timeout=1800)
            if proc.returncode != 0 or not _complete(tmp):
                failed_log = base / f"{key}.failed.log"
                log = tmp / "logs" / "build.log"
                if log.exists():
                    shutil.copy2(log, failed_log)
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(seq2seq_folder(tmp), ignore_errors=True)
                raise RuntimeError(f"test model build failed (rc={proc.returncode}); "
                                   f"log: {failed_log}")
            os.rename(seq2seq_folder(tmp), seq2seq_folder(final))
            os.rename(tmp, final)
            progress(f"[test-models] all built in {time.time() - t0:.1f}s -> {final}")
        finally:
            fcntl.flock(lockf, fcntl.LOCK_UN)
    return paths


def _vision_builders():
    """tests/vision_builders.py, imported whatever the import mode (it builds on demand)."""
    import importlib.util

    mod = sys.modules.get("vision_builders")
    if mod is None:
        spec = importlib.util.spec_from_file_location("vision_builders", Path(__file__).with_name("vision_builders.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["vision_builders"] = mod
        spec.loader.exec_module(mod)
    return mod


def _worker(tmp: Path) -> int:
    """Subprocess body: build into ``tmp``; library noise goes to ``tmp/logs/build.log``,
    progress lines to the original stderr."""
    import traceback

    t0 = time.time()
    (tmp / "logs").mkdir(parents=True, exist_ok=True)
    progress_fd = os.dup(2)
    progress_out = os.fdopen(progress_fd, "w", buffering=1)
    log = open(tmp / "logs" / "build.log", "w", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)

    def progress(msg):
        progress_out.write(msg + "\n")
        print(msg, flush=True)  # into the log too

    try:
        paths = build_all(tmp, progress=progress, seq2seq_root=seq2seq_folder(tmp))
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        sys.stderr.flush()
        progress_out.write("[test-models] BUILD FAILED:\n"
                           + "".join(traceback.format_exc()[-3000:]) + "\n")
        return 1
    for folder, dirs in ((tmp, MODEL_DIRS), (seq2seq_folder(tmp), SEQ2SEQ_DIRS)):
        manifest = {
            "models": {k: str(paths[k].relative_to(folder)) for k in dirs},
            "versions": package_versions(),
            "cache_key": cache_key(),
            "build_seconds": round(time.time() - t0, 1),
            "files": sorted(str(f.relative_to(folder)) for f in folder.rglob("*")
                            if f.is_file() and f.parts[len(folder.parts)] != "logs"),
        }
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return 0


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", help="cache root (default $RAYMUTER_TEST_MODELS or "
                                   "~/.cache/raymuter/test-models)")
    ap.add_argument("--key", choices=sorted({**MODEL_DIRS, **SEQ2SEQ_DIRS}),
                    help="print only this model's folder")
    ap.add_argument("--build-into", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.build_into:
        return _worker(Path(a.build_into))
    paths = ensure_test_models(a.root, seq2seq=True)
    if a.key:
        print(paths[a.key])
    else:
        print(json.dumps({k: str(v) for k, v in paths.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
