"""The router's Prometheus metrics (docs/design.md §9b): the request histograms and token counters
under vLLM's names (core.metric_names), the rest under ``tandem:``.

Each :class:`RouterMetrics` owns its registry, so several routers (tests) never collide. The
``vllm:`` metrics carry vLLM's ``model_name`` label (the served model's name, as the workers'
gauges), which vLLM's dashboards filter on.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from core import metric_names as names

# Buckets of vLLM's histograms of the same name, in seconds.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
PREDICTION_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class RouterMetrics:
    """Counters, gauges and histograms of requests passing through this router.

    Exposed names (prometheus-client appends ``_total`` to counters): see ``__init__``.
    ``model_name``: the served model's name, the ``model_name`` label of the ``vllm:`` metrics.
    """

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, model = self.registry, {"model_name": model_name}
        vllm_label = ["model_name"]
        self.ttft_s = Histogram(names.TTFT_SECONDS, "Time to first token.", vllm_label, buckets=TTFT_BUCKETS_S,
                                registry=r).labels(**model)
        self.itl_s = Histogram(names.ITL_SECONDS, "Time between output tokens.", vllm_label, buckets=ITL_BUCKETS_S,
                               registry=r).labels(**model)
        self.e2e_s = Histogram(names.E2E_SECONDS, "Arrival to last token.", vllm_label, buckets=E2E_BUCKETS_S,
                               registry=r).labels(**model)
        self.request_success = Counter(
            names.REQUEST_SUCCESS, "Finished requests by finish reason.", ["model_name", "finished_reason"], registry=r
        )
        self.prompt_tokens = Counter(names.PROMPT_TOKENS, "Prompt tokens of admitted requests.", vllm_label,
                                     registry=r).labels(**model)
        self.generation_tokens = Counter(names.GENERATION_TOKENS, "Generated tokens.", vllm_label,
                                         registry=r).labels(**model)
        self.prefix_cache_queries = Counter(names.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache.",
                                            vllm_label, registry=r).labels(**model)
        self.prefix_cache_hits = Counter(names.PREFIX_CACHE_HITS, "Prompt tokens found in the prefix cache.",
                                         vllm_label, registry=r).labels(**model)
        self.rejections = Counter("tandem:rejections", "Requests refused before any token, by reason.", ["reason"], registry=r)
        self.routing_decisions = Counter(
            "tandem:routing_decisions", "Workers chosen, by policy and role.", ["policy", "role"], registry=r
        )
        self.num_requests_running = Gauge("tandem:router_requests_running", "Requests in generation at this router.", registry=r)
        self.placements = Counter(
            "tandem:placements", "Requests placed, by policy and mode (colocated or disaggregated).",
            ["policy", "mode"], registry=r,
        )
        self.ttft_predicted_s = Histogram(
            "tandem:ttft_predicted_seconds", "Predicted TTFT of placed requests, by mode.", ["mode"],
            buckets=TTFT_BUCKETS_S, registry=r,
        )
        self.ttft_prediction_ratio = Histogram(
            "tandem:ttft_prediction_ratio", "Actual over predicted TTFT, by mode (1 = exact).", ["mode"],
            buckets=PREDICTION_RATIO_BUCKETS, registry=r,
        )
        self.worker_failures = Counter(
            "tandem:worker_failures", "Workers marked down after a failed RPC or stream, by role.", ["role"], registry=r
        )
        self.prefill_retries = Counter("tandem:prefill_retries", "Prefills retried after their worker failed.", registry=r)
        self.migrations = Counter(
            "tandem:migrations", "Decode streams resumed on another worker after theirs failed.", registry=r
        )
        self.colocated_fallbacks = Counter(
            "tandem:colocated_fallbacks", "Requests prefilled on their decode worker for want of a prefill worker "
            "(router.placement.fallback), by reason.", ["reason"], registry=r
        )

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason=reason).inc()

    def worker_failed(self, role: str) -> None:
        self.worker_failures.labels(role=role).inc()

    def prefill_retried(self) -> None:
        self.prefill_retries.inc()

    def migrated(self) -> None:
        self.migrations.inc()

    def routed(self, policy: str, role: str) -> None:
        self.routing_decisions.labels(policy=policy, role=role).inc()

    def placed(self, policy: str, mode: str) -> None:
        self.placements.labels(policy=policy, mode=mode).inc()

    def ttft_predicted(self, mode: str, predicted_s: float, actual_s: float) -> None:
        """One request's predicted and actual TTFT (seconds)."""
        self.ttft_predicted_s.labels(mode=mode).observe(predicted_s)
        self.ttft_prediction_ratio.labels(mode=mode).observe(actual_s / max(predicted_s, 1e-6))

    def first_token(self, ttft_s: float, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.ttft_s.observe(ttft_s)
        self.generation_tokens.inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prefix_cache_queries.inc(num_prompt_tokens)
        self.prefix_cache_hits.inc(num_cached_tokens)

    def output_tokens(self, num_tokens: int, elapsed_s: float) -> None:
        """``num_tokens`` arrived together ``elapsed_s`` after the previous ones (each gets the mean)."""
        self.generation_tokens.inc(num_tokens)
        for _ in range(num_tokens):
            self.itl_s.observe(elapsed_s / num_tokens)

    def finished(self, finish_reason: str, e2e_s: float) -> None:
        self.request_success.labels(model_name=self.model_name, finished_reason=finish_reason).inc()
        self.e2e_s.observe(e2e_s)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
