"""The Redis pod deleted under load: the cluster keeps serving while it is gone (routers keep
their view of the workers, requests need no Redis on their path), and recovers as under
`tandem up` (docs/failover.md): the new Redis pod starts empty, every worker and the pool node
register again, and the pool rebuilds its block index."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from tests.k8s.load import Load

pytestmark = pytest.mark.k8s
CONCURRENCY = 6


def redis_keys(node, pod: str) -> list[str]:
    try:
        out = node.kubectl("exec", pod, "--", "redis-cli", "--scan", "--pattern", "tandem:*", timeout_s=20)
    except subprocess.CalledProcessError:
        return []
    return out.split()


def test_redis_pod_deleted_under_load(baseline, references, record):
    node = baseline

    async def run():
        async with Load(node.url, concurrency=CONCURRENCY, continuous=True) as load:
            await load.wait_for(lambda: load.first_tokens >= CONCURRENCY, "the load running")
            (redis,) = node.pods("redis")
            deleted_s = time.time()
            await asyncio.to_thread(node.delete_pod, redis.name)

            def new_redis():
                pods = [p for p in node.pods("redis") if p.created_s > redis.created_s and p.ready_s is not None]
                return pods[0] if pods else None

            await load.wait_for(new_redis, "a new Redis pod Ready", timeout_s=300)
            ready_s = time.time()
            fresh = await asyncio.to_thread(new_redis)
            keys = {}

            def registered_again() -> bool:
                keys["now"] = redis_keys(node, fresh.name)
                found = " ".join(keys["now"])
                return all(part in found for part in ("tandem:workers:prefill:", "tandem:workers:decode:",
                                                      "tandem:kv_index_node:"))

            await load.wait_for(registered_again, "workers and the pool node registered in the new Redis")
            recovered_s = time.time()
            served = len(load.outcomes)
            await load.wait_for(lambda: len(load.outcomes) >= served + CONCURRENCY, "requests after the recovery")
            load.stop()
            tally = await load.finish()
        return {**tally.as_dict(), "redis_time_to_ready_s": fresh.time_to_ready_s,
                "deleted_to_new_pod_ready_s": round(ready_s - deleted_s, 1),
                "deleted_to_registered_again_s": round(recovered_s - deleted_s, 1),
                "keys_after": sorted({k.rsplit(":", 1)[0] for k in keys["now"]})}

    numbers = asyncio.run(run())
    record("Redis pod deleted under load", **numbers)
    assert (numbers["lost"], numbers["wrong"]) == (0, 0), numbers["errors"]
