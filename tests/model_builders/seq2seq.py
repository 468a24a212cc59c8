"""The tiny encoder-decoder test models (Marian, T5, BART, Whisper): configs, tokenizers,
random weights, and optimum's export sorted into the layouts the engine serves.

Keys of :data:`SEQ2SEQ_DIRS`, relative folders under the SIBLING folder ``<cache folder>-seq2seq``,
built by :func:`model_builders.text.build_all` with the decoder-only models (one worker, one key;
``model_builders.text.ensure_test_models(seq2seq=True)``).  d_model 64, 2 encoder + 2 decoder layers,
4 heads of 16, vocab 1000, random weights as in :data:`SEQ2SEQ_INIT` (greedy output depends on
the source):

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
"""
from __future__ import annotations

import shutil
from pathlib import Path

from .common import SEED, TINY_VOCAB, copy_hf_files, tiny_corpus

#: encoder-decoder key -> folder relative to the SEQ2SEQ cache folder (``text.seq2seq_folder``)
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

    corpus = list(corpus if corpus is not None else tiny_corpus())

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
