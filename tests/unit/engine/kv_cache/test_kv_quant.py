"""The 8-bit KV row layout and its readable quantise / dequantise (engine.kv_cache.kv_quant):
the round trip against float32 within the bound each format guarantees, and the packed bytes."""

from __future__ import annotations

import pytest
import torch

from core.kv_cache_spec import KVCacheSpec
from engine.attention import TorchAttentionBackend, write_kv
from engine.kv_cache.kv_quant import (allocate_kv_cache, cache_dtype, dequantize_rows, head_dim_of,
                                      quantize_rows)

FP8, INT8 = torch.float8_e4m3fn, torch.int8


def rows(seed: int = 0) -> torch.Tensor:
    """[64, 3, 64] float32 rows over six orders of magnitude, a zero row, and rows whose small
    values land in e4m3's subnormal range."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 3, 64, generator=gen) * torch.logspace(-3, 3, 64)[:, None, None]
    x[5, 1] = 0.0
    x[6, 0, 1:] *= 1e-4  # one large value per row, the rest far below its scale
    return x


def test_int8_round_trip_within_half_a_step():
    """int8: |x - x'| <= scale / 2 = max|row| / 254 (plus float32 rounding of the product)."""
    x = rows()
    back = dequantize_rows(quantize_rows(x, INT8))
    bound = x.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-6)
    assert (back - x).abs().le(bound).all()
    assert back[5, 1].eq(0).all()


def test_fp8_round_trip_within_e4m3_rounding():
    """e4m3: relative error <= 2^-4 (half of 3 mantissa bits) on normals, absolute <= 2^-10 x
    scale (half the subnormal step 2^-9) below 2^-6 x scale; scale = max|row| / 448."""
    x = rows()
    back = dequantize_rows(quantize_rows(x, FP8))
    scale = x.abs().amax(-1, keepdim=True) / 448
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
    assert (back - x).abs().le(bound).all()
    assert back[5, 1].eq(0).all()
    assert back.abs().amax(-1).sub(x.abs().amax(-1)).abs().le(1e-6 * x.abs().amax(-1)).all()  # the max is exact


@pytest.mark.parametrize("dtype", [FP8, INT8])
def test_packed_row_is_values_then_float32_scale(dtype):
    x = torch.tensor([[[1.0, -2.0, 0.5, 4.0]]])
    packed = quantize_rows(x, dtype)
    assert packed.dtype == dtype and packed.shape == (1, 1, 8)
    qmax = 448.0 if dtype == FP8 else 127.0
    assert packed[..., 4:].contiguous().view(torch.float32).item() == torch.tensor(4.0 / qmax).item()  # float32
    assert packed[0, 0, 3].to(torch.float32).item() == qmax


@pytest.mark.parametrize("name,dtype,row", [("auto", torch.float32, 64), ("fp8", FP8, 68), ("int8", INT8, 68)])
def test_allocated_cache_has_one_head_row_per_spec_row(name, dtype, row):
    cache = allocate_kv_cache(30, 5, 16, 3, 64, cache_dtype(name, torch.float32), "cpu")
    assert cache.dtype == dtype and cache.shape == (30, 2, 5, 16, 3, row) and head_dim_of(cache) == 64
    spec = KVCacheSpec("m", "r", "float32", 30, 3, 64, 16, kv_cache_dtype=name)
    assert cache.element_size() * cache[:, :, 0].numel() == spec.block_bytes


def test_cache_dtype_refuses_unknown_names():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8', 'int8'\), got 'fp16'"):
        cache_dtype("fp16", torch.float32)


@pytest.mark.parametrize("dtype", [FP8, INT8])
def test_reference_write_then_gather_round_trips(dtype):
    """write_kv quantises into the slots; the reference backend's gather reads back exactly the
    dequantised rows."""
    x = rows(1)[:8]  # [8, 3, 64]
    cache = allocate_kv_cache(1, 4, 4, 3, 64, dtype, "cpu")[0]
    slots = torch.tensor([5, 0, 15, 7, 1, 2, 3, 4])
    write_kv(x, -x, cache, slots)
    k, v = TorchAttentionBackend._gather(cache, torch.tensor([0, 1, 2, 3]), 16)
    expected = dequantize_rows(quantize_rows(x, dtype))
    assert torch.equal(dequantize_rows(k[slots]), expected)
    assert torch.equal(dequantize_rows(v[slots]), -expected)


def test_config_refuses_unknown_kv_cache_dtypes_and_the_flag_lists_the_choices():
    from click.testing import CliRunner

    from decode_worker.__main__ import main as decode_main
    from engine.config import EngineConfig
    from prefill_worker.__main__ import main as prefill_main
    from tandem_cli.up import up

    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8', 'int8'\), got 'fp16'"):
        EngineConfig(kv_cache_dtype="fp16")
    assert EngineConfig(kv_cache_dtype="int8", dtype="bfloat16").kv_cache_dtype == "int8"
    for command in (decode_main, prefill_main, up):
        params = {p.name: p for p in command.params}
        assert params["kv_cache_dtype"].default == "auto"
        result = CliRunner().invoke(command, ["--kv-cache-dtype", "fp16"])
        assert result.exit_code == 2 and "Invalid value for '--kv-cache-dtype'" in result.output
