"""``tandem chaos CAMPAIGN.yaml``: a fault campaign on a local cluster (docs/failover.md).

Starts ``tandem up``'s local cluster as the campaign's ``cluster`` says (its services started
with the fault-injection file of core.fault_injection), computes the Hugging Face references
once (cached next to the results), runs each scenario and writes ``results.json`` and
``results.md`` to ``--out``. Exits 1 when a scenario lost, got wrong or leaked anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

import click
from rich.console import Console

from bench.client import ClientConfig
from bench.synthesis import SynthesisConfig
from bench.workloads import WorkloadConfig, load_workload
from chaos import netfilter, report
from chaos.campaign import CampaignRunner, ScenarioResult, result_json
from chaos.link_proxy import LinkProxies
from chaos.sampler import plot
from chaos.reference import references
from chaos.schedule import LINK_FAULTS, Campaign, Fault, load_campaign
from core.fault_injection import ENV_VAR
from core.model_source import DEFAULT_MODEL, resolve_model
from launcher.config import ClusterConfig
from launcher.local_cluster import LocalCluster
from launcher.ports import free_port, free_port_run

console = Console()


def cluster_config(campaign: Campaign, model: str, log_dir: Path) -> ClusterConfig:
    """The campaign's ``cluster`` mapping (``tandem up``'s option names) as a ClusterConfig,
    ports picked free. Raises ValueError naming an unknown option."""
    values = dict(campaign.cluster)
    num_routers = int(values.get("num_routers", 1))  # router i on port + i: one run of free ports for all
    first = free_port_run(2 * num_routers)
    try:
        return ClusterConfig.from_options(**{"model": model, "http_port": first, "grpc_port": first + num_routers,
                                             "log_dir": log_dir, **values})
    except ValueError as err:
        raise ValueError(f"cluster: {err}") from None


def data_path(path: Path) -> Path:
    """A campaign's workload file: ``path`` itself when it exists or is absolute, else the file of
    that name in the data folder (core.datasets.data_dir: TANDEM_DATA_DIR)."""
    from core.datasets import data_dir

    if path.is_absolute() or path.exists():
        return path
    return data_dir() / path


def workload(campaign: Campaign) -> WorkloadConfig:
    values = dict(campaign.workload)
    values.setdefault("kind", "prompts")
    values["path"] = data_path(Path(values["path"])) if values.get("path") else None
    if values["path"] is not None and not values["path"].is_file():
        from core.datasets import DEFAULT_FOR_KIND, where_to_get

        get = f"; get {where_to_get(values['kind'])}" if values["kind"] in DEFAULT_FOR_KIND else ""
        raise ValueError(f"workload: no file {values['path']}{get}")
    if "synthesis" in values:
        values["synthesis"] = SynthesisConfig(**values["synthesis"])
    return WorkloadConfig(**values)


def run_campaign(campaign: Campaign, out_dir: Path, model: str = DEFAULT_MODEL, with_reference: bool = True,
                 only: tuple[str, ...] = ()) -> list[ScenarioResult]:
    """Runs ``campaign`` (the scenarios named in ``only``, or all) and writes its results.

    Raises:
        ValueError: a bad campaign or scenario name.
        RuntimeError: the cluster did not start or did not become whole after a scenario.
    """
    scenarios = [s for s in campaign.scenarios if not only or s.name in only]
    if only and len(scenarios) != len(only):
        raise ValueError(f"unknown scenario(s) {sorted(set(only) - {s.name for s in scenarios})}")
    linked = {f.link: f for s in scenarios for f in s.faults if f.do in LINK_FAULTS}
    check_link_services(cluster_config(campaign, model, out_dir / "logs"), list(linked.values()))  # before any work
    out_dir.mkdir(parents=True, exist_ok=True)
    requests = load_workload(workload(campaign))
    refs = references(requests, model, out_dir / "references.json") if with_reference else None
    fault_file = str((out_dir / "faults.json").resolve())
    (out_dir / "faults.json").write_text('{"rules": []}')
    config = cluster_config(campaign, model, out_dir / "logs")  # its free ports just before the cluster starts
    expected = {"decode": config.num_decode_workers, "pool": 1,
                **({} if config.colocated else {"prefill": config.num_prefill_workers})}
    results: list[ScenarioResult] = []
    with _fault_injection(fault_file), LocalCluster(config) as cluster, LinkProxies() as links:
        _put_link_proxies(cluster, links, sorted(linked.values(), key=lambda f: f.link), campaign.seed)
        cluster.start(on_progress=console.print)
        client = ClientConfig(cluster.http_url, resolve_model(model).name, timeout_s=campaign.deadline_s)
        runner = CampaignRunner(cluster, campaign, requests, client, refs, fault_file, expected, links)
        rng = random.Random(campaign.seed)
        for scenario in scenarios:
            console.print(f"scenario: {scenario.name}")
            results.append(asyncio.run(runner.run(scenario, rng.randrange(2**31), results[-1] if results else None)))
            _write(out_dir, campaign, results, with_reference)
    return results


def check_link_services(config: ClusterConfig, faults: list[Fault]) -> None:
    """Raises ValueError naming a link fault whose service (or Redis client) ``config`` does not
    start: its proxy would sit on no one's path and the fault would do nothing."""
    workers = [name for name, _ in config.worker_names]
    for fault in faults:
        if fault.client:
            known, name = [*config.router_names, *workers, *config.pool_names], fault.client
        else:
            known, name = [*workers, *config.pool_names], fault.service
        if name not in known:
            raise ValueError(f"{fault.label}: the cluster runs no {name!r} (its services: {', '.join(known)})")


def _put_link_proxies(cluster: LocalCluster, links: LinkProxies, faults: list[Fault], seed: int) -> None:
    """One proxy per link that ``faults`` name, before the cluster starts: a worker's or pool
    node's is the address it advertises (the routers, and for a pool node the workers, dial it);
    a Redis link is the Redis URL its client service is started with (Redis started first, so
    its address is known). Mutates ``cluster``'s addresses, advertised addresses and Redis URLs.

    Raises:
        RuntimeError / FileNotFoundError: Redis did not start (LocalCluster.start_redis).
    """
    config = cluster.config
    for i, fault in enumerate(faults):
        if fault.client:
            if not cluster.redis_url:
                cluster.start_redis(on_progress=console.print)
            redis_address = cluster.redis_url.removeprefix("redis://").split("/", 1)[0]
            cluster.redis_urls[fault.client] = f"redis://{links.add(fault.link, redis_address, seed + i)}/0"
        else:  # the routers dial this worker (or the workers this pool node) through the proxy
            cluster.addresses[fault.link] = f"{config.host}:{free_port()}"
            cluster.advertised[fault.link] = links.add(fault.link, cluster.addresses[fault.link], seed + i)


@contextlib.contextmanager
def _fault_injection(fault_file: str) -> Iterator[None]:
    """Names ``fault_file`` in the environment every service started meanwhile inherits (the
    chaos option of core.fault_injection); restores the environment after."""
    previous = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = fault_file
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = previous


def _write(out_dir: Path, campaign: Campaign, results: list[ScenarioResult], with_reference: bool) -> None:
    data = {"seed": campaign.seed, "cluster": campaign.cluster, "workload": campaign.workload,
            "concurrency": campaign.concurrency, "scenarios": [result_json(r) for r in results]}
    (out_dir / "results.json").write_text(json.dumps(data, indent=2, default=str))
    text = report.markdown(results, with_reference)
    for i, result in enumerate(results):
        if result.samples:
            plot(result.samples, out_dir / f"samples-{i}.png", f"{result.name}: gauges over time")
            load = (f"open loop at {result.offered_rate_per_s:.3f} req/s" if result.offered_rate_per_s
                    else f"closed loop, {campaign.concurrency} in flight")
            text += (f"\n### {result.name}: gauges over time (samples-{i}.png)\n\n{load}; completed "
                     f"{result.completion_rate_per_s:.3f} req/s over {result.duration_s:.0f} s\n\n"
                     + report.samples_markdown(result))
    (out_dir / "results.md").write_text(text)


@click.command()
@click.argument("campaign_path", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", "out_dir", default=".cache/chaos", show_default=True, type=click.Path(path_type=Path),
              help="Results (results.md, results.json), reference cache and service logs.")
@click.option("--model", default=DEFAULT_MODEL, show_default=True)
@click.option("--scenario", "only", multiple=True, help="Run only this scenario (repeatable).")
@click.option("--reference/--no-reference", default=True, show_default=True,
              help="Compare greedy answers with Hugging Face transformers (computed once, cached).")
@click.option("--partition", "partition", metavar="CLIENT_IP,SERVER_IP", default=None,
              help="Instead of a campaign: drop the packets between two IP addresses (pods) with iptables "
                   f"rules in the {netfilter.CHAIN} chain for --for-s seconds, then heal (needs root).")
@click.option("--for-s", "for_s", default=10.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="How long --partition lasts.")
@click.option("--direction", type=click.Choice(netfilter.DIRECTIONS), default="both", show_default=True,
              help="Which packets --partition drops (to_server: CLIENT_IP -> SERVER_IP only).")
@click.option("--loss", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=None,
              help="With --partition: drop each packet with this probability instead of all of them.")
@click.option("--cap-bytes-per-s", "cap_bytes_per_s", type=click.IntRange(min=1), default=None,
              help="With --partition: drop the packets above this byte rate each way instead (a policer).")
@click.option("--reset", is_flag=True,
              help="With --partition: answer TCP packets with a reset instead (connections break, new ones refused).")
@click.option("--cleanup", is_flag=True,
              help=f"Remove every rule and jump of the {netfilter.CHAIN} chain a killed run left, then exit.")
@click.option("--netns", default="", help="Run iptables in this network namespace (ip netns exec) instead of here.")
def chaos(campaign_path: Path | None, out_dir: Path, model: str, only: tuple[str, ...], reference: bool,
          partition: str | None, for_s: float, direction: str, loss: float | None, cap_bytes_per_s: int | None,
          reset: bool, cleanup: bool, netns: str) -> None:
    """Run a fault campaign (YAML: cluster, workload, scenarios of timed faults) on a local cluster,
    or partition two pod addresses (--partition), or remove what a killed partition left (--cleanup)."""
    # the rule kind of --partition, and its arguments after the two addresses
    kinds = [(netfilter.Netfilter.lose, (loss,)) if loss is not None else None,
             (netfilter.Netfilter.cap, (cap_bytes_per_s,)) if cap_bytes_per_s is not None else None,
             (netfilter.Netfilter.reset, ()) if reset else None]
    chosen = [kind for kind in kinds if kind is not None]
    if len(chosen) > 1:
        raise click.UsageError("give at most one of --loss, --cap-bytes-per-s and --reset")
    if cleanup or partition:
        add, args = chosen[0] if chosen else (netfilter.Netfilter.partition, ())
        _netfilter(partition, for_s, direction, cleanup, netns, add, args)
        return
    if campaign_path is None:
        raise click.UsageError("give a CAMPAIGN_PATH, --partition or --cleanup")
    try:
        campaign = load_campaign(campaign_path)
        results = run_campaign(campaign, out_dir, model, reference, only)
    except ValueError as err:
        raise click.ClickException(str(err)) from None
    console.print(report.markdown(results, reference))
    misses = report.failed(results)
    for line in misses:
        console.print(f"[red]target missed[/]: {line}")
    if misses:
        raise click.exceptions.Exit(1)


def _netfilter(partition: str | None, for_s: float, direction: str, cleanup: bool, netns: str,
               add=netfilter.Netfilter.partition, args: tuple = ()) -> None:
    """``--cleanup`` or ``--partition`` (chaos.netfilter). Raises ClickException naming what failed."""
    rules = netfilter.Netfilter(["ip", "netns", "exec", netns] if netns else [])
    try:
        if cleanup:
            console.print(f"removed {rules.cleanup()} rule(s) and the {netfilter.CHAIN} chain")
            return
        client, _, server = partition.partition(",")
        netfilter.hold_partition(rules, client.strip(), server.strip(), for_s, direction, console.print, None,
                                 add, *args)
    except (ValueError, RuntimeError, OSError) as err:
        raise click.ClickException(str(err)) from None
    except (KeyboardInterrupt, netfilter.Interrupted) as err:
        console.print(f"interrupted ({err or 'SIGINT'}): rules removed")
        raise click.exceptions.Exit(130) from None
