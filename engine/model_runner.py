"""ModelRunner: executes a SchedulerOutput on the model and samples; never sees a queue."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from core.cost_model import StepSample, prefill_attn_pairs
from core.request import Request
from engine.attention import AttentionBackend, AttentionMetadata, ForwardContext, forward_context
from engine.kv_connector import unpack_blocks
from engine.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SchedulerOutput
from engine.sampler import Sampler


@dataclass
class PreparedStep:
    """A step's inputs, built ahead of time. ``input_ids`` stays a Python list until run() so
    placeholders can be patched cheaply."""

    out: SchedulerOutput
    input_ids: list[int] = field(default_factory=list)
    positions: torch.Tensor | None = None  # [num_tokens], int64
    meta: AttentionMetadata | None = None
    logits_indices: torch.Tensor | None = None  # [num_sampling], int64
    # Copies of the sampling requests as of preparation (the live ones move on concurrently).
    sampling_requests: list[Request] = field(default_factory=list)
    # (index into input_ids, request_id) whose token comes from the previous step.
    placeholders: list[tuple[int, str]] = field(default_factory=list)
    # The cost model's features of this pass (num_new_tokens, num_seqs, attn_pairs), taken while
    # num_computed_tokens is still the pass's start (overlap moves it on before the pass runs).
    features: tuple[int, int, float] = (0, 0, 0.0)

    def patch(self, sampled: dict[str, int]) -> None:
        """Fills placeholders with the tokens the previous step sampled. Mutates this step."""
        for index, request_id in self.placeholders:
            self.input_ids[index] = sampled[request_id]
        for snap in self.sampling_requests:
            if snap.output_token_ids and snap.output_token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                snap.output_token_ids[-1] = sampled[snap.request_id]
        self.placeholders = []


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
        # Seconds spent in forward + sampling (the "device busy" time).
        self.busy_time_s = 0.0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """prepare + run in one go (the non-overlapped path)."""
        return self.run(self.prepare(out))

    def prepare(self, out: SchedulerOutput) -> PreparedStep:
        """Builds the step's input tensors and sampling snapshots from the requests. CPU only;
        reads the requests, never the KV cache, so it can run while the previous step executes.

        Tokens not known yet (``PLACEHOLDER_TOKEN_ID``, sampled by the step still running) are
        listed in ``placeholders`` for :meth:`PreparedStep.patch`.
        """
        if out.is_empty:
            return PreparedStep(out)
        input_ids, positions, meta, logits_indices = self._prepare_inputs(out)
        # Only a request's last token can be unknown: check each request's last input token.
        last_indices = [end - 1 for end in meta.query_start_loc[1:].tolist()]
        placeholders = [
            (i, item.request.request_id)
            for i, item in zip(last_indices, out.scheduled)
            if input_ids[i] == PLACEHOLDER_TOKEN_ID
        ]
        snapshots = []
        for item in out.scheduled:
            if item.samples:
                snap = copy.copy(item.request)
                snap.output_token_ids = list(item.request.output_token_ids)
                snapshots.append(snap)
        features = (
            out.num_scheduled_tokens,
            len(out.scheduled),
            sum(prefill_attn_pairs(s.num_new_tokens, s.request.num_computed_tokens) for s in out.scheduled),
        )
        return PreparedStep(out, input_ids, positions, meta, logits_indices, snapshots,
                            placeholders, features)

    @torch.inference_mode()
    def run(self, step: PreparedStep) -> ModelRunnerOutput:
        """Copies blocks (copy-on-write), loads external KV, runs one forward over every scheduled
        token, samples where due. Mutates the KV cache; touches no request (overlap-safe)."""
        out = step.out
        for src, dst in out.block_copies:
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        for load in out.kv_loads:
            unpack_blocks(self.kv_cache, load.block_ids, load.payloads)
        if out.is_empty:
            return ModelRunnerOutput()
        started = time.perf_counter()
        input_ids = torch.tensor(step.input_ids, dtype=torch.long, device=self.device)
        ctx = ForwardContext(step.meta, self.backend, list(self.kv_cache.unbind(0)))
        with forward_context(ctx):
            logits = self.model(input_ids, step.positions, step.logits_indices)  # [num_sampling, vocab]
        sampled = self.sampler.sample(logits, step.sampling_requests)
        duration_s = time.perf_counter() - started
        self.busy_time_s += duration_s
        return ModelRunnerOutput({r.request_id: t for r, t in zip(step.sampling_requests, sampled)},
                                 StepSample(*step.features, duration_s))

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
            input_ids,
            torch.tensor(positions, dtype=torch.long, device=self.device),
            meta,
            torch.tensor(logits_indices, dtype=torch.long, device=self.device),
        )
