"""Summaries of a run: throughput, latency percentiles, goodput and SLO attainment.

Definitions (times in ms in the summary):
- TTFT: send to first non-empty chunk. E2E: send to end of stream.
- TBT: every gap between consecutive non-empty chunks, pooled over all successful requests.
- Request TBT: the p90 of one request's gaps (0 for a request with one chunk). p90 rather than max
  so that one scheduler hiccup does not fail a request, while a request that is slow for more than
  a tenth of its tokens does.
- Goodput (DistServe): successful requests with TTFT <= the TTFT SLO and request TBT <= the TBT SLO,
  per second of run time. SLO attainment: the same requests as a fraction of all sent requests.
- Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from bench.client import RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft_ms: float = 2000.0
    tbt_ms: float = 200.0

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.tbt_ms <= 0:
            raise ValueError(f"SLOs must be > 0 ms, got ttft {self.ttft_ms}, tbt {self.tbt_ms}")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation; NaN for no values."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def request_tbt_s(record: RequestRecord) -> float:
    """The per-request TBT used by goodput: the p90 of its gaps, 0 without gaps."""
    gaps = record.gaps_s
    return percentile(gaps, 90) if gaps else 0.0


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    return (record.ok and record.ttft_s is not None and record.ttft_s * 1000 <= slo.ttft_ms
            and request_tbt_s(record) * 1000 <= slo.tbt_ms)


def distribution_ms(values_s: list[float]) -> dict[str, float]:
    """mean and p50/p90/p99 in ms."""
    ms = [v * 1000 for v in values_s]
    out = {"mean": float(np.mean(ms)) if ms else float("nan")}
    out.update({f"p{q}": percentile(ms, q) for q in PERCENTILES})
    return out


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO) -> dict:
    """JSON-ready summary of one run; ``duration_s`` is the wall time the rates divide by."""
    ok = [r for r in records if r.ok]
    good = [r for r in ok if meets_slo(r, slo)]
    rate = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: float("nan"))
    busy_s = sum(r.e2e_s or 0.0 for r in ok)
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "errors_by_kind": dict(Counter(r.error_kind for r in records if not r.ok)),
        "finish_reasons": dict(Counter(r.finish_reason for r in ok)),
        "duration_s": duration_s,
        "request_throughput_rps": rate(len(ok)),
        "output_throughput_tps": rate(sum(r.output_tokens for r in ok)),
        "input_throughput_tps": rate(sum(r.prompt_tokens for r in ok)),
        "mean_prompt_tokens": float(np.mean([r.prompt_tokens for r in ok])) if ok else float("nan"),
        "mean_output_tokens": float(np.mean([r.output_tokens for r in ok])) if ok else float("nan"),
        "mean_in_flight": rate(busy_s),  # Little's law: the average batch the server saw
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tbt_ms": distribution_ms([g for r in ok for g in r.gaps_s]),
        "request_tbt_ms": distribution_ms([request_tbt_s(r) for r in ok if r.gaps_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "slo": {"ttft_ms": slo.ttft_ms, "tbt_ms": slo.tbt_ms, "request_tbt": "p90 of gaps"},
        "goodput_rps": rate(len(good)),
        "slo_attainment": len(good) / len(records) if records else float("nan"),
    }
