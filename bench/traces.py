"""Parsers for public LLM-serving traces: Mooncake JSONL, Azure LLM inference CSV, BurstGPT CSV.

Each parser returns ``TraceRow``s in file order with ``arrival_s`` relative to the first row, so
arrivals and synthesis never see a trace's own format. Formats and sources: docs/data.md.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512  # the trace's hash block: hash_ids[i] covers tokens [512 i, 512 (i+1))


@dataclass(frozen=True)
class TraceRow:
    arrival_s: float  # seconds after the trace's first row
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # prefix-block hashes (Mooncake only); empty: no shared prefix


def read_mooncake(path: Path) -> list[TraceRow]:
    """Mooncake FAST'25 JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``.

    Raises ValueError on a row whose hash_ids do not cover its input at 512 tokens a block.
    """
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            hash_ids = tuple(r["hash_ids"])
            expected_blocks = -(-r["input_length"] // MOONCAKE_BLOCK_TOKENS)
            if len(hash_ids) != expected_blocks:
                raise ValueError(f"{path}:{line_no}: {len(hash_ids)} hash_ids for input_length "
                                 f"{r['input_length']} (expected {expected_blocks})")
            rows.append(TraceRow(r["timestamp"] / 1000.0, r["input_length"], r["output_length"], hash_ids))
    return _relative(rows)


def read_azure(path: Path) -> list[TraceRow]:
    """Azure LLM inference CSV: ``TIMESTAMP`` (wall clock, 7 fractional digits), ``ContextTokens``,
    ``GeneratedTokens``."""
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            rows.append(TraceRow(_azure_time_s(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"])))
    return _relative(rows)


def read_burstgpt(path: Path, *, keep_failures: bool = False) -> list[TraceRow]:
    """BurstGPT CSV (``BurstGPT_1`` or the session-carrying ``BurstGPT_3`` layout): ``Timestamp`` (s),
    ``Request tokens``, ``Response tokens``.

    Rows with 0 response tokens are the source system's failures and are dropped unless
    ``keep_failures``.
    """
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row = TraceRow(float(r["Timestamp"]), int(r["Request tokens"]), int(r["Response tokens"]))
            if row.output_tokens > 0 or keep_failures:
                rows.append(row)
    return _relative(rows)


def read_trace(path: Path, kind: str) -> list[TraceRow]:
    """``kind``: mooncake, azure or burstgpt. Raises ValueError for another kind."""
    readers = {"mooncake": read_mooncake, "azure": read_azure, "burstgpt": read_burstgpt}
    if kind not in readers:
        raise ValueError(f"unknown trace kind {kind!r}; expected one of {sorted(readers)}")
    return readers[kind](Path(path))


def _azure_time_s(stamp: str) -> float:
    # "2023-11-16 18:17:03.9799600": 7 fractional digits, one more than strptime's %f takes.
    whole, _, frac = stamp.partition(".")
    return datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc).timestamp() + float(f"0.{frac or 0}")


def _relative(rows: list[TraceRow]) -> list[TraceRow]:
    if not rows:
        return rows
    t0 = min(r.arrival_s for r in rows)
    return [TraceRow(r.arrival_s - t0, r.input_tokens, r.output_tokens, r.hash_ids) for r in rows]
