"""vLLM's Grafana dashboard reads GET /metrics unchanged: every metric each of its PromQL queries
names (a histogram's _bucket, _sum and _count as the query uses them) is served under that
name with the `model_name` label its `$model_name` variable selects, and has been observed once
requests ran. The queries are the dashboard's own, copied into tests/data/vllm_grafana_dashboard.json
(its source and licence in the file); they once named four panels' metrics /metrics did not serve.

The fake engine behind the app's routes in this process (deployments/fake.py)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from app_routes import app_routes
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "data" / "vllm_grafana_dashboard.json"
# PromQL's functions, aggregations and their modifiers: names in a query that are no metric
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
                "unless"}


def queries(dashboard: dict) -> list[str]:
    """Every panel's PromQL expressions (a row's nested panels too)."""
    panels = list(dashboard["panels"])
    found = []
    while panels:
        panel = panels.pop(0)
        panels += panel.get("panels", [])
        found += [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: its identifiers once strings, label matchers,
    ranges, grouping clauses, function calls and keywords are taken out.

    >>> sorted(metric_names('histogram_quantile(0.9, sum by(le) (rate(vllm:a_bucket{m="$m"}[$__rate_interval])))'))
    ['vllm:a_bucket']
    """
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = {m.group(0) for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr)
             if not re.match(r"\s*\(", expr[m.end():])}  # a name before "(" is a function's
    return names - PROMQL_WORDS


@pytest.fixture(scope="module")
def scraped():
    """/metrics after a chat answered whole and one streamed, both ending at their budget."""
    config = dict(engine="fake", name="fake", slots=4, step_seconds=0.002)
    with app_routes(config) as (client, _):
        async def go():
            async with client() as http:
                for stream in (False, True):
                    answer = await http.post("/v1/chat/completions", json=dict(
                        model="fake", messages=[{"role": "user", "content": "hello"}], max_tokens=6, stream=stream))
                    assert answer.status_code == 200
                metrics = await http.get("/metrics")
                assert metrics.status_code == 200
                return metrics.text

        yield asyncio.run(go())


def samples(text: str) -> dict[str, list]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_every_metric_the_dashboard_queries_is_served_with_its_model_label(scraped):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = queries(dashboard)
    assert len(exprs) == 27  # the copy holds every query of the dashboard's 12 panels
    served = samples(scraped)
    wanted = set().union(*map(metric_names, exprs))
    assert all(name.startswith("vllm:") for name in wanted), wanted
    missing = sorted(name for name in wanted if name not in served)
    assert not missing, f"/metrics lacks what vLLM's dashboard queries: {missing}"
    for name in wanted:
        assert any(s.labels.get("model_name") == "fake" for s in served[name]), name
    assert {s.labels["finished_reason"] for s in served["vllm:request_success_total"]} == {"length"}


def test_the_added_families_hold_what_vllm_puts_in_them(scraped):
    served = samples(scraped)

    def value(name, **labels):
        return sum(s.value for s in served[name] if all(s.labels.get(k) == v for k, v in labels.items()))

    # two requests of 6 tokens: 5 gaps each between their tokens, the same in the old name and the new
    assert value("vllm:time_per_output_token_seconds_count") == value("vllm:inter_token_latency_seconds_count") == 10
    assert value("vllm:time_per_output_token_seconds_sum") == value("vllm:inter_token_latency_seconds_sum")
    for name in ("vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds"):
        assert value(name + "_count") == 2 and value(name + "_sum") > 0
    # the decode time is the tokens' gaps, the prefill time at most the time to the first token
    assert value("vllm:request_decode_time_seconds_sum") == pytest.approx(
        value("vllm:inter_token_latency_seconds_sum"), rel=1e-6)
    assert value("vllm:request_prefill_time_seconds_sum") <= value("vllm:time_to_first_token_seconds_sum")
    assert value("vllm:request_max_num_generation_tokens_count") == 2
    assert value("vllm:request_max_num_generation_tokens_sum") == 12
    assert value("vllm:request_max_num_generation_tokens_bucket", le="5.0") == 0
    assert value("vllm:gpu_cache_usage_perc") == value("vllm:kv_cache_usage_perc")
    assert "raymuter:gpu_cache_usage_perc" not in served  # vLLM's older name: under vllm: only
