"""A worker's Prometheus metrics (docs/design.md §9b), read from its live load at scrape time.

Under vLLM's names (core.metric_names), so the Gateway API Inference Extension's endpoint picker
and KEDA triggers written for vLLM read a worker as they read a vLLM server:

    vllm:num_requests_running{role, model_name}   gauge, requests in the batch
    vllm:num_requests_waiting{role, model_name}   gauge, requests queued
    vllm:kv_cache_usage_perc{role, model_name}    gauge, used / total KV blocks (0..1)
    vllm:num_preemptions_total{role, model_name}  counter

and Tandem's own:

    tandem:kv_blocks{role, state=used|free}                       gauge
    tandem:step_time_seconds{role}                                gauge, mean of the last ~16 passes
    tandem:waiting_tokens{role}                                   gauge, prompt tokens still to compute
    tandem:cost_model_coefficient_seconds{role, coefficient}      gauge, the fitted step-time model
    tandem:kv_load_bandwidth_bytes_per_second{role}               gauge, measured pool -> worker (EWMA)

plus ``tandem:grammar_compiles_total``, ``tandem:grammar_compile_seconds_total`` and
``tandem:grammar_cache_hits_total`` {role} (structured outputs, :class:`GrammarCollector`),
``tandem:kv_transfer_*`` (core.kv_transfer.metered) and
``tandem:kv_load_failures_total{stage, reason, action}`` (engine.kv_connector.load_failure),
all in one registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from core import metric_names as names

COEFFICIENTS = ("base_s", "per_token_s", "per_seq_s", "per_attn_s")
_KEYS = ("num_requests_running", "num_requests_waiting", "num_used_blocks", "num_total_blocks", "num_free_blocks",
         "num_preemptions", "recent_step_time_s", "num_waiting_tokens", "cost_kv_load_bytes_per_s",
         *(f"cost_{name}" for name in COEFFICIENTS))


class WorkerCollector(Collector):
    """Yields the metrics above from ``load_fn()``: a load's wire form (core.worker_load.WorkerLoad.to_wire)."""

    def __init__(self, load_fn: Callable[[], Mapping[str, float]], role: str, model_name: str):
        self.load_fn, self.role, self.model_name = load_fn, role, model_name

    def collect(self) -> Iterator[Metric]:
        wire = self.load_fn()
        load = {key: wire.get(key, 0) for key in _KEYS}  # a key left out (None: not reported) reads 0
        vllm_labels, values = ["role", "model_name"], [self.role, self.model_name]

        def vllm_gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, help_text, labels=vllm_labels)
            family.add_metric(values, value)
            return family

        yield vllm_gauge(names.NUM_REQUESTS_RUNNING, "Requests in the running batch.", load["num_requests_running"])
        yield vllm_gauge(names.NUM_REQUESTS_WAITING, "Requests waiting to be scheduled.", load["num_requests_waiting"])
        yield vllm_gauge(names.KV_CACHE_USAGE_PERC, "KV-cache usage. 1 means 100 percent usage.",
                         load["num_used_blocks"] / max(1, load["num_total_blocks"]))
        preemptions = CounterMetricFamily(names.NUM_PREEMPTIONS, "Preempted requests.", labels=vllm_labels)
        preemptions.add_metric(values, load["num_preemptions"])
        yield preemptions
        yield from self._tandem(load)

    def _tandem(self, load: Mapping[str, float]) -> Iterator[Metric]:
        role = [self.role]
        blocks = GaugeMetricFamily("tandem:kv_blocks", "KV cache blocks, by state.", labels=["role", "state"])
        blocks.add_metric([self.role, "used"], load["num_used_blocks"])
        blocks.add_metric([self.role, "free"], load["num_free_blocks"])
        yield blocks
        for name, key, help_text in (
            ("tandem:step_time_seconds", "recent_step_time_s", "Mean wall time of the last ~16 passes."),
            ("tandem:waiting_tokens", "num_waiting_tokens", "Prompt tokens still to compute."),
            ("tandem:kv_load_bandwidth_bytes_per_second", "cost_kv_load_bytes_per_s",
             "Measured pool -> worker KV bandwidth (EWMA)."),
        ):
            family = GaugeMetricFamily(name, help_text, labels=["role"])
            family.add_metric(role, load[key])
            yield family
        coefficient = GaugeMetricFamily(
            "tandem:cost_model_coefficient_seconds",
            "Fitted step-time coefficient (seconds per step, token, sequence or 1k attention pairs).",
            labels=["role", "coefficient"])
        for name in COEFFICIENTS:
            coefficient.add_metric([self.role, name], load[f"cost_{name}"])
        yield coefficient


class GrammarCollector(Collector):
    """The engine's grammar compiler counters (engine.structured_output.GrammarStats), read at
    scrape time from ``stats_fn()``."""

    def __init__(self, stats_fn: Callable[[], object], role: str):
        self.stats_fn, self.role = stats_fn, role

    def collect(self) -> Iterator[Metric]:
        stats = self.stats_fn()
        for name, value, help_text in (
            (names.GRAMMAR_COMPILES, stats.num_compiled, "Structured-output grammars compiled."),
            (names.GRAMMAR_COMPILE_SECONDS, stats.compile_time_s, "Seconds spent compiling grammars."),
            (names.GRAMMAR_CACHE_HITS, stats.num_cache_hits,
             "Structured requests whose grammar was compiled (or compiling) already."),
        ):
            family = CounterMetricFamily(name, help_text, labels=["role"])
            family.add_metric([self.role], value)
            yield family
