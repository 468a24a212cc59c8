"""The decoder's Prometheus families read from its batcher when scraped: preemptions (rows paused
to keep the KV cache within its budget) under Raymuter's and vLLM's names, and the cache's
host <-> device ledger."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployments.metrics import DecoderMetrics


def test_preemptions_are_a_counter_under_both_names():
    batcher = SimpleNamespace(running=2, waiting=1, occupied=2, slots=4, preemptions=0, prefix=None)
    metrics = DecoderMetrics("m", batcher)
    assert 'raymuter:num_preemptions_total{model_name="m"} 0.0' in metrics.text()
    batcher.preemptions = 3
    text = metrics.text()
    assert 'raymuter:num_preemptions_total{model_name="m"} 3.0' in text
    assert 'vllm:num_preemptions_total{model_name="m"} 3.0' in text
    older = SimpleNamespace(running=0, waiting=0, occupied=0, slots=1, prefix=None)  # a batcher without the count
    assert 'raymuter:num_preemptions_total{model_name="m"} 0.0' in DecoderMetrics("m", older).text()


@pytest.mark.parametrize("buffers", ["host", "device"])
def test_the_cache_ledger_is_read_when_scraped(test_models, load_model, buffers):
    """raymuter:host_device_bytes_total{cause}, decode_steps_total and decode_rows_total read the
    batcher's cache ledger: a decode step's logits are its rows x vocab x 4 bytes."""
    import generation
    from generation.engine.batching import ContinuousBatcher

    model = load_model(test_models["llama-genai"])
    batcher = ContinuousBatcher(generation.compile(generation.context(model, buffers=buffers), batch_size=4),
                                slots=4, capacity=64)
    try:
        requests = [batcher.submit([5 + i, 6, 7], seed=i, settings=dict(max_new_tokens=8, eos_token_id=[]))
                    for i in range(3)]
        assert all(len(r.result(timeout=120).tokens) == 8 for r in requests)
        text = DecoderMetrics("m", batcher).text()
    finally:
        batcher.close()
    assert batcher.scheduler.state.cache.memory == buffers
    samples = {(s.name, s.labels.get("cause")): s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name.startswith("raymuter:")}
    steps, rows = samples["raymuter:decode_steps_total", None], samples["raymuter:decode_rows_total", None]
    assert steps >= 7 and rows >= 3 * 7
    assert samples["raymuter:host_device_bytes_total", "logits"] == rows * model.vocab_size * 4
    assert samples["raymuter:host_device_bytes_total", "prompt"] > 0
    assert 0 < samples["raymuter:host_device_bytes_total", "inputs"] <= rows * 64 + steps * 8
