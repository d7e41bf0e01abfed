"""Prometheus metrics in vLLM's style (`llm_engine:num_requests_running`, ...), one registry per server."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from frontend.engine_proc.wire import EngineStats

PREFIX = "llm_engine:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats], model_name: str):
        """`stats` gives the engine's latest numbers: read live in-process, the last step's from an engine process."""
        self.registry = reg = CollectorRegistry()
        self.stats = stats
        labels = ["model_name"]

        def gauge(name: str, doc: str, read) -> None:
            Gauge(PREFIX + name, doc, labels, registry=reg).labels(model_name).set_function(read)

        gauge("num_requests_running", "Sequences in the running batch.", lambda: stats().running)
        gauge("num_requests_waiting", "Sequences waiting to be scheduled.", lambda: stats().waiting_seqs)
        gauge("kv_cache_usage_perc", "Share of KV-cache blocks in use (1 means full).",
              lambda: 1.0 - (s := stats()).free_blocks / s.total_blocks)
        gauge("num_kv_blocks_free", "KV-cache blocks free (cached prefixes in them may still be reused).",
              lambda: stats().free_blocks)
        gauge("num_kv_blocks_total", "KV-cache blocks in all.", lambda: stats().total_blocks)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens prefilled.", labels,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", labels,
                                         registry=reg).labels(model_name)
        self.steps = Counter(PREFIX + "engine_steps", "Engine steps run.", labels, registry=reg).labels(model_name)
        self.request_success = Counter(PREFIX + "request_success", "Requests finished, by finish reason.",
                                       labels + ["finished_reason"], registry=reg)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to the first generated token.",
                              labels, buckets=_TTFT_BUCKETS, registry=reg).labels(model_name)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request.", labels, buckets=_TPOT_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             labels, buckets=_E2E_BUCKETS, registry=reg).labels(model_name)
        self.model_name = model_name
        now = stats()
        self._seen = {key: getattr(now, key) for key in ("prompt_tokens", "generation_tokens", "steps")}

    def after_step(self) -> None:
        """Called after each step (in the engine thread, or on the loop for an engine process): moves the engine's
        token counts into the counters."""
        stats = self.stats()
        for key, counter in (("prompt_tokens", self.prompt_tokens), ("generation_tokens", self.generation_tokens),
                             ("steps", self.steps)):
            value, seen = getattr(stats, key), self._seen[key]
            if value < seen:  # a restarted engine process counts from 0 again
                seen = 0
            if value > seen:
                counter.inc(value - seen)
            self._seen[key] = value

    def finished(self, reason: str | None) -> None:
        self.request_success.labels(self.model_name, reason or "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
