import pytest

from engine.kv_cache.block_pool import BlockPool, NoFreeBlocksError
from engine.kv_cache.kv_cache_manager import KVCacheManager


def test_allocate_and_free_counts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1  # a failed allocation takes nothing
    pool.free(a)
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([a[0]])


def test_manager_grows_tables_and_refuses_without_side_effects():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    table = kv.allocate_slots("a", 5)
    assert len(table.block_ids) == 2
    assert table.slots(3, 6) == [table.block_ids[0] * 4 + 3, table.block_ids[1] * 4, table.block_ids[1] * 4 + 1]
    assert kv.allocate_slots("b", 9) is None and kv.num_free_blocks == 1 and "b" not in kv.block_tables
    assert kv.free("a") == 2 and kv.free("a") == 0 and kv.num_free_blocks == 3
