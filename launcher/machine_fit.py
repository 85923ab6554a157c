"""Whether a cluster fits the machine it is about to start on: the memory every process will take
against what the machine has, and the pool's NVMe tier against its disk.

``tandem up`` refuses a cluster that does not fit before it starts anything (``--force``
overrides), so a values file with a GPU cluster's sizes cannot push a laptop into the kernel's
out-of-memory killer. Per process (resident set, worst case: every KV block and pool slot used):

- a worker rank: its share of the weights (``--dtype``), on a CPU the copies its linear layers'
  GEMM backends prepare from them (:data:`PREPARED_COPIES`), its paged KV cache
  (``--num-kv-blocks`` x block bytes, split between tensor-parallel ranks) and
  :data:`PROCESS_BYTES` of its own;
- a KV pool node: its DRAM arena (``--pool-capacity-bytes``, committed as blocks arrive; it lives
  in ``/dev/shm``, whose size is checked too) and its process;
- a router (its tokenizer), the private Redis.

The same estimate checks a Kubernetes rendering (:func:`pod_shortfalls`): each pod's memory
limit against what its container will take.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from core.settings import quantity_bytes as quantity
from launcher.model_shape import ModelShape

MIB, GIB = 1 << 20, 1 << 30
# Resident memory of each process beside its weights, KV cache and arena (Python, torch,
# transformers, gRPC, the step's activations): PSS measured on a 1P+1D SmolLM2-135M float32
# cluster, 2-core x86-64, torch 2.13 CPU (worker ~700 MiB, router ~315 MiB, pool ~40 MiB,
# redis ~4 MiB), rounded up.
PROCESS_BYTES = {"worker": 768 * MIB, "router": 384 * MIB, "kv_pool": 64 * MIB, "redis": 16 * MIB}
# Copies of the weights a CPU worker's linear layers keep beside them, one per GEMM backend their
# plans use (engine.model.linear.Linear.set_plan: a weight reordered for oneDNN, packed for
# Tandem's kernels or MKL): ``auto`` may mix two backends in one layer's M buckets, a named backend
# prepares one copy, ``torch`` none. In process, SmolLM2-135M float32 (513 MiB of linear weights):
# resident 1086 MiB with torch, 1844-1848 MiB with one backend, 2362 MiB with auto. An int8 model's
# copies are of its int8 weights (a quarter of float32's; 1449 MiB resident with auto).
PREPARED_COPIES = {"auto": 2, "torch": 0}
USABLE_FRACTION = 0.9  # of the available memory a cluster may plan to take (the rest: everything else)


@dataclass(frozen=True)
class Need:
    """``count`` processes of one kind, each taking ``each_bytes`` (``parts``: what makes it up)."""

    name: str
    count: int
    each_bytes: int
    parts: tuple[tuple[str, int], ...]  # (what, bytes) summing to each_bytes
    flags: str  # the options that size it, with their values

    @property
    def total_bytes(self) -> int:
        return self.count * self.each_bytes

    def line(self) -> str:
        parts = " + ".join(f"{what} {size(n)}" for what, n in self.parts)
        return f"{self.name}: {self.count} x {size(self.each_bytes)} ({parts})  [{self.flags}]"


@dataclass(frozen=True)
class Fit:
    """The verdict: what the processes take against what the machine offers."""

    needs: tuple[Need, ...]
    available_bytes: int  # memory the machine can give now (MemAvailable, within a cgroup limit)
    shm_free_bytes: int | None  # free /dev/shm, where the pool arenas live (None: no /dev/shm)
    nvme_bytes: int  # the pool's NVMe tier, all nodes
    nvme_path: str
    disk_free_bytes: int | None  # free space where the NVMe tier goes (None: no tier)

    @property
    def memory_bytes(self) -> int:
        return sum(n.total_bytes for n in self.needs)

    @property
    def arena_bytes(self) -> int:
        return sum(n.count * dict(n.parts).get("DRAM arena", 0) for n in self.needs)

    @property
    def usable_bytes(self) -> int:
        return int(self.available_bytes * USABLE_FRACTION)

    def problems(self) -> list[str]:
        """One line per resource that does not fit (empty: it fits)."""
        out = []
        if self.memory_bytes > self.usable_bytes:
            out.append(f"memory: the processes will take {size(self.memory_bytes)}; this machine has "
                       f"{size(self.available_bytes)} available ({USABLE_FRACTION:.0%} of it: {size(self.usable_bytes)})")
        if self.shm_free_bytes is not None and self.arena_bytes > self.shm_free_bytes:
            out.append(f"/dev/shm: the pool arenas take {size(self.arena_bytes)}; /dev/shm has "
                       f"{size(self.shm_free_bytes)} free")
        if self.disk_free_bytes is not None and self.nvme_bytes > self.disk_free_bytes:
            out.append(f"disk: the NVMe tier takes {size(self.nvme_bytes)} in {self.nvme_path}; that disk has "
                       f"{size(self.disk_free_bytes)} free  [--pool-nvme-capacity-bytes, --pool-nvme-path]")
        return out

    def report(self) -> str:
        """What each kind of process takes, then the verdict."""
        lines = [n.line() for n in self.needs]
        lines.append(f"total {size(self.memory_bytes)} of memory; available {size(self.available_bytes)} "
                     f"(plans up to {size(self.usable_bytes)})")
        if self.nvme_bytes:
            free = "" if self.disk_free_bytes is None else f", {size(self.disk_free_bytes)} free there"
            lines.append(f"NVMe tier: {size(self.nvme_bytes)} in {self.nvme_path}{free}")
        return "\n".join(lines)

    def message(self) -> str:
        """The refusal: what does not fit, what each process takes, how to go on."""
        return ("this cluster does not fit this machine:\n  " + "\n  ".join(self.problems())
                + "\nwhat each process will take (the options that size it in brackets):\n  "
                + self.report().replace("\n", "\n  ")
                + "\nlower those options (in a values file: decode/prefill.numKvBlocks, .replicas, kvPool.dram, "
                  "kvPool.nvme, router.replicas; a named --linear-backend keeps one GEMM copy of the weights, "
                  "torch none, at some speed), or pass --force to start anyway")


def size(num_bytes: float) -> str:
    """``1536`` -> ``1.5 KiB``: binary units, one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"


def worker_need(role: str, count: int, tp: int, num_kv_blocks: int, block_size: int, shape: ModelShape, dtype: str,
                flags: str, on_gpu: bool = False, kv_cache_dtype: str = "auto", linear_backend: str = "auto",
                quantization: str = "none") -> Need:
    """``count`` workers of ``role`` with ``tp`` ranks each (each rank a process). ``on_gpu``:
    weights and KV cache live in GPU memory, the host keeps the process only. ``kv_cache_dtype``:
    as --kv-cache-dtype (8-bit blocks are about a quarter of float32's). ``linear_backend``: as
    --linear-backend (the GEMM copies a CPU worker prepares, :data:`PREPARED_COPIES`), of int8
    weights under ``quantization`` int8 or w8a16."""
    block_bytes = shape.kv_block_bytes(block_size, dtype, kv_cache_dtype)
    kv = num_kv_blocks * block_bytes // tp
    parts = [("process", PROCESS_BYTES["worker"])]
    if not on_gpu:
        weights = shape.weight_bytes(dtype) // tp
        copies = PREPARED_COPIES.get(linear_backend, 1)
        int8 = quantization in ("int8", "w8a16")  # copies of the int8 weights: one byte per parameter
        copy_bytes = shape.num_params // tp if int8 else weights
        gemm = [(f"GEMM copies ({copies} x {'int8 ' if int8 else ''}weights, --linear-backend {linear_backend})",
                 copies * copy_bytes)] if copies else []
        parts = [("weights", weights), *gemm,
                 (f"KV cache ({num_kv_blocks} blocks x {size(block_bytes)}"
                  + (f" / {tp} ranks)" if tp > 1 else ")"), kv)] + parts
    name = f"{role} worker ranks" if tp > 1 else f"{role} workers"
    return Need(name, count * tp, sum(n for _, n in parts), tuple(parts), flags)


def cluster_needs(config, shape: ModelShape, workers_on_gpu: bool = False) -> tuple[Need, ...]:
    """What every process of ``config`` (a launcher.config.ClusterConfig) takes."""
    dtype = config.engine.dtype
    block_size = config.engine.block_size
    needs = []
    for role in config.worker_roles:
        count = config.num_prefill_workers if role == "prefill" else config.num_decode_workers
        tp = config.tensor_parallel_size(role)
        blocks = config.engine_config(role).num_kv_blocks
        block_flag = "--prefill-num-kv-blocks" if role == "prefill" and config.prefill_num_kv_blocks else "--num-kv-blocks"
        flags = (f"--num-{role}-workers {count}, {block_flag} {blocks}, --block-size {block_size}, --dtype {dtype}"
                 + (f", --{role}-tp {tp}" if tp > 1 else ""))
        kv_dtype = config.engine.kv_cache_dtype
        flags += f", --kv-cache-dtype {kv_dtype}" if kv_dtype != "auto" else ""
        linear = config.engine_config(role).linear_backend
        flags += f", --linear-backend {linear}" if not workers_on_gpu else ""
        needs.append(worker_need(role, count, tp, blocks, block_size, shape, dtype, flags, workers_on_gpu, kv_dtype,
                                 linear, config.engine.quantization))
    arena = config.pool.capacity_bytes
    needs.append(Need("KV pool nodes", config.num_pool_nodes, arena + PROCESS_BYTES["kv_pool"],
                      (("DRAM arena", arena), ("process", PROCESS_BYTES["kv_pool"])),
                      f"--num-pool-nodes {config.num_pool_nodes}, --pool-capacity-bytes {arena}"))
    needs.append(Need("routers", config.num_routers, PROCESS_BYTES["router"], (("process", PROCESS_BYTES["router"]),),
                      f"--num-routers {config.num_routers}"))
    if not config.redis_url:
        needs.append(Need("Redis", 1, PROCESS_BYTES["redis"], (("process", PROCESS_BYTES["redis"]),), "--redis-url"))
    return tuple(needs)


def available_memory_bytes() -> int:
    """Memory this machine can give a new process now: ``MemAvailable``, lowered to what is left
    of this process's cgroup limit (a container) when that is smaller."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:  # not Linux: free physical pages
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def free_bytes(path: str | Path) -> int | None:
    """Free space on the file system that holds ``path`` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def check(config, shape: ModelShape, workers_on_gpu: bool = False, available_bytes: int | None = None) -> Fit:
    """The fit of ``config`` on this machine (``available_bytes``: instead of measuring it)."""
    nvme_path = config.pool.nvme_path
    nvme_each = config.pool.nvme_capacity_bytes if nvme_path else 0
    shm = Path("/dev/shm")
    return Fit(cluster_needs(config, shape, workers_on_gpu),
               available_memory_bytes() if available_bytes is None else available_bytes,
               shutil.disk_usage(shm).free if shm.is_dir() else None,
               nvme_each * config.num_pool_nodes, nvme_path, free_bytes(nvme_path) if nvme_path else None)


# --- Kubernetes: a rendered chart's pods against the same estimate -------------------------------

def pod_shortfalls(objects: Iterable[Mapping], shape: ModelShape) -> list[str]:
    """Each rendered Tandem container (Deployments, StatefulSets) whose memory limit (else its
    request) is below what its process will take, one line each naming the workload and the
    numbers. ``objects``: the rendering (its ConfigMaps resolve ``configMapKeyRef`` variables).
    Workers on ``cuda`` keep weights and KV cache in GPU memory: only their process counts."""
    config_maps = {o["metadata"]["name"]: o.get("data") or {} for o in objects if o.get("kind") == "ConfigMap"}
    out = []
    for obj in objects:
        if obj.get("kind") not in ("Deployment", "StatefulSet"):
            continue
        for container in obj["spec"]["template"]["spec"].get("containers", []):
            env = _env(container, config_maps)
            resources = container.get("resources") or {}
            limit = (resources.get("limits") or {}).get("memory") or (resources.get("requests") or {}).get("memory")
            need = _container_need(container, env, shape, resources)
            if need is not None and limit is not None and quantity(limit) < need.each_bytes:
                out.append(f"{obj['kind']} {obj['metadata']['name']}: memory {limit} is below the "
                           f"{size(need.each_bytes)} its {need.name} will take ({need.line()})")
    return out


def _env(container: Mapping, config_maps: Mapping[str, Mapping]) -> dict[str, str]:
    """A container's literal and ConfigMap-referenced variables."""
    env = {}
    for entry in container.get("env") or []:
        ref = (entry.get("valueFrom") or {}).get("configMapKeyRef")
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
        elif ref and ref["key"] in config_maps.get(ref["name"], {}):
            env[entry["name"]] = str(config_maps[ref["name"]][ref["key"]])
    return env


def _container_need(container: Mapping, env: Mapping[str, str], shape: ModelShape, resources: Mapping) -> Need | None:
    """What one rendered container will take, from its command and TANDEM_* environment."""
    command = " ".join(str(a) for a in container.get("command", []) + container.get("args", []))
    for role in ("prefill", "decode"):
        prefix = f"TANDEM_{role.upper()}_"
        if f"-m {role}_worker" not in command or not env.get(f"{prefix}NUM_KV_BLOCKS"):
            continue
        blocks, dtype = int(env[f"{prefix}NUM_KV_BLOCKS"]), env.get(f"{prefix}DTYPE") or "float32"
        tp = int(env.get(f"{prefix}TENSOR_PARALLEL_SIZE") or 1)
        on_gpu = (env.get(f"{prefix}DEVICE") or "cpu").startswith("cuda")
        linear = env.get(f"{prefix}LINEAR_BACKEND") or "auto"
        ranks = worker_need(role, 1, tp, blocks, int(env.get(f"{prefix}BLOCK_SIZE") or 16), shape, dtype,
                            f"{role}.numKvBlocks {blocks}, model.dtype {dtype}, {role}.device "
                            f"{env.get(f'{prefix}DEVICE') or 'cpu'}"
                            + ("" if on_gpu else f", engine.linearBackend {linear}"), on_gpu,
                            env.get(f"{prefix}KV_CACHE_DTYPE") or "auto", linear,
                            env.get(f"{prefix}QUANTIZATION") or "none")
        return Need(f"{role} worker", 1, ranks.total_bytes, ranks.parts, ranks.flags)  # the ranks share one pod
    if "-m kv_pool" in command and env.get("POOL_ARENA_PERCENT") and (resources.get("requests") or {}).get("memory"):
        request = quantity(resources["requests"]["memory"])
        arena = request // 100 * int(env["POOL_ARENA_PERCENT"])  # as the pod computes it
        return Need("KV pool node", 1, arena + PROCESS_BYTES["kv_pool"],
                    (("DRAM arena", arena), ("process", PROCESS_BYTES["kv_pool"])),
                    f"kvPool.dram {resources['requests']['memory']}, kvPool.arenaPercent {env['POOL_ARENA_PERCENT']}")
    if "-m router" in command:
        return Need("router", 1, PROCESS_BYTES["router"], (("process", PROCESS_BYTES["router"]),), "router.resources")
    return None
