import pytest

from core.block_hash import hash_block, hash_block_chain
from core.block_key import BlockKey
from core.kv_cache_spec import KVCacheSpec
from core.request import FinishReason, Request
from core.sampling_params import SamplingParams


def test_hash_chain_covers_full_blocks_and_depends_on_prefix():
    a = hash_block_chain(list(range(10)), 4)
    b = hash_block_chain([99] + list(range(1, 10)), 4)
    assert len(a) == 2 and len(hash_block_chain(list(range(3)), 4)) == 0
    assert a[0] != b[0] and a[1] != b[1]  # same tokens in block 1, different parent
    assert a == hash_block_chain(list(range(8)), 4)
    assert a[1] == hash_block(a[0], [4, 5, 6, 7])


def test_spec_fingerprint_and_block_bytes():
    spec = KVCacheSpec("m", "r", "float32", num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)
    assert spec.block_bytes == 30 * 2 * 16 * 3 * 64 * 4 == 737280
    other = KVCacheSpec("m", "r", "float16", num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)
    assert spec.fingerprint != other.fingerprint and len(spec.fingerprint) == 16


def test_spec_kv_layout_is_all_heads_only():
    spec = KVCacheSpec("m", "r", "float32", num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)
    assert spec.kv_layout == "all_heads"  # any TP degree writes and reads this one layout
    with pytest.raises(ValueError, match="kv_layout must be one of \\('all_heads',\\), got 'per_rank'"):
        KVCacheSpec("m", "r", "float32", 30, 3, 64, 16, kv_layout="per_rank")


def test_block_key_identity():
    with pytest.raises(ValueError):
        BlockKey("fp")
    with pytest.raises(ValueError):
        BlockKey("fp", block_hash=1, request_id="r", block_index=0)
    assert BlockKey.scoped("fp", "r", 2).is_scoped and not BlockKey.content("fp", 5).is_scoped


def test_request_stops_on_length_and_stop_token():
    r = Request("r", [1, 2], SamplingParams(max_tokens=2, stop_token_ids=(9,)), eos_token_id=2)
    assert r.append_output_token(5) is None
    assert r.append_output_token(6) is FinishReason.LENGTH and r.num_tokens == 4
    s = Request("s", [1], SamplingParams(max_tokens=5, stop_token_ids=(9,)), eos_token_id=2)
    assert s.append_output_token(9) is FinishReason.STOP
    with pytest.raises(ValueError, match="prompt is empty"):
        Request("e", [], SamplingParams())

