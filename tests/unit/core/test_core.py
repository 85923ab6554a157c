import pytest

from core.block_hash import hash_block, hash_block_chain
from core.block_key import BlockKey
from core.kv_cache_spec import KVCacheSpec, kv_bytes_per_token, kv_head_row_bytes
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


def test_8bit_kv_specs_count_their_scales_and_get_their_own_namespace():
    """SmolLM2-135M's blocks (30 layers, 3 KV heads, head_dim 64, 16 tokens): an 8-bit row is 64
    values and a 4-byte float32 scale. float32 keeps the fingerprint it had before the KV dtype
    existed (pools already hold blocks under it)."""
    def spec(dtype="float32", kv="auto"):
        return KVCacheSpec("SmolLM2-135M-Instruct", "r1", dtype, 30, 3, 64, 16, kv_cache_dtype=kv)

    assert spec().fingerprint == "a91614d808b74df6"
    sizes = {(d, kv): spec(d, kv).block_bytes for d, kv in
             [("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"), ("float32", "int8"), ("bfloat16", "fp8")]}
    assert sizes == {("float32", "auto"): 737280, ("bfloat16", "auto"): 368640, ("float32", "fp8"): 195840,
                     ("float32", "int8"): 195840, ("bfloat16", "fp8"): 195840}
    prints = {spec(d, kv).fingerprint for d, kv in sizes} | {spec("float16").fingerprint}
    assert len(prints) == 6  # every KV dtype (and model dtype) its own namespace
    assert spec(kv="fp8").kv_dtype_name == "fp8" and spec("bfloat16").kv_dtype_name == "bfloat16"
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8', 'int8'\), got 'fp16'"):
        spec(kv="fp16")


def test_kv_bytes_per_token_is_the_one_count_of_a_token_s_kv_rows():
    """The spec, the launcher's memory check and the simulator all count a token's KV here: K and V
    of every layer and KV head, a row of head_dim values, each 8-bit row followed by its scale."""
    assert kv_head_row_bytes(128, 2) == 256
    assert kv_head_row_bytes(128, 2, "fp8") == kv_head_row_bytes(128, 4, "int8") == 132  # whatever the model's dtype
    assert kv_head_row_bytes(64, 2) == 128 and kv_head_row_bytes(64, 2, "fp8") == 68
    # Llama-3.1-8B (32 layers, 8 KV heads, head_dim 128) and SmolLM2-135M (30, 3, 64), bf16 vs 8-bit
    assert (kv_bytes_per_token(32, 8, 128, 2), kv_bytes_per_token(32, 8, 128, 2, "fp8")) == (131_072, 67_584)
    assert (kv_bytes_per_token(30, 3, 64, 2), kv_bytes_per_token(30, 3, 64, 2, "int8")) == (23_040, 12_240)
    spec = KVCacheSpec("m", "r", "bfloat16", 32, 8, 128, 16, kv_cache_dtype="fp8")
    assert spec.block_bytes == 16 * 67_584 and spec.head_row_bytes == 132
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8', 'int8'\), got 'fp16'"):
        kv_bytes_per_token(32, 8, 128, 2, "fp16")


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

