"""``tandem up``: a local (or Ray) cluster from one command. Its cluster settings are generated
from the services' configurations (launcher.config.SECTIONS, core.settings): one declaration,
one default per setting."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from bench.prompts import load_prompts
from core import cluster_record
from core.model_source import resolve_model
from core.settings import options
from launcher.config import SECTIONS, ClusterConfig
from launcher.local_cluster import LocalCluster
from launcher.ports import free_port
from launcher.preflight import PreflightError, check_engine_sizes, check_ports_free
from launcher.supervisor import RestartPolicy, ServiceExited, ServiceStartError, StartInterrupted

console = Console()


def cluster_options(f: Callable) -> Callable:
    """Every ``tandem up`` option of a cluster setting: each section's fields (pool ones as
    ``--pool-<flag>``), then ClusterConfig's own, as their configs declare them."""
    f = options(ClusterConfig)(f)
    for section in reversed(SECTIONS):
        f = options(section.config, prefix=section.prefix, exclude=section.set_by_cluster | section.hidden)(f)
    return f


def _values_file(ctx: click.Context, _param: click.Parameter, path: Path | None) -> Path | None:
    """-f: the settings the values file makes become the defaults of the other options (flags
    win); what it leaves out keeps tandem up's own defaults (tandem_cli.values)."""
    if path is None:
        return None
    from tandem_cli.values import load_values, model_source_problem, read_file, up_options

    try:
        values = load_values(path)
        options = up_options(values, read_file(path))
    except ValueError as err:
        raise click.BadParameter(str(err), ctx, _param) from None
    ctx.default_map = {**(ctx.default_map or {}), **options}
    ctx.meta["values_model_problem"] = model_source_problem(values)  # an error unless --model is given
    return path


@click.command()
@click.option("-f", "--values", "values_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              is_eager=True, expose_value=False, callback=_values_file,
              help="A Helm values file (the chart's vocabulary and schema) setting the options below; "
                   "flags override it, and what it leaves out keeps tandem up's defaults (not the chart's).")
@click.option("--print-config", is_flag=True, help="Print the effective configuration and each service's command, "
                                                   "then exit.")
@cluster_options
@click.option("--api-key", "api_keys", multiple=True, envvar="TANDEM_API_KEY",
              help="A key clients must send as 'Authorization: Bearer <key>' to the router (repeat for several; "
                   "env TANDEM_API_KEY, space-separated). Unset: the API is open.")
@click.option("--api-key-file", default="", help="A file of API keys, one a line, added to --api-key.")
@click.option("--cluster-token", default="", envvar="TANDEM_CLUSTER_TOKEN",
              help="Shared secret the pool and worker RPCs demand (gRPC metadata); unset: none.")
@click.option("--demo", is_flag=True, help="Send demo prompts, print answers with TTFT/TBT, then stop.")
@click.option("--prompts", "prompts_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Prompt file for --demo (ShareGPT/AlpacaEval JSON or text lines). Default: the ShareGPT set in "
                   "--data-dir if present (docs/data.md), else built-in prompts.")
@click.option("--data-dir", "data_folder", envvar="TANDEM_DATA_DIR", default=None,
              type=click.Path(file_okay=False, path_type=Path),
              help="Folder of the public data sets (--demo's prompts) [env TANDEM_DATA_DIR; default: "
                   "~/.cache/tandem/data].")
@click.option("--num-prompts", default=8, show_default=True, type=int)
@click.option("--max-tokens", default=64, show_default=True, type=int)
@click.option("--ray", "use_ray", is_flag=True,
              help="Place the services as Ray actors (workers get a GPU each where the cluster has GPUs).")
@click.option("--address", default=None,
              help="With --ray: address of an existing Ray cluster (e.g. auto, HOST:6379). Default: a local Ray.")
@click.option("--restart/--no-restart", default=True, show_default=True,
              help="Supervise: a prefill/decode worker or KV pool process that exits is restarted with the same "
                   "flags and port (log appended; backoff 0.5 s doubling; at most 5 restarts per service in 60 s, "
                   "then the cluster stops); a private Redis is restarted the same way (empty: workers "
                   "re-register, pools re-publish their block index); the router exiting always stops it. With --ray the actor "
                   "restarts its service the same way; a dead actor stops the cluster. --no-restart: any exit "
                   "stops the cluster (CI).")
@click.option("--force", is_flag=True,
              help="Start even when the cluster does not fit this machine (the memory its processes will take, "
                   "the NVMe tier's disk): tandem up refuses it otherwise, naming what does not fit.")
@click.option("--autoscale", is_flag=True,
              help="Start and drain prefill and decode workers from their heartbeats against the SLOs "
                   "(--ttft-slo-s/--tbt-slo-s, else 2 s / 0.2 s; docs/autoscaling.md).")
@click.option("--max-prefill-workers", default=4, show_default=True, type=int, help="With --autoscale.")
@click.option("--max-decode-workers", default=4, show_default=True, type=int, help="With --autoscale.")
@click.option("--autoscale-interval-s", default=2.0, show_default=True, type=float, help="With --autoscale.")
@click.option("--autoscale-cooldown-s", default=30.0, show_default=True, type=float,
              help="With --autoscale: no second change of a role within this many seconds.")
def up(demo: bool, prompts_path: Path | None, data_folder: Path | None, num_prompts: int, max_tokens: int,
       use_ray: bool, address: str | None, print_config: bool, force: bool, autoscale: bool, max_prefill_workers: int,
       max_decode_workers: int, autoscale_interval_s: float, autoscale_cooldown_s: float, **kwargs) -> None:
    """Start Redis, the KV pool, a prefill worker, a decode worker and the router on this machine
    (or, with --ray, the same services as Ray actors)."""
    if address and not use_ray:
        raise click.UsageError("--address needs --ray")
    if autoscale and use_ray:
        raise click.UsageError("--autoscale runs local workers; on Kubernetes enable the chart's autoscaler")
    autoscale_config = _autoscale_config(kwargs, max_prefill_workers, max_decode_workers,
                                         autoscale_cooldown_s) if autoscale else None
    if use_ray and (kwargs["num_prefill_workers"] > 1 or kwargs["num_decode_workers"] > 1):
        raise click.UsageError("--ray starts one worker per role; --num-prefill/decode-workers > 1 need the local launcher")
    if use_ray and kwargs["num_routers"] > 1:
        raise click.UsageError("--ray starts one router; --num-routers > 1 needs the local launcher")
    if use_ray and kwargs["num_pool_nodes"] > 1:
        raise click.UsageError("--ray starts one pool node; --num-pool-nodes > 1 needs the local launcher")
    if kwargs["colocated"] and _given("num_prefill_workers"):
        raise click.UsageError("--colocated starts no prefill worker; drop --num-prefill-workers or --colocated")
    problem = click.get_current_context().meta.get("values_model_problem")
    if problem and not _given("model"):
        raise click.UsageError(problem)
    given = {name: (kwargs[name], _source(name)) for name in kwargs}
    if demo and prompts_path is None:
        from core.datasets import data_dir, default_file

        prompts_path = default_file("sharegpt", data_dir(data_folder))
    config, source, prompts = _prepare(kwargs, prompts_path if demo else None, num_prompts, demo,
                                       check_ports=not (address or print_config))
    fit = _check_model_and_machine(config, source, check_machine=not address, workers_on_gpu=use_ray)
    if print_config:
        from tandem_cli.config_report import config_report

        console.print(config_report(config, given), markup=False, highlight=False, soft_wrap=True)
        if fit is not None:
            verdict = "; ".join(fit.problems()) or "fits"
            console.print(f"# this machine: {verdict}\n# " + fit.report().replace("\n", "\n# "), markup=False,
                          highlight=False, soft_wrap=True)
        return
    if fit is not None and fit.problems() and not force:
        raise click.ClickException(fit.message())
    with console.status(f"preparing model {source.name} (first run converts the GGUF once)"):
        from engine.model.gguf_convert import ensure_hf_dir  # torch import: only when starting a cluster

        ensure_hf_dir(source)
    _prepare_cpu_kernel()
    stop, signals = _catch_stop_signals()
    if use_ray:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise click.ClickException("--ray needs ray: pip install 'tandem-serve[ray]'") from None
        from launcher.ray_cluster import RayCluster

        cluster = RayCluster(config, address=address, interrupted=stop.is_set)
    else:
        cluster = LocalCluster(config, interrupted=stop.is_set)
    record = None
    try:
        with console.status("starting services") as status:
            # A pipe or a log file gets no spinner: one line per step instead.
            cluster.start(on_progress=status.update if console.is_terminal else console.print)
        record = cluster_record.write([r.http_url for r in getattr(cluster, "routers", None) or []]
                                      or [cluster.http_url], config.log_dir)  # tandem status finds it
        where = f"  Ray actors on {sorted({s.node_ip for s in cluster.services})}" if use_ray else ""
        # soft_wrap: no line breaks inserted into the URLs (a piped console is 80 columns wide)
        console.print(f"[green]Tandem is up[/]: {_api_line(cluster)}  "
                      f"Redis {cluster.redis_url}  logs {Path(config.log_dir).resolve()}{where}", soft_wrap=True)
        _print_metrics(getattr(cluster, "metrics_urls", None) or {"router": f"{cluster.http_url}/metrics"})
        if demo:
            _print_demo(asyncio.run(_demo(cluster, source.name, prompts, max_tokens)))
        else:
            console.print("Ctrl-C stops every service.")
            scaler = None
            if autoscale_config is not None:
                from autoscaler.local import LocalAutoscaler

                scaler = LocalAutoscaler(cluster, autoscale_config, autoscale_interval_s)
            while not stop.wait(timeout=1.0):
                _supervise(cluster)
                for event in scaler.step() if scaler else ():
                    console.print(event)
    except StartInterrupted as err:
        console.print(f"[yellow]{err}[/]")
        raise click.exceptions.Exit(128 + signals[0]) from None  # as a shell reports a signal: 130 for SIGINT
    except ServiceStartError as err:  # a service exited or never became healthy: its cause, not a traceback
        raise click.ClickException(str(err)) from None
    finally:
        if record is not None:
            cluster_record.remove(record)
        with console.status("stopping services"):
            cluster.stop()
        console.print("stopped")




def _check_model_and_machine(config: ClusterConfig, source, check_machine: bool, workers_on_gpu: bool):
    """--max-model-len against the model, and (``check_machine``) the cluster's fit on this machine
    (launcher.machine_fit; a local Ray with GPUs keeps the workers' weights and KV there).

    Raises:
        click.ClickException: the context is longer than the model supports, or its shape is unreadable.
    """
    import shutil

    from launcher import machine_fit, model_shape

    try:
        shape = model_shape.read_shape(source)
        model_shape.check_max_model_len(shape, config.engine.max_model_len)
    except PreflightError as err:
        raise click.ClickException(str(err)) from None
    except (OSError, KeyError, ValueError) as err:
        raise click.ClickException(f"cannot read the shape of model {source.path}: {err!r}") from None
    if not check_machine:
        return None
    return machine_fit.check(config, shape, workers_on_gpu and shutil.which("nvidia-smi") is not None)


def _api_line(cluster) -> str:
    """Where clients connect: the router's OpenAI API and gRPC, or each of several routers'."""
    routers = getattr(cluster, "routers", None) or []
    if len(routers) <= 1:
        return f"OpenAI API {cluster.http_url}/v1  gRPC {cluster.grpc_address}"
    return "routers: " + "; ".join(f"{r.name} OpenAI API {r.http_url}/v1 gRPC {r.grpc_address}" for r in routers)


def _autoscale_config(kwargs: dict, max_prefill: int, max_decode: int, cooldown_s: float):
    """The autoscaler's bounds and SLOs from ``tandem up``'s flags. Raises click.UsageError."""
    from autoscaler.policy import AutoscaleConfig

    colocated = kwargs["colocated"]
    try:
        return AutoscaleConfig(
            ttft_slo_s=kwargs["ttft_slo_s"] or 2.0, tbt_slo_s=kwargs["tbt_slo_s"] or 0.2,
            min_prefill=0 if colocated else 1, max_prefill=0 if colocated else max_prefill,
            min_decode=1, max_decode=max_decode, cooldown_s=cooldown_s)
    except ValueError as err:
        raise click.UsageError(str(err)) from None


def _print_metrics(urls: dict[str, str]) -> None:
    """Where each process serves Prometheus metrics (the router's also shows the whole cluster)."""
    if urls:
        console.print("metrics: " + "  ".join(f"{name} {url}" for name, url in urls.items())
                      + "  (router: the whole cluster; `tandem status` shows it live)", soft_wrap=True)


def _catch_stop_signals() -> tuple[threading.Event, list[int]]:
    """From now on SIGINT and SIGTERM set the returned event and are appended to the returned
    list (instead of raising KeyboardInterrupt): start-up launches nothing more, serving stops."""
    stop, signals = threading.Event(), []

    def on_signal(signum: int, _frame) -> None:
        signals.append(signum)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    return stop, signals


def _source(name: str) -> str:
    """Where option ``name``'s value came from: command line, environment, values file or default."""
    source = click.get_current_context().get_parameter_source(name)
    return {click.core.ParameterSource.DEFAULT_MAP: "values file"}.get(source, source.name.lower().replace("_", " "))


def _given(name: str) -> bool:
    """Whether the user set option ``name`` (on the command line or through its environment variable)."""
    return click.get_current_context().get_parameter_source(name) is not click.core.ParameterSource.DEFAULT


def _prepare_cpu_kernel() -> None:
    """Compiles the CPU attention kernels (decode and prefill) once per machine before the workers
    start (they would otherwise each compile them, silently, in their logs) and says so on the
    first start."""
    from engine.kernels import cpu_build, cpu_decode_attention, cpu_prefill_attention

    for module, name, fallback in ((cpu_decode_attention, "paged-attention", "gather + SDPA attention"),
                                   (cpu_prefill_attention, "prefill-attention", "SDPA for prompt chunks")):
        if module.SOURCE.is_file() and cpu_build.library_path(module.SOURCE).exists():
            continue
        started = time.perf_counter()
        with console.status(f"compiling the CPU {name} kernel (first start on this machine only)"):
            kernel = module.load_kernel()
        if kernel is None:
            console.print(f"[yellow]the CPU {name} kernel is unavailable (no working C compiler, or its source is "
                          f"not installed): the workers use {fallback} (slower); see the worker logs[/]")
        else:
            console.print(f"compiled the CPU {name} kernel in {time.perf_counter() - started:.1f} s "
                          f"({cpu_build.library_path(module.SOURCE)})")


def _prepare(params: dict, prompts_path: Path | None, num_prompts: int, demo: bool,
             check_ports: bool) -> tuple[ClusterConfig, object, list[str]]:
    """(cluster config, model source, demo prompts) from ``up``'s cluster parameters, checked
    before any process starts or any log file opens: free ports, engine and router sizes, the
    model, the demo prompt file.

    Raises:
        click.ClickException: one line naming the flag to change.
    """
    from router.api.auth import load_api_keys  # torch-free

    options = dict(params)
    try:
        api_keys = load_api_keys(options.pop("api_keys"), options.pop("api_key_file"))
        if check_ports:
            check_ports_free(options["host"], _router_ports(options))
            for key in ("http_port", "grpc_port"):  # 0: a free port, chosen here so the launcher knows it
                if options[key] == 0 and options["num_routers"] <= 1:
                    options[key] = free_port()
        check_engine_sizes(*(options[k] for k in ("block_size", "num_kv_blocks", "max_num_seqs",
                                                  "max_num_batched_tokens", "max_model_len")))
        prompts = _demo_prompts(prompts_path, num_prompts) if demo else []
        restart = RestartPolicy() if options.pop("restart") else RestartPolicy(max_restarts=0)
        config = ClusterConfig.from_options(**options, api_keys=api_keys, restart=restart)
        source = resolve_model(config.model)
    except (ValueError, FileNotFoundError) as err:
        raise click.ClickException(name_flags(str(err), params)) from None
    return config, source, prompts


def name_flags(message: str, names: Iterable[str]) -> str:
    """``message`` with each option field it names written as the flag that sets it
    (``max_mixed_prefill_tokens must be >= 0`` -> ``--max-mixed-prefill-tokens must be >= 0``,
    ``needs dtype 'float32'`` -> ``needs --dtype 'float32'``): a name with an underscore
    anywhere, a one-word name only before a quoted value, so that plain words stay words."""
    for name in sorted(names, key=len, reverse=True):
        after = r"(?!\w)" if "_" in name else r"(?= ')"
        message = re.sub(rf"(?<![\w-]){re.escape(name)}{after}", "--" + name.replace("_", "-"), message)
    return message


def _router_ports(kwargs: dict) -> dict[str, int]:
    """Every router's ports by the flag that sets them (router i: ``--http-port`` + i)."""
    ports = {}
    for i in range(max(1, kwargs["num_routers"])):
        suffix = f" + {i}" if i else ""
        ports[f"--http-port{suffix}"] = kwargs["http_port"] + i if kwargs["http_port"] else 0
        ports[f"--grpc-port{suffix}"] = kwargs["grpc_port"] + i if kwargs["grpc_port"] else 0
    return ports


def _demo_prompts(path: Path | None, num_prompts: int) -> list[str]:
    """--demo's prompts: ``path``, else the built-in ones."""
    try:
        prompts = load_prompts(path, num_prompts, max_chars=400)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise PreflightError(f"cannot read prompts from {path}: {err}") from None
    if not prompts:
        raise PreflightError(f"no prompt of at most 400 characters in {path}; pass --prompts")
    return prompts


def _supervise(cluster) -> None:
    """One supervision pass of a LocalCluster or RayCluster; prints what it did.

    Raises:
        click.ClickException: the cluster must stop (router or Redis exited, --no-restart, or a
            service restarted too often); the message names the service and its log.
    """
    try:
        for event in cluster.supervise():
            console.print(f"[yellow]{event}[/]")
    except ServiceExited as err:
        raise click.ClickException(str(err)) from None


async def _demo(cluster, model: str, prompts: list[str], max_tokens: int):
    from tandem_cli.demo import run_demo

    return await run_demo(cluster.http_url, model, prompts, max_tokens)


def _print_demo(results) -> None:
    for i, r in enumerate(results):
        console.rule(f"[bold]{i}[/] {r.prompt[:100]!r}")
        console.print(r.error or r.text)
    table = Table("#", "TTFT s", "mean TBT ms", "chars", "finish")
    for i, r in enumerate(results):
        table.add_row(str(i), f"{r.ttft_s:.3f}", f"{r.mean_tbt_s * 1000:.1f}", str(len(r.text)), r.finish_reason or r.error[:30])
    console.print(table)
    if any(r.error for r in results):
        raise click.ClickException("some demo requests failed")


