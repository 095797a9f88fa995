"""The router's own Prometheus metrics (a registry of its own): what went where and why, failures,
retries, the replicas' health and load."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .policy import Choice

_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, urls: list[str]):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "plait_router_requests",
            "Requests sent to a replica, by route and by why it was chosen (prefix, new, balance, round_robin)",
            ["replica", "route", "reason"],
            registry=r,
        )
        self.prompt_items = Counter(
            "plait_router_prompt_items", "Routing-key items (characters or token ids) of the requests sent", registry=r
        )
        self.matched_items = Counter(
            "plait_router_matched_items",
            "Of those, items the chosen replica had been sent before (the router's estimate of its prefix-cache hits)",
            registry=r,
        )
        self.errors = Counter(
            "plait_router_replica_errors",
            "Replica failures seen by requests (unreachable, 503, broken, mid_stream)",
            ["replica", "kind"],
            registry=r,
        )
        self.retries = Counter("plait_router_retries", "Requests sent again to another replica", registry=r)
        self.failed = Counter("plait_router_unroutable", "Requests no replica could take (503)", registry=r)
        self.healthy = Gauge(
            "plait_router_replica_healthy", "1 while the replica is routed to", ["replica"], registry=r
        )
        self.in_flight = Gauge(
            "plait_router_replica_in_flight", "Requests open on the replica", ["replica"], registry=r
        )
        self.latency = Histogram(
            "plait_router_request_seconds",
            "Time to the routed response's headers (a stream: its start)",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        for url in urls:
            self.healthy.labels(url).set(1)
            self.in_flight.labels(url).set(0)

    def routed(self, choice: Choice, route: str, key_items: int) -> None:
        self.requests.labels(choice.replica, route, choice.reason).inc()
        self.prompt_items.inc(key_items)
        self.matched_items.inc(choice.matched)

    def error(self, url: str, kind: str) -> None:
        self.errors.labels(url, kind).inc()

    def set_health(self, replicas) -> None:
        for r in replicas.replicas.values():
            self.healthy.labels(r.url).set(1 if r.healthy else 0)
            self.in_flight.labels(r.url).set(r.in_flight)

    def render(self) -> bytes:
        return generate_latest(self.registry)
