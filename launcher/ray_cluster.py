"""RayCluster: the services of ``tandem up`` placed as Ray actors (``tandem up --ray``).

Each service (KV pool, prefill worker, decode worker, router) runs in its own Ray actor, which
starts it as a subprocess ``python -m <package> <flags>`` — the same argv as the local launcher
(:func:`launcher.commands.service_argv`). The workers request one GPU each when the Ray
cluster has GPUs (and then run with ``--device cuda``), else an explicit CPU budget; the pool and
the router request no resources. Redis is a redis-server started by this process (or
``config.redis_url``). Health is checked from this process with the local launcher's probes
(launcher.readiness).

Without ``address`` a local Ray instance is started and the services bind ``config.host``; with
``address`` (an existing cluster) every service binds the IP of the node Ray placed it on, and the
private Redis binds this node's IP. ``stop()`` stops the services, kills the actors and disconnects
from Ray (shutting the local instance down).

``supervise()`` restarts a worker or KV pool subprocess that exited, inside its actor, with the
local launcher's policy (launcher.supervisor); an actor that dies (its node lost) stops the cluster.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from launcher import processes
from launcher.commands import service_argv, service_env, worker_threads
from launcher.config import ClusterConfig
from launcher.local_cluster import LocalCluster
from launcher.readiness import grpc_ready, http_ready
from launcher.supervisor import ServiceExited, ServiceStartError, StartInterrupted, Supervisor, log_cause

ACTOR_START_TIMEOUT_S = 120.0  # an actor not placed by then: the cluster lacks the resources


class ServiceHost:
    """Ray actor body: one service as a subprocess of the actor's process.

    The subprocess gets SIGTERM when the actor's process dies (PR_SET_PDEATHSIG), so killing the
    actor never leaves the service behind.
    """

    def __init__(self, name: str, log_dir: str):
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        self.process: subprocess.Popen | None = None

    def info(self, host: str) -> dict:
        """This actor's node IP, pid, Python, and a free port on ``host`` (node IP when empty)."""
        import ray

        node_ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host or node_ip, 0))
            port = s.getsockname()[1]
        return {"node_ip": node_ip, "pid": os.getpid(), "python": sys.executable, "port": port}

    def start(self, argv: list[str], env: dict[str, str], note: str = "") -> int:
        """Starts the service; its log truncated, or (a restart) with ``note`` appended."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.process = processes.spawn(argv, env, self.log_path, note)
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll() if self.process else None

    def log_tail(self, num_chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError as e:
            return f"(log unreadable: {e})"

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
        if self.process is None:
            return None
        return processes.stop(self.process, timeout_s)


@dataclass
class RayService:
    name: str
    actor: object  # ray.actor.ActorHandle
    address: str  # host:port of its gRPC server
    node_ip: str
    actor_pid: int
    pid: int  # the service subprocess, on node_ip
    log_path: Path  # on node_ip
    ready: Callable[[], bool]
    python: str = ""  # the interpreter of the actor's node that runs the service
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def log_location(self) -> str:
        return f"{self.log_path} on {self.node_ip}"

    def exit_code(self) -> int | None:
        """The subprocess's exit code, None while it runs.

        Raises:
            ServiceExited: the actor itself failed (its node is gone): nothing to restart it in.
        """
        import ray

        try:
            return ray.get(self.actor.poll.remote(), timeout=30)
        except ray.exceptions.RayError as e:
            raise ServiceExited(f"{self.name}'s Ray actor failed ({type(e).__name__}); "
                                f"see {self.log_location}") from None

    def restart(self, note: str) -> None:
        """Starts the same argv again in the actor (same port), ``note`` appended to the log."""
        import ray

        self.pid = ray.get(self.actor.start.remote(self.argv, self.env, note))


class RayCluster:
    """Same attributes as :class:`LocalCluster`: ``addresses``, ``http_url``, ``grpc_address``,
    ``services``, ``redis_url``."""

    def __init__(self, config: ClusterConfig, address: str | None = None,
                 interrupted: Callable[[], bool] = lambda: False):
        """``interrupted``: as :class:`LocalCluster`'s (checked before each service starts and
        while it is awaited)."""
        self.config = config
        self.interrupted = interrupted
        self.ray_address = address
        self.services: list[RayService] = []
        self.redis_url = config.redis_url
        self.http_url = f"http://{config.host}:{config.http_port}"
        self.grpc_address = f"{config.host}:{config.grpc_port}"
        self.addresses: dict[str, str] = {}
        self.use_gpus = False
        self._redis = LocalCluster(config, interrupted)  # only for the private redis-server
        self._connected = False
        self._supervisor = Supervisor(config.restart)

    def start(self, on_progress: Callable[[str], None] = lambda _: None, timeout_s: float = 300.0) -> None:
        """Connects to Ray (or starts a local instance), places the services, waits until each is healthy.

        Raises:
            ImportError: ray is not installed (``pip install 'tandem-serve[ray]'``).
            FileNotFoundError: redis-server is needed and not installed.
            RuntimeError: an actor could not be placed, or a service exited or did not become
                healthy in time (its log is named).
            StartInterrupted: ``interrupted()`` turned true; :meth:`stop` stops what started.
        """
        import ray

        c = self.config
        if not ray.is_initialized():
            on_progress(f"connecting to Ray at {self.ray_address}" if self.ray_address else "starting local Ray")
            if self.ray_address:
                ray.init(address=self.ray_address, include_dashboard=False)
            else:
                # "local": a new instance, even when another one on this machine could be joined.
                ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False)
            self._connected = True
        # On an existing cluster every service binds its node's IP, so the others can dial it.
        host = c.host if not self.ray_address else ""
        if not self.redis_url:
            self._redis.start_redis(on_progress, timeout_s, bind=c.host if host else ray.util.get_node_ip_address())
            self.redis_url = self._redis.redis_url
        self.use_gpus = ray.cluster_resources().get("GPU", 0) >= 1
        log_dir = str(Path(c.log_dir).resolve())

        threads = worker_threads(c.num_threads or os.cpu_count() or 2, c.colocated)
        # Explicit resources: a worker never shares its GPU, nor (on CPU) its thread budget.
        worker_resources = {role: {"num_gpus": c.tensor_parallel_size(role), "num_cpus": c.tensor_parallel_size(role)}
                            if self.use_gpus else {"num_cpus": threads[role]} for role in c.worker_roles}
        pool, *workers, router = self._place(
            {"kv_pool": {"num_cpus": 0}, **worker_resources, "router": {"num_cpus": 0}}, host, log_dir)

        self._launch(pool, lambda py, h, port: service_argv(c, "kv_pool", py, h, port, self.redis_url), {},
                     on_progress, timeout_s)
        if self.use_gpus and c.engine.device == "cpu":  # the default: these workers get a GPU each
            c = dataclasses.replace(c, engine=dataclasses.replace(c.engine, device="cuda"))
        for worker in workers:
            def argv(py, h, port, role=worker.name):
                return service_argv(c, role, py, h, port, self.redis_url, pool_address=pool.address,
                                    num_threads=threads[role])

            rank_threads = c.rank_threads(worker.name, threads[worker.name])
            self._launch(worker, argv, {"OMP_NUM_THREADS": str(rank_threads)}, None, timeout_s)
        for worker in workers:
            self._wait(worker, on_progress, timeout_s)
        self.http_url = f"http://{host or router.node_ip}:{c.http_port}"
        router.ready = http_ready(f"{self.http_url}/health")
        self._launch(router, lambda py, h, port: service_argv(c, "router", py, h, port, self.redis_url), {},
                     on_progress, timeout_s)

    def _place(self, resources: dict[str, dict], host: str, log_dir: str) -> list[RayService]:
        """Creates one actor per service (all at once: Ray starts their processes in parallel) and
        waits until Ray has placed each; in start order."""
        import ray

        services = []
        for name, request in resources.items():
            actor = ray.remote(**request, max_restarts=0)(ServiceHost).remote(name, log_dir)
            # Registered before it is placed, so stop() kills it even when placing fails.
            services.append(RayService(name, actor, "", "", 0, 0, Path(log_dir) / f"{name}.log", lambda: False))
        self.services.extend(services)
        infos = {s.name: s.actor.info.remote(host) for s in services}
        deadline = time.monotonic() + ACTOR_START_TIMEOUT_S
        for service in services:
            try:
                info = ray.get(infos[service.name], timeout=max(1.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise ServiceStartError(
                    f"Ray could not place {service.name} (requests {resources[service.name]}) within "
                    f"{ACTOR_START_TIMEOUT_S:.0f} s; cluster resources: {ray.cluster_resources()}"
                ) from None
            service.node_ip, service.actor_pid, service.python = info["node_ip"], info["pid"], info["python"]
            port = self.config.grpc_port if service.name == "router" else info["port"]
            service.address = f"{host or info['node_ip']}:{port}"
            service.ready = grpc_ready(service.address)
            if service.name == "router":
                self.grpc_address = service.address
            else:
                self.addresses[service.name] = service.address
        return services

    def _launch(self, service: RayService, argv: Callable[[str, str, int], list[str]], env: dict[str, str],
                on_progress: Callable[[str], None] | None, timeout_s: float) -> None:
        """Starts the service's subprocess in its actor (Python of the actor's node); waits unless
        ``on_progress`` is None."""
        import ray

        if self.interrupted():
            raise StartInterrupted(service.name)
        host, port = service.address.rsplit(":", 1)
        env = {**service_env(self.config, service.name), **env}
        service.argv, service.env = argv(service.python, host, int(port)), env
        service.pid = ray.get(service.actor.start.remote(service.argv, env))
        if on_progress is not None:
            self._wait(service, on_progress, timeout_s)

    def _wait(self, service: RayService, on_progress: Callable[[str], None], timeout_s: float) -> None:
        import ray

        on_progress(f"starting {service.name} on {service.node_ip}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.interrupted():
                raise StartInterrupted(service.name)
            code = ray.get(service.actor.poll.remote())
            if code is not None:
                cause = log_cause(ray.get(service.actor.log_tail.remote()))
                raise ServiceStartError(f"{service.name} exited with code {code}" + (f": {cause}" if cause else "")
                                        + f"; log {service.log_path} on {service.node_ip}")
            if service.ready():
                on_progress(f"{service.name} ready")
                return
            time.sleep(0.2)  # polling a service's health, not synchronising threads
        raise ServiceStartError(f"{service.name} not healthy after {timeout_s:.0f} s; "
                                f"log {service.log_path} on {service.node_ip}")

    def supervise(self) -> list[str]:
        """One supervision pass (see :meth:`LocalCluster.supervise`): Redis, then the services.

        Raises:
            launcher.supervisor.ServiceExited: the cluster must stop.
        """
        return [*self._redis.supervise(), *self._supervisor.poll(self.services)]

    def dead_service(self) -> tuple[RayService, str] | None:
        """The first service whose process or actor has died, with why; None when all run."""
        import ray

        for service in self.services:
            try:
                code = ray.get(service.actor.poll.remote(), timeout=30)
            except ray.exceptions.RayError as e:
                return service, f"its Ray actor failed: {type(e).__name__}"
            if code is not None:
                return service, f"exited ({code})"
        return None

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stops the services in reverse start order, kills their actors, stops Redis, disconnects
        from Ray (which shuts down a local instance this cluster started)."""
        import ray

        for service in reversed(self.services):
            try:
                ray.get(service.actor.stop.remote(timeout_s), timeout=timeout_s + 10)
            except ray.exceptions.RayError:
                pass  # the actor is gone (its subprocess got SIGTERM with it) or hangs: killed below
            ray.kill(service.actor)
        self.services.clear()
        self._redis.stop(timeout_s)
        if self._connected:
            ray.shutdown()
            self._connected = False

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
