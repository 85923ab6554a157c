"""Hand-built worker states for the routing tests: WorkerInfo with a heartbeat load and a cost model."""

from __future__ import annotations

from core.cost_model import CostModel
from core.registry import WorkerInfo
from core.worker_load import WorkerLoad
from router.placement.prediction import SLO, RoutingRequest
from router.placement.prefix_index import prompt_block_hashes
from router.placement.state import PlacementBook
from router.placement.policies import RoutingPolicy, make_policy

BLOCK_SIZE = 16
FINGERPRINT = "fp-test"
# 10 ms a step, 1 ms a token, 0.5 ms a sequence, no attention term; 1 GB/s at 1000 B a token.
COST = CostModel(base_s=0.010, per_token_s=0.001, per_seq_s=0.0005, per_attn_s=0.0, num_samples=100,
                 max_num_batched_tokens=512, kv_load_bytes_per_s=1e9, kv_bytes_per_token=1000.0)


def worker(worker_id: str, role: str = "prefill", *, cost: CostModel | None = COST, running: int = 0,
           waiting: int = 0, waiting_tokens: int = 0, batched_tokens: int = 0, kv_tokens: int = 0,
           free_blocks: int = 1000, max_num_seqs: int = 64) -> WorkerInfo:
    """A worker at ``127.0.0.1:<9000 + digits of worker_id>`` with this load."""
    load = WorkerLoad(num_requests_running=running, num_requests_waiting=waiting, num_waiting_tokens=waiting_tokens,
                      num_batched_tokens=batched_tokens, num_kv_tokens=kv_tokens, num_free_blocks=free_blocks,
                      num_total_blocks=1000, max_num_seqs=max_num_seqs, cost_model=cost or CostModel())
    port = 9000 + int("".join(c for c in worker_id if c.isdigit()) or 0) + (500 if role == "decode" else 0)
    return WorkerInfo(worker_id, role, f"127.0.0.1:{port}", load, spec_fingerprint=FINGERPRINT, block_size=BLOCK_SIZE)


def request(num_tokens: int = 100, *, pool_cached: int = 0, max_tokens: int = 16, first: int = 1000,
            request_id: str = "req-1") -> RoutingRequest:
    """A prompt of ``num_tokens`` consecutive ids from ``first`` (same ``first``: same prefix)."""
    prompt = list(range(first, first + num_tokens))
    hashes = tuple(prompt_block_hashes(prompt, BLOCK_SIZE))
    return RoutingRequest(request_id, prompt, max_tokens, BLOCK_SIZE, hashes, pool_cached)


def policy(name: str, *, disaggregation: str = "auto", slo: SLO = SLO()) -> RoutingPolicy:
    """The policy ``name`` over a fresh, empty PlacementBook."""
    return booked_policy(name, disaggregation=disaggregation, slo=slo)[1]


def booked_policy(name: str, *, disaggregation: str = "auto", slo: SLO = SLO()) -> tuple[PlacementBook, RoutingPolicy]:
    """A fresh PlacementBook (the tests write it as the Placer would) and the policy ``name`` reading it."""
    book = PlacementBook()
    return book, make_policy(name, book.view, disaggregation, slo)
