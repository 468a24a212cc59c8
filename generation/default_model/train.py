"""Train the default model that ships with Raymuter, from text every Python install already has.

    python -m generation.default_model.train --out generation/default_model/files --seed 0

Data (no download): the Python documentation CPython ships in `pydoc_data/topics.py` (what
`help("assert")` shows), the docstrings of the builtins, and the docstrings of the standard
library's own modules, classes and functions (read with `ast`, nothing imported). All of it is
under the PSF licence. A third of the documents are written as one-turn chats
("user: What does json.dumps do?\\nassistant: <docstring>") so the chat template means something.

Steps: corpus -> byte-level BPE tokenizer (`tokenizers`) -> a small Llama trained with AdamW
(tqdm bar) -> loss curves (CSV and PNG) -> fp16 checkpoint -> ONNX exports
(`generation.default_model.export`) -> model card. Deterministic for a seed on one machine and thread
count (same Python version, same package versions).

torch, transformers, onnx and matplotlib are imported only here, lazily: install them with
`pip install 'raymuter[cpu,train]'`.
"""

from __future__ import annotations

import argparse
import ast
import csv
import hashlib
import json
import math
import os
import re
import sys
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

PAD, BOS, EOS = "<pad>", "<s>", "</s>"  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}assistant: {{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ message['role'] }}: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
# Generation defaults written to generation_config.json: every field is one the engine applies.
GENERATION_DEFAULTS = dict(do_sample=True, temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.15,
                           max_new_tokens=128)
_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class Shape:
    """The model: a Llama with grouped-query attention and tied embeddings (2.4M parameters)."""

    vocab_size: int = 4096
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512


@dataclass(frozen=True)
class Schedule:
    """Optimisation: AdamW, linear warm-up then cosine decay to a tenth of the peak."""

    steps: int = 600
    batch_size: int = 16
    seq_len: int = 512
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    eval_every: int = 25


def _require(*modules: str):
    import importlib

    try:
        return [importlib.import_module(m) for m in modules]
    except ImportError as e:
        raise SystemExit(f"train_default needs {e.name}: pip install 'raymuter[cpu,train]' "
                         "(install torch==2.13.0 first on CPU machines)") from None


# --------------------------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------------------------
def _clean(text: str) -> str:
    return re.sub(r"\n{3,}", "\n\n", text.strip())


def _topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return [(f"topic:{name}", _clean(text)) for name, text in sorted(topics.items())]


def _builtin_docs() -> list[tuple[str, str]]:
    """Docstrings of the builtins and their methods (`list`, `list.append`, ...)."""
    import builtins

    docs = []
    for name in sorted(dir(builtins)):
        obj = getattr(builtins, name)
        if name.startswith("_") or not callable(obj):
            continue
        docs.append((name, obj.__doc__ or ""))
        if isinstance(obj, type):
            for attr in sorted(vars(obj)):
                if not attr.startswith("_"):
                    docs.append((f"{name}.{attr}", getattr(vars(obj)[attr], "__doc__", None) or ""))
    return [(n, _clean(d)) for n, d in docs]


def _source_docs(root: Path) -> list[tuple[str, str]]:
    """Module, class and function docstrings of the standard library's .py files under `root`."""
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_DIRS & set(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")

        def visit(node, prefix):
            doc = ast.get_docstring(node)
            if doc:
                docs.append((prefix, _clean(doc)))
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit(child, f"{prefix}.{child.name}")

        visit(tree, module)
    return docs


def documents() -> list[tuple[str, str]]:
    """(name, text) of every document, in a fixed order; repeated texts and stubs dropped."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    seen, out = set(), []
    for name, text in _topics() + _builtin_docs() + _source_docs(stdlib):
        if len(text) >= 40 and text not in seen:
            seen.add(text)
            out.append((name, text))
    return out


def _crc(*parts: str) -> int:
    return zlib.crc32("\0".join(parts).encode())


def as_text(name: str, text: str) -> str:
    """A document as the model sees it: plain, or (a third of them) a one-turn chat."""
    if _crc("chat", name) % 3:
        return text
    if name.startswith("topic:"):
        question = f"What does the Python documentation say about {name[6:].replace('-', ' ')}?"
    else:
        question = f"What does {name} do?"
    return f"user: {question}\nassistant: {text}"


def split(docs: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """Training and validation texts: one document in 20 is held out, chosen by its name."""
    train, val = [], []
    for name, text in docs:
        (val if _crc("val", name) % 20 == 0 else train).append(as_text(name, text))
    return train, val


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE on `texts`: <pad> 0, <s> 1, </s> 2; encoding prepends <s> (as Llama)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the corpus filled {tok.get_vocab_size()} of {vocab_size} tokens")
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, 1)])
    return tok


def encode(tok, texts: list[str]):
    """One int32 stream: <s> document </s> <s> document </s> ..."""
    import numpy as np

    ids = [[1] + e.ids + [2] for e in tok.encode_batch(texts, add_special_tokens=False)]
    return np.concatenate([np.asarray(i, dtype=np.int32) for i in ids])


# --------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------
def hf_config(shape: Shape):
    from transformers import LlamaConfig

    return LlamaConfig(**asdict(shape), tie_word_embeddings=True, rope_theta=10000.0, initializer_range=0.02,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)


def learning_rate(step: int, s: Schedule) -> float:
    """Linear warm-up over `s.warmup` steps, then cosine from `s.lr` down to `s.lr / 10`."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    done = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def _windows(ids, starts, length: int):
    """ids [N] int32, starts [B] -> torch int64 [B, length]: the token windows at `starts`."""
    import numpy as np
    import torch

    return torch.from_numpy(ids[starts[:, None] + np.arange(length)].astype(np.int64))


def evaluate(model, val_ids, s: Schedule) -> float:
    """Mean next-token cross-entropy over the validation stream, in windows of `s.seq_len + 1`."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    starts = np.arange(0, len(val_ids) - s.seq_len - 1, s.seq_len)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(starts), s.batch_size):
            x = _windows(val_ids, starts[i:i + s.batch_size], s.seq_len + 1)
            logits = model(input_ids=x[:, :-1]).logits
            total += float(F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum"))
            count += x[:, 1:].numel()
    model.train()
    return total / count


def train(shape: Shape, s: Schedule, train_ids, val_ids, seed: int):
    """Train from scratch; returns the model (fp32) and one history row per step."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config(shape)).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(seed)
    history, val_loss = [], float("nan")
    started = time.perf_counter()
    bar = tqdm(range(s.steps), desc="training", unit="step", dynamic_ncols=True, file=sys.stderr)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, s)
        x = _windows(train_ids, rng.integers(0, len(train_ids) - s.seq_len - 1, s.batch_size), s.seq_len + 1)
        logits = model(input_ids=x[:, :-1]).logits  # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = float(loss.detach())
        last = step == s.steps - 1
        val = evaluate(model, val_ids, s) if (step + 1) % s.eval_every == 0 or last else None
        val_loss = val if val is not None else val_loss
        elapsed = time.perf_counter() - started
        history.append({"step": step + 1, "tokens": (step + 1) * s.batch_size * s.seq_len,
                        "lr": learning_rate(step, s), "train_loss": loss, "val_loss": val,
                        "seconds": round(elapsed, 1)})
        bar.set_postfix(loss=f"{loss:.3f}", val=f"{val_loss:.3f}",
                        tok_s=f"{history[-1]['tokens'] / elapsed:.0f}")
    bar.close()
    return model, history


def write_curves(history: list[dict], out: Path) -> None:
    """loss_curves.csv (every step) and loss_curves.png (training loss, smoothed, and validation)."""
    with open(out / "loss_curves.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(history[0]))
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in row.items()} for row in history)
    (matplotlib,) = _require("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    train = [r["train_loss"] for r in history]
    smooth, ema = [], train[0]
    for v in train:
        ema = 0.9 * ema + 0.1 * v
        smooth.append(ema)
    evals = [(r["step"], r["val_loss"]) for r in history if r["val_loss"] is not None]
    fig, ax = plt.subplots(figsize=(6.4, 4), dpi=100)
    ax.plot(steps, train, color="tab:blue", alpha=0.25, linewidth=0.8, label="training (per step)")
    ax.plot(steps, smooth, color="tab:blue", label="training (smoothed)")
    ax.plot(*zip(*evals), "o-", color="tab:orange", markersize=3, label="validation")
    ax.set_xlabel(f"step ({history[0]['tokens']} tokens each)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(bottom=min(min(train), min(v for _, v in evals)) - 0.2, top=min(9.0, max(train) + 0.2))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png")
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# checkpoint, card, command
# --------------------------------------------------------------------------------------------
def save_checkpoint(model, tok, shape: Shape, out: Path) -> None:
    """config.json, generation_config.json, model.safetensors (float16), tokenizer files."""
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, **GENERATION_DEFAULTS)
    model.to(torch.float16).save_pretrained(out)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=shape.max_position_embeddings, chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(out)


SAMPLE_PROMPTS = ("The list type", "A context manager", "Exceptions are raised when",
                  "user: What does json.dumps do?\nassistant:")


def samples(folder: Path, max_new_tokens: int = 60) -> list[dict]:
    """Completions of SAMPLE_PROMPTS by Raymuter on the exported model: greedy, and sampled with
    the defaults of generation_config.json (seed 0)."""
    import generation
    from generation.text.tokenizer import model_tokenizer

    model = generation.load(folder)
    tok = model_tokenizer(model)
    prompts = [tok.encode(p).ids for p in SAMPLE_PROMPTS]
    rows = []
    for mode, settings in (("greedy", {"do_sample": False}), ("sampled", {})):
        ctx = generation.compile(generation.context(model, max_new_tokens=max_new_tokens, **settings),
                                 batch_size=len(prompts))
        out = generation.generate(ctx, prompts, seeds=[0] * len(prompts))
        rows += [{"mode": mode, "prompt": p, "completion": tok.decode(r, skip_special_tokens=True),
                  "tokens": len(r), "eos": len(r) < max_new_tokens} for p, r in zip(SAMPLE_PROMPTS, out)]
    return rows


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write_card(out: Path, info: dict) -> None:
    """README.md of the model folder, from training.json's numbers and the samples."""
    card = Path(__file__).with_name("card.md").read_text()
    quote = []
    for s in info["samples"]:
        text = (s["prompt"] + s["completion"]).replace("\n", "\n> ")
        end = "eos" if s["eos"] else "limit"
        quote.append(f"**{s['mode']}** ({s['tokens']} tokens, stopped at {end}):\n\n> {text}\n")
    shape = info["shape"]
    fields = {**info, **shape, **info["schedule"], "samples": "\n".join(quote),
              "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
              "minutes": f"{info['seconds']['total'] / 60:.1f}", "train_minutes": f"{info['seconds']['train'] / 60:.1f}",
              "params_m": f"{info['parameters'] / 1e6:.2f}", "size_mb": f"{info['bytes'] / 1e6:.1f}",
              "tokens_m": f"{info['tokens_seen'] / 1e6:.1f}", "epochs": f"{info['tokens_seen'] / info['train_tokens']:.1f}",
              "val_loss": f"{info['val_loss_fp16']:.3f}", "val_ppl": f"{math.exp(info['val_loss_fp16']):.1f}",
              "val_loss_fp32": f"{info['val_loss_fp32']:.4f}", "train_loss": f"{info['train_loss_last']:.3f}",
              "train_ppl": f"{math.exp(info['train_loss_last']):.1f}", "train_chars_m": f"{info['train_chars'] / 1e6:.2f}"}
    (out / "README.md").write_text(card.format(**fields))


def run(out: Path, seed: int, steps: int, threads: int, export: bool = True) -> dict:
    """The whole build into `out`; returns what training.json records."""
    torch, _, _, _ = _require("torch", "transformers", "tqdm", "onnx")
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    shape, schedule = Shape(), Schedule(steps=steps)
    out.mkdir(parents=True, exist_ok=True)
    seconds, t0 = {}, time.perf_counter()

    docs = documents()
    train_texts, val_texts = split(docs)
    tok = train_tokenizer(train_texts, shape.vocab_size)
    train_ids, val_ids = encode(tok, train_texts), encode(tok, val_texts)
    seconds["data"] = time.perf_counter() - t0
    print(f"[train] {len(docs)} documents: {len(train_ids)} training and {len(val_ids)} validation tokens "
          f"({seconds['data']:.1f} s)", file=sys.stderr)

    model, history = train(shape, schedule, train_ids, val_ids, seed)
    seconds["train"] = time.perf_counter() - t0 - seconds["data"]
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())  # the float16 checkpoint, computed in float32
    val_fp16 = evaluate(model, val_ids, schedule)
    save_checkpoint(model, tok, shape, out)
    write_curves(history, out)
    print(f"[train] validation loss {history[-1]['val_loss']:.4f} (float32), {val_fp16:.4f} (float16 weights), "
          f"perplexity {math.exp(val_fp16):.2f}", file=sys.stderr)
    info = {"seed": seed, "threads": threads, "shape": asdict(shape), "schedule": asdict(schedule),
            "parameters": sum(p.numel() for p in model.parameters()), "documents": len(docs),
            "train_tokens": len(train_ids), "val_tokens": len(val_ids),
            "train_chars": sum(map(len, train_texts)), "val_chars": sum(map(len, val_texts)),
            "tokens_seen": history[-1]["tokens"], "train_loss_last": sum(r["train_loss"] for r in history[-20:]) / 20,
            "val_loss_fp32": history[-1]["val_loss"], "val_loss_fp16": val_fp16,
            "corpus_sha256": hashlib.sha256("\0".join(train_texts + val_texts).encode()).hexdigest(),
            "python": sys.version.split()[0], "torch": torch.__version__}
    if export:
        from .export import export_all

        started = time.perf_counter()
        export_all(out)
        seconds["export"] = time.perf_counter() - started
        info["samples"] = samples(out / "genai")
    seconds["total"] = time.perf_counter() - t0
    info["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    info["bytes"] = _size(out)
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    if export:
        write_card(out, info)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m generation.default_model.train", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="model folder to write (e.g. generation/default_model/files)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=Schedule.steps, help="optimiser steps (default %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s; results are "
                        "deterministic for a seed and a thread count)")
    parser.add_argument("--no-export", action="store_true", help="stop after the checkpoint and the loss curves")
    parser.add_argument("--card", action="store_true", help="only rewrite OUT/README.md from OUT/training.json")
    args = parser.parse_args(argv)
    if args.card:
        write_card(args.out, json.loads((args.out / "training.json").read_text()))
        return 0
    # Idle OpenMP threads sleep instead of spinning: on 2 cores shared with other work, spinning
    # threads made training 6x slower. Set before torch starts its thread pool.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    info = run(args.out, args.seed, args.steps, args.threads, export=not args.no_export)
    print(f"[train] done in {info['seconds']['total'] / 60:.1f} min; {args.out} holds {info['bytes'] / 1e6:.1f} MB",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
