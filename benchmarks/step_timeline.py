"""Where a served run's step timeline departs from the cost model: per-pass measurements from the
workers' DEBUG logs (engine.engine logs every pass: its features, forward + sampling time and the
whole pass), compared within one run, so a loaded machine moves both sides alike.

    .venv/bin/python benchmarks/step_timeline.py .cache/logs/sim-validation/1P+1D [--since TS]

For each worker: the host share of a pass (scheduling, input preparation, output processing and
delivery: pass - forward), the error of a cost model fitted on its passes (core.cost_model's own
fit), and, where workers share the cores, the measured slowdown of passes that ran while another
worker computed against those that ran alone (the ratio a CoreSharing.slowdown should give).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.cost_model import CostModel, StepSample, StepTimeFit  # noqa: E402
from engine.step_stats import StepStats  # noqa: E402
from sim.adapter import step_size  # noqa: E402

PASS = re.compile(r"pass: (\d+) tokens, (\d+) seqs, ([\d.]+) k attention pairs, forward ([\d.]+) ms, pass ([\d.]+) ms")
CALIBRATED = re.compile(r"cost model calibrated: (\d+) passes")  # worker.runtime's log line
ALONE, SHARED = 0.1, 0.9  # a pass contended for < 10 % / > 90 % of its time
MIN_FIT_PASSES = 8


@dataclass(frozen=True)
class Pass:
    worker: str
    end_s: float  # wall clock (the log's ts, ms resolution)
    sample: StepSample

    @property
    def start_s(self) -> float:
        return self.end_s - self.sample.duration_s


def read_log(log: Path) -> list[Pass | int]:
    """A worker's DEBUG log in order: a :class:`Pass` per pass line, and for the start-up
    calibration's "cost model calibrated: N passes" line the int N."""
    events: list[Pass | int] = []
    for line in log.read_text().splitlines():
        calibrated = CALIBRATED.search(line)
        if calibrated:
            events.append(int(calibrated[1]))
        elif '"pass:' in line:
            entry = json.loads(line)
            m = PASS.search(entry["msg"])
            if m is not None:
                sample = StepSample(int(m[1]), int(m[2]), float(m[3]), float(m[5]) / 1e3, float(m[4]) / 1e3)
                events.append(Pass(log.stem, entry["ts"], sample))
    return events


def read_passes(log: Path, since_s: float = 0.0) -> list[Pass]:
    """The passes a worker's DEBUG log holds that ended after ``since_s`` (wall clock)."""
    return [e for e in read_log(log) if isinstance(e, Pass) and e.end_s >= since_s]


def worker_logs(log_dir: Path) -> list[Path]:
    """A local cluster's worker logs (prefill*.log, decode*.log) in the order the simulator
    numbers their workers: decode, decode-1, decode-2, ..."""
    return sorted([*log_dir.glob("prefill*.log"), *log_dir.glob("decode*.log")], key=lambda p: (len(p.stem), p.stem))


def before_replay(log_dir: Path, since_s: float) -> dict[str, list[StepSample]]:
    """role -> the StepSamples of the passes the role's first worker logged before ``since_s``
    (wall clock; its start-up calibration and the probes: what its live cost-model fit held
    when the replay began); a colocated cluster's prefill role is its decode workers'."""
    out: dict[str, list[StepSample]] = {}
    for log in worker_logs(log_dir):
        out.setdefault(log.stem.split("-")[0], [p.sample for p in read_passes(log) if p.end_s < since_s])
    out.setdefault("prefill", out.get("decode", []))
    return out


def published_schedules(log_dir: Path, since_s: float, published: dict[str, CostModel]) -> dict[str, tuple]:
    """role -> one schedule per worker of it (:func:`worker_logs` order) of ((seconds since
    ``since_s``, cost model), ...): the fit that worker published from each of its passes on,
    recomputed as the worker computes it (the real engine.step_stats.StepStats over its start-up
    calibration's passes, since the calibration clears the fit first, then every pass it logged
    after; window 512, refit every 16), with ``published``'s budget and KV bandwidth. The first
    entry, at 0 s, is what it published when the replay began. The router's view of the workers
    as the replay went, from their pass timings only; a colocated cluster's prefill role is its
    decode workers'."""
    out: dict[str, list] = {}
    for log in worker_logs(log_dir):
        role = log.stem.split("-")[0]
        if role not in published:
            continue
        cost, stats, schedule, seen = published[role], StepStats(), [], []
        fields = dict(max_num_batched_tokens=cost.max_num_batched_tokens, kv_load_bytes_per_s=cost.kv_load_bytes_per_s,
                      kv_bytes_per_token=cost.kv_bytes_per_token)
        at_s = 0.0
        for event in read_log(log):
            if isinstance(event, int):  # the calibration line: the fit holds its passes only
                stats = StepStats()
                for sample in seen[-event:]:
                    stats.record(sample)
            else:
                seen.append(event.sample)
                stats.record(event.sample)
                at_s = max(0.0, event.end_s - since_s)
            model = stats.model(**fields)
            if schedule and schedule[-1][0] == at_s == 0.0:  # before the replay: only the last counts
                schedule.pop()
            if not schedule or model != schedule[-1][1]:
                schedule.append((at_s, model))
        out.setdefault(role, []).append(tuple(schedule))
    out.setdefault("prefill", out.get("decode", []))
    return {role: tuple(schedules) for role, schedules in out.items()}


def quantiles(values: list[float], qs=(0.1, 0.5, 0.9)) -> list[float]:
    v = sorted(values)
    return [v[round(q * (len(v) - 1))] for q in qs] if v else []


def overlap_fraction(p: Pass, others: list[Pass]) -> float:
    """Share of ``p``'s time during which some pass of another worker ran (intervals merged)."""
    return contention(p, others, {}, num_cores=1)[0]


def contention(p: Pass, others: list[Pass], threads: dict[str, int], num_cores: int) -> tuple[float, float]:
    """(share of ``p``'s time during which its worker's threads plus those of the other workers
    computing then exceed ``num_cores``, CoreSharing's processor-sharing slowdown averaged over
    the pass). ``threads``: worker -> threads (1 where absent)."""
    if p.sample.duration_s <= 0:
        return 0.0, 1.0
    edges = [(p.start_s, 0), (p.end_s, 0)]
    for o in others:
        if o.end_s > p.start_s and o.start_s < p.end_s:
            n = threads.get(o.worker, 1)
            edges += [(max(o.start_s, p.start_s), n), (min(o.end_s, p.end_s), -n)]
    edges.sort()
    own, busy, contended_s, weighted_s = threads.get(p.worker, 1), 0, 0.0, 0.0
    for (t, delta), (t_next, _) in zip(edges, edges[1:]):
        busy += delta
        span = t_next - t
        if own + busy > num_cores:
            contended_s += span
        weighted_s += span * max(1.0, (own + busy) / num_cores)
    return contended_s / p.sample.duration_s, weighted_s / p.sample.duration_s


def by_kind(samples: list[StepSample], ratio) -> dict[str, list[list[float]]]:
    """kind -> [size, ``ratio([sample])`` (4 decimals)] of each of ``samples`` (sim.adapter.step_size)."""
    out: dict[str, list[list[float]]] = {}
    for s in samples:
        kind, size = step_size(s.num_new_tokens, s.num_seqs)
        for r in ratio([s]):
            out.setdefault(kind, []).append([size, round(r, 4)])
    return out


def analyze(passes_by_worker: dict[str, list[Pass]], threads: dict[str, int] | None = None, num_cores: int = 1) -> dict:
    """Per worker: pass counts, host share, the cost model fitted on its uncontended passes (those
    that ran while the busy threads fitted the cores) and its error (quantiles, and every pass's
    size and pass / fit ratio by kind of step); with contended passes, their
    measured slowdown against that fit beside what CoreSharing's processor sharing predicts.
    ``threads``: worker -> threads (1 where absent); ``num_cores``: the cores they share."""
    out, threads = {}, threads or {}
    for name, passes in passes_by_worker.items():
        if len(passes) < 4:
            continue
        others = [p for n, ps in passes_by_worker.items() if n != name for p in ps]
        shares = [contention(p, others, threads, num_cores) for p in passes]
        alone = [p.sample for p, (f, _) in zip(passes, shares) if f < ALONE]
        shared = [p.sample for p, (f, _) in zip(passes, shares) if f > SHARED]
        modelled = [m for f, m in shares if f > SHARED]
        fitted = alone if len(alone) >= MIN_FIT_PASSES else [p.sample for p in passes]
        fit = StepTimeFit(window=4096)
        for s in fitted:
            fit.add(s)
        model = fit.model()
        ratio = lambda ss: [s.duration_s / model.step_s(s.num_new_tokens, s.num_seqs, s.attn_pairs)  # noqa: E731
                            for s in ss if model.step_s(s.num_new_tokens, s.num_seqs, s.attn_pairs) > 0]
        row = {
            "num_passes": len(passes), "num_alone": len(alone), "num_shared": len(shared),
            "host_ms_p10_p50_p90": [round(x * 1e3, 2) for x in quantiles([p.sample.host_s for p in passes])],
            "host_share_p50": statistics.median(p.sample.host_s / p.sample.duration_s for p in passes),
            "fit_from": "uncontended passes" if len(alone) >= MIN_FIT_PASSES else "all passes (too few uncontended)",
            "fit_on_alone_passes": {"base_ms": model.base_s * 1e3, "per_token_us": model.per_token_s * 1e6,
                                    "per_seq_us": model.per_seq_s * 1e6, "per_attn_us": model.per_attn_s * 1e6},
            "alone_pass_over_fit_p10_p50_p90": quantiles(ratio(alone)),
            "fitted_pass_over_fit_p10_p50_p90": quantiles(ratio(fitted)),  # over the passes the fit was made on
            # every one of them by kind of step, with its size (sim.adapter.JitteredTimer draws from these)
            "pass_over_fit": by_kind(fitted, ratio),
        }
        if shared:
            row["shared_pass_over_fit_p10_p50_p90"] = quantiles(ratio(shared))
            row["modelled_slowdown_p50"] = statistics.median(modelled)
            if alone:
                row["measured_slowdown_p50"] = statistics.median(ratio(shared)) / statistics.median(ratio(alone))
        out[name] = row
    return out


def analyze_dir(log_dir: Path, since_s: float = 0.0, role_threads: dict[str, int] | None = None,
                num_cores: int = 1) -> dict:
    """analyze() over every worker log (prefill*.log, decode*.log) of a local cluster's log folder;
    ``role_threads``: role -> threads of each of its workers."""
    logs = worker_logs(log_dir)
    threads = {log.stem: (role_threads or {}).get(log.stem.split("-")[0], 1) for log in logs}
    return analyze({log.stem: read_passes(log, since_s) for log in logs}, threads, num_cores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log_dir", type=Path)
    parser.add_argument("--since", type=float, default=0.0, help="wall-clock start of the run (skips calibration)")
    parser.add_argument("--cores", type=int, default=1, help="cores the workers share")
    parser.add_argument("--prefill-threads", type=int, default=1)
    parser.add_argument("--decode-threads", type=int, default=1)
    args = parser.parse_args()
    threads = {"prefill": args.prefill_threads, "decode": args.decode_threads}
    print(json.dumps(analyze_dir(args.log_dir, args.since, threads, args.cores), indent=1))


if __name__ == "__main__":
    main()
