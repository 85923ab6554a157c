"""Writes Tandem's Grafana dashboard (``deploy/k8s/helm/tandem/dashboards/tandem.json``, which
the chart ships as a ConfigMap for the Grafana sidecar; import the same file by hand elsewhere).

Every query reads what some service exports (tests/deploy/test_dashboard.py checks each name
against the services' registries). The per-worker and per-pool-node panels read the router's
cluster view (``tandem:worker_*``, ``tandem:pool_node_*``), so scraping the routers alone is
enough (``tandem up``: the router's /metrics); ``max by`` removes the copies several routers
export. SLO attainment is read from the histogram bucket at the SLO, so the SLO variables offer
the bucket bounds (router.metrics).

Usage: python deploy/grafana/make_dashboard.py [--check]   (--check: exit 1 if the file is stale)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "k8s" / "helm" / "tandem" / "dashboards" / "tandem.json"
RATE = "$__rate_interval"
DS = {"type": "prometheus", "uid": "${datasource}"}


def quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    return [(f"p{q}" + (f" {{{{{by}}}}}" if by else ""),
             f"histogram_quantile(0.{q}, sum by ({group}) (rate({metric}_bucket[{RATE}])))") for q in (50, 90, 99)]


def panel(title: str, targets: list[tuple[str, str]], unit: str = "short", kind: str = "timeseries",
          description: str = "") -> dict:
    return {"type": kind, "title": title, "description": description, "datasource": DS,
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend, "datasource": DS}
                        for i, (legend, expr) in enumerate(targets)]}


def rows() -> list[tuple[str, list[dict]]]:
    ttft, itl = "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"
    requests = [
        panel("TTFT vs SLO", [*quantiles(ttft), ("SLO", "vector($ttft_slo)")], "s",
              description="Arrival to first token at the router; the line is the TTFT SLO variable."),
        panel("TBT (inter-token latency) vs SLO", [*quantiles(itl), ("SLO", "vector($tbt_slo)")], "s"),
        panel("Goodput", [
            ("requests/s within the TTFT SLO", f'sum(rate({ttft}_bucket{{le="$ttft_slo"}}[{RATE}]))'),
            ("finished requests/s", f"sum(rate(vllm:request_success_total[{RATE}]))"),
            ("output tokens/s", f"sum(rate(vllm:generation_tokens_total[{RATE}]))"),
        ], "reqps"),
        panel("SLO attainment", [
            ("TTFT", f'sum(rate({ttft}_bucket{{le="$ttft_slo"}}[{RATE}])) / sum(rate({ttft}_count[{RATE}]))'),
            ("TBT (tokens)", f'sum(rate({itl}_bucket{{le="$tbt_slo"}}[{RATE}])) / sum(rate({itl}_count[{RATE}]))'),
        ], "percentunit", "stat"),
        panel("E2E latency", quantiles("vllm:e2e_request_latency_seconds"), "s"),
        panel("Rejections by reason", [("{{reason}}", f"sum by (reason) (rate(tandem:rejections_total[{RATE}]))")],
              "reqps"),
        panel("Failures", [
            ("workers marked down {{role}}", f"sum by (role) (rate(tandem:worker_failures_total[{RATE}]))"),
            ("prefill retries", f"sum(rate(tandem:prefill_retries_total[{RATE}]))"),
            ("decode migrations", f"sum(rate(tandem:migrations_total[{RATE}]))"),
        ], "reqps"),
        panel("Placements by mode", [("{{mode}}", f"sum by (mode) (rate(tandem:placements_total[{RATE}]))")],
              "reqps"),
        panel("TTFT actual / predicted", quantiles("tandem:ttft_prediction_ratio", "mode"), "short",
              description="1 = the cost model predicted the TTFT exactly."),
    ]
    workers = [
        panel("Queue per worker", [("{{role}} {{worker_id}}",
                                    "max by (role, worker_id) (tandem:worker_num_requests_waiting)")]),
        panel("Running requests per worker", [("{{role}} {{worker_id}}",
                                              "max by (role, worker_id) (tandem:worker_num_requests_running)")]),
        panel("KV cache usage per worker", [("{{role}} {{worker_id}}",
                                            "max by (role, worker_id) (tandem:worker_kv_cache_usage_perc)")],
              "percentunit"),
        panel("Step time per worker", [("{{role}} {{worker_id}}",
                                       "max by (role, worker_id) (tandem:worker_step_time_seconds)")], "s"),
        panel("Preemptions", [("{{worker_id}}",
                               f"max by (worker_id) (rate(tandem:worker_preemptions_total[{RATE}]))")], "ops"),
        panel("Live processes", [("{{role}}", "max by (role) (tandem:cluster_workers)")], "short", "stat"),
    ]
    pool = [
        panel("Pool tier usage", [("{{node_id}} {{tier}}", "max by (node_id, tier) (tandem:pool_node_bytes)"
                                   " / max by (node_id, tier) (tandem:pool_node_capacity_bytes)")], "percentunit"),
        panel("Pool hit rate by tier", [("{{tier}}", f"sum by (tier) (rate(tandem:pool_node_hits_total[{RATE}]))"
                                         f" / (sum by (tier) (rate(tandem:pool_node_hits_total[{RATE}]))"
                                         f" + sum by (tier) (rate(tandem:pool_node_misses_total[{RATE}])))")],
              "percentunit"),
        panel("Prefix cache hit rate (prompt tokens)", [
            ("cached / looked up", f"sum(rate(vllm:prefix_cache_hits_total[{RATE}]))"
                                   f" / sum(rate(vllm:prefix_cache_queries_total[{RATE}]))")], "percentunit"),
        panel("Leases per pool node", [("{{node_id}}", "max by (node_id) (tandem:pool_node_leases)")]),
    ]
    transfer = [
        panel("KV transfer bandwidth", [
            ("{{backend}} {{direction}}", f"sum by (backend, direction) (rate(tandem:kv_transfer_bytes_total[{RATE}]))"),
        ], "Bps"),
        panel("KV transfer errors", [
            ("{{backend}} {{direction}}", f"sum by (backend, direction) (rate(tandem:kv_transfer_errors_total[{RATE}]))"),
        ], "ops"),
        panel("Measured pool -> worker bandwidth", [
            ("{{worker_id}}", "max by (worker_id) (tandem:worker_kv_load_bandwidth_bytes_per_second)")], "Bps"),
    ]
    return [("Requests (router)", requests), ("Workers", workers), ("KV pool", pool), ("KV transfer", transfer)]


def variable(name: str, label: str, values: list[str], default: str) -> dict:
    options = [{"text": v, "value": v, "selected": v == default} for v in values]
    return {"name": name, "label": label, "type": "custom", "query": ",".join(values),
            "current": {"text": default, "value": default}, "options": options}


def dashboard() -> dict:
    panels, y, next_id = [], 0, 1
    for title, members in rows():
        panels.append({"type": "row", "title": title, "id": next_id, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        next_id, y = next_id + 1, y + 1
        for i, p in enumerate(members):
            p.update(id=next_id, gridPos={"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)})
            panels.append(p)
            next_id += 1
        y += 8 * ((len(members) + 2) // 3)
    templating = [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
        variable("ttft_slo", "TTFT SLO (s)", ["0.25", "0.5", "1.0", "2.5", "5.0"], "2.5"),
        variable("tbt_slo", "TBT SLO (s)", ["0.05", "0.1", "0.2", "0.3", "0.5"], "0.2"),
    ]
    return {"uid": "tandem-cluster", "title": "Tandem cluster", "tags": ["tandem", "llm"], "schemaVersion": 39,
            "version": 1, "editable": True, "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
            "templating": {"list": templating}, "panels": panels}


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if OUT.read_text() == render() else 1)
    OUT.write_text(render())
    print(f"wrote {OUT}")
