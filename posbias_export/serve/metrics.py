"""What `GET /metrics` reports, in Prometheus' text format (prometheus_client, its own registry):
requests and tokens by route, the requests that failed by route and HTTP status (what an alert
watches: 4xx the callers', 5xx ours, 499 a client that left before its answer's end), the time a request waited
in a replica before its first batch, the batch sizes its inputs ran in, each replica's resident
memory (as its last answer said)."""
from __future__ import annotations


class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("posbias_requests", "requests answered", ["route"], registry=self.registry)
        self.tokens = Counter("posbias_tokens", "tokens read (prompt) and written (completion)", ["route", "kind"],
                              registry=self.registry)
        self.failures = Counter("posbias_request_failures", "requests answered with an error, by HTTP status "
                                "(499: the client left before its answer's end)", ["route", "status"],
                                registry=self.registry)
        self.latency = Histogram("posbias_request_seconds", "a request's time in the server", ["route"],
                                 registry=self.registry)
        self.queue = Histogram("posbias_queue_seconds", "a request's wait in a replica before its first batch or token",
                               ["route"], registry=self.registry)
        self.batch = Histogram("posbias_batch_size", "inputs per embedding batch a request ran in", ["route"],
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=self.registry)
        self.rss = Gauge("posbias_replica_rss_bytes", "a replica's resident memory at its last answer", ["replica"],
                         registry=self.registry)

    def observe(self, route: str, read: int, written: int, replies: list[dict], seconds: float) -> None:
        """One request answered; `replies`: what each of its replica calls said (a completion
        request of several prompts makes one call a prompt)."""
        self.requests.labels(route).inc()
        self.tokens.labels(route, "prompt").inc(read)
        self.tokens.labels(route, "completion").inc(written)
        self.latency.labels(route).observe(seconds)
        for stats in replies:
            if "queue_s" in stats:
                self.queue.labels(route).observe(max(stats["queue_s"], 0.0))
            for size in stats.get("batch_sizes", []):
                self.batch.labels(route).observe(size)
            if "rss" in stats:
                self.rss.labels(stats.get("replica", "0")).set(stats["rss"])

    def failed(self, route: str, status: int) -> None:
        self.failures.labels(route, str(status)).inc()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
