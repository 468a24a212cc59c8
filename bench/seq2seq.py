"""Text-to-text and speech-to-text throughput: raymuter against transformers on models of
realistic size.

The model: MarianMTModel with opus-mt's shape (d_model 512, 6 + 6 layers, 8 heads, FFN 2048)
and a 32000-token vocabulary, random weights (~60M parameters), exported with optimum
(`encoder_model.onnx` + `decoder_model_merged.onnx`); built once into
$RAYMUTER_BENCH_MODELS/marian (default ~/.cache/raymuter/bench-models). Each system translates
`--batch` sources of `--source` random tokens into exactly `--new` tokens (eos and the forced
eos off, so every row runs to the limit), greedy, the systems alternating, best of the repeats.
Prints sources/s and tokens/s and the ratio to transformers; target: >= 2x at batch 8.
`--task speech`: a Whisper-base shaped model (d_model 512, 6 + 6 layers, 80 mels, 30 s windows,
vocabulary 51865, ~72M parameters, random weights), clips of 30 s of noise, the decoder
prompt <|startoftranscript|> alone (a random model has no languages to detect).

    PYTHONPATH=. python bench/seq2seq.py                 # text, batch 1 and 8: ~3 min on 2 cores
    PYTHONPATH=. python bench/seq2seq.py --task speech   # ~6 min (the first run exports the model)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import generation  # noqa: E402
from generation.runtime.encoders import encode_text  # noqa: E402


def build(root: Path) -> Path:
    """ROOT/marian/{hf,optimum}, built when missing."""
    import models as bench_models

    base = root / "marian"
    hf, optimum = base / "hf", base / "optimum"
    if (optimum / "decoder_model_merged.onnx").exists():
        return base
    import torch
    import transformers as tf
    from optimum.exporters.onnx import main_export

    shutil.rmtree(base, ignore_errors=True)
    config = tf.MarianConfig(vocab_size=32000, d_model=512, encoder_layers=6, decoder_layers=6,
                             encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048,
                             decoder_ffn_dim=2048, max_position_embeddings=512, pad_token_id=31999,
                             eos_token_id=0, decoder_start_token_id=31999, forced_eos_token_id=0)
    torch.manual_seed(0)
    model = tf.MarianMTModel(config).eval()
    model.save_pretrained(hf)
    bench_models.builders().common.build_tokenizer().save_pretrained(hf)
    print(f"[bench-models] marian: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters",
          file=sys.stderr)
    main_export(str(hf), output=str(optimum), task="text2text-generation-with-past", library_name="transformers",
                local_files_only=True, do_validation=False)
    for extra in ("decoder_model.onnx", "decoder_with_past_model.onnx"):
        (optimum / extra).unlink(missing_ok=True)
    return base


def build_whisper(root: Path) -> Path:
    """ROOT/whisper/{hf,optimum}, built when missing."""
    base = root / "whisper"
    hf, optimum = base / "hf", base / "optimum"
    if (optimum / "decoder_model_merged.onnx").exists():
        return base
    import torch
    import transformers as tf
    from optimum.exporters.onnx import main_export

    shutil.rmtree(base, ignore_errors=True)
    config = tf.WhisperConfig(vocab_size=51865, d_model=512, encoder_layers=6, decoder_layers=6,
                              encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048,
                              decoder_ffn_dim=2048, num_mel_bins=80, max_source_positions=1500,
                              max_target_positions=448, decoder_start_token_id=50258, eos_token_id=50257,
                              pad_token_id=50257, bos_token_id=50257, suppress_tokens=None, begin_suppress_tokens=None)
    torch.manual_seed(0)
    model = tf.WhisperForConditionalGeneration(config).eval()
    model.save_pretrained(hf)
    tf.WhisperFeatureExtractor(feature_size=80).save_pretrained(hf)
    print(f"[bench-models] whisper: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters",
          file=sys.stderr)
    main_export(str(hf), output=str(optimum), task="automatic-speech-recognition-with-past",
                library_name="transformers", local_files_only=True, do_validation=False)
    for extra in ("decoder_model.onnx", "decoder_with_past_model.onnx"):
        (optimum / extra).unlink(missing_ok=True)
    return base


def speech_systems(base: Path, args, batch: int):
    import torch
    import transformers as tf

    from generation.families.whisper.audio import whisper_features
    from generation.runtime.encoders import encode_audio

    hf = tf.WhisperForConditionalGeneration.from_pretrained(base / "hf").eval()
    model = generation.load(base / "optimum", threads=args.threads, provider="cpu")
    ctx = generation.context(model, max_new_tokens=args.new, eos_token_id=[], do_sample=False)
    clips = [np.random.default_rng(i).standard_normal(480000).astype(np.float32) * 0.1 for i in range(batch)]
    start = hf.config.decoder_start_token_id

    def ours():
        features = whisper_features(clips).features
        return np.array(generation.generate(ctx, [[start]] * batch, encoder=encode_audio(model, features)))

    def theirs():
        features = torch.from_numpy(whisper_features(clips).features)
        with torch.inference_mode():
            out = hf.generate(features, decoder_input_ids=torch.full((batch, 1), start), max_new_tokens=args.new,
                              min_new_tokens=args.new, do_sample=False, num_beams=1)
        return out[:, -args.new:].numpy()
    return ours, theirs


def compare(ours, theirs, batch: int, args) -> list[tuple]:
    """Both systems alternating, best of the repeats after one warm-up round: table rows."""
    best, tokens = {}, {}
    for rep in range(args.repeats + 1):
        for name, run in (("raymuter", ours), ("transformers", theirs)):
            t0 = time.perf_counter()
            tokens[name] = run()
            elapsed = time.perf_counter() - t0
            if rep and (name not in best or elapsed < best[name]):
                best[name] = elapsed
    same = "yes" if np.array_equal(tokens["raymuter"], tokens["transformers"]) else "no"
    return [(batch, name, batch / best[name], batch * args.new / best[name], best["transformers"] / best[name], same)
            for name in ("raymuter", "transformers")]


def table(title: str, unit: str, rows) -> None:
    print(f"\n## {title}\n")
    print(f"| batch | system | {unit} | tokens/s | x transformers | same tokens |\n|---|---|---|---|---|---|")
    for batch, name, per_source, tps, ratio, same in rows:
        print(f"| {batch} | {name} | {per_source:.2f} | {tps:.1f} | {ratio:.2f} | {same} |")
    print("\nTarget: >= 2x transformers at batch 8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--source", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--task", choices=["text", "speech"], default="text")
    args = parser.parse_args()
    root = Path(os.environ.get("RAYMUTER_BENCH_MODELS") or Path.home() / ".cache" / "raymuter" / "bench-models")
    if args.task == "speech":
        return speech_main(build_whisper(root.expanduser()), args)
    base = build(root.expanduser())

    import torch
    import transformers as tf

    torch.set_num_threads(args.threads)
    hf = tf.MarianMTModel.from_pretrained(base / "hf").eval()
    model = generation.load(base / "optimum", threads=args.threads, provider="cpu")
    ctx = generation.context(model, max_new_tokens=args.new, eos_token_id=[], forced_eos_token_id=None,
                             do_sample=False)
    rows = []
    for batch in [int(b) for b in args.batch.split(",")]:
        sources = np.random.default_rng(0).integers(3, 31000, (batch, args.source)).tolist()
        sources = [s + [0] for s in sources]

        def ours():
            encoder = encode_text(model, sources)
            return np.array(generation.generate(ctx, [[31999]] * batch, encoder=encoder))

        def theirs():
            ids = torch.tensor(sources)
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                                  min_new_tokens=args.new, do_sample=False, num_beams=1, forced_eos_token_id=None)
            return out[:, 1:].numpy()

        rows += compare(ours, theirs, batch, args)
    table(f"Text-to-text (Marian-base shape, random weights; source {args.source}, {args.new} new tokens, "
          f"greedy, {args.threads} threads, best of {args.repeats})", "sources/s", rows)
    return 0


def speech_main(base: Path, args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    rows = []
    for batch in [int(b) for b in args.batch.split(",")]:
        ours, theirs = speech_systems(base, args, batch)
        rows += compare(ours, theirs, batch, args)
    table(f"Speech-to-text (Whisper-base shape, random weights; 30 s clips, {args.new} new tokens, greedy, "
          f"{args.threads} threads, best of {args.repeats}; features + encoder + decoder)", "clips/s", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
