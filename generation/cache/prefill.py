"""Running prompts through the decoder: the cache and last logits of fresh rows (prefill).

A prompt runs in one step (`whole`) or in the seed's power-of-two pieces (45 tokens as 32, 8,
4, 1). Rows are right-padded: a row's real tokens come first, so its valid cache is always the
prefix [0, length) and the padding rows after it are free rows that later steps overwrite. The
next token of a row comes from the logits of its last real token.

How rows share a run depends on what the graph allows:
- `append` (position_ids, the mask hides holes): all rows in one run per piece.
- `grow` (positions from the cache length): rows of equal length in one run, group by group.
- `in_place`: as `append`, all rows in one run.
A graph under int8 dynamic quantization (`graph.prompts_by_length`) runs its prompts as `grow` does,
rows of one length together: its activation scale spans each row's positions
(runtime/int8_rows.py), which padding positions would enter.
A graph with GroupQueryAttention batches its first piece, but onnxruntime refuses a later piece
longer than one token for more than one row ("batch_size must be 1 when sequence_length > 1 and
past context is given"), so there the later pieces run row by row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runtime.feeds import last_read, pieces, prompt_widths, step_inputs
from ..runtime.graph import DecoderGraph


@dataclass
class PromptCache:
    """Prefill results for n rows: each row's cache, per cache input name an array
    [heads, length, head_dim] (views into the run's presents), and its last logits [n, V]."""

    rows: list[dict[str, np.ndarray]]
    lengths: np.ndarray
    last_logits: np.ndarray
    cached: np.ndarray | None = None  # [n] tokens of each prompt taken from a prefix cache


def run_rows(session, graph: DecoderGraph, prompts: list[list[int]], widths: list[int], pad: int,
              max_position: int, past: dict[str, np.ndarray] | None = None, offset: int = 0,
              embed=None, images=None, on_logits=None, lora: dict | None = None):
    """Run `prompts` from token `offset` in steps of `widths`; past holds the first `offset`
    tokens of each row. Returns (last logits [n, V] of rows whose prompt ended here, presents).
    A graph that takes inputs_embeds embeds each piece with `embed`, the image features of
    `images` (vision.PromptImages, one row per prompt) in place of its image tokens.
    `on_logits(logits [n, width, V], offset)` sees every piece's logits before they go (prompt
    log-probabilities read them: logits/prompt_logprobs.py). `lora`: the rows' adapter inputs
    (runtime.lora.bank.LoraBank.feeds), for a model with adapters."""
    n = len(prompts)
    lengths = np.array([len(p) for p in prompts])
    if past is None:
        past = {e.past: np.zeros((n, e.heads, 0, e.head_dim), graph.cache_dtype) for e in graph.cache}
    names = ["logits"] + [e.present for e in graph.cache]
    last = np.zeros((n, graph.vocab_size), np.float32)
    for width in widths:
        real = np.clip(lengths - offset, 0, width)
        ids = np.full((n, width), pad, np.int64)
        for b, prompt in enumerate(prompts):
            ids[b, :real[b]] = prompt[offset:offset + real[b]]
        mask = np.ones((n, offset + width), np.int64)
        mask[:, :offset] = np.arange(offset) < lengths[:, None]  # holes of rows that ended earlier
        positions = np.broadcast_to(np.minimum(offset + np.arange(width), max_position - 1), (n, width))
        embeds = None
        if graph.has_inputs_embeds:
            embeds = embed(ids) if images is None else images.embeddings(embed, ids, real, prompts, offset)
            if images is not None and graph.position_axes == 3:
                positions = images.piece_positions(positions, real, offset)
        # the graph's LM head at each row's last token only, where it can and no one reads the rest
        read = last_read(lengths, offset, width) if graph.has_logits_positions and on_logits is None else None
        feeds = step_inputs(graph, ids, mask, positions, offset, embeds, read)
        feeds.update(past)
        feeds.update(lora or graph.no_adapter(n))
        logits, *presents = session.run(names, feeds)
        ends = np.flatnonzero((lengths > offset) & (lengths <= offset + width))
        last[ends] = logits[ends, 0] if read is not None else logits[ends, lengths[ends] - offset - 1]
        if on_logits is not None:
            on_logits(logits, offset)
        del logits  # all-position logits are large: drop them before the next piece
        past = {e.past: p for e, p in zip(graph.cache, presents)}
        offset += width
    return last, past


def run_from(session, graph: DecoderGraph, prompt: list[int], offset: int, past: dict[str, np.ndarray], steps: str,
             pad: int, max_position: int, embed=None, images=None, lora: dict | None = None):
    """One prompt's tokens from `offset` on, after `past` (its first `offset` tokens' cache,
    [1, heads, offset, head_dim] per input: a cached prefix), in `steps`: (last logits [1, V],
    presents [1, heads, len(prompt), head_dim] per cache input). embed, images: as run_prompts'
    (a vision-language prompt's embedding and its PromptImages, one row)."""
    return run_rows(session, graph, [prompt], prompt_widths(len(prompt) - offset, steps), pad, max_position,
                     past, offset, embed=embed, images=images, lora=lora)


def run_prompts(session, graph: DecoderGraph, mode: str, steps: str, prompts: list[list[int]],
                pad: int, max_position: int, embed=None, images=None, lora=None) -> PromptCache:
    """Prefill non-empty `prompts` for cache `mode` with `steps` ('whole' or 'pieces').
    embed: ids -> embeddings, for a graph that takes inputs_embeds; images: their PromptImages
    (features and positions per prompt). A row with positions of its own keeps its delta (its
    largest position + 1 - its length) as "position_delta" beside its cache. lora: the LoRA inputs
    of prompts by their indices (indices -> feeds), for a model with adapters."""
    n = len(prompts)
    lora = lora or (lambda indices: None)
    lengths = np.array([len(p) for p in prompts])
    last = np.zeros((n, graph.vocab_size), np.float32)
    rows: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
    deltas = images.deltas(lengths) if images is not None else [None] * n

    def keep(indices, group_last, presents):
        for j, b in enumerate(indices):
            last[b] = group_last[j]
            rows[b] = {name: array[j, :, :lengths[b]] for name, array in presents.items()}
            if deltas[b] is not None:
                rows[b]["position_delta"] = deltas[b]

    if mode == "grow" or graph.prompts_by_length:  # positions from the cache length, or int8 scales
        groups = [np.flatnonzero(lengths == length) for length in np.unique(lengths)]
    else:  # the mask hides each row's free rows: one run for all
        groups = [np.arange(n)]
    for group in groups:
        group_prompts = [prompts[b] for b in group]
        widths = prompt_widths(int(lengths[group].max()), steps)
        if graph.has_group_query_attention and len(group) > 1 and len(widths) > 1:
            # GroupQueryAttention: the first piece batched, the later ones row by row
            first = widths[0]
            group_last, presents = run_rows(session, graph, group_prompts, [first], pad, max_position,
                                             lora=lora(group))
            keep(group, group_last, presents)
            for j, b in enumerate(group):
                if lengths[b] > first:
                    row_past = {name: np.ascontiguousarray(array[j:j + 1]) for name, array in presents.items()}
                    row_last, row_presents = run_rows(session, graph, [prompts[b]], pieces(int(lengths[b]) - first),
                                                       pad, max_position, row_past, first, lora=lora([b]))
                    keep([b], row_last, row_presents)
        else:
            group_images = None if images is None else images.take(group)
            group_last, presents = run_rows(session, graph, group_prompts, widths, pad, max_position,
                                             embed=embed, images=group_images, lora=lora(group))
            keep(group, group_last, presents)
    return PromptCache(rows, lengths, last)
