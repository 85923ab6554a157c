"""ModelRunner: executes a SchedulerOutput on the model and samples; never sees a queue."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from core.cost_model import StepSample, prefill_attn_pairs
from engine.attention import AttentionBackend, AttentionMetadata, ForwardContext, forward_context
from engine.kv_connector.blocks import pack_blocks, unpack_blocks
from engine.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, PromptLogprobsInput, SamplingInput, SchedulerOutput
from engine.sampler import Sampler, prompt_logprobs
from engine.structured_output import StructuredOutputManager


@dataclass
class PreparedStep:
    """A step's inputs, built ahead of time. ``input_ids`` stays a Python list until run() so
    placeholders can be patched cheaply."""

    out: SchedulerOutput
    input_ids: list[int] = field(default_factory=list)
    positions: torch.Tensor | None = None  # [num_tokens], int64
    meta: AttentionMetadata | None = None
    logits_indices: torch.Tensor | None = None  # [num_sampling + num_prompt_logprobs], int64
    # What the sampler reads of each sampling request (copied at schedule time).
    sampling: list[SamplingInput] = field(default_factory=list)
    # (index into input_ids, request_id) whose token comes from the previous step.
    placeholders: list[tuple[int, str]] = field(default_factory=list)
    # Requests whose prompt logprobs this step computes; their logits rows follow the sampling ones.
    prompt_rows: list[tuple[str, PromptLogprobsInput]] = field(default_factory=list)

    def patch(self, sampled: dict[str, int]) -> None:
        """Fills placeholders with the tokens the previous step sampled. Mutates this step (and
        its sampling inputs' output copies)."""
        for index, request_id in self.placeholders:
            self.input_ids[index] = sampled[request_id]
        for item in self.sampling:
            if item.output_token_ids and item.output_token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                item.output_token_ids[-1] = sampled[item.request_id]
        self.placeholders = []

    @property
    def features(self) -> tuple[int, int, float]:
        """The cost model's features of this pass: (num_new_tokens, num_seqs, attn_pairs)."""
        scheduled = self.out.scheduled
        pairs = sum(prefill_attn_pairs(s.num_new_tokens, s.num_computed_tokens) for s in scheduled)
        return self.out.num_scheduled_tokens, len(scheduled), pairs


class ModelRunner:
    """Owns the model, the KV cache tensor and the sampler of one engine.

    ``kv_cache``: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, backend: AttentionBackend, sampler: Sampler):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.sampler = sampler
        # The engine's grammars (engine.structured_output); None runs without structured outputs.
        self.structured: StructuredOutputManager | None = None
        self.device = kv_cache.device
        self.block_size = kv_cache.shape[3]
        # Seconds spent in forward + sampling (the "device busy" time).
        self.busy_time_s = 0.0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """prepare + run in one go (the non-overlapped path)."""
        return self.run(self.prepare(out))

    def prepare(self, out: SchedulerOutput) -> PreparedStep:
        """Builds the step's input tensors from ``out`` (plain data). CPU only; never reads the
        KV cache, so it can run while the previous step executes.

        Tokens not known yet (``PLACEHOLDER_TOKEN_ID``, sampled by the step still running) are
        listed in ``placeholders`` for :meth:`PreparedStep.patch`.
        """
        if out.is_empty:
            return PreparedStep(out)
        input_ids, positions, meta, logits_indices = self._prepare_inputs(out)
        # Only a request's last token can be unknown: check each request's last input token.
        last_indices = [end - 1 for end in meta.query_start_loc[1:].tolist()]
        placeholders = [
            (i, item.request_id)
            for i, item in zip(last_indices, out.scheduled)
            if input_ids[i] == PLACEHOLDER_TOKEN_ID
        ]
        sampling = [item.sampling for item in out.scheduled if item.sampling is not None]
        prompt_rows = [(item.request_id, item.prompt_logprobs) for item in out.scheduled
                       if item.prompt_logprobs is not None]
        return PreparedStep(out, input_ids, positions, meta, logits_indices, sampling, placeholders, prompt_rows)

    @torch.inference_mode()
    def run(self, step: PreparedStep) -> ModelRunnerOutput:
        """Copies blocks (copy-on-write), loads external KV, runs one forward over every scheduled
        token, samples where due. Mutates the KV cache and the structured rows' grammar matchers
        (the bitmask is filled on the fill thread while the forward runs); touches no request
        (overlap-safe)."""
        out = step.out
        self._move_kv(out)
        if out.is_empty:
            return ModelRunnerOutput()
        started = time.perf_counter()
        structured = self.structured
        filling = structured.fill_async(step.sampling) if structured is not None else None
        input_ids = torch.tensor(step.input_ids, dtype=torch.long, device=self.device)
        ctx = ForwardContext(step.meta, self.backend, list(self.kv_cache.unbind(0)))
        with forward_context(ctx):
            logits = self.model(input_ids, step.positions, step.logits_indices)  # [num_logits, vocab]
        num_sampling = len(step.sampling)
        sampled = self.sampler.sample(logits[:num_sampling], step.sampling,
                                      filling.result() if filling is not None else None)
        if filling is not None:
            structured.accept(step.sampling, sampled)
        prompt = prompt_logprobs(logits[num_sampling:], step.prompt_rows)
        duration_s = time.perf_counter() - started
        self.busy_time_s += duration_s
        return ModelRunnerOutput({r.request_id: t for r, t in zip(step.sampling, sampled)},
                                 step_sample=StepSample(*step.features, duration_s), prompt_logprobs=prompt)

    def _move_kv(self, out: SchedulerOutput) -> None:
        """The step's copy-on-write block copies, then its external KV loads. Mutates the KV cache."""
        for src, dst in out.block_copies:
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        for load in out.kv_loads:
            unpack_blocks(self.kv_cache, load.block_ids, load.payloads)

    def pack_blocks(self, block_ids: list[int]) -> list[bytes]:
        """The pool bytes of ``block_ids`` (engine.kv_connector.pack_blocks). Reads only."""
        return pack_blocks(self.kv_cache, block_ids)

    def shutdown(self) -> None:
        """Releases what the runner started (nothing here; tensor-parallel ranks in a subclass)."""

    def _prepare_inputs(self, out: SchedulerOutput):
        """Step tensors with numpy, one Python operation per sequence, none per token::

            q_lens          [3, 1, 5]            tokens each sequence computes this step
            query_start_loc [0, 3, 4, 9]         prefix sums
            positions       c0 c0+1 c0+2 | c1 | c2 .. c2+4     (c = num_computed_tokens)
            slot_mapping    table[seq, pos // block_size] * block_size + pos % block_size
        """
        scheduled = out.scheduled
        num_seqs = len(scheduled)
        q_lens = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, num_seqs)
        computed = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, num_seqs)
        starts = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(q_lens, out=starts[1:])
        seq_lens = computed + q_lens
        input_ids: list[int] = []
        for item in scheduled:
            input_ids += item.token_ids
        max_blocks = max(len(s.block_ids) for s in scheduled)
        tables = np.zeros((num_seqs, max_blocks), np.int64)  # padded with block 0, never read
        for i, item in enumerate(scheduled):
            tables[i, : len(item.block_ids)] = item.block_ids
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
        positions = np.arange(starts[-1], dtype=np.int64) - starts[:-1][seq_of_token] + computed[seq_of_token]
        bs = self.block_size
        slots = tables[seq_of_token, positions // bs] * bs + positions % bs
        samples = np.fromiter((s.samples for s in scheduled), bool, num_seqs)
        logits_indices = starts[1:][samples] - 1  # each sampling sequence's last token
        # Then, for prompt logprobs, a sequence's first len(targets) tokens (PromptLogprobsInput).
        prompt_indices = [np.arange(starts[i], starts[i] + len(s.prompt_logprobs.target_token_ids))
                          for i, s in enumerate(scheduled) if s.prompt_logprobs is not None]
        if prompt_indices:
            logits_indices = np.concatenate([logits_indices, *prompt_indices])
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(self.device),
            query_start_loc=torch.from_numpy(starts),
            seq_lens=torch.from_numpy(seq_lens),
            block_tables=torch.from_numpy(tables).to(self.device),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        return (
            input_ids,
            torch.from_numpy(positions).to(self.device),
            meta,
            torch.from_numpy(logits_indices).to(self.device),
        )

    def warm_up(self, num_tokens: int) -> None:
        """One forward of a single ``num_tokens``-token sequence (<= block_size) at positions
        0.. in block 0, so a compiled model compiles that shape now rather than on a request.
        Writes garbage K/V into block 0, which is free (every block is written before read)."""
        positions = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=positions.clone(),
            query_start_loc=torch.tensor([0, num_tokens]),
            seq_lens=torch.tensor([num_tokens]),
            block_tables=torch.zeros(1, 1, dtype=torch.long, device=self.device),
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
        )
        # Inputs made outside inference mode, as prepare() makes them: a compiled graph guards on it.
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        logits_indices = torch.tensor([num_tokens - 1], device=self.device)
        with torch.inference_mode(), forward_context(ForwardContext(meta, self.backend, list(self.kv_cache.unbind(0)))):
            self.model(input_ids, positions, logits_indices)
