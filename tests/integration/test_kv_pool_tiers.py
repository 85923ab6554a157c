"""A real pool process with a small DRAM arena over an NVMe tier (a directory under tmp)."""

from __future__ import annotations

import os
import urllib.request

import grpc
import pytest

from core.block_key import BlockKey
from core.pool_client import PoolClient
from kv_pool.index_mirror import hash_field, index_key
from tests.integration.test_kv_pool_server import SMOLLM_BLOCK_BYTES, block, fp, rdb, start_pool  # noqa: F401

BLOCK = SMOLLM_BLOCK_BYTES
# Watermarks at 1: DRAM evicts only what a put needs, so the tier contents below are exact.
ON_DEMAND_FLAGS = ("--evict-high-watermark", "1", "--evict-low-watermark", "1")


@pytest.mark.parametrize("nvme_io", ["os", "nixl"])  # nixl: NIXL's POSIX backend does the file I/O
def test_dram_to_nvme_to_dram_is_byte_identical(start_pool, rdb, fp, tmp_path, free_port, wait_until, nvme_io):
    pool = start_pool(
        2 * BLOCK, "--nvme-path", str(tmp_path / "nvme"), "--nvme-capacity-bytes", str(4 * BLOCK),
        "--metrics-port", str(free_port), "--nvme-io", nvme_io, *ON_DEMAND_FLAGS,
    )
    data = {h: block(h, BLOCK) for h in range(1, 8)}
    key = {h: BlockKey.content(fp, h) for h in data}
    with PoolClient(pool.address, timeout_s=30) as client:
        client.put_blocks((key[h], data[h]) for h in (1, 2, 3, 4))  # DRAM {3, 4}, NVMe {1, 2}
        stats = client.stats()
        assert (stats["num_stored_blocks"], stats["num_nvme_blocks"], stats["num_nvme_demotions"]) == (2, 2, 2)
        assert os.path.getsize(tmp_path / "nvme" / "blocks.bin") == 4 * BLOCK
        wait_until(lambda: rdb.hget(index_key(fp), hash_field(1)) == f"{pool.node_id}:nvme",
                   message="index says the demoted block is on NVMe")
        assert rdb.hget(index_key(fp), hash_field(4)) == f"{pool.node_id}:dram"

        assert client.get_blocks([key[1], key[2]]) == [data[1], data[2]]  # promoted; 3, 4 demoted
        stats = client.stats()
        assert (stats["num_nvme_promotions"], stats["num_nvme_demotions"], stats["num_nvme_blocks"]) == (2, 4, 2)
        wait_until(lambda: rdb.hget(index_key(fp), hash_field(1)) == f"{pool.node_id}:dram",
                   message="index says the promoted block is in DRAM")

        client.put_blocks((key[h], data[h]) for h in (5, 6, 7))  # NVMe (4 blocks) drops its LRU: 3
        with pytest.raises(grpc.RpcError) as excinfo:
            client.get_blocks([key[3]])
        assert excinfo.value.code() == grpc.StatusCode.NOT_FOUND
        assert client.get_blocks([key[h] for h in (4, 5, 6, 7, 1, 2)]) == [data[h] for h in (4, 5, 6, 7, 1, 2)]
        stats = client.stats()
        assert stats["num_nvme_evictions"] >= 1 and stats["num_nvme_misses"] >= 1
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{free_port}/metrics", timeout=10).read().decode()
        assert f'tandem:pool_tier_promotions_total{{tier="nvme"}} {float(stats["num_nvme_promotions"])}' in metrics
        assert 'tandem:pool_tier_capacity_bytes{tier="nvme"}' in metrics
        assert 'tandem:pool_tier_blocks{tier="dram"} 2.0' in metrics
    assert pool.stop() == 0, pool.logs()
    assert not os.path.exists(tmp_path / "nvme" / "blocks.bin")
    assert f"({nvme_io} I/O)" in pool.logs()


def test_watermark_flags_demote_in_one_batch(start_pool, fp, tmp_path):
    pool = start_pool(
        10 * BLOCK, "--nvme-path", str(tmp_path / "nvme"), "--nvme-capacity-bytes", str(10 * BLOCK),
        "--evict-high-watermark", "0.9", "--evict-low-watermark", "0.5",
    )
    data = {h: block(h, BLOCK) for h in range(10)}
    with PoolClient(pool.address, timeout_s=30) as client:
        client.put_blocks((BlockKey.content(fp, h), data[h]) for h in range(9))  # 90%: no eviction
        assert client.stats()["num_nvme_demotions"] == 0
        client.put_blocks([(BlockKey.content(fp, 9), data[9])])  # past 90%: down to 50% at once
        stats = client.stats()
        assert (stats["num_nvme_demotions"], stats["num_stored_blocks"], stats["num_nvme_blocks"]) == (5, 5, 5)
        assert client.get_blocks([BlockKey.content(fp, 0)]) == [data[0]]  # promoted, byte-identical
    assert pool.stop() == 0, pool.logs()
