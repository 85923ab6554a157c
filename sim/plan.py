"""``tandem plan``: search P:D splits (and TP) per fleet size with the simulator.

For each GPU count and TP degree: the colocated cluster and disaggregated splits of the same
GPUs (prefill share 1/8 .. 3/4 of the workers), each simulated on the whole workload. A
configuration stops early once more requests missed the SLO than its attainment target allows
(it cannot qualify; its goodput is then a lower bound, marked ``aborted``). The recommendation
is the fewest GPUs whose best configuration meets the target, at the highest goodput.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.metrics import SLO, summarize
from sim.cluster import ClusterSpec
from sim.setup import ClusterChoice, build_worker
from sim.simulator import Simulation
from sim.workload import SimRequest

PREFILL_SHARES = (1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4)
CHART_POLICIES = {"predicted_latency": "cost_model", "cache_aware": "prefix_aware", "least_loaded": "least_loaded",
                  "round_robin": "round_robin"}


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

    @property
    def label(self) -> str:
        if not self.num_prefill:
            return f"colocated {self.num_decode} x TP{self.tp}"
        return f"{self.num_prefill}P + {self.num_decode}D (TP{self.tp})"


def splits(num_workers: int) -> list[int]:
    """Prefill worker counts to try for ``num_workers`` workers: 0 (colocated) and the shares."""
    counts = {min(num_workers - 1, max(1, round(share * num_workers))) for share in PREFILL_SHARES}
    return [0] + sorted(c for c in counts if num_workers >= 2)


def evaluate(requests: list[SimRequest], cluster: ClusterSpec, slo: SLO, target: float, tp: int) -> PlanPoint:
    max_misses = int(len(requests) * (1 - target))
    result = Simulation(cluster).run(requests, slo, max_misses)
    s = summarize(result.records, result.duration_s, slo)
    return PlanPoint(cluster.num_gpus, tp, cluster.num_prefill, cluster.num_decode, s["goodput_rps"],
                     s["slo_attainment"], s["ttft_ms"]["p90"], s["tbt_ms"]["p90"], result.aborted)


def search(requests: list[SimRequest], base: ClusterChoice, gpu_counts: list[int], tps: list[int], slo: SLO,
           target: float, progress=None) -> list[PlanPoint]:
    """Every configuration's point (see the module docstring). Raises ValueError for a TP the
    model does not fit, or GPU counts not divisible by it."""
    points = []
    for tp in tps:
        worker = build_worker(base, tp)
        for num_gpus in gpu_counts:
            if num_gpus % tp:
                continue
            workers = num_gpus // tp
            for num_prefill in splits(workers):
                cluster = ClusterSpec(num_prefill, workers - num_prefill if num_prefill else workers, worker, worker,
                                      base.pool_capacity_blocks, base.router)
                point = evaluate(requests, cluster, slo, target, tp)
                points.append(point)
                if progress:
                    progress(point)
    return points


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


def plot(points: list[PlanPoint], path: Path, title: str) -> Path:
    """Goodput vs GPUs: the best disaggregated and the colocated configuration of each size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for colocated, name in ((False, "best disaggregated P:D"), (True, "colocated")):
        best = best_per_size(points, colocated)
        sizes = sorted(best)
        ax.plot(sizes, [best[n].goodput_rps for n in sizes], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("goodput (req/s within SLO)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def helm_values(point: PlanPoint, base: ClusterChoice, num_kv_blocks: int, max_model_len: int, slo: SLO) -> dict:
    """Overrides of deploy/k8s/helm/tandem/values.yaml for ``point`` (colocated: no prefill pods)."""
    return {
        "model": {"maxModelLen": max_model_len},
        "engine": {"blockSize": base.block_size, "maxNumBatchedTokens": base.max_num_batched_tokens,
                   "maxNumSeqs": base.max_num_seqs},
        "routing": {"policy": CHART_POLICIES[base.router.policy],
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
