"""A real ``python -m decode_worker`` process publishes its live load and its calibrated cost
model in its Redis heartbeat (and in GetStats), ready for the router before any request."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid

import grpc
import pytest
import redis

from core.registry import WorkerRegistry, worker_key
from core.worker_load import LOAD_VERSION, WorkerLoad
from tandem.v1 import decode_worker_pb2_grpc, prefill_worker_pb2

TINY_CONFIG = dict(
    vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.5, rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)
LOAD_KEYS = {  # version 1 of the heartbeat's load (core.worker_load)
    "num_requests_running", "num_requests_waiting", "num_total_blocks", "num_used_blocks", "num_free_blocks",
    "num_preemptions", "num_batched_tokens", "num_waiting_tokens", "num_kv_tokens", "recent_step_time_s",
    "max_num_seqs", "cost_base_s", "cost_per_token_s", "cost_per_seq_s", "cost_per_attn_s", "cost_num_samples",
    "cost_max_num_batched_tokens", "cost_kv_load_bytes_per_s", "cost_kv_bytes_per_token",
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(LlamaConfig(**TINY_CONFIG)).save_pretrained(folder)
    return folder


def test_heartbeat_carries_load_and_calibrated_cost_model(tiny_dir, redis_url, free_port, tmp_path, wait_until):
    worker_id = f"decode-hb-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "decode_worker", "--port", str(free_port), "--redis-url", redis_url,
           "--worker-id", worker_id, "--model", str(tiny_dir), "--block-size", "8", "--num-kv-blocks", "64",
           "--max-model-len", "256", "--max-num-batched-tokens", "128", "--max-num-seqs", "16",
           "--num-threads", "1", "--calibration-steps", "12"]
    log_path = tmp_path / "decode.log"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        def registered() -> bool:
            assert proc.poll() is None, log_path.read_text()
            return client.get(worker_key("decode", worker_id)) is not None

        wait_until(registered, timeout_s=120, message="decode worker registered")
        entry = json.loads(client.get(worker_key("decode", worker_id)))
        load = entry["load"]
        assert set(load) == LOAD_KEYS and entry["load_version"] == LOAD_VERSION
        assert entry["block_size"] == 8 and len(entry["spec_fingerprint"]) == 16
        model = WorkerLoad.from_wire(load).fitted_cost_model
        assert model is not None and model.num_samples >= 12
        assert model.max_num_batched_tokens == 128
        assert model.kv_bytes_per_token == 2 * 2 * 2 * 8 * 4  # layers, K and V, kv heads, head_dim, fp32
        assert model.prefill_s(100) > 0 and model.decode_step_s(4, 400) > 0
        assert model.kv_load_bytes_per_s == 0.0  # no pool read yet
        assert (load["num_used_blocks"], load["num_free_blocks"], load["num_preemptions"]) == (0, 64, 0)
        assert (load["num_batched_tokens"], load["num_waiting_tokens"], load["num_kv_tokens"]) == (0, 0, 0)
        assert load["max_num_seqs"] == 16

        (info,) = [w for w in asyncio.run(_list_decode(redis_url)) if w.worker_id == worker_id]
        assert (info.spec_fingerprint, info.block_size) == (entry["spec_fingerprint"], 8)
        assert (info.load.num_free_blocks, info.load.max_num_seqs, info.load.cost_model) == (64, 16, model)

        with grpc.insecure_channel(f"127.0.0.1:{free_port}") as channel:
            stats = decode_worker_pb2_grpc.DecodeWorkerStub(channel).GetStats(
                prefill_worker_pb2.GetWorkerStatsRequest(), timeout=10)
        assert stats.cost_num_samples == model.num_samples
        assert stats.cost_max_num_batched_tokens == 128 and stats.max_num_seqs == 16
        assert stats.cost_kv_bytes_per_token == model.kv_bytes_per_token
        assert stats.cost_per_token_s == model.per_token_s and stats.cost_base_s == model.base_s
        assert (stats.num_used_blocks, stats.num_batched_tokens, stats.num_waiting_tokens) == (0, 0, 0)
        assert "cost model calibrated" in log_path.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        client.close()


async def _list_decode(redis_url: str):
    registry = WorkerRegistry(redis_url)
    try:
        return await registry.list_workers("decode")
    finally:
        await registry.close()
