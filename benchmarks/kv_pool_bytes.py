"""What one prompt costs the KV pool, by weight dtype and ``--kv-cache-dtype``: bytes moved and
blocks held, read from the pool's own Prometheus metrics (kv_pool/metrics.py).

    .venv/bin/python benchmarks/kv_pool_bytes.py --prompts sharegpt_v3_first_turn_500.json \
        [--variants float32/auto,bfloat16/auto,float32/fp8,float32/int8] [--num-prompts 32] \
        [--pool-capacity-bytes 16777216] [--large-pool-bytes 2147483648]

For each variant (``DTYPE/KV_CACHE_DTYPE``) two disaggregated clusters (``tandem up`` defaults,
one prefill and one decode worker, every request through the pool: ``disaggregation=always``) on
the real model, each sent the same distinct prompts one after another (``max_tokens`` 2: the
prefill worker writes every prompt's blocks, the decode worker reads them back for its first
step), then one scrape of the pool's ``/metrics``:

- with a pool large enough to evict nothing (``--large-pool-bytes``): ``put`` / ``get`` bytes per
  prompt, ``tandem:pool_transfer_bytes_total{direction=put|get}`` over the prompts sent (every
  transport: a block already stored, such as the chat template's shared first block, is not
  sent again), and bytes per block, ``tandem:pool_used_bytes`` over
  ``tandem:pool_blocks{state="stored"}``;
- with a small pool (``--pool-capacity-bytes``): the blocks it holds once full,
  ``tandem:pool_blocks{state="stored"}`` (``tandem:pool_evictions_total`` > 0 shows it was full).

Ratios to the first variant are printed beside each row; a JSON with every metric read goes to
``--output-dir``. Prompts: a ShareGPT-format JSON (public source: the ShareGPT dataset,
docs/data.md), ``--prompts`` or ``TANDEM_PEERS_PROMPTS``; the built-in prompts when missing.
Timing-free: the numbers depend on the prompts' token counts alone.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.prompts import load_prompts  # noqa: E402
from launcher.config import ClusterConfig  # noqa: E402
from launcher.local_cluster import LocalCluster  # noqa: E402
from launcher.ports import free_port  # noqa: E402

DEFAULT_VARIANTS = "float32/auto,bfloat16/auto,float32/fp8,float32/int8"


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` at ``url`` -> {sample name with its labels: value} (Prometheus text format)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def complete(http_url: str, prompt: str) -> int:
    """One chat completion of two tokens; returns its prompt token count (the API's usage)."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 2, "temperature": 0}
    request = urllib.request.Request(f"{http_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())["usage"]["prompt_tokens"]


def measure(variant: str, prompts: list[str], capacity: int, log_dir: Path) -> dict:
    dtype, kv_cache_dtype = variant.split("/")
    config = ClusterConfig.from_options(
        http_port=free_port(), grpc_port=free_port(), log_dir=log_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
        pool_capacity_bytes=capacity, disaggregation="always")
    with LocalCluster(config) as cluster:
        cluster.start()
        started = time.monotonic()
        prompt_tokens = sum(complete(cluster.http_url, p) for p in prompts)
        seconds = time.monotonic() - started
        m = scrape(cluster.metrics_urls["kv_pool"])
    stored = m['tandem:pool_blocks{state="stored"}']
    put, get = m['tandem:pool_transfer_bytes_total{direction="put"}'], m['tandem:pool_transfer_bytes_total{direction="get"}']
    return {"variant": variant, "prompts": len(prompts), "prompt_tokens": prompt_tokens, "seconds": seconds,
            "put_bytes_per_prompt": put / len(prompts), "get_bytes_per_prompt": get / len(prompts),
            "bytes_per_block": m["tandem:pool_used_bytes"] / stored if stored else 0.0,
            "stored_blocks": stored, "evictions": m["tandem:pool_evictions_total"],
            "capacity_bytes": m["tandem:pool_capacity_bytes"], "metrics": m}


def markdown(rows: list[dict]) -> str:
    base = rows[0]
    lines = ["| dtype / KV | put MB / prompt | x | get MB / prompt | x | bytes / block | x | "
             "blocks held (small pool) | x | evictions |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        moved, held, b_moved, b_held = r["large"], r["small"], base["large"], base["small"]
        lines.append(
            f"| {r['variant']} | {moved['put_bytes_per_prompt'] / 1e6:.3f} | "
            f"{moved['put_bytes_per_prompt'] / b_moved['put_bytes_per_prompt']:.3f} | "
            f"{moved['get_bytes_per_prompt'] / 1e6:.3f} | "
            f"{moved['get_bytes_per_prompt'] / b_moved['get_bytes_per_prompt']:.3f} | "
            f"{moved['bytes_per_block']:,.0f} | {moved['bytes_per_block'] / b_moved['bytes_per_block']:.3f} | "
            f"{held['stored_blocks']:.0f} | {held['stored_blocks'] / b_held['stored_blocks']:.2f} | "
            f"{held['evictions']:.0f} |")
    return "\n".join(lines)


@click.command()
@click.option("--prompts", "prompts_path", type=click.Path(path_type=Path), envvar="TANDEM_PEERS_PROMPTS",
              default=None, help="ShareGPT-format JSON; env TANDEM_PEERS_PROMPTS. Missing: built-in prompts.")
@click.option("--num-prompts", default=32, show_default=True)
@click.option("--variants", default=DEFAULT_VARIANTS, show_default=True, help="DTYPE/KV_CACHE_DTYPE, comma-separated.")
@click.option("--pool-capacity-bytes", default=16 * 1024**2, show_default=True,
              help="The small pool: small enough that every variant's fills (evictions > 0).")
@click.option("--large-pool-bytes", default=2 * 1024**3, show_default=True,
              help="The pool of the bytes-moved run: large enough that nothing is evicted.")
@click.option("--output-dir", type=click.Path(path_type=Path), default=Path("bench-results/kv_pool_bytes"),
              show_default=True)
def main(prompts_path, num_prompts, variants, pool_capacity_bytes, large_pool_bytes, output_dir):
    """Pool bytes per prompt and blocks held, per weight and KV dtype; one table."""
    load_at_start = os.getloadavg()
    prompts = load_prompts(prompts_path if prompts_path and prompts_path.exists() else None, num_prompts)
    prompts = [f"[{i}] {prompts[i % len(prompts)]}" for i in range(num_prompts)]  # distinct, even the built-in 8 cycled
    rows = []
    with tempfile.TemporaryDirectory(prefix="kv_pool_bytes-") as tmp:
        for variant in variants.split(","):
            click.echo(f"{variant}: {len(prompts)} prompts ...")
            logs = Path(tmp) / variant.replace("/", "-")
            rows.append({"variant": variant, "large": measure(variant, prompts, large_pool_bytes, logs / "large"),
                         "small": measure(variant, prompts, pool_capacity_bytes, logs / "small")})
    table = markdown(rows)
    click.echo(table)
    output_dir.mkdir(parents=True, exist_ok=True)
    out = {"settings": {"num_prompts": len(prompts), "pool_capacity_bytes": pool_capacity_bytes,
                        "large_pool_bytes": large_pool_bytes,
                        "prompts": str(prompts_path) if prompts_path else "built-in"},
           "load_average_at_start": load_at_start, "rows": rows, "markdown": table}
    (output_dir / "kv_pool_bytes.json").write_text(json.dumps(out, indent=1))
    click.echo(f"wrote {output_dir / 'kv_pool_bytes.json'}")


if __name__ == "__main__":
    main()
