"""The grammar compiler's counters on a worker's /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from engine.structured_output import GrammarStats
from worker.metrics import GrammarCollector


def test_grammar_counters_are_exported_with_the_role() -> None:
    registry = CollectorRegistry()
    registry.register(GrammarCollector(lambda: GrammarStats(num_compiled=3, num_cache_hits=5, compile_time_s=0.25),
                                       "prefill"))
    samples = [line for line in generate_latest(registry).decode().splitlines() if not line.startswith("#")]
    assert samples == [
        'tandem:grammar_compiles_total{role="prefill"} 3.0',
        'tandem:grammar_compile_seconds_total{role="prefill"} 0.25',
        'tandem:grammar_cache_hits_total{role="prefill"} 5.0',
    ]
