"""What the simulator replays: requests with token-id prompts and arrival times.

Trace prompts are :class:`TracePrompt` sequences computed on demand instead of lists (the full
Mooncake conversation trace holds 145M prompt tokens: as Python ints, several GB). They keep the
trace's promise that two rows share their prompt prefix exactly as far as their leading
``hash_ids`` agree, which is all the schedulers' prefix caches look at (block hashes of token
ids); the first token of each trace block is its hash id, the others their offset in the block.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.arrivals import ArrivalConfig, send_times_s
from bench.traces import MOONCAKE_BLOCK_TOKENS, read_trace
from bench.workloads import BenchRequest

_UNIQUE_BASE = 1 << 30  # node ids of rows without hash ids: never equal to a trace hash id


class TokenSequence(Sequence[int]):
    """A read-only token sequence; ``+ list`` gives a list-like concatenation (Request.all_token_ids)."""

    def __add__(self, other: Sequence[int]) -> Sequence[int]:
        return _Concat(self, list(other)) if other else self

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


class TracePrompt(TokenSequence):
    """``length`` tokens in blocks of ``block_tokens``; block ``j`` starts with ``node_ids[j]``."""

    __slots__ = ("node_ids", "block_tokens", "length")

    def __init__(self, node_ids: Sequence[int], block_tokens: int, length: int):
        if length < 1 or len(node_ids) * block_tokens < length:
            raise ValueError(f"{len(node_ids)} blocks of {block_tokens} cannot hold {length} tokens")
        self.node_ids, self.block_tokens, self.length = tuple(node_ids), block_tokens, length

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        return iter(self.tolist())

    def tolist(self) -> list[int]:
        """The tokens as a list (what the simulated workers' Requests hold: ``len`` and slices
        of a list are C calls, the scheduler's hot path). The offsets are shared int objects, so
        a list costs one pointer per token."""
        tail, tokens = _offsets(self.block_tokens), []
        for node in self.node_ids:
            tokens.append(node)
            tokens += tail
        del tokens[self.length:]
        return tokens

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self.length)
            if step == 1:
                return self._span(start, stop)
            nodes, unit = self.node_ids, self.block_tokens
            return [nodes[p // unit] if p % unit == 0 else p % unit for p in range(start, stop, step)]
        if index < 0:
            index += self.length
        if not 0 <= index < self.length:
            raise IndexError(index)
        return self.node_ids[index // self.block_tokens] if index % self.block_tokens == 0 else index % self.block_tokens

    def _span(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) (0 <= start <= stop <= length), a trace block at a time."""
        unit, tail, tokens = self.block_tokens, _offsets(self.block_tokens), []
        block, offset = divmod(start, unit)
        while start < stop:
            end = min(stop, (block + 1) * unit)
            if offset == 0:
                tokens.append(self.node_ids[block])
                tokens += tail[: end - start - 1]
            else:
                tokens += tail[offset - 1 : offset - 1 + end - start]
            start, block, offset = end, block + 1, 0
        return tokens


@functools.lru_cache(maxsize=None)
def _offsets(block_tokens: int) -> tuple[int, ...]:
    """1 .. block_tokens - 1: the tokens after a trace block's first (one shared tuple per size)."""
    return tuple(range(1, block_tokens))


class _Concat(TokenSequence):
    __slots__ = ("head", "tail")

    def __init__(self, head: Sequence[int], tail: list[int]):
        self.head, self.tail = head, tail

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    def __iter__(self):
        return iter(self[0:len(self)])

    def __getitem__(self, index):
        n = len(self.head)
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            left = self.head[start:min(stop, n)] if start < n else []
            right = self.tail[max(0, start - n):max(0, stop - n)]
            return left + right if right else left
        if index < 0:
            index += len(self)
        return self.head[index] if index < n else self.tail[index - n]


@dataclass(frozen=True)
class SimRequest:
    prompt: Sequence[int]
    max_tokens: int
    arrival_s: float  # send time, seconds after the run starts


def from_bench(requests: list[BenchRequest], arrivals: ArrivalConfig) -> list[SimRequest]:
    """``tandem bench`` requests with token-id prompts (traces, or prompt sets already
    tokenized), sent at the times ``arrivals`` gives (trace or poisson; not closed-loop).

    Raises:
        ValueError: a text prompt, or a concurrency (closed-loop) arrival mode.
    """
    times = send_times_s(arrivals, [r.arrival_s for r in requests])
    if times is None:
        raise ValueError("the simulator replays open-loop arrivals (trace or poisson), not concurrency")
    out = []
    for request, t in zip(requests, times):
        if isinstance(request.prompt, str):
            raise ValueError("the simulator needs token-id prompts (tokenize prompt sets first)")
        out.append(SimRequest(request.prompt, request.max_tokens, t))
    return out


def load_trace(path: Path, kind: str, time_scale: float = 1.0, num_requests: int = 0,
               max_total_tokens: int = 0) -> list[SimRequest]:
    """A trace's rows as lazy-prompt requests arriving at ``arrival_s * time_scale``.

    Rows whose input + output exceed ``max_total_tokens`` (0: no limit) are skipped.
    """
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    out = []
    for index, row in enumerate(read_trace(Path(path), kind)):
        if num_requests and len(out) >= num_requests:
            break
        if max_total_tokens and row.input_tokens + row.output_tokens > max_total_tokens:
            continue
        num_blocks = -(-row.input_tokens // MOONCAKE_BLOCK_TOKENS)
        nodes = row.hash_ids or tuple(_UNIQUE_BASE + index * 4096 + j for j in range(num_blocks))
        prompt = TracePrompt(nodes, MOONCAKE_BLOCK_TOKENS, max(1, row.input_tokens))
        out.append(SimRequest(prompt, max(1, row.output_tokens), row.arrival_s * time_scale))
    return out
