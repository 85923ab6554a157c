"""LocalCluster: every Tandem service as its own process on this machine (docs/design.md §9).

Start order: Redis → KV pool → the workers and routers together (a router counts as started
once it sees every worker in the registry); stop order is the reverse. Each child gets SIGTERM if this process dies (PR_SET_PDEATHSIG), so no process is left
behind even when the launcher is killed. A start-up whose ``interrupted()`` turns true (Ctrl-C
at ``tandem up``) starts nothing more and raises StartInterrupted. While it runs,
:meth:`LocalCluster.supervise` restarts a worker, KV pool or (one of several) router process
that exited (launcher.supervisor).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from launcher import processes
from launcher.commands import (core_share_argv, pool_node_args, service_argv, service_env, shared_threads,
                               worker_threads)
from launcher.config import ClusterConfig
from launcher.ports import free_port
from launcher.readiness import grpc_ready, http_ready, redis_ready, router_sees
from launcher.supervisor import ServiceStartError, StartInterrupted, Supervisor, log_cause


@dataclass
class Service:
    """One process of the cluster, with what it takes to start it again."""

    name: str
    process: subprocess.Popen
    ready: Callable[[], bool]
    log_path: Path
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def log_location(self) -> str:
        return str(self.log_path)

    def exit_code(self) -> int | None:
        return self.process.poll()

    def restart(self, note: str) -> None:
        """Starts the same argv again (same port); ``note`` and its output appended to the log.
        Mutates: ``process``. Must run on the thread that started the cluster: children get
        SIGTERM when the thread that forked them ends (PR_SET_PDEATHSIG)."""
        self.process = processes.spawn(self.argv, self.env, self.log_path, note)


@dataclass(frozen=True)
class RouterEndpoint:
    """Where one router of the cluster serves clients."""

    name: str  # service name: router, or router-0, router-1, ...
    http_url: str  # http://host:port (the OpenAI API under /v1)
    grpc_address: str  # host:port of tandem.v1.Router


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


class LocalCluster:
    def __init__(self, config: ClusterConfig, interrupted: Callable[[], bool] = lambda: False):
        """``interrupted``: polled while starting; once it returns True no further service is
        started and :meth:`start` raises StartInterrupted."""
        self.config = config
        self.interrupted = interrupted
        self.services: list[Service] = []
        self.redis_url = config.redis_url
        self.routers = [RouterEndpoint(name, f"http://{config.host}:{http}", f"{config.host}:{grpc_port}")
                        for name in config.router_names for http, grpc_port in [config.router_ports(name)]]
        self.http_url = self.routers[0].http_url  # the first router's (every router serves the whole cluster)
        self.grpc_address = self.routers[0].grpc_address
        # gRPC address of each started pool node and worker, by name (kv_pool, prefill, decode, prefill-1, ...).
        # Set one before start() to choose a worker's port.
        self.addresses: dict[str, str] = {}
        # The address a worker or pool node registers for others to dial (and a pool node's that
        # the workers are given), by name, when not its own (a chaos campaign puts a link proxy
        # there: chaos.link_proxy); set before start().
        self.advertised: dict[str, str] = {}
        # The Redis URL a service dials, by name, when not :attr:`redis_url` (a chaos campaign puts
        # a link proxy in front of Redis for one service: chaos.link_proxy); set before start().
        self.redis_urls: dict[str, str] = {}
        # Where each service serves Prometheus metrics, by name; a router's has the cluster view.
        self.metrics_urls: dict[str, str] = {r.name: f"{r.http_url}/metrics" for r in self.routers}
        # A lone router is critical (nothing serves without it); one of several is restarted like a worker.
        self._supervisor = Supervisor(config.restart, critical=frozenset(config.router_names)
                                      if config.num_routers == 1 else frozenset())
        self._threads: dict[str, int] = {}  # torch threads of each role's workers
        self._shared_threads = 0  # a decode worker's extra threads on idle prefill cores (engine.core_share)
        self._core_share_dir = ""  # their lock files, made at start() when sharing, removed at stop()
        self._pool_address = ""  # every pool node's gRPC address, comma-separated (the workers' --pool-address)
        self._metrics_ports: dict[str, int] = {}  # /metrics port of each pool and worker process
        self._draining: list[Service] = []  # removed workers finishing their in-flight requests

    def _spawn(self, name: str, argv: list[str], ready: Callable[[], bool], env: dict | None = None) -> Service:
        self._stop_if_interrupted(name)
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.config.log_dir / f"{name}.log"
        role = "router" if name.startswith("router") else "kv_pool" if name.startswith("kv_pool") else "worker"
        env = {**service_env(self.config, role), **(env or {})} if name != "redis" else (env or {})
        service = Service(name, processes.spawn(argv, env, log_path), ready, log_path, argv, env)
        self.services.append(service)
        return service

    def supervise(self, exclude: frozenset[str] = frozenset()) -> list[str]:
        """One supervision pass over the started services but ``exclude`` (names; a chaos run
        holds a service down that way), called every second or so from the thread that started
        the cluster: restarts exited services with their argv and port (launcher.supervisor).
        Returns what happened, one line each.

        Raises:
            launcher.supervisor.ServiceExited: the cluster must stop (the router exited,
                restarts off, or a service restarted too often).
        """
        return self._supervisor.poll([s for s in self.services if s.name not in exclude])

    def start(self, on_progress: Callable[[str], None] = lambda _: None, timeout_s: float = 300.0) -> None:
        """Starts every service and waits until each is healthy.

        Raises:
            FileNotFoundError: redis-server is needed and not installed.
            RuntimeError: a service exited or did not become healthy in time (its log is named).
            StartInterrupted: ``interrupted()`` turned true; the services started so far still run
                (:meth:`stop` stops them).
        """
        c = self.config
        py = sys.executable
        if not self.redis_url:
            self.start_redis(on_progress, timeout_s)
        chosen = self.addresses  # set before start(): kept
        self.addresses = {name: chosen.get(name) or f"{c.host}:{free_port()}"
                          for name in [*c.pool_names, *(name for name, _ in c.worker_names)]}
        metrics_ports = {name: free_port() for name in self.addresses}
        self.metrics_urls.update({name: f"http://{c.host}:{p}/metrics" for name, p in metrics_ports.items()})
        pools = [self._spawn(name, service_argv(c, "kv_pool", py, c.host, _port(self.addresses[name]),
                                                self.redis_url_of(name), metrics_port=metrics_ports[name])
                             + pool_node_args(name, c)
                             + (["--advertise-address", self.advertised[name]] if name in self.advertised else []),
                             grpc_ready(self.addresses[name])) for name in c.pool_names]
        for pool in pools:
            self._wait(pool, on_progress, timeout_s)
        pool_address = ",".join(self.advertised.get(name, self.addresses[name]) for name in c.pool_names)
        # One thread budget per process: oversubscribed torch processes slow down 10-100x.
        self._pool_address = pool_address
        self._metrics_ports = metrics_ports
        cores = c.num_threads or os.cpu_count() or 2
        self._threads = worker_threads(cores, c.colocated, c.num_prefill_workers, c.num_decode_workers)
        self._shared_threads = shared_threads(cores, self._threads, c)
        if self._shared_threads and not self._core_share_dir:
            self._core_share_dir = tempfile.mkdtemp(prefix="tandem-cores-")
        # The routers start beside the workers (they load only a tokenizer) and are ready once
        # they see every worker in the registry.
        workers = [self._spawn_worker(name, role) for name, role in c.worker_names]
        routers = [self._spawn(r.name, service_argv(c, "router", py, c.host, c.router_ports(r.name)[1],
                                                    self.redis_url_of(r.name), http_port=c.router_ports(r.name)[0]),
                               http_ready(f"{r.http_url}/health")) for r in self.routers]
        for worker in workers:
            self._wait(worker, on_progress, timeout_s)
        roles = [role for _, role in c.worker_names]
        for router, r in zip(routers, self.routers):
            self._wait(router, on_progress, timeout_s,
                       ready=router_sees(f"{r.http_url}/health", roles.count("prefill"), roles.count("decode")))

    def redis_url_of(self, name: str) -> str:
        """The Redis URL service ``name`` is started with: its own from :attr:`redis_urls`, else
        the cluster's."""
        return self.redis_urls.get(name, self.redis_url)

    def _spawn_worker(self, name: str, role: str) -> Service:
        c, threads = self.config, self._threads[role]
        self.addresses.setdefault(name, f"{c.host}:{free_port()}")
        metrics_port = self._metrics_ports.setdefault(name, free_port())
        self.metrics_urls[name] = f"http://{c.host}:{metrics_port}/metrics"
        argv = service_argv(c, role, sys.executable, c.host, _port(self.addresses[name]), self.redis_url_of(name),
                            pool_address=self._pool_address, num_threads=threads, metrics_port=metrics_port)
        if name in self.advertised:
            argv += ["--advertise-address", self.advertised[name]]
        argv += core_share_argv(c, role, self._core_share_dir, self._shared_threads)
        return self._spawn(name, argv, grpc_ready(self.addresses[name]),
                           env={"OMP_NUM_THREADS": str(c.rank_threads(role, threads))})

    def draining(self) -> list[Service]:
        """Removed workers whose process has not exited yet (reaps the others)."""
        self._draining = [s for s in self._draining if s.process.poll() is None]
        return list(self._draining)

    def worker_services(self, role: str) -> list[Service]:
        """The running (not draining) worker processes of ``role``, in start order."""
        return [s for s in self.services if s.name == role or s.name.startswith(f"{role}-")]

    def add_worker(self, role: str) -> str:
        """Starts one more worker of ``role`` (not waiting for it: it registers itself once its
        model is loaded and calibrated); returns its service name. Call from the thread that
        started the cluster (see Service.restart). Raises ValueError for a role this cluster has
        no workers of (colocated: no prefill)."""
        if role not in self.config.worker_roles:
            raise ValueError(f"this cluster runs no {role} workers (roles: {self.config.worker_roles})")
        taken = {s.name for s in self.services} | {s.name for s in self._draining}
        name = next(n for n in (f"{role}-{i}" for i in range(1, 10_000)) if n not in taken)
        self._spawn_worker(name, role)
        return name

    def remove_worker(self, role: str) -> str:
        """Drains the newest worker of ``role``: SIGTERM (it deregisters, finishes its in-flight
        requests within its grace period, exits); no longer supervised. Returns its name.
        Raises ValueError when it is the role's last worker."""
        workers = self.worker_services(role)
        if len(workers) <= 1:
            raise ValueError(f"cannot remove the last {role} worker")
        service = workers[-1]
        self.services.remove(service)
        self.addresses.pop(service.name, None)
        self._draining.append(service)
        if service.process.poll() is None:
            service.process.send_signal(signal.SIGTERM)
        self._draining = [s for s in self._draining if s.process.poll() is None]
        return service.name

    def start_redis(self, on_progress: Callable[[str], None] = lambda _: None, timeout_s: float = 300.0,
                    bind: str = "127.0.0.1") -> None:
        """Starts a private, non-persistent redis-server listening on ``bind``; sets ``redis_url``.

        Raises:
            FileNotFoundError: redis-server is not installed.
            RuntimeError: it exited or did not answer PING in time.
            StartInterrupted: as :meth:`start`.
        """
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(
                "redis-server not found: install it (Debian/Ubuntu: apt-get install -y redis-server) "
                "or pass --redis-url redis://HOST:PORT/0"
            )
        port = free_port()
        self.redis_url = f"redis://{bind}:{port}/0"
        argv = [binary, "--port", str(port), "--bind", bind, "--save", "", "--appendonly", "no"]
        if bind not in ("127.0.0.1", "localhost", "::1"):
            # Protected mode refuses every non-loopback client of a password-less Redis; other
            # nodes must reach this one (a private network is assumed; else use --redis-url).
            argv += ["--protected-mode", "no"]
        self._wait(self._spawn("redis", argv, redis_ready(port, bind)), on_progress, timeout_s)

    def _wait(self, service: Service, on_progress: Callable[[str], None], timeout_s: float,
              ready: Callable[[], bool] | None = None) -> None:
        """Until ``ready`` (default: the service's own probe) holds. Raises RuntimeError when the
        service exits or ``timeout_s`` passes; StartInterrupted when interrupted."""
        ready = ready or service.ready
        on_progress(f"starting {service.name}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._stop_if_interrupted(service.name)
            if service.process.poll() is not None:
                cause = log_cause(service.log_path.read_text(errors="replace")[-20000:])
                raise ServiceStartError(f"{service.name} exited with code {service.process.returncode}"
                                        + (f": {cause}" if cause else "") + f"; log {service.log_path}")
            if ready():
                on_progress(f"{service.name} ready")
                return
            time.sleep(0.2)  # polling a child's health, not synchronising threads
        raise ServiceStartError(f"{service.name} not healthy after {timeout_s:.0f} s; log {service.log_path}")

    def _stop_if_interrupted(self, starting: str) -> None:
        if self.interrupted():
            raise StartInterrupted(starting)

    def service(self, name: str) -> Service:
        """The started service called ``name`` (``decode-1``, ...). Raises KeyError if none."""
        for service in self.services:
            if service.name == name:
                return service
        raise KeyError(f"no service {name!r}; started: {[s.name for s in self.services]}")

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM in reverse start order, SIGKILL what is still alive after ``timeout_s``."""
        for service in [*reversed(self.services), *self._draining]:
            processes.stop(service.process, timeout_s)
        self.services.clear()
        self._draining.clear()
        if self._core_share_dir:
            shutil.rmtree(self._core_share_dir, ignore_errors=True)
            self._core_share_dir = ""

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
