"""Prometheus metrics, named after vLLM's (`vllm:time_to_first_token_seconds` ->
`raymuter:time_to_first_token_seconds`), and each also under vLLM's own name with the same labels
(`model_name`), so vLLM's Grafana dashboards and the Gateway API inference extension read them
unchanged (`exposition`: the `vllm:` families are the `raymuter:` ones renamed when scraped, not
counted twice; `vllm:gpu_cache_usage_perc`, vLLM's older name of the KV usage its dashboard reads,
is `raymuter:kv_cache_usage_perc` under that name too). Each metric means what vLLM v1's does
(`vllm/v1/metrics/loggers.py`): a choice of an n-choice request is a request of its own here.

Each deployment keeps its own registry; the ingress's `/metrics` joins the ingress's with one
replica of each deployment behind it (`exposition`). With several replicas of a deployment,
scrape each replica's node through Ray's metrics export instead (docs/cluster.md).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class DecoderMetrics:
    """The decoder's request metrics; gauges read the batcher when scraped."""

    def __init__(self, model_name: str, batcher=None):
        self.registry = CollectorRegistry()
        labels, r = ["model_name"], self.registry
        self.model_name = model_name

        def one(metric):
            return metric.labels(model_name=model_name)

        self.ttft = one(Histogram("raymuter:time_to_first_token_seconds", "Time from arrival at the decoder to the "
                                  "first token.", labels, buckets=TTFT_BUCKETS, registry=r))
        self.inter_token = one(Histogram("raymuter:inter_token_latency_seconds", "Time between a request's tokens.",
                                         labels, buckets=ITL_BUCKETS, registry=r))
        # vLLM's older name of the same observations, which its Grafana dashboard still reads
        self.per_output_token = one(Histogram("raymuter:time_per_output_token_seconds", "Time between a request's "
                                              "tokens (inter_token_latency_seconds, under vLLM's older name).",
                                              labels, buckets=ITL_BUCKETS, registry=r))
        self.prefill = one(Histogram("raymuter:request_prefill_time_seconds", "Time from a request's slot to its "
                                     "first token.", labels, buckets=E2E_BUCKETS, registry=r))
        self.decode = one(Histogram("raymuter:request_decode_time_seconds", "Time from a request's first token to "
                                    "its last.", labels, buckets=E2E_BUCKETS, registry=r))
        self.max_generation = one(Histogram("raymuter:request_max_num_generation_tokens", "New tokens per request, "
                                            "the most of its choices (each choice is a request here).", labels,
                                            buckets=TOKEN_BUCKETS, registry=r))
        self.e2e = one(Histogram("raymuter:e2e_request_latency_seconds", "Time from arrival to the last token.",
                                 labels, buckets=E2E_BUCKETS, registry=r))
        self.queue = one(Histogram("raymuter:request_queue_time_seconds", "Time waiting for a slot.", labels,
                                   buckets=E2E_BUCKETS, registry=r))
        self.prompt_hist = one(Histogram("raymuter:request_prompt_tokens", "Prompt tokens per request.", labels,
                                         buckets=TOKEN_BUCKETS, registry=r))
        self.generation_hist = one(Histogram("raymuter:request_generation_tokens", "New tokens per request.",
                                             labels, buckets=TOKEN_BUCKETS, registry=r))
        self.prompt_tokens = one(Counter("raymuter:prompt_tokens", "Prompt tokens processed.", labels, registry=r))
        self.generation_tokens = one(Counter("raymuter:generation_tokens", "Tokens generated.", labels, registry=r))
        self.success = Counter("raymuter:request_success", "Finished requests by reason.",
                               labels + ["finished_reason"], registry=r)
        self.rejected = one(Counter("raymuter:request_rejected", "Requests refused because the queue was full.",
                                    labels, registry=r))
        # LoRA adapters (vLLM's lora_requests_info, as counters by adapter)
        self.adapter_requests = Counter("raymuter:lora_requests", "Finished requests by the LoRA adapter they ran "
                                        "with.", labels + ["lora_name"], registry=r)
        self.adapter_tokens = Counter("raymuter:lora_generation_tokens", "Tokens generated by the LoRA adapter they "
                                      "ran with.", labels + ["lora_name"], registry=r)
        self.adapter_loads = one(Counter("raymuter:lora_adapter_loads", "LoRA adapters loaded while serving "
                                         "(/v1/load_lora_adapter).", labels, registry=r))
        if batcher is not None:
            one(Gauge("raymuter:num_requests_running", "Requests in the batch now.", labels,
                      registry=r)).set_function(lambda: batcher.running)
            one(Gauge("raymuter:num_requests_waiting", "Requests waiting for a slot.", labels,
                      registry=r)).set_function(lambda: batcher.waiting)
            one(Gauge("raymuter:batch_occupancy", "Share of the decoder's slots in use (0-1).", labels,
                      registry=r)).set_function(lambda: batcher.occupied / batcher.slots)
            one(Gauge("raymuter:kv_cache_usage_perc", "Share of the KV cache in use (0-1): each slot owns its "
                      "rows, so the share of slots held.", labels,
                      registry=r)).set_function(lambda: batcher.occupied / batcher.slots)
            one(Gauge("raymuter:num_slots", "The decoder's batch slots.", labels,
                      registry=r)).set_function(lambda: batcher.slots)
            if getattr(batcher, "prefix", None) is not None:
                r.register(_PrefixCache(model_name, batcher.prefix))
            r.register(_Preemptions(model_name, batcher))
            if callable(getattr(batcher, "adapter_names", None)):
                one(Gauge("raymuter:lora_adapters", "LoRA adapters this decoder replica knows by name (read from their folders).", labels,
                          registry=r)).set_function(lambda: len(batcher.adapter_names()))
                r.register(_Adapters(model_name, batcher))
            r.register(_Transfers(model_name, batcher))

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def next_token(self, seconds: float) -> None:
        """The time since the request's previous token."""
        self.inter_token.observe(seconds)
        self.per_output_token.observe(seconds)

    def started(self, seconds: float) -> None:
        _startup_gauge(self.registry, self.model_name).set(seconds)

    def finished(self, completion, prompt_tokens: int, seconds: float, decode_seconds: float | None,
                 adapter: str | None = None) -> None:
        """A request's end: `completion` the batcher's (queue and first-token times from its
        submission), `seconds` from its arrival, `decode_seconds` from its first token to its
        last (None: it made none; then neither its prefill nor its decode time is observed);
        `adapter` the LoRA adapter it ran with."""
        if adapter is not None:
            self.adapter_requests.labels(model_name=self.model_name, lora_name=adapter).inc()
            self.adapter_tokens.labels(model_name=self.model_name, lora_name=adapter).inc(len(completion.tokens))
        self.e2e.observe(seconds)
        self.queue.observe(completion.queued_seconds)
        if decode_seconds is not None and completion.first_token_seconds is not None:
            self.prefill.observe(max(0.0, completion.first_token_seconds - completion.queued_seconds))
            self.decode.observe(decode_seconds)
        self.prompt_hist.observe(prompt_tokens)
        self.generation_hist.observe(len(completion.tokens))
        self.max_generation.observe(len(completion.tokens))
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(len(completion.tokens))
        self.success.labels(model_name=self.model_name, finished_reason=completion.finish_reason).inc()

    def text(self) -> str:
        return exposition(self.registry)


class _PrefixCache:
    """The decoder's prefix store, read when scraped: vLLM's prefix_cache_queries and
    prefix_cache_hits (prompt tokens looked up and found, counters) and the store's bytes."""

    def __init__(self, model_name: str, store):
        self.model_name, self.store = model_name, store

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, text, value in (("raymuter:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                   self.store.queries),
                                  ("raymuter:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   self.store.hits)):
            family = CounterMetricFamily(name, text, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        family = GaugeMetricFamily("raymuter:prefix_cache_bytes", "Bytes the prefix cache holds.",
                                   labels=["model_name"])
        family.add_metric([self.model_name], self.store.bytes)
        yield family


class _Transfers:
    """The decoder's host <-> device ledger (generation.runtime.device), read when scraped: bytes
    by cause, and the decode steps and rows (summed over steps) they came with; on a cache of
    host buffers, what would cross were it on a device. Absent where the cache mode keeps no ledger."""

    def __init__(self, model_name: str, batcher):
        self.model_name, self.batcher = model_name, batcher

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        stats = getattr(self.batcher, "transfers", None)
        if not stats:
            return
        family = CounterMetricFamily("raymuter:host_device_bytes", "Bytes crossing between the host and the "
                                     "decoder's device, by cause.", labels=["model_name", "cause"])
        for cause, value in stats["host_device_bytes"].items():
            family.add_metric([self.model_name, cause], value)
        yield family
        for name, text, key in (("raymuter:decode_steps", "Decode steps the decoder ran.", "decode_steps"),
                                ("raymuter:decode_rows", "Rows the decode steps ran, summed over steps.", "decode_rows")):
            family = CounterMetricFamily(name, text, labels=["model_name"])
            family.add_metric([self.model_name], stats[key])
            yield family


class _Adapters:
    """The LoRA bank's adapters in a place now, and those evicted from one for another (vLLM's
    --max-loras LRU), read from the batcher (its engine process's, as its steps report) when scraped."""

    def __init__(self, model_name: str, batcher):
        self.model_name, self.batcher = model_name, batcher

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        resident, evictions = self.batcher.adapter_counts()
        gauge = GaugeMetricFamily("raymuter:lora_adapters_resident", "LoRA adapters in the bank's places now "
                                  "(at most --max-loras).", labels=["model_name"])
        gauge.add_metric([self.model_name], resident)
        counter = CounterMetricFamily("raymuter:lora_adapter_evictions", "LoRA adapters that left their place for "
                                      "another (the least recently used one no running row uses).",
                                      labels=["model_name"])
        counter.add_metric([self.model_name], evictions)
        return [gauge, counter]


class _Preemptions:
    """vLLM's num_preemptions: rows the scheduler paused to keep the KV cache within its budget
    (resumed later, their tokens unchanged), read from the batcher when scraped."""

    def __init__(self, model_name: str, batcher):
        self.model_name, self.batcher = model_name, batcher

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily("raymuter:num_preemptions", "Rows preempted to keep the KV cache within its "
                                     "budget (resumed later, exactly).", labels=["model_name"])
        family.add_metric([self.model_name], getattr(self.batcher, "preemptions", 0))
        yield family


def _startup_gauge(registry, model_name: str):
    return Gauge("raymuter:replica_startup_seconds", "Seconds this replica took to start: the model found or "
                 "downloaded, rewritten (fusion, once per node), loaded and warmed up.", ["model_name"],
                 registry=registry).labels(model_name=model_name)


class EncoderMetrics:
    """An encoder or vision replica: latency per call and the feature cache's hits."""

    def __init__(self, model_name: str, kind: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.latency = Histogram(f"raymuter:{kind}_latency_seconds", f"Time per {kind} call.", labels,
                                 buckets=E2E_BUCKETS, registry=self.registry).labels(model_name=model_name)
        self.items = Counter(f"raymuter:{kind}_inputs", f"Inputs through the {kind}.", labels,
                             registry=self.registry).labels(model_name=model_name)
        self.cache_hits = Counter(f"raymuter:{kind}_cache_hits", f"{kind} inputs served from the cache.", labels,
                                  registry=self.registry).labels(model_name=model_name)
        self.cache_misses = Counter(f"raymuter:{kind}_cache_misses", f"{kind} inputs computed.", labels,
                                    registry=self.registry).labels(model_name=model_name)

    def started(self, seconds: float) -> None:
        _startup_gauge(self.registry, self.model_name).set(seconds)

    def text(self) -> str:
        return exposition(self.registry)


class IngressMetrics:
    """HTTP requests by route and status."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("raymuter:http_requests", "HTTP requests by route and status.", ["route", "status"],
                                registry=self.registry)

    def text(self) -> str:
        return exposition(self.registry)


# families vLLM's Grafana dashboard reads under an older name as well (vLLM 0.10 renamed it)
VLLM_ALIASES = {"kv_cache_usage_perc": "gpu_cache_usage_perc"}


class _Renamed:
    """A registry's families under another prefix (and those of `aliases` under their other
    name too), read when scraped (a collector of its own registry: the families are counted once)."""

    def __init__(self, registry: CollectorRegistry, old: str, new: str, aliases: dict[str, str] | None = None):
        self.registry, self.old, self.new, self.aliases = registry, old, new, aliases or {}

    def collect(self):
        for family in self.registry.collect():
            if not family.name.startswith(self.old):
                continue
            name = family.name[len(self.old):]
            yield _named(family, self.new + name)
            if name in self.aliases:
                yield _named(family, self.new + self.aliases[name])


def _named(family, name: str):
    """`family` (its samples too) under `name`."""
    from prometheus_client.metrics_core import Metric
    from prometheus_client.samples import Sample

    renamed = Metric(name, family.documentation, family.type, family.unit)
    renamed.samples = [Sample(name + s.name[len(family.name):], s.labels, s.value, s.timestamp, s.exemplar)
                       for s in family.samples]
    return renamed


def exposition(registry: CollectorRegistry) -> str:
    """The registry's metrics in Prometheus' text format, each `raymuter:` family also as `vllm:`."""
    view = CollectorRegistry(auto_describe=False)
    view.register(_Renamed(registry, "raymuter:", "vllm:", VLLM_ALIASES))
    return (generate_latest(registry) + generate_latest(view)).decode()
