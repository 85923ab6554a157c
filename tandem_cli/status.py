"""``tandem status``: a live table of a running cluster, read from one router's ``/metrics``.

The router's metrics carry the cluster view (router.cluster_metrics: every live worker's and
pool node's heartbeat load) next to its own request metrics, so one scrape is the whole picture:
workers by role with their load, KV usage, step time and fitted cost model; pool nodes with
their tiers and hit rate; the router's rates (between two scrapes) and latency percentiles.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import click
import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from core import cluster_record
from core.cluster_record import choose_url, with_scheme

_console = Console(width=None if sys.stdout.isatty() else 200)  # piped: whole table rows, not 80 columns

Labels = tuple[tuple[str, str], ...]


@dataclass
class Snapshot:
    """One scrape: every sample by metric name, then by its sorted labels; ``time_s`` when taken."""

    samples: dict[str, dict[Labels, float]] = field(default_factory=dict)
    time_s: float = 0.0

    @classmethod
    def parse(cls, text: str, time_s: float = 0.0) -> Snapshot:
        """Reads Prometheus text exposition. Raises ValueError on text that is not one."""
        snap = cls(time_s=time_s)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                snap.samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return snap

    def value(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels`` (0 when none)."""
        wanted = set(labels.items())
        return sum(v for k, v in self.samples.get(name, {}).items() if wanted <= set(k))

    def by(self, name: str, *keys: str) -> dict[tuple[str, ...], float]:
        """``name``'s samples summed by the label values ``keys``."""
        out: dict[tuple[str, ...], float] = defaultdict(float)
        for labels, v in self.samples.get(name, {}).items():
            d = dict(labels)
            out[tuple(d.get(k, "") for k in keys)] += v
        return dict(out)


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus's ``histogram_quantile``: linear interpolation inside the bucket holding the
    q-th observation. ``buckets``: upper bound (``inf`` included) -> cumulative count. NaN when empty."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] == 0:
        return math.nan
    rank, lower, below = q * buckets[bounds[-1]], 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def _buckets(snap: Snapshot, name: str, since: Snapshot | None) -> dict[float, float]:
    now = snap.by(f"{name}_bucket", "le")
    old = since.by(f"{name}_bucket", "le") if since else {}
    return {float(le): v - old.get((le,), 0.0) for (le,), v in now.items()}


def _fmt(value: float, unit: str = "", digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if unit == "%":
        return f"{100 * value:.{digits}f}%"
    if unit == "ms":
        return f"{1e3 * value:.{digits}f}"
    return f"{value:.{digits}f}" if isinstance(value, float) and not value.is_integer() else f"{int(value)}"


def _fixed(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def workers_table(snap: Snapshot) -> Table:
    table = Table("role", "worker", "running", "waiting", "KV used", "free blocks", "step ms",
                  "cost: base ms", "us/token", "us/seq", title="Workers (cost: the fitted step-time model)")
    running = snap.by("tandem:worker_num_requests_running", "role", "worker_id")
    coeff = snap.by("tandem:worker_cost_model_coefficient_seconds", "role", "worker_id", "coefficient")
    for role, worker in sorted(running, key=lambda k: (k[0] != "prefill", k[1])):
        ids = {"role": role, "worker_id": worker}

        def c(name: str) -> float:
            return coeff.get((role, worker, name), math.nan)

        table.add_row(role, worker, _fmt(running[(role, worker)]),
                      _fmt(snap.value("tandem:worker_num_requests_waiting", **ids)),
                      _fmt(snap.value("tandem:worker_kv_cache_usage_perc", **ids), "%"),
                      _fmt(snap.value("tandem:worker_kv_free_blocks", **ids)),
                      _fmt(snap.value("tandem:worker_step_time_seconds", **ids), "ms"),
                      *(_fixed(c(k) * scale) for k, scale in (("base_s", 1e3), ("per_token_s", 1e6), ("per_seq_s", 1e6))))
    return table


def pool_table(snap: Snapshot) -> Table:
    table = Table("pool node", "tier", "used", "capacity", "used %", "blocks", "hit rate", "leases", title="KV pool")
    used = snap.by("tandem:pool_node_bytes", "node_id", "tier")
    for node, tier in sorted(used):
        ids = {"node_id": node, "tier": tier}
        capacity = snap.value("tandem:pool_node_capacity_bytes", **ids)
        hits, misses = snap.value("tandem:pool_node_hits_total", **ids), snap.value("tandem:pool_node_misses_total", **ids)
        table.add_row(node, tier, _bytes(used[(node, tier)]), _bytes(capacity),
                      _fmt(used[(node, tier)] / capacity if capacity else math.nan, "%"),
                      _fmt(snap.value("tandem:pool_node_blocks", **ids)),
                      _fmt(hits / (hits + misses) if hits + misses else math.nan, "%"),
                      _fmt(snap.value("tandem:pool_node_leases", node_id=node)) if tier == "dram" else "")
    return table


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def router_table(snap: Snapshot, since: Snapshot | None = None) -> Table:
    """Totals, rates since ``since`` (or since start when None) and TTFT/TBT percentiles."""
    dt = snap.time_s - since.time_s if since else 0.0

    def rate(name: str, **labels: str) -> str:
        if not since or dt <= 0:
            return "-"
        return f"{(snap.value(name, **labels) - since.value(name, **labels)) / dt:.2f}"

    table = Table("router", "total", "per s", title="Router" + (f" (rates over {dt:.1f} s)" if since else ""))
    for label, name in (("finished requests", "vllm:request_success_total"),
                        ("output tokens", "vllm:generation_tokens_total"),
                        ("prompt tokens", "vllm:prompt_tokens_total"),
                        ("rejected", "tandem:rejections_total"),
                        ("decode migrations", "tandem:migrations_total")):
        table.add_row(label, _fmt(snap.value(name)), rate(name))
    hits, queries = snap.value("vllm:prefix_cache_hits_total"), snap.value("vllm:prefix_cache_queries_total")
    table.add_row("prefix cache hit rate", _fmt(hits / queries if queries else math.nan, "%"), "")
    table.add_row("in flight", _fmt(snap.value("tandem:router_requests_running")), "")
    for label, name in (("TTFT ms", "vllm:time_to_first_token_seconds"), ("TBT ms", "vllm:inter_token_latency_seconds")):
        buckets = _buckets(snap, name, since)
        table.add_row(f"{label} p50 / p99", " / ".join(_fmt(histogram_quantile(q, buckets), "ms") for q in (0.5, 0.99)), "")
    return table


def render(snap: Snapshot, since: Snapshot | None = None, where: str = "") -> Group:
    """Everything ``tandem status`` shows for one scrape (``where``: the router's URL, in the head line)."""
    live = snap.by("tandem:cluster_workers", "role")
    head = "  ".join(f"{role} {int(live.get((role,), 0))}" for role in ("prefill", "decode", "pool"))
    at = f" at {where}" if where else ""
    return Group(f"[bold]Tandem cluster{at}[/]  live processes: {head}", workers_table(snap), pool_table(snap),
                 router_table(snap, since))


def scrape(url: str, api_key: str = "", timeout_s: float = 5.0) -> Snapshot:
    """GET ``url`` (a router's /metrics).

    Raises:
        httpx.HTTPError: unreachable, or not 200 (401: the router wants an API key for /metrics).
    """
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(url, headers=headers, timeout=timeout_s)
    response.raise_for_status()
    return Snapshot.parse(response.text, time.monotonic())


def metrics_url(base: str) -> str:
    """``http://host:port`` (or ``.../v1``, or ``.../metrics``, or ``host:port``) -> the router's ``/metrics``."""
    base = with_scheme(base).rstrip("/")
    for suffix in ("/metrics", "/v1"):
        base = base.removesuffix(suffix)
    return base + "/metrics"


@click.command("status")
@click.option("--url", default=None,
              help="A router (http://host:port, or host:port): its /metrics carries the whole cluster's load. "
                   "Default: the cluster tandem up runs on this machine, else http://127.0.0.1:8000.")
@click.option("--api-key", default="", envvar="TANDEM_API_KEY",
              help="Sent as Bearer token, for a router whose /metrics needs a key (the first of TANDEM_API_KEY).")
@click.option("--interval-s", default=2.0, show_default=True, type=click.FloatRange(min=0.1), help="Refresh period.")
@click.option("--once", is_flag=True, help="Print one table (totals only) and exit.")
@click.option("--svg", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write one table (rates over --interval-s) as an SVG image and exit.")
def status_command(url: str | None, api_key: str, interval_s: float, once: bool, svg: Path | None) -> None:
    """A live table of a running cluster: workers by role with load, KV usage, step time and cost
    model; pool nodes with tiers and hit rate; the router's rates and latency percentiles."""
    base, why = choose_url(url, cluster_record.running())
    target, key = metrics_url(base), (api_key.split() or [""])[0]

    def take():
        try:
            return scrape(target, key)
        except httpx.HTTPStatusError as err:
            hint = "; pass --api-key (or set TANDEM_API_KEY)" if err.response.status_code in (401, 403) else ""
            raise click.ClickException(f"cannot read {target}: HTTP {err.response.status_code}{hint}") from None
        except httpx.HTTPError as err:
            chose = f" ({why})" if why else ""
            raise click.ClickException(f"cannot read {target}{chose}: {err}; is a cluster up there? pass --url with "
                                       "its router's address (tandem up prints it)") from None

    first = take()
    if once:
        _console.print(render(first, where=base))
        return
    if svg is not None:
        time.sleep(interval_s)  # the refresh period: rates need a second scrape
        recorder = Console(record=True, width=130, file=open(os.devnull, "w"))  # noqa: SIM115
        recorder.print(render(take(), first, where=base))
        recorder.save_svg(str(svg), title="tandem status")
        _console.print(f"wrote {svg}")
        return
    previous = first
    with Live(render(first, where=base), console=_console, refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(interval_s)  # the refresh period, not a synchronisation
                current = take()
                live.update(render(current, previous, where=base))
                previous = current
        except KeyboardInterrupt:
            pass
