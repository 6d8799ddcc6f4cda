"""The HTTP server's Prometheus metrics (`GET /metrics`), in a registry of its own."""

from typing import Any

__all__ = ["Metrics"]

SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Queued requests and busy slots (read from the engine when scraped), a paged cache's free
    and held pages, requests by outcome, tokens generated, and histograms of the time to the
    first token and of whole requests."""

    def __init__(self, server: Any, engine: Any) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        from prometheus_client.exposition import CONTENT_TYPE_LATEST

        self.registry = registry = CollectorRegistry()
        self.content_type = CONTENT_TYPE_LATEST
        queued = Gauge(
            "dense_armor_queued_requests", "Requests waiting for a slot.", registry=registry
        )
        queued.set_function(lambda: server.pending)
        busy = Gauge("dense_armor_busy_slots", "Slots serving a request.", registry=registry)
        busy.set_function(lambda: server.busy)
        flight = Gauge(
            "dense_armor_requests_in_flight", "Requests queued or in a slot.", registry=registry
        )
        flight.set_function(lambda: engine.in_flight)
        if server.page_counts is not None:  # a paged cache: its pages
            free = Gauge(
                "dense_armor_free_pages",
                "Pages of the paged cache that requests could take.",
                registry=registry,
            )
            free.set_function(lambda: server.page_counts[0])
            held = Gauge("dense_armor_held_pages", "Pages held by requests.", registry=registry)
            held.set_function(lambda: server.page_counts[1])
        self.tokens = Counter(
            "dense_armor_generated_tokens", "New tokens generated.", registry=registry
        )
        self.requests = Counter(
            "dense_armor_requests",
            "Requests answered, by HTTP status.",
            ["status"],
            registry=registry,
        )
        self.ttft = Histogram(
            "dense_armor_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first new token.",
            buckets=SECONDS,
            registry=registry,
        )
        self.latency = Histogram(
            "dense_armor_request_latency_seconds",
            "Seconds from a request's arrival to its last token.",
            buckets=SECONDS,
            registry=registry,
        )

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def token(self) -> None:
        self.tokens.inc()

    def finished(self, seconds: float) -> None:
        self.latency.observe(seconds)
        self.requests.labels(status="200").inc()

    def refused(self, status: int) -> None:
        self.requests.labels(status=str(status)).inc()

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
