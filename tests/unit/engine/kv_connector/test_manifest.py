"""Manifest.validate from plain values: a manifest of another spec, another prompt length or a
wrong block count is refused naming what differs."""

from __future__ import annotations

import pytest

from core.block_key import BlockKey
from core.kv_cache_spec import KVCacheSpec
from engine.kv_connector.manifest import Manifest

SPEC = KVCacheSpec("m", "r", "float32", 2, 2, 8, 16)


def manifest(num_tokens: int, num_keys: int, fingerprint: str = SPEC.fingerprint) -> Manifest:
    return Manifest(fingerprint, "", [BlockKey.content(fingerprint, i + 1) for i in range(num_keys)], num_tokens)


def test_a_manifest_covering_the_prompt_in_its_blocks_is_accepted():
    manifest(33, 3).validate(SPEC, 33)  # 2 full blocks and a 1-token tail
    manifest(32, 2).validate(SPEC, 32)


@pytest.mark.parametrize(("m", "num_prompt_tokens", "fragment"), [
    (manifest(33, 3, "other"), 33, "manifest KV spec 'other'"),
    (manifest(33, 3), 34, "manifest covers 33 tokens, prompt has 34"),
    (manifest(33, 2), 33, "manifest lists 2 blocks for 33 tokens"),
])
def test_a_mismatched_manifest_is_refused(m, num_prompt_tokens, fragment):
    with pytest.raises(ValueError, match=fragment):
        m.validate(SPEC, num_prompt_tokens)


def test_a_manifest_of_another_kv_dtype_is_refused_naming_both():
    fp8 = KVCacheSpec("m", "r", "float32", 2, 2, 8, 16, kv_cache_dtype="fp8")
    m = Manifest(fp8.fingerprint, "", [BlockKey.content(fp8.fingerprint, 1)], 16, fp8.kv_dtype_name)
    m.validate(fp8, 16)
    with pytest.raises(ValueError, match=r"^manifest KV blocks are fp8, this worker's KV cache is float32: prefill and "
                                         r"decode workers need the same --kv-cache-dtype \(and --dtype\)$"):
        m.validate(SPEC, 16)
    int8 = KVCacheSpec("m", "r", "float32", 2, 2, 8, 16, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="manifest KV blocks are fp8, this worker's KV cache is int8"):
        m.validate(int8, 16)
    unnamed = Manifest(fp8.fingerprint, "", m.keys, 16)  # a sender that does not name its dtype: the fingerprint
    with pytest.raises(ValueError, match=f"manifest KV spec '{fp8.fingerprint}' != this worker's '{SPEC.fingerprint}'"):
        unnamed.validate(SPEC, 16)
