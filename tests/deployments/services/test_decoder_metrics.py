"""The decoder's Prometheus families read from its batcher when scraped: preemptions (rows paused
to keep the KV cache within its budget) under Raymuter's and vLLM's names."""

from __future__ import annotations

from types import SimpleNamespace

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
