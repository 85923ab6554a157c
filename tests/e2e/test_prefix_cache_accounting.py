"""Prompt tokens reported cached (``usage.prompt_tokens_details.cached_tokens``) are the ones the
cluster really did not compute, on both paths:

- colocated: the decode worker prefills and finds the prompt in its own prefix cache; it says so
  with the first token it streams (``TokenChunk.num_cached_tokens``);
- a request that ends at its first token (max_tokens 1) never reaches the decode worker: the
  router must not count the prompt as held there, or it places the next identical request on a
  decode worker that recomputes every token (router.placement.placer ``Placer.decoding``).

The count is exact: every full block of the prompt, the last prompt token always recomputed
(its logits give the first output token).
"""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import poll_until
from tests.e2e.conftest import BLOCK_SIZE, ClusterProbe, _shared_cluster

pytestmark = pytest.mark.e2e


def expected_cached(num_prompt_tokens: int) -> int:
    return min(num_prompt_tokens // BLOCK_SIZE * BLOCK_SIZE, num_prompt_tokens - 1)


def complete(cluster, prompt: str, max_tokens: int = 1) -> dict:
    """One greedy /v1/completions; its usage."""
    response = httpx.post(f"{cluster.http_url}/v1/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def placements(cluster, mode: str) -> float:
    """The router's ``tandem:placements`` count of ``mode`` (every policy)."""
    text = httpx.get(f"{cluster.http_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tandem:placements_total{") and f'mode="{mode}"' in line)


@pytest.fixture(scope="module")
def auto_cluster(tmp_path_factory):
    """One prefill and one decode worker, sized as the shared ``cluster``, with the default
    conditional disaggregation: a prompt the decode worker holds may be placed colocated."""
    yield from _shared_cluster("auto_cluster", tmp_path_factory.mktemp("auto-cluster-logs"))


def test_colocated_hit_reports_the_decode_workers_cached_tokens(colocated_cluster):
    prompt = "Colocated accounting. " + "Rain falls softly on the old stone bridge. " * 12
    decode = ClusterProbe(colocated_cluster).decode_stats
    before = decode().num_cached_tokens
    first = complete(colocated_cluster, prompt)
    second = complete(colocated_cluster, prompt)
    n = first["prompt_tokens"]
    assert n > 4 * BLOCK_SIZE and second["prompt_tokens"] == n
    assert first["prompt_tokens_details"]["cached_tokens"] == 0  # no one sent this prompt before
    assert second["prompt_tokens_details"]["cached_tokens"] == expected_cached(n)
    assert decode().num_cached_tokens - before == expected_cached(n)


def test_a_request_ended_at_its_first_token_leaves_nothing_on_the_decode_worker(auto_cluster):
    probe = ClusterProbe(auto_cluster)
    prompt = "First token only. " + "A journey of a thousand miles begins with one step. " * 12
    # Who holds the prompt's KV: "prefill" (the prefill worker and the pool it wrote to) once it
    # prefilled the prompt, "decode" once the decode worker computed it (colocated) or loaded
    # it (a Decode stream: max_tokens > 1). The router places by the cost model: disaggregated
    # as a rule (ties go that way), colocated when the decode worker calibrated clearly faster
    # or holds the prompt; either way the count must be exactly what that worker held.
    held: set[str] = set()
    n = 0

    def run(max_tokens: int) -> str:
        nonlocal n
        before = placements(auto_cluster, "colocated")
        usage = complete(auto_cluster, prompt, max_tokens)
        n = usage["prompt_tokens"]
        where = "decode" if placements(auto_cluster, "colocated") > before else "prefill"
        assert usage["prompt_tokens_details"]["cached_tokens"] == (expected_cached(n) if where in held else 0), where
        held.add(where)
        if max_tokens > 1:
            held.add("decode")
        return where

    first = run(1)
    assert [run(1), run(1)] == [first, first]  # the worker holding it; never one without it
    if first == "prefill":  # ended at its first token: it never reached the decode worker
        assert probe.decode_stats().num_cached_tokens == 0
        assert probe.prefill_stats().num_cached_tokens == 2 * expected_cached(n)
    run(2)  # decoded once: the prompt is on the decode worker too
    run(1)  # a hit wherever it goes now
    poll_until(probe.is_idle, timeout_s=5, message="cluster back to idle")


def test_a_grammar_refused_after_a_prefix_load_holds_no_pool_lease(cluster):
    probe = ClusterProbe(cluster)
    # The prefill worker loads the pool-cached prefix (shared-memory views), then the engine
    # refuses the grammar: the views' guard must let the lease go (it was renewed until restart).
    prompt = "Grammar refused. " + "The river bends twice before it reaches the sea. " * 6
    n = complete(cluster, prompt)["prompt_tokens"]
    hits = probe.pool_stats().num_dram_hits
    response = httpx.post(f"{cluster.http_url}/v1/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 4, "guided_regex": "(?<=a)b"})
    assert response.status_code == 400
    assert "the regex cannot be compiled: " in response.json()["error"]["message"]
    assert probe.pool_stats().num_dram_hits - hits == n // BLOCK_SIZE  # loaded before the refusal
    poll_until(probe.is_idle, timeout_s=5, message="no pool lease left")
