"""Prometheus metrics of one server (its own registry, so several servers can live in one process).

Names follow vLLM's (``vllm:time_to_first_token_seconds`` -> ``plyx_time_to_first_token_seconds``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["COUNTED_KEY", "ServerMetrics", "route_of"]

#: ASGI scope key a handler sets once it counted its own request (generation requests, with their finish reason)
COUNTED_KEY = "plyx.counted"


def route_of(scope: Any) -> str:
    """The route template that answered (``/v1/models/{model}``, not the path a client sent, so the label's
    values stay few); ``unmatched`` for a path no route serves."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if path:
        return str(path)
    # answered before routing (401, 413 from the guard middleware): the route that would have served the path
    from starlette.routing import Match

    app = scope.get("app")
    for candidate in getattr(getattr(app, "router", None), "routes", ()):
        match, _ = candidate.matches(scope)
        if match != Match.NONE and getattr(candidate, "path", None):
            return str(candidate.path)
    return "unmatched"


_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class _EngineCollector(Collector):
    """Reads the engine's gauges and counters at scrape time (no locking: ints and lengths are atomic reads)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Any]:
        e = self.m.engine
        yield GaugeMetricFamily("plyx_num_requests_waiting", "Requests waiting for admission (queue length).",
                                value=e.num_waiting)
        yield GaugeMetricFamily("plyx_num_requests_running", "Sequences in the running batch.", value=e.num_running)
        yield GaugeMetricFamily("plyx_kv_cache_usage_ratio", "Share of KV-cache blocks in use (1 = full).",
                                value=e.cache_usage())
        hit = e.prefix.hit_rate if e.prefix is not None else 0.0
        yield GaugeMetricFamily("plyx_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache over "
                                "prompt tokens looked up.", value=hit)
        yield GaugeMetricFamily("plyx_generation_tokens_per_second", "Generated tokens per second over the last "
                                "10 s.", value=self.m.tokens_per_second())
        s = e.stats
        yield CounterMetricFamily("plyx_generation_tokens", "Generated tokens.", value=s.generated_tokens)
        yield CounterMetricFamily("plyx_prompt_tokens", "Prompt tokens computed (recomputes included).",
                                  value=s.prompt_tokens)
        yield CounterMetricFamily("plyx_num_preemptions", "Sequences preempted (recomputed later).",
                                  value=s.preemptions)
        yield CounterMetricFamily("plyx_engine_steps", "Engine steps run.", value=s.steps)
        # speculation (n-gram or draft heads), as vLLM's spec_decode counters: acceptance length is
        # 1 + accepted / verified rows; a tree's every node counts as drafted
        yield CounterMetricFamily("plyx_spec_decode_num_draft_tokens", "Draft tokens fed for verification.",
                                  value=s.spec_drafted)
        yield CounterMetricFamily("plyx_spec_decode_num_accepted_tokens", "Draft tokens the model confirmed.",
                                  value=s.spec_accepted)
        yield CounterMetricFamily("plyx_spec_decode_num_verified_rows", "Row-steps that verified drafts.",
                                  value=s.spec_rows)


class ServerMetrics:
    """TTFT, TPOT, end-to-end latency and request counts, plus the engine's live gauges."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram("plyx_time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("plyx_time_per_output_token_seconds", "Time per output token after the first.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("plyx_e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter("plyx_requests", "Answered API requests by finish reason, HTTP status and route "
                                "(errors too: finish_reason `error`; answers that generate nothing: `none`).",
                                ["finish_reason", "status", "route"], registry=self.registry)
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, int]] = deque()
        self.registry.register(_EngineCollector(self))

    def tokens_per_second(self, window: float = 10.0) -> float:
        now, total = time.monotonic(), self.engine.stats.generated_tokens
        with self._lock:
            self._samples.append((now, total))
            while len(self._samples) > 2 and now - self._samples[1][0] > window:
                self._samples.popleft()
            t0, n0 = self._samples[0]
        return (total - n0) / (now - t0) if now > t0 else 0.0

    def count(self, *, route: str, status: int, finish_reason: str) -> None:
        """One answered request in ``plyx_requests_total``."""
        self.requests.labels(finish_reason=finish_reason, status=str(status), route=route).inc()

    def observe(self, *, arrival: float, first_token: float | None, finish: float, tokens: int,
                finish_reason: str, status: int = 200, route: str = "unmatched") -> None:
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if tokens > 1:
                self.tpot.observe((finish - first_token) / (tokens - 1))
        self.e2e.observe(finish - arrival)
        self.count(route=route, status=status, finish_reason=finish_reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)
