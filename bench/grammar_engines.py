"""llguidance against xgrammar on what our loop asks of a grammar engine, side by side in one run.

Each step of a batch of 8 rows under one JSON schema (bench/structured.py's) asks the engine for
every row's token mask over the ~125M bench model's 32000 ids, then the row's token is consumed;
the rows follow the tokens of JSON texts that match the schema, so every step is a real one. The
table gives each engine's milliseconds per step (all 8 masks, and the 8 tokens consumed) and its
compile time for the schema (tokenizer setup apart), the median of --rounds.

xgrammar needs torch, transformers and triton at run time, which Raymuter's image does not
have, so it is not a dependency: run this in a venv of its own,

    python -m venv /tmp/xg && /tmp/xg/bin/pip install torch==2.13.0 xgrammar llguidance transformers
    /tmp/xg/bin/python bench/grammar_engines.py --tokenizer ~/.cache/raymuter/bench-models/small/hf
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "note"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 130},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
                         "note": {"type": "string", "maxLength": 2000}}}
TEXTS = [json.dumps({"name": f"row {i}", "age": 20 + i, "tags": ["red", "blue"][:i % 3],
                     "note": "the quick brown fox jumps over the lazy dog " * 3}) for i in range(8)]


def run_llguidance(tokenizer_json: str, vocab: int, eos: int, tokens: list[list[int]]) -> tuple[float, float]:
    import llguidance
    import llguidance.numpy as lnp
    import numpy as np

    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    template = llguidance.LLMatcher(tok, grammar, log_level=0)
    compile_s = time.perf_counter() - started
    matchers = [template.deep_copy() for _ in tokens]
    executor = llguidance.LLExecutor()
    mask = lnp.allocate_token_bitmask(len(tokens), vocab)
    steps = min(len(t) for t in tokens)
    started = time.perf_counter()
    for j in range(steps):
        lnp.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)
        np.unpackbits(mask.view(np.uint8), axis=1, count=vocab, bitorder="little")  # as constrain() reads it
        for m, row in zip(matchers, tokens):
            assert m.consume_token(row[j]), m.get_error()
    return (time.perf_counter() - started) / steps, compile_s


def run_xgrammar(hf_dir: str, vocab: int, tokens: list[list[int]]) -> tuple[float, float]:
    import transformers
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(transformers.AutoTokenizer.from_pretrained(hf_dir), vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    compile_s = time.perf_counter() - started
    matchers = [xgr.GrammarMatcher(compiled) for _ in tokens]
    mask = xgr.allocate_token_bitmask(len(tokens), vocab)
    steps = min(len(t) for t in tokens)
    started = time.perf_counter()
    for j in range(steps):
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)
        mask.numpy()  # the mask as our numpy loop would read it
        for m, row in zip(matchers, tokens):
            assert m.accept_token(row[j])
    return (time.perf_counter() - started) / steps, compile_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", default=str(Path.home() / ".cache/raymuter/bench-models/small/hf"),
                        help="a Hugging Face folder with tokenizer.json")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    folder = Path(args.tokenizer).expanduser()
    text = (folder / "tokenizer.json").read_text()
    tokenizer = Tokenizer.from_str(text)
    eos = json.loads((folder / "config.json").read_text()).get("eos_token_id", 2)
    tokens = [tokenizer.encode(t, add_special_tokens=False).ids for t in TEXTS]
    rows = {"llguidance": [], "xgrammar": []}
    for _ in range(args.rounds):  # alternating, so both see the same machine
        rows["llguidance"].append(run_llguidance(text, args.vocab, eos, tokens))
        rows["xgrammar"].append(run_xgrammar(str(folder), args.vocab, tokens))
    base = statistics.median(s for s, _ in rows["llguidance"])
    print(f"## Grammar engines: 8 rows, one JSON schema, {args.vocab} ids (median of {args.rounds})\n")
    print("| engine | ms per step (8 masks + 8 tokens) | ratio | schema compile ms |")
    print("|---|---|---|---|")
    for name, results in rows.items():
        step = statistics.median(s for s, _ in results)
        compile_ms = statistics.median(c for _, c in results) * 1e3
        print(f"| {name} | {step * 1e3:.3f} | {step / base:.2f} | {compile_ms:.1f} |")


if __name__ == "__main__":
    main()
