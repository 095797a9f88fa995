"""Prometheus metrics of one server, in its own CollectorRegistry.

A per-app registry (not prometheus_client's global one) keeps two servers or two test apps in one
process from colliding on metric names. Latencies are measured here, at the HTTP edge, from the
stream of chunks the Engine hands back: that is what a client experiences. Scheduler
gauges (running / queued requests, KV usage) are read from `Engine.get_server_info()` at scrape time.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate
from typing import Any, Iterable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

# Buckets cover a CPU test box (hundreds of ms per token) up to GPU serving (ms per token).
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0, 10.0)

# Names the Engine may use for each scheduler statistic (first one found wins).
_RUNNING_KEYS = ("num_running_reqs", "num_running_requests", "running_reqs")
_QUEUED_KEYS = ("num_waiting_reqs", "num_queue_reqs", "num_queued_reqs", "num_waiting_requests")
_KV_USAGE_KEYS = ("kv_cache_usage", "token_usage", "kv_usage", "kv_cache_usage_ratio")
_HIT_RATE_KEYS = ("cache_hit_rate", "prefix_cache_hit_rate")

CONTENT_TYPE = CONTENT_TYPE_LATEST

# The scheduler's own running totals and gauges, exported as they are at scrape time: metric name (a counter's
# without its _total), help, the names the Engine may report it under. Absent ones are not exported (a
# grammar compile time the backend does not report yet, an accept length before speculation exists).
_SCHEDULER_COUNTERS = (
    ("plait_grammar_cache_hits", "Constraints served from the grammar cache", ("grammar_cache_hits",)),
    ("plait_grammar_cache_misses", "Constraints compiled (grammar cache misses)", ("grammar_cache_misses",)),
    (
        "plait_grammar_compile_seconds",
        "Seconds spent compiling grammars",
        ("grammar_compile_seconds", "grammar_compile_seconds_total"),
    ),
    ("plait_jump_forward_tokens", "Tokens a grammar forced, appended without a decode step", ("jump_forward_tokens",)),
    ("plait_retractions", "Requests retracted for lack of KV memory", ("num_retractions",)),
    ("plait_spec_verify_steps", "Speculative verify steps", ("spec_verify_steps",)),
    ("plait_spec_accepted_tokens", "Tokens accepted by speculative verify steps", ("spec_accepted_tokens",)),
    ("plait_spec_draft_tokens", "Draft tokens proposed", ("spec_draft_tokens",)),
    ("plait_hicache_loaded_tokens", "Cached tokens loaded back from the host tier", ("hicache_loaded_tokens",)),
    ("plait_hicache_bytes_to_host", "Bytes of K/V copied to the host tier", ("hicache_bytes_to_host",)),
    ("plait_hicache_bytes_to_device", "Bytes of K/V loaded back from the host tier", ("hicache_bytes_to_device",)),
)
# (exported while a host tier runs: --enable-hierarchical-cache)
_HICACHE_USAGE = ("plait_hicache_host_usage", "Fraction of the host tier's slots in use (0-1)", ("hicache_host_usage",))
# (exported only once speculation ran: the scheduler reports 0.0 when it is off)
_SPEC_ACCEPT_LENGTH = (
    "plait_spec_accept_length",
    "Average accepted tokens per speculative verify step",
    ("avg_spec_accept_length",),
)


# The Kubernetes model-server protocol (what the Gateway API Inference Extension's endpoint pickers, llm-d,
# KServe and the SGLang / vLLM routers scrape): the same three scheduler gauges under vLLM's and SGLang's
# names, both always (a picker configured for either engine reads plait unchanged; six gauges cost nothing).
# The hit rate is set at scrape time from the same source as plait_cache_hit_rate.
_PROTOCOL_GAUGES = (
    ("vllm:num_requests_running", "Requests in the running batch (vLLM's name)", _RUNNING_KEYS),
    ("vllm:num_requests_waiting", "Requests waiting in the scheduler queue (vLLM's name)", _QUEUED_KEYS),
    ("vllm:kv_cache_usage_perc", "Fraction of KV cache slots in use, 0-1 (vLLM's name)", _KV_USAGE_KEYS),
    ("sglang:num_running_reqs", "Requests in the running batch (SGLang's name)", _RUNNING_KEYS),
    ("sglang:num_queue_reqs", "Requests waiting in the scheduler queue (SGLang's name)", _QUEUED_KEYS),
    ("sglang:token_usage", "Fraction of KV cache slots in use, 0-1 (SGLang's name)", _KV_USAGE_KEYS),
)
_PROTOCOL_HIT_RATE = ("sglang:cache_hit_rate", "Prefix cache hit rate, 0-1 (SGLang's name)")


class ProtocolGauges:
    """A collector of the model-server protocol's gauges from the last server info handed to `update`."""

    def __init__(self, label: dict[str, str]) -> None:
        self._label = label
        self._info: dict[str, Any] = {}
        self._hit_rate: Optional[float] = None

    def update(self, info: dict[str, Any], hit_rate: Optional[float]) -> None:
        self._info, self._hit_rate = info, hit_rate

    def collect(self) -> Iterable[Any]:
        values = [(name, doc, find_stat(self._info, keys)) for name, doc, keys in _PROTOCOL_GAUGES]
        values.append((*_PROTOCOL_HIT_RATE, self._hit_rate))
        for name, doc, value in values:
            if value is not None:
                metric = GaugeMetricFamily(name, doc, labels=list(self._label))
                metric.add_metric(list(self._label.values()), value)
                yield metric


class SchedulerStats:
    """A collector of the scheduler's totals from the last server info handed to `update`."""

    def __init__(self, label: dict[str, str]) -> None:
        self._label = label
        self._info: dict[str, Any] = {}

    def update(self, info: dict[str, Any]) -> None:
        self._info = info

    def collect(self) -> Iterable[Any]:
        gauges = (_SPEC_ACCEPT_LENGTH,) if (find_stat(self._info, ("spec_verify_steps",)) or 0) > 0 else ()
        gauges += (_HICACHE_USAGE,)
        for table, family in ((_SCHEDULER_COUNTERS, CounterMetricFamily), (gauges, GaugeMetricFamily)):
            for name, doc, keys in table:
                value = find_stat(self._info, keys)
                if value is not None:
                    metric = family(name, doc, labels=list(self._label))
                    metric.add_metric(list(self._label.values()), value)
                    yield metric


class CountingHistogram:
    """A histogram of one label set, kept as plain counts and exported at scrape time as Prometheus'
    Histogram exports it (buckets, count, sum).

    NOTE: the inter-token latency is observed for every token of every stream, tens of thousands of times
    a second under load; prometheus_client's Histogram takes a lock and updates a value per bucket each
    time, a few times what a bisect and an add cost here. Observed and scraped on the server's loop."""

    def __init__(self, name: str, doc: str, buckets: Iterable[float], label: dict[str, str]) -> None:
        self.name, self.doc, self._label = name, doc, label
        self._bounds = list(buckets)
        self._counts = [0] * (len(self._bounds) + 1)  # one per bucket, the last past every bound (+Inf)
        self._sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self._counts[bisect_left(self._bounds, value)] += times
        self._sum += value * times

    def collect(self) -> Iterable[Any]:
        cumulative = list(accumulate(self._counts))
        buckets = [(floatToGoString(b), n) for b, n in zip(self._bounds, cumulative)] + [("+Inf", cumulative[-1])]
        family = HistogramMetricFamily(self.name, self.doc, labels=list(self._label))
        family.add_metric(list(self._label.values()), buckets, self._sum)
        yield family


def find_stat(info: dict[str, Any], names: Iterable[str]) -> Optional[float]:
    """Look a statistic up in the Engine's server info, top level first, then one level of nesting
    (dicts, or the first dict of a list such as SGLang's `internal_states`)."""
    names = tuple(names)
    layers: list[dict[str, Any]] = [info]
    for value in info.values():
        if isinstance(value, dict):
            layers.append(value)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            layers.append(value[0])
    for layer in layers:
        for name in names:
            v = layer.get(name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
    return None


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        self.prompt_tokens = counter("plait_prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("plait_generation_tokens", "Tokens generated")
        self.cached_tokens = counter("plait_cached_tokens", "Prompt tokens served from the prefix cache")
        self.requests = Counter(
            "plait_requests", "Finished generation requests", labels + ["finish_reason"], registry=r
        )
        self.rejected = counter("plait_rejected_requests", "Requests refused with 503 (queue full)")
        self.running = gauge("plait_num_running_reqs", "Requests in the running batch")
        self.queued = gauge("plait_num_queued_reqs", "Requests waiting in the scheduler queue")
        self.in_flight = gauge("plait_num_in_flight_reqs", "Generation requests open at the HTTP server")
        self.kv_usage = gauge("plait_kv_cache_usage", "Fraction of KV cache slots in use (0-1)")
        self.hit_rate = gauge("plait_cache_hit_rate", "Prefix cache hit rate: cached / prompt tokens (0-1)")
        self.ttft = Histogram(
            "plait_time_to_first_token_seconds", "Time to first token", labels, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = CountingHistogram(
            "plait_inter_token_latency_seconds", "Time between output tokens", _ITL_BUCKETS, {"model_name": model_name}
        )
        r.register(self.itl)
        self.e2e = Histogram(
            "plait_e2e_request_latency_seconds",
            "End-to-end request latency",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._label = {"model_name": model_name}
        self._ttft_child = self.ttft.labels(**self._label)  # (looked up once, not per request)
        self.scheduler_stats = SchedulerStats(self._label)
        r.register(self.scheduler_stats)
        self.protocol_gauges = ProtocolGauges(self._label)
        r.register(self.protocol_gauges)
        self._prompt_total = 0
        self._cached_total = 0

    # ---- per-request observations (called by EngineClient) ----
    def observe_first_token(self, seconds: float) -> None:
        self._ttft_child.observe(seconds)

    def observe_inter_token(self, seconds_per_token: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self.itl.observe(seconds_per_token, num_tokens)

    def observe_finished(self, meta_info: dict[str, Any], e2e_seconds: float) -> None:
        prompt = int(meta_info.get("prompt_tokens") or 0)
        completion = int(meta_info.get("completion_tokens") or 0)
        cached = int(meta_info.get("cached_tokens") or 0)
        self.prompt_tokens.labels(**self._label).inc(prompt)
        self.generation_tokens.labels(**self._label).inc(completion)
        self.cached_tokens.labels(**self._label).inc(cached)
        finish = meta_info.get("finish_reason") or {}
        reason = finish.get("type", "unknown") if isinstance(finish, dict) else str(finish)
        self.requests.labels(finish_reason=reason, **self._label).inc()
        self.e2e.labels(**self._label).observe(e2e_seconds)
        self._prompt_total += prompt
        self._cached_total += cached

    def observe_rejected(self) -> None:
        self.rejected.labels(**self._label).inc()

    def set_in_flight(self, n: int) -> None:
        self.in_flight.labels(**self._label).set(n)

    # ---- scrape ----
    def render(self, server_info: Optional[dict[str, Any]]) -> bytes:
        info = server_info or {}
        self.scheduler_stats.update(info)
        for gauge, keys in (
            (self.running, _RUNNING_KEYS),
            (self.queued, _QUEUED_KEYS),
            (self.kv_usage, _KV_USAGE_KEYS),
        ):
            value = find_stat(info, keys)
            if value is not None:
                gauge.labels(**self._label).set(value)
        hit_rate = find_stat(info, _HIT_RATE_KEYS)
        if hit_rate is None and self._prompt_total:
            hit_rate = self._cached_total / self._prompt_total
        if hit_rate is not None:
            self.hit_rate.labels(**self._label).set(hit_rate)
        self.protocol_gauges.update(info, hit_rate)
        return generate_latest(self.registry)
