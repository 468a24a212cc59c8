"""Whisper's timestamp rules (generation/families/whisper/timestamps.py) against transformers'
WhisperTimeStampLogitsProcessor, on random scores and random token histories."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

from generation.families.whisper.timestamps import timestamp_rules

VOCAB, NO_TIMESTAMPS, EOS = 60, 40, 30  # text 0..39 (eos 30), <|notimestamps|> 40, timestamps 41..59


def history(rng, length):
    """A plausible history: text tokens and timestamps that never go back, in pairs mostly."""
    out, time = [], NO_TIMESTAMPS + 1
    for _ in range(length):
        if rng.random() < 0.35:
            time = min(VOCAB - 1, time + int(rng.integers(0, 3)))
            out.append(time)
        else:
            out.append(int(rng.integers(0, NO_TIMESTAMPS)))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_equals_transformers(seed):
    rng = np.random.default_rng(seed)
    prompt = [50, 51, 52][: int(rng.integers(1, 4))]
    length = int(rng.integers(0, 8))
    rows = [history(rng, length) for _ in range(3)]
    scale = float(rng.choice([0.5, 3.0, 8.0]))
    scores = (rng.standard_normal((3, VOCAB)) * scale).astype(np.float32)
    scores[:, NO_TIMESTAMPS + 1:] += float(rng.normal(0, 2))  # sometimes the timestamps dominate
    max_initial = [None, 0, 5][seed % 3]
    config = GenerationConfig(no_timestamps_token_id=NO_TIMESTAMPS, eos_token_id=EOS, max_initial_timestamp_index=max_initial)
    processor = WhisperTimeStampLogitsProcessor(config, begin_index=len(prompt))
    ids = torch.tensor([prompt + row for row in rows])
    expected = processor(ids, torch.from_numpy(scores.copy())).numpy()
    got = timestamp_rules(scores, rows, NO_TIMESTAMPS, EOS, max_initial)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expected))
    np.testing.assert_allclose(got[np.isfinite(got)], expected[np.isfinite(expected)])
    assert got is not scores
