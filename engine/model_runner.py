"""ModelRunner: executes a SchedulerOutput on the model and samples; never sees a queue."""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend, AttentionMetadata, ForwardContext, forward_context
from engine.kv_connector import unpack_blocks
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.sampler import Sampler


class ModelRunner:
    """Owns the model, the KV cache tensor and the sampler of one engine.

    ``kv_cache``: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, backend: AttentionBackend, sampler: Sampler):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.sampler = sampler
        self.device = kv_cache.device
        self.block_size = kv_cache.shape[3]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Copies blocks (copy-on-write), loads external KV, runs one forward over every scheduled
        token, samples where due. Mutates the KV cache.
        """
        for src, dst in out.block_copies:
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        for load in out.kv_loads:
            unpack_blocks(self.kv_cache, load.block_ids, load.payloads)
        if out.is_empty:
            return ModelRunnerOutput()
        input_ids, positions, meta, logits_indices = self._prepare_inputs(out)
        ctx = ForwardContext(meta, self.backend, list(self.kv_cache.unbind(0)))
        with forward_context(ctx):
            logits = self.model(input_ids, positions, logits_indices)  # [num_sampling, vocab]
        requests = [s.request for s in out.scheduled if s.samples]
        sampled = self.sampler.sample(logits, requests)
        return ModelRunnerOutput({r.request_id: t for r, t in zip(requests, sampled)})

    def _prepare_inputs(self, out: SchedulerOutput):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        bs = self.block_size
        for item in out.scheduled:
            start = item.request.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids += item.request.all_token_ids[start:end]
            positions += range(start, end)
            slots += [item.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            starts.append(starts[-1] + item.num_new_tokens)
            seq_lens.append(end)
            if item.samples:
                logits_indices.append(starts[-1] - 1)
        max_blocks = max(len(s.block_ids) for s in out.scheduled)
        tables = torch.zeros(len(out.scheduled), max_blocks, dtype=torch.long)
        for i, item in enumerate(out.scheduled):
            tables[i, : len(item.block_ids)] = torch.tensor(item.block_ids, dtype=torch.long)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            query_start_loc=torch.tensor(starts, dtype=torch.long),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long),
            block_tables=tables.to(self.device),
            max_query_len=max(s.num_new_tokens for s in out.scheduled),
            max_seq_len=max(seq_lens),
        )
        return (
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            meta,
            torch.tensor(logits_indices, dtype=torch.long, device=self.device),
        )
