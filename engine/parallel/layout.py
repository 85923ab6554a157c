"""Which slice of the model each tensor-parallel rank owns (plain ints, no torch).

Heads follow Megatron-LM / vLLM: KV heads are split into contiguous near-equal runs, one per
rank, and every query head goes with the KV head it attends through (GQA group). When the ranks
outnumber the KV heads, each KV head is replicated on ``tp / num_kv_heads`` ranks, which split its
query heads between them (vLLM's rule; it needs ``tp % num_kv_heads == 0``). Unlike vLLM the runs
may be uneven (SmolLM2-135M has 9 query and 3 KV heads: at TP=2 rank 0 owns KV heads 0-1 and
query heads 0-5, rank 1 KV head 2 and query heads 6-8), so any model shards at any TP up to its
KV heads; the cost is that the largest rank sets the pace.
"""

from __future__ import annotations

from dataclasses import dataclass


def split_evenly(total: int, parts: int, index: int) -> range:
    """The ``index``-th of ``parts`` contiguous runs of ``range(total)``, sizes differing by at
    most one, the larger runs first (numpy's ``array_split``)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


@dataclass(frozen=True)
class ShardLayout:
    """Rank ``rank`` of ``tp``'s share of a model with ``num_heads`` query and ``num_kv_heads`` KV
    heads, ``intermediate_size`` MLP columns and ``vocab_size`` rows.

    Raises:
        ValueError: quoting the sizes, when ``tp`` cannot shard them (more ranks than query heads,
            or more ranks than KV heads without ``tp % num_kv_heads == 0``).
    """

    rank: int
    tp: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank {self.rank} outside tensor_parallel_size {self.tp}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.tp > self.num_kv_heads:
            if self.tp % self.num_kv_heads:
                raise ValueError(f"tensor_parallel_size {self.tp} exceeds num_kv_heads {self.num_kv_heads} "
                                 f"and is not a multiple of it")
            if self.tp // self.num_kv_heads > self.num_heads // self.num_kv_heads:
                raise ValueError(f"tensor_parallel_size {self.tp} exceeds num_heads {self.num_heads}")
        if self.tp > min(self.intermediate_size, self.vocab_size):
            raise ValueError(f"tensor_parallel_size {self.tp} exceeds the MLP or vocabulary size")

    @property
    def replicas(self) -> int:
        """Ranks holding each KV head (1 unless the ranks outnumber the KV heads)."""
        return max(1, self.tp // self.num_kv_heads)

    def kv_heads(self, rank: int | None = None) -> range:
        """KV heads of ``rank`` (default: this layout's rank)."""
        rank = self.rank if rank is None else rank
        if self.replicas > 1:
            head = rank // self.replicas
            return range(head, head + 1)
        return split_evenly(self.num_kv_heads, self.tp, rank)

    def q_heads(self, rank: int | None = None) -> range:
        """Query heads of ``rank``: those of its KV heads' GQA groups (a share of the group when
        the KV head is replicated)."""
        rank = self.rank if rank is None else rank
        group = self.num_heads // self.num_kv_heads
        kv = self.kv_heads(rank)
        if self.replicas > 1:
            part = split_evenly(group, self.replicas, rank % self.replicas)
            return range(kv.start * group + part.start, kv.start * group + part.stop)
        return range(kv.start * group, kv.stop * group)

    def mlp_columns(self) -> range:
        """This rank's columns of the MLP's intermediate dimension."""
        return split_evenly(self.intermediate_size, self.tp, self.rank)

    def vocab_rows(self, rank: int | None = None) -> range:
        """``rank``'s rows of the LM head (token ids)."""
        return split_evenly(self.vocab_size, self.tp, self.rank if rank is None else rank)

    def kv_owner(self, head: int) -> int:
        """The rank whose copy of KV head ``head`` is packed into pool blocks (the first holder)."""
        if self.replicas > 1:
            return head * self.replicas
        return next(r for r in range(self.tp) if head in self.kv_heads(r))
