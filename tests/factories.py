"""Factories for tests built from plain ints: requests, schedulers, a fake model runner."""

from __future__ import annotations

import itertools

from core.request import Request
from core.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.outputs import ModelRunnerOutput, SampledToken, SchedulerOutput
from engine.scheduler import Scheduler

_ids = itertools.count()


def make_request(num_prompt_tokens: int, max_tokens: int = 4, request_id: str | None = None, **params) -> Request:
    prompt = [(7 * i + 3) % 1000 + 3 for i in range(num_prompt_tokens)]
    return Request(
        request_id or f"req-{next(_ids)}",
        prompt,
        SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),
        eos_token_id=2,
    )


def make_scheduler(**overrides) -> Scheduler:
    defaults = dict(block_size=4, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128)
    return Scheduler(EngineConfig(**{**defaults, **overrides}))


def fake_runner_output(out: SchedulerOutput, token_id: int = 100) -> ModelRunnerOutput:
    """Samples ``token_id`` for every request whose step reaches its last token."""
    return ModelRunnerOutput({s.request_id: SampledToken(token_id) for s in out.scheduled if s.samples})


def engine_logits(model, token_ids: list[int], backend, num_cached: int = 0, block_size: int = 16):
    """Logits ``[len(token_ids) - num_cached, vocab]`` (float32) of ``model`` (an engine
    LlamaForCausalLM) at each position from ``num_cached`` on, for one sequence on blocks
    0, 1, ... of a fresh KV cache: one forward of the first ``num_cached`` tokens (when > 0) fills
    the cache, a second computes the rest over it (a decode when one token is left)."""
    import torch

    from engine.attention import AttentionMetadata, ForwardContext, forward_context

    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    num_blocks = -(-len(token_ids) // block_size)
    dtype = model.model.embed_tokens.weight.dtype
    kv_cache = torch.zeros(config.num_hidden_layers, 2, num_blocks, block_size, config.num_key_value_heads,
                           head_dim, dtype=dtype)
    logits = None
    for start, end in ((0, num_cached), (num_cached, len(token_ids))):
        if end == start:
            continue
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, end),  # blocks 0, 1, ... in order: slot == position
            query_start_loc=torch.tensor([0, end - start]),
            seq_lens=torch.tensor([end]),
            block_tables=torch.arange(num_blocks)[None],
            max_query_len=end - start,
            max_seq_len=end,
        )
        with torch.inference_mode(), forward_context(ForwardContext(meta, backend, list(kv_cache.unbind(0)))):
            logits = model(torch.tensor(token_ids[start:end]), torch.arange(start, end), torch.arange(end - start))
    return logits


def run_all(engine, requests, external=None) -> dict[str, list[int]]:
    """Adds ``requests`` (with their ``external`` KV by request id) to an LLMEngine, steps it until
    none is unfinished and returns each request's output token ids; asserts every KV block is free
    afterwards."""
    outputs = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r, (external or {}).get(r.request_id))
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id] += o.new_token_ids
    assert engine.stats().num_used_blocks == 0
    return outputs


def stored_prefix(store, spec_fingerprint: str, block_hashes) -> int:
    """How many leading ``block_hashes`` a kv_pool BlockStore holds STORED, in DRAM or on NVMe (a
    WRITING block is a gap). Mutates nothing: no lease, no LRU touch, no promotion."""
    from core.block_key import BlockKey
    from kv_pool.block_store import BlockState

    for i, block_hash in enumerate(block_hashes):
        key = BlockKey.content(spec_fingerprint, block_hash)
        on_nvme = store.nvme is not None and key in store.nvme
        if store.block_state(key) is not BlockState.STORED and not on_nvme:
            return i
    return len(block_hashes)
