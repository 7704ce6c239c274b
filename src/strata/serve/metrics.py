"""Prometheus metrics, with speculative-decoding counters named like vLLM's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self, max_window: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("strata:requests", "HTTP requests by route (unmatched paths: 'unmatched') and "
                                "status", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("strata:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("strata:generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("strata:request_success", "Finished generations by reason", ["finish_reason"],
                                registry=r)
        self.latency = Histogram("strata:e2e_request_latency_seconds", "Request latency", registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.running = Gauge("strata:num_requests_running", "Requests being generated", registry=r)
        self.waiting = Gauge("strata:num_requests_waiting", "Requests admitted and waiting for the engine", registry=r)
        self.batch_size = Histogram("strata:batch_size", "Sequences per decode step", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.drafts = Counter("strata:spec_decode_num_drafts", "Speculative rounds (drafts verified)", registry=r)
        self.draft_tokens = Counter("strata:spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("strata:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       registry=r)
        self.accepted_per_pos = Counter("strata:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each position", ["position"], registry=r)
        for i in range(max(0, max_window - 1)):
            self.accepted_per_pos.labels(position=str(i))

    def record_generation(self, res, finish_reason: str) -> None:
        """finish_reason: as the client is told (a stop string is "stop", though it ended the engine's run)."""
        self.prompt_tokens.inc(len(res.prompt_ids))
        self.generation_tokens.inc(res.new_tokens)
        self.finished.labels(finish_reason=finish_reason).inc()
        acc = res.acceptance
        drafted = sum(acc.drafted)
        if drafted:
            self.drafts.inc(acc.rounds)
            self.draft_tokens.inc(drafted)
            self.accepted_tokens.inc(sum(acc.accepted))
            for i, n in enumerate(acc.accepted):
                self.accepted_per_pos.labels(position=str(i)).inc(n)
