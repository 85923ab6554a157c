"""LocalCluster: every Tandem service as its own process on this machine (docs/design.md §9).

Start order: Redis → KV pool → prefill workers → decode workers → routers; stop order is the
reverse. Each child gets SIGTERM if this process dies (PR_SET_PDEATHSIG), so no process is left
behind even when the launcher is killed. A start-up whose ``interrupted()`` turns true (Ctrl-C
at ``tandem up``) starts nothing more and raises StartInterrupted. While it runs,
:meth:`LocalCluster.supervise` restarts a worker, KV pool or (one of several) router process
that exited (launcher.supervisor).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.grpc_service import cluster_channel
from launcher.supervisor import RestartPolicy, StartInterrupted, Supervisor

_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(num_ports: int, attempts: int = 100) -> int:
    """The first of ``num_ports`` consecutive ports that are free on 127.0.0.1 now (for several
    routers on ``port + i``). Raises RuntimeError when no such run is found in ``attempts`` tries."""
    for _ in range(attempts):
        first = free_port()
        if first + num_ports - 1 > 65535:
            continue
        with contextlib.ExitStack() as held:  # hold each port while checking the next
            try:
                for port in range(first, first + num_ports):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
    raise RuntimeError(f"no {num_ports} consecutive free ports found in {attempts} tries")


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: Ctrl-C still stops everything through stop()
        pass


@dataclass(frozen=True)
class ClusterConfig:
    """What ``tandem up`` starts. Raises ValueError on impossible sizes."""

    model: str
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50050
    redis_url: str = ""  # empty: start a private redis-server
    block_size: int = 16
    num_kv_blocks: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    pool_capacity_bytes: int = 2 * 1024**3
    num_threads: int = 0  # total CPU threads for the two workers; 0: all cores
    log_dir: Path = field(default_factory=lambda: Path.cwd() / ".cache" / "logs")
    extra_worker_args: tuple[str, ...] = ()
    # Router flags (routing policy, disaggregation, SLOs: python -m router --help).
    extra_router_args: tuple[str, ...] = ()
    # No prefill worker: the decode worker prefills, chunked into its decode steps (Sarathi-Serve).
    colocated: bool = False
    # Worker processes per role (colocated: no prefill worker whatever num_prefill_workers says).
    num_prefill_workers: int = 1
    num_decode_workers: int = 1
    # Restarts of exited worker and pool processes (max_restarts 0: any exit stops the cluster).
    restart: RestartPolicy = RestartPolicy()
    # Tensor-parallel ranks of each prefill / decode worker (engine.parallel; one GPU each on CUDA).
    prefill_tp: int = 1
    decode_tp: int = 1
    # Keys clients must send to the router (router.api.auth); empty: open. Passed in the environment,
    # never in argv (which `ps` shows).
    api_keys: tuple[str, ...] = ()
    # Shared secret of the cluster's internal RPCs (core.grpc_auth); empty: none.
    cluster_token: str = ""
    # KV blocks of each prefill worker's cache; 0: num_kv_blocks (the decode workers').
    prefill_num_kv_blocks: int = 0
    # KV pool processes; the workers spread blocks over all of them (core.pool_ring).
    num_pool_nodes: int = 1
    # KV pool flags beyond capacity (lease TTL, NVMe tier: python -m kv_pool --help).
    extra_pool_args: tuple[str, ...] = ()
    # Router processes serving the same cluster (the chart's router.replicas); router i listens
    # on http_port + i and grpc_port + i. Several routers are supervised like workers.
    num_routers: int = 1

    def __post_init__(self) -> None:
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        for name in ("num_prefill_workers", "num_decode_workers", "num_pool_nodes", "prefill_tp", "decode_tp",
                     "num_routers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_routers > 1 and not (self.http_port and self.grpc_port):
            raise ValueError(f"num_routers={self.num_routers} needs http_port and grpc_port > 0 (router i "
                             f"listens on port + i), got {self.http_port} and {self.grpc_port}")
        http = set(range(self.http_port, self.http_port + self.num_routers))
        grpc_ports = set(range(self.grpc_port, self.grpc_port + self.num_routers))
        if self.num_routers > 1 and http & grpc_ports:
            raise ValueError(f"the routers' HTTP ports {min(http)}-{max(http)} and gRPC ports "
                             f"{min(grpc_ports)}-{max(grpc_ports)} overlap; move --http-port or --grpc-port")
        if max(http | grpc_ports) > 65535:
            raise ValueError(f"router ports run past 65535 with num_routers={self.num_routers}")

    @property
    def router_names(self) -> tuple[str, ...]:
        """Service names of the routers: ``router`` alone, else ``router-0``, ``router-1``, ..."""
        return ("router",) if self.num_routers == 1 else tuple(f"router-{i}" for i in range(self.num_routers))

    def router_ports(self, name: str) -> tuple[int, int]:
        """(HTTP port, gRPC port) of router ``name``: ``http_port + i``, ``grpc_port + i``.
        Raises ValueError for a name that is not one of :attr:`router_names`."""
        if name not in self.router_names:
            raise ValueError(f"no router {name!r}; routers: {self.router_names}")
        i = self.router_names.index(name)
        return self.http_port + i, self.grpc_port + i

    def tensor_parallel_size(self, role: str) -> int:
        """Ranks of one ``role`` worker (prefill or decode)."""
        return self.prefill_tp if role == "prefill" else self.decode_tp

    def rank_threads(self, role: str, worker_threads: int) -> int:
        """Threads of each rank of a ``role`` worker given ``worker_threads`` for the whole
        worker: split between its ranks, at least 1 (TP=2 on 2 cores: 1 thread a rank)."""
        return max(1, worker_threads // self.tensor_parallel_size(role))

    @property
    def pool_names(self) -> tuple[str, ...]:
        """Service names of the pool nodes: ``kv_pool``, then ``kv_pool-1``, ..."""
        return tuple("kv_pool" if i == 0 else f"kv_pool-{i}" for i in range(self.num_pool_nodes))

    @property
    def worker_roles(self) -> tuple[str, ...]:
        return ("decode",) if self.colocated else ("prefill", "decode")

    @property
    def worker_names(self) -> tuple[tuple[str, str], ...]:
        """(service name, role) of every worker process, in start order. The first worker of a
        role is named after the role (``prefill``, ``decode``), the others ``prefill-1``, ..."""
        counts = {"prefill": self.num_prefill_workers, "decode": self.num_decode_workers}
        return tuple((role if i == 0 else f"{role}-{i}", role)
                     for role in self.worker_roles for i in range(counts[role]))


def _popen(argv: list[str], env: dict[str, str], log_path: Path, note: str = "") -> subprocess.Popen:
    """Starts ``argv`` with ``env`` added, output to ``log_path``: truncated, or with ``note``
    appended to it (a restart keeps the previous process's log)."""
    with open(log_path, "ab" if note else "wb") as log_file:
        log_file.write(note.encode())
        log_file.flush()
        return subprocess.Popen(
            argv, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent, env={**os.environ, **env},
        )


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
        self.process = _popen(self.argv, self.env, self.log_path, note)


@dataclass(frozen=True)
class RouterEndpoint:
    """Where one router of the cluster serves clients."""

    name: str  # service name: router, or router-0, router-1, ...
    http_url: str  # http://host:port (the OpenAI API under /v1)
    grpc_address: str  # host:port of tandem.v1.Router


def _grpc_ready(address: str) -> Callable[[], bool]:
    def check() -> bool:
        with cluster_channel(address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

    return check


def _http_ready(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return httpx.get(url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    return check


def _redis_ready(port: int, host: str = "127.0.0.1") -> Callable[[], bool]:
    def check() -> bool:
        try:
            with socket.create_connection((host, port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    return check


SERVICE_PACKAGES = {"kv_pool": "kv_pool", "prefill": "prefill_worker", "decode": "decode_worker", "router": "router"}


# Up to this many cores, a 1P+1D cluster gives the decode worker every core and each prefill
# worker one thread (see worker_threads).
SMALL_MACHINE_CORES = 4


def worker_threads(cores: int, colocated: bool = False, num_prefill_workers: int = 1,
                   num_decode_workers: int = 1, share_cores: bool = True) -> dict[str, int]:
    """CPU threads of each prefill and each decode worker when they share ``cores`` cores.

    Colocated: every core to the decode workers. Disaggregated on a small machine (up to
    ``SMALL_MACHINE_CORES``), when there is one decode worker: it gets every core, and each
    prefill worker one thread. Decode is the latency-critical, always-running role; a
    single-threaded prefill opens no OpenMP team, so it only takes time slices from decode and
    never stalls at a barrier, where two multi-threaded workers sharing cores collapse (2 cores,
    ShareGPT at concurrency 16: prefill 1 + decode 2 threads served 164 tok/s, 1 + 1 served 125,
    2 + 2 served 62; docs/bench.md). Otherwise, or without ``share_cores`` (Ray reserves each
    worker's threads as CPUs), half the cores to each role, never shared. At least 1 each.
    """
    if colocated:
        return {"decode": max(1, cores // num_decode_workers)}
    if share_cores and cores <= SMALL_MACHINE_CORES and num_decode_workers == 1:
        return {"prefill": 1, "decode": cores}
    return {"prefill": max(1, (cores // 2) // num_prefill_workers),
            "decode": max(1, (cores - cores // 2) // num_decode_workers)}


def service_argv(c: ClusterConfig, role: str, python: str, host: str, port: int, redis_url: str, *,
                 pool_address: str = "", num_threads: int = 1, metrics_port: int = 0, http_port: int = 0) -> list[str]:
    """``python -m <package> <flags>`` of one service (role: kv_pool, prefill, decode, router).

    ``port`` is the gRPC port (a router's HTTP port is ``http_port``, 0: ``c.http_port``); ``metrics_port``: where
    a pool or worker serves ``/metrics`` (0: off; the router serves it on its HTTP port). Shared
    by the local and the Ray launcher, so both start the services with the same flags.
    ``num_threads``: the whole worker's; a tensor-parallel worker's ranks split it
    (``ClusterConfig.rank_threads``).
    """
    common = [python, "-m", SERVICE_PACKAGES[role], "--host", host, "--redis-url", redis_url]
    if metrics_port and role != "router":
        common += ["--metrics-port", str(metrics_port)]
    if role == "kv_pool":
        return [*common, "--port", str(port), "--capacity-bytes", str(c.pool_capacity_bytes), *c.extra_pool_args]
    if role == "router":
        return [*common, "--http-port", str(http_port or c.http_port), "--grpc-port", str(port),
                "--model", c.model, "--max-model-len", str(c.max_model_len), *c.extra_router_args]
    if role not in ("prefill", "decode"):
        raise ValueError(f"unknown service role {role!r}")
    num_kv_blocks = c.prefill_num_kv_blocks if role == "prefill" and c.prefill_num_kv_blocks else c.num_kv_blocks
    return [
        *common, "--model", c.model, "--block-size", str(c.block_size), "--num-kv-blocks", str(num_kv_blocks),
        "--max-num-seqs", str(c.max_num_seqs), "--max-num-batched-tokens", str(c.max_num_batched_tokens),
        "--max-model-len", str(c.max_model_len), "--pool-address", pool_address,
        *c.extra_worker_args, "--port", str(port), "--num-threads", str(c.rank_threads(role, num_threads)),
        "--tensor-parallel-size", str(c.tensor_parallel_size(role)),
    ]


def service_env(c: ClusterConfig, role: str) -> dict[str, str]:
    """Environment variables of one service beyond the launcher's own: its secrets."""
    env = {"TANDEM_CLUSTER_TOKEN": c.cluster_token} if c.cluster_token else {}
    if role == "router" and c.api_keys:
        env["TANDEM_ROUTER_API_KEY"] = " ".join(c.api_keys)
    return env


def pool_node_args(name: str, c: ClusterConfig) -> list[str]:
    """What sets pool node ``name`` apart when several share this host: its id and, with an NVMe
    tier, a folder of its own under ``--nvme-path`` (a repeated flag: the last one counts)."""
    if c.num_pool_nodes == 1:
        return []
    index = name.removeprefix("kv_pool").lstrip("-") or "0"
    args = ["--node-id", f"pool-{index}"]
    if "--nvme-path" in c.extra_pool_args:
        base = c.extra_pool_args[c.extra_pool_args.index("--nvme-path") + 1]
        args += ["--nvme-path", str(Path(base) / f"pool-{index}")]
    return args


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
        self.addresses: dict[str, str] = {}
        # Where each service serves Prometheus metrics, by name; a router's has the cluster view.
        self.metrics_urls: dict[str, str] = {r.name: f"{r.http_url}/metrics" for r in self.routers}
        # A lone router is critical (nothing serves without it); one of several is restarted like a worker.
        self._supervisor = Supervisor(config.restart, critical=frozenset(config.router_names)
                                      if config.num_routers == 1 else frozenset())
        self._threads: dict[str, int] = {}  # torch threads of each role's workers
        self._pool_address = ""  # every pool node's gRPC address, comma-separated (the workers' --pool-address)
        self._metrics_ports: dict[str, int] = {}  # /metrics port of each pool and worker process
        self._draining: list[Service] = []  # removed workers finishing their in-flight requests

    def _spawn(self, name: str, argv: list[str], ready: Callable[[], bool], env: dict | None = None) -> Service:
        self._stop_if_interrupted(name)
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.config.log_dir / f"{name}.log"
        role = "router" if name.startswith("router") else "kv_pool" if name.startswith("kv_pool") else "worker"
        env = {**service_env(self.config, role), **(env or {})} if name != "redis" else (env or {})
        service = Service(name, _popen(argv, env, log_path), ready, log_path, argv, env)
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
        self.addresses = {name: f"{c.host}:{free_port()}" for name in c.pool_names}
        self.addresses.update({name: f"{c.host}:{free_port()}" for name, _ in c.worker_names})
        metrics_ports = {name: free_port() for name in self.addresses}
        self.metrics_urls.update({name: f"http://{c.host}:{p}/metrics" for name, p in metrics_ports.items()})
        pools = [self._spawn(name, service_argv(c, "kv_pool", py, c.host, _port(self.addresses[name]), self.redis_url,
                                                metrics_port=metrics_ports[name]) + pool_node_args(name, c),
                             _grpc_ready(self.addresses[name])) for name in c.pool_names]
        for pool in pools:
            self._wait(pool, on_progress, timeout_s)
        pool_address = ",".join(self.addresses[name] for name in c.pool_names)
        # One thread budget per process: oversubscribed torch processes slow down 10-100x.
        self._pool_address = pool_address
        self._metrics_ports = metrics_ports
        self._threads = worker_threads(c.num_threads or os.cpu_count() or 2, c.colocated,
                                       c.num_prefill_workers, c.num_decode_workers)
        workers = [self._spawn_worker(name, role) for name, role in c.worker_names]
        for worker in workers:
            self._wait(worker, on_progress, timeout_s)
        routers = [self._spawn(r.name, service_argv(c, "router", py, c.host, c.router_ports(r.name)[1], self.redis_url,
                                                    http_port=c.router_ports(r.name)[0]),
                               _http_ready(f"{r.http_url}/health")) for r in self.routers]
        for router in routers:
            self._wait(router, on_progress, timeout_s)

    def _spawn_worker(self, name: str, role: str) -> Service:
        c, threads = self.config, self._threads[role]
        self.addresses.setdefault(name, f"{c.host}:{free_port()}")
        metrics_port = self._metrics_ports.setdefault(name, free_port())
        self.metrics_urls[name] = f"http://{c.host}:{metrics_port}/metrics"
        argv = service_argv(c, role, sys.executable, c.host, _port(self.addresses[name]), self.redis_url,
                            pool_address=self._pool_address, num_threads=threads, metrics_port=metrics_port)
        return self._spawn(name, argv, _grpc_ready(self.addresses[name]),
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
        self._wait(self._spawn("redis", argv, _redis_ready(port, bind)), on_progress, timeout_s)

    def _wait(self, service: Service, on_progress: Callable[[str], None], timeout_s: float) -> None:
        on_progress(f"starting {service.name}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._stop_if_interrupted(service.name)
            if service.process.poll() is not None:
                tail = service.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{service.name} exited with code {service.process.returncode}; "
                                   f"log {service.log_path}:\n{tail}")
            if service.ready():
                on_progress(f"{service.name} ready")
                return
            time.sleep(0.2)  # polling a child's health, not synchronising threads
        raise RuntimeError(f"{service.name} not healthy after {timeout_s:.0f} s; log {service.log_path}")

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
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGTERM)
            try:
                service.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                service.process.kill()
                service.process.wait()
        self.services.clear()
        self._draining.clear()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
