"""``python -m autoscaler``: the chart's autoscaler Deployment (Kubernetes actuator)."""

from __future__ import annotations

import asyncio

import click

from autoscaler.actuators import KubernetesActuator
from autoscaler.policy import AutoscaleConfig
from autoscaler.service import AutoscaleLoop
from core.logging_setup import setup_logging
from core.registry import WorkerRegistry


@click.command(context_settings={"auto_envvar_prefix": "TANDEM_AUTOSCALER"})
@click.option("--redis-url", required=True)
@click.option("--namespace", default="", help="Default: the pod's own (service-account namespace file).")
@click.option("--prefill-deployment", default="", help="Empty: no prefill workers (colocated).")
@click.option("--decode-deployment", required=True)
@click.option("--ttft-slo-s", default=2.0, show_default=True, type=float, help="TTFT SLO, seconds (as the router's).")
@click.option("--tbt-slo-s", default=0.2, show_default=True, type=float, help="TBT SLO, seconds (as the router's).")
@click.option("--min-prefill", default=1, show_default=True, type=int)
@click.option("--max-prefill", default=4, show_default=True, type=int)
@click.option("--min-decode", default=1, show_default=True, type=int)
@click.option("--max-decode", default=4, show_default=True, type=int)
@click.option("--cooldown-s", default=120.0, show_default=True, type=float)
@click.option("--interval-s", default=5.0, show_default=True, type=float)
@click.option("--log-level", default="INFO", show_default=True)
def main(redis_url: str, namespace: str, prefill_deployment: str, decode_deployment: str, ttft_slo_s: float,
         tbt_slo_s: float, min_prefill: int, max_prefill: int, min_decode: int, max_decode: int, cooldown_s: float,
         interval_s: float, log_level: str) -> None:
    """Scale the prefill and decode Deployments from the workers' heartbeats (docs/autoscaling.md)."""
    setup_logging("autoscaler", log_level)
    if not prefill_deployment:
        min_prefill = max_prefill = 0
    try:
        config = AutoscaleConfig(ttft_slo_s, tbt_slo_s, min_prefill, max_prefill, min_decode,
                                 max_decode, cooldown_s=cooldown_s)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None
    deployments = {"decode": decode_deployment, **({"prefill": prefill_deployment} if prefill_deployment else {})}

    async def run() -> None:
        registry = WorkerRegistry(redis_url)
        try:
            await AutoscaleLoop(registry, KubernetesActuator(deployments, namespace), config, interval_s).run()
        finally:
            await registry.close()

    asyncio.run(run())


if __name__ == "__main__":
    main()
