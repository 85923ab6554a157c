"""Rank 0's ModelRunner, which sends every step to the other ranks, and their execute-only loop.

Rank 0 runs the scheduler (the whole LLMEngine); per pass it scatters one :class:`StepMessage`
per rank (the pass's inputs, copy-on-write copies, and the KV to load cut to that rank's heads),
then every rank runs the same forward over its shard, and rank 0 samples from the gathered
logits. The other ranks never see a request.

KV in the pool is TP-independent: a block is ``[num_layers, 2, block_size, num_kv_heads,
head_dim]`` with every KV head (docs/design.md §4). Rank 0 does all pool I/O ("one rank gathers"):

- load: rank 0 reads each block once from the pool and sends each rank the bytes of the heads it
  owns, ``(tp - 1) / tp`` of the block over the TP group (a replicated head goes to each holder);
- save: each rank packs its heads, rank 0 gathers and interleaves them into whole blocks, the
  same ``(tp - 1) / tp`` of a block in, then one pool write.

Reading per rank instead would move the same bytes from the pool and none between ranks, but
needs a pool client, a lease and the manifest on every rank, and N puts that must commit together
for a block to become visible; the extra hop is inside one node (NVLink / shared memory), faster
than the pool's link, so the gather keeps the pool protocol unchanged at a small cost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention import AttentionMetadata, ForwardContext, forward_context
from engine.kv_connector import ArenaBlock, pack_blocks, unpack_blocks
from engine.model_runner import ModelRunner, PreparedStep
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.parallel.group import CollectiveTimer, RankFailure, RankGroup
from engine.parallel.layout import ShardLayout

STEP, PACK, WARM_UP, TIMINGS, STOP = "step", "pack", "warm_up", "timings", "stop"


@dataclass
class StepMessage:
    """What one rank executes next. ``kind``: STEP (copies, loads, then a forward when
    ``input_ids`` is set), PACK (send back ``block_ids``' bytes), WARM_UP, TIMINGS (send back
    and reset the CollectiveTimer) or STOP. Tensors on CPU."""

    kind: str
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # (block_ids, payloads of this rank's heads) per load.
    loads: list[tuple[list[int], list[bytes]]] = field(default_factory=list)
    input_ids: list[int] | None = None
    positions: torch.Tensor | None = None  # [num_tokens], int64
    meta: AttentionMetadata | None = None
    logits_indices: torch.Tensor | None = None  # [num_sampling], int64
    block_ids: list[int] = field(default_factory=list)  # PACK
    num_tokens: int = 0  # WARM_UP


def head_slice(payload, layout: ShardLayout, shape: tuple[int, ...], rank: int) -> bytes:
    """The bytes of ``rank``'s KV heads out of one whole block ``payload`` (``shape``: the block
    as ``[num_layers, 2, block_size, num_kv_heads, head_dim x element bytes]`` uint8)."""
    heads = layout.kv_heads(rank)
    block = np.frombuffer(payload, dtype=np.uint8).reshape(shape)
    return np.ascontiguousarray(block[:, :, :, heads.start:heads.stop]).tobytes()


def join_heads(parts: list[list[bytes]], layout: ShardLayout, shape: tuple[int, ...]) -> list[bytes]:
    """Whole blocks from every rank's packed heads (``parts[rank][block]``), each head taken from
    its owner (:meth:`ShardLayout.kv_owner`)."""
    blocks = []
    for i in range(len(parts[0])):
        block = np.empty(shape, np.uint8)
        for rank in sorted({layout.kv_owner(h) for h in range(layout.num_kv_heads)}):
            heads = layout.kv_heads(rank)
            local = (*shape[:3], len(heads), shape[4])
            block[:, :, :, heads.start:heads.stop] = np.frombuffer(parts[rank][i], np.uint8).reshape(local)
        blocks.append(block.tobytes())
    return blocks


def apply_kv_moves(kv_cache: torch.Tensor, message: StepMessage) -> None:
    """The message's block copies, then its loads (this rank's heads). Mutates ``kv_cache``."""
    for src, dst in message.block_copies:
        kv_cache[:, :, dst] = kv_cache[:, :, src]
    for block_ids, payloads in message.loads:
        unpack_blocks(kv_cache, block_ids, payloads)


class TensorParallelRunner(ModelRunner):
    """Rank 0 of a tensor-parallel worker: a ModelRunner whose passes run on every rank.

    ``kv_cache`` holds rank 0's KV heads only; :meth:`pack_blocks` returns whole pool blocks.
    Raises :class:`engine.parallel.group.RankFailure` from any method once a rank is gone.
    """

    def __init__(self, model, kv_cache, backend, sampler, group: RankGroup, layout: ShardLayout,
                 on_shutdown=lambda: None, on_failure=None):
        super().__init__(model, kv_cache, backend, sampler)
        self.group, self.layout = group, layout
        self._on_shutdown = on_shutdown
        self._on_failure = on_failure  # called with the RankFailure before it propagates
        self._local: StepMessage | None = None
        self._busy_mark = 0.0  # busy_time_s at the last rank_timings()
        num_layers, _, _, block_size, _, head_dim = kv_cache.shape
        # One whole block as bytes: [num_layers, 2, block_size, num_kv_heads, head_dim x elt].
        self.block_shape = (num_layers, 2, block_size, layout.num_kv_heads, head_dim * kv_cache.element_size())

    @torch.inference_mode()
    def run(self, step: PreparedStep) -> ModelRunnerOutput:
        with self._failing():
            self._local = self.group.scatter([self._message(step, rank) for rank in range(self.group.world_size)])
            self.group.timer.num_passes += not step.out.is_empty
            return super().run(step)

    @contextlib.contextmanager
    def _failing(self):
        """Hands a RankFailure to ``on_failure`` (a served worker exits there), then re-raises."""
        try:
            yield
        except RankFailure as err:
            if self._on_failure is not None:
                self._on_failure(err)
            raise

    def _move_kv(self, out: SchedulerOutput) -> None:
        apply_kv_moves(self.kv_cache, self._local)

    def _message(self, step: PreparedStep, rank: int) -> StepMessage:
        out = step.out
        loads = [(load.block_ids, [head_slice(p, self.layout, self.block_shape, rank) for p in load.payloads])
                 for load in out.kv_loads]
        if rank == self.group.world_size - 1:  # every slice is cut: the pool's slots may go
            _release_arena_leases(out)
        if out.is_empty:
            return StepMessage(STEP, list(out.block_copies), loads)
        return StepMessage(STEP, list(out.block_copies), loads, step.input_ids, step.positions.cpu(),
                           _cpu_meta(step.meta), step.logits_indices.cpu())

    def pack_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Whole blocks (every KV head) gathered from the ranks. Reads only."""
        with self._failing():
            self.group.scatter([StepMessage(PACK, block_ids=block_ids)] * self.group.world_size)
            parts = self.group.gather(pack_blocks(self.kv_cache, block_ids))
        return join_heads(parts, self.layout, self.block_shape)

    def rank_timings(self) -> list[CollectiveTimer]:
        """Every rank's CollectiveTimer since the last call (rank 0's ``forward_s``: its
        forward + sampling), then resets them all (benchmarks/tp_step.py)."""
        with self._failing():
            self.group.scatter([StepMessage(TIMINGS)] * self.group.world_size)
            mine = dataclasses.replace(self.group.timer, forward_s=self.busy_time_s - self._busy_mark)
            timings = self.group.gather(_reset(self.group))
        self._busy_mark = self.busy_time_s
        timings[0] = mine
        return timings

    def warm_up(self, num_tokens: int) -> None:
        with self._failing():
            self.group.scatter([StepMessage(WARM_UP, num_tokens=num_tokens)] * self.group.world_size)
            super().warm_up(num_tokens)

    def shutdown(self) -> None:
        """Tells the other ranks to exit, then leaves the group (idempotent)."""
        if self._on_shutdown is None:
            return
        on_shutdown, self._on_shutdown = self._on_shutdown, None
        on_shutdown()


def serve_rank(runner: ModelRunner, group: RankGroup) -> None:
    """A rank > 0's loop: executes rank 0's messages on ``runner`` (this rank's shard and KV
    heads) until STOP. Raises RankFailure when rank 0 is gone."""
    while True:
        message: StepMessage = group.scatter(None)
        if message.kind == STOP:
            return
        if message.kind == PACK:
            group.gather(pack_blocks(runner.kv_cache, message.block_ids))
        elif message.kind == TIMINGS:
            group.gather(_reset(group))
        elif message.kind == WARM_UP:
            runner.warm_up(message.num_tokens)
        else:
            started = time.perf_counter()
            execute_step(runner, message)
            group.timer.forward_s += time.perf_counter() - started
            group.timer.num_passes += message.input_ids is not None


@torch.inference_mode()
def execute_step(runner: ModelRunner, message: StepMessage) -> None:
    """Loads and forward of one pass on a rank > 0; the logits are rank 0's to sample."""
    apply_kv_moves(runner.kv_cache, message)
    if message.input_ids is None:
        return
    device = runner.device
    input_ids = torch.tensor(message.input_ids, dtype=torch.long, device=device)
    meta = _on_device(message.meta, device)
    with forward_context(ForwardContext(meta, runner.backend, list(runner.kv_cache.unbind(0)))):
        runner.model(input_ids, message.positions.to(device), message.logits_indices.to(device))


def _reset(group: RankGroup) -> CollectiveTimer:
    """This rank's timer so far; the group gets a fresh one."""
    timer, group.timer = group.timer, CollectiveTimer()
    return timer


def _release_arena_leases(out: SchedulerOutput) -> None:
    """Lets go of the pool leases behind shared-memory payloads once their bytes were copied."""
    guards = {id(p.guard): p.guard for load in out.kv_loads for p in load.payloads
              if isinstance(p, ArenaBlock) and p.guard is not None}
    for guard in guards.values():
        guard.done()


def _cpu_meta(meta: AttentionMetadata) -> AttentionMetadata:
    return _on_device(meta, "cpu")


def _on_device(meta: AttentionMetadata, device) -> AttentionMetadata:
    moved = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
    for name in ("slot_mapping", "block_tables"):
        moved[name] = moved[name].to(device)
    return AttentionMetadata(**moved)
