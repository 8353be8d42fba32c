"""Prometheus metrics of the server, named like vLLM's (``inkfw:`` instead of ``vllm:``) so
that vLLM dashboards carry over.

Every metric has the label ``model_name``. Counters are exposed with the ``_total`` suffix
(prometheus-client adds it), e.g. ``inkfw:spec_decode_num_drafts_total``. The speculative
counters follow :class:`~inkfw.speculative.metrics.SpecMetrics` (docs/design.md §6): one
*draft* is one request's verify step that drafted at least one token;
``spec_decode_num_accepted_tokens_per_pos{position="i"}`` counts the verify steps that accepted
draft ``i``, so mean acceptance length = 1 + accepted tokens / verify steps.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

# seconds; vLLM's buckets, trimmed at both ends
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)


class ServerMetrics:
    """The server's Prometheus collectors, in their own registry (several servers may run in
    one process, e.g. in tests)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        disable_created_metrics()  # no *_created series (as vLLM); process-wide in prometheus-client
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]
        r = self.registry
        self.num_requests_running = Gauge(
            "inkfw:num_requests_running", "Requests in the engine's running batch.", label, registry=r
        )
        self.num_requests_waiting = Gauge(
            "inkfw:num_requests_waiting",
            "Requests received and not yet running (queued or preempted).",
            label,
            registry=r,
        )
        self.kv_cache_usage_perc = Gauge(
            "inkfw:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", label, registry=r
        )
        self.prompt_tokens = Counter("inkfw:prompt_tokens", "Prompt tokens of admitted requests.", label, registry=r)
        self.generation_tokens = Counter("inkfw:generation_tokens", "Generated tokens.", label, registry=r)
        self.request_success = Counter(
            "inkfw:request_success", "Finished requests, by finish reason.", label + ["finished_reason"], registry=r
        )
        self.spec_decode_num_drafts = Counter(
            "inkfw:spec_decode_num_drafts", "Verify steps that drafted at least one token.", label, registry=r
        )
        self.spec_decode_num_draft_tokens = Counter(
            "inkfw:spec_decode_num_draft_tokens", "Drafted tokens.", label, registry=r
        )
        self.spec_decode_num_accepted_tokens = Counter(
            "inkfw:spec_decode_num_accepted_tokens", "Accepted draft tokens.", label, registry=r
        )
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "inkfw:spec_decode_num_accepted_tokens_per_pos",
            "Verify steps that accepted the draft at position.",
            label + ["position"],
            registry=r,
        )
        self.time_to_first_token_seconds = Histogram(
            "inkfw:time_to_first_token_seconds",
            "Time from receiving a request to its first token.",
            label,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency_seconds = Histogram(
            "inkfw:inter_token_latency_seconds",
            "Time between a request's successive outputs (one per engine step that gave it tokens).",
            label,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency_seconds = Histogram(
            "inkfw:e2e_request_latency_seconds",
            "Time from receiving a request to its end.",
            label,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self._spec_seen: dict[str, Any] = {
            "num_drafts": 0,
            "num_draft_tokens": 0,
            "num_accepted_tokens": 0,
            "accepted_per_position": [],
        }

    def _label(self, metric, **extra: str):
        return metric.labels(model_name=self.model_name, **extra)

    # ---------------------------------------------------------------- recording
    def start_from(self, engine: Any) -> None:
        """Count the engine's speculative work from now on (not what it did before serving)."""
        m = engine.metrics
        self._spec_seen = {
            "num_drafts": int(m.num_drafts),
            "num_draft_tokens": int(m.num_draft_tokens),
            "num_accepted_tokens": int(m.num_accepted_tokens),
            "accepted_per_position": list(m.accepted_per_position),
        }
        self.record_engine(engine)

    def record_engine(self, engine: Any, num_queued: int = 0) -> None:
        """Gauges from the engine's state, and the speculative counters' growth since the last
        call (from ``engine.metrics``)."""
        self._label(self.num_requests_running).set(len(engine.running))
        self._label(self.num_requests_waiting).set(len(engine.waiting) + num_queued)
        self._label(self.kv_cache_usage_perc).set(engine.kv.usage())
        m = engine.metrics
        seen = self._spec_seen
        for name, counter in (
            ("num_drafts", self.spec_decode_num_drafts),
            ("num_draft_tokens", self.spec_decode_num_draft_tokens),
            ("num_accepted_tokens", self.spec_decode_num_accepted_tokens),
        ):
            now = int(getattr(m, name))
            if now > seen[name]:
                self._label(counter).inc(now - seen[name])
            seen[name] = now
        per_pos = list(m.accepted_per_position)
        before = seen["accepted_per_position"]
        for i, count in enumerate(per_pos):
            grew = count - (before[i] if i < len(before) else 0)
            if grew > 0:
                self._label(self.spec_decode_num_accepted_tokens_per_pos, position=str(i)).inc(grew)
        seen["accepted_per_position"] = per_pos

    def record_admitted(self, num_prompt_tokens: int) -> None:
        self._label(self.prompt_tokens).inc(num_prompt_tokens)

    def record_output(self, num_tokens: int, first: bool, seconds: float) -> None:
        """``num_tokens`` new tokens of one request; ``seconds`` since it arrived (first output)
        or since its previous output."""
        if num_tokens:
            self._label(self.generation_tokens).inc(num_tokens)
        hist = self.time_to_first_token_seconds if first else self.inter_token_latency_seconds
        self._label(hist).observe(max(0.0, seconds))

    def record_finished(self, reason: str, seconds: float) -> None:
        self._label(self.request_success, finished_reason=reason).inc()
        self._label(self.e2e_request_latency_seconds).observe(max(0.0, seconds))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
