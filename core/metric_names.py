"""The names of the Prometheus metrics Tandem's services export (docs/design.md §9b).

Where a vLLM metric means the same thing (same quantity, unit and type), Tandem exports it under
vLLM's own name (``vllm/v1/metrics/loggers.py``), so what reads vLLM's metrics works unchanged:
the Gateway API Inference Extension's endpoint picker (``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` on each model server: here the prefill and decode workers), KEDA
triggers and vLLM's Grafana dashboards (the request histograms and token counters: here the
router, which is what a vLLM API server is to its clients). Everything vLLM has no name for is
``tandem:`` (pool tiers, transfers, leases, placements, migrations, the cluster view).

Labels differ from vLLM's: Tandem sets ``role`` (and ``model_name``) on worker gauges instead of
vLLM's ``model_name`` and ``engine``; the router's request metrics carry ``model_name`` as vLLM's
do. Queries that aggregate (``sum``, ``max``, ``rate``) work as they are.
"""

from __future__ import annotations

# ---- vLLM's names (same meaning), exported by the service named -------------------------------
TTFT_SECONDS = "vllm:time_to_first_token_seconds"  # router, histogram: arrival to first token
ITL_SECONDS = "vllm:inter_token_latency_seconds"  # router, histogram: between output tokens (TBT)
E2E_SECONDS = "vllm:e2e_request_latency_seconds"  # router, histogram: arrival to last token
REQUEST_SUCCESS = "vllm:request_success"  # router, counter {finished_reason}
PROMPT_TOKENS = "vllm:prompt_tokens"  # router, counter: prompt tokens of admitted requests
GENERATION_TOKENS = "vllm:generation_tokens"  # router, counter
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"  # router, counter: prompt tokens looked up
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"  # router, counter: of which cached (pool or worker)
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"  # workers, gauge: requests in the batch
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"  # workers, gauge: requests queued
KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"  # workers, gauge: used / total KV blocks, 0..1
NUM_PREEMPTIONS = "vllm:num_preemptions"  # workers, counter

# name -> (Prometheus type, exporting service); tests/unit/core/test_metric_names.py checks each
# against vLLM's list (tests/data/vllm_metrics.txt) and against what the service registers.
VLLM_COMPATIBLE: dict[str, tuple[str, str]] = {
    TTFT_SECONDS: ("histogram", "router"),
    ITL_SECONDS: ("histogram", "router"),
    E2E_SECONDS: ("histogram", "router"),
    REQUEST_SUCCESS: ("counter", "router"),
    PROMPT_TOKENS: ("counter", "router"),
    GENERATION_TOKENS: ("counter", "router"),
    PREFIX_CACHE_QUERIES: ("counter", "router"),
    PREFIX_CACHE_HITS: ("counter", "router"),
    NUM_REQUESTS_RUNNING: ("gauge", "worker"),
    NUM_REQUESTS_WAITING: ("gauge", "worker"),
    KV_CACHE_USAGE_PERC: ("gauge", "worker"),
    NUM_PREEMPTIONS: ("counter", "worker"),
}

# ---- Tandem's own -----------------------------------------------------------------------------
# KV transfer, per backend (grpc, shm, nixl) and direction (read: pool -> worker, write: worker -> pool),
# in the process that moves the bytes (the workers).
KV_TRANSFER_BYTES = "tandem:kv_transfer_bytes"  # counter
KV_TRANSFER_SECONDS = "tandem:kv_transfer_seconds"  # counter: wall time of the transfers
KV_TRANSFER_ERRORS = "tandem:kv_transfer_errors"  # counter: transfers that raised
# KV loads from the pool that failed, in the worker that loaded {stage, reason, action}
# (engine.kv_connector.load_failure).
KV_LOAD_FAILURES = "tandem:kv_load_failures"  # counter
# Structured outputs, in each worker's engine {role} (engine.structured_output.GrammarStats).
GRAMMAR_COMPILES = "tandem:grammar_compiles"  # counter: grammars compiled
GRAMMAR_COMPILE_SECONDS = "tandem:grammar_compile_seconds"  # counter: time spent compiling
GRAMMAR_CACHE_HITS = "tandem:grammar_cache_hits"  # counter: requests whose grammar was compiled already
# Core sharing between the roles on one machine (engine.core_share).
CORE_SHARE_PASSES = "tandem:core_share_passes"  # counter {cores: own|borrowed}: a decode worker's passes
CORE_SHARE_WAIT_SECONDS = "tandem:core_share_wait_seconds"  # counter: a prefill worker's waits for its cores

# The router's cluster view: one sample per live worker or pool node, read from its heartbeat.
CLUSTER_WORKERS = "tandem:cluster_workers"  # gauge {role}: live processes
WORKER_PREFIX = "tandem:worker_"  # tandem:worker_<load key> {role, worker_id}
POOL_NODE_PREFIX = "tandem:pool_node_"  # tandem:pool_node_<quantity> {node_id[, tier]}
