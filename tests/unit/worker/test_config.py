"""WorkerConfig: the choices it names without importing the KV connector are the connector's, a
bad value is refused quoting it, and the worker command is generated from the two configs."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from engine.config import EngineConfig
from engine.kv_connector import KVLoadFailurePolicy
from worker.cli import worker_command
from worker.config import KV_LOAD_FAILURE_POLICIES, WorkerConfig


def test_failure_policies_are_the_connectors() -> None:
    assert KV_LOAD_FAILURE_POLICIES == tuple(p.value for p in KVLoadFailurePolicy)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("kv_transfer", "tcp", "kv_transfer must be one of"),
    ("kv_load_failure_policy", "retry", "kv_load_failure_policy must be one of"),
    ("calibration_steps", -1, "calibration_steps must be >= 0, got -1"),
    ("kv_lease_ttl_s", 0.0, "kv_lease_ttl_s must be > 0, got 0.0"),
    ("port", 70000, r"port must be in \[0, 65535\], got 70000"),
])
def test_bad_values_are_refused(field, value, message) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerConfig(**{field: value})


def test_the_command_takes_both_configs_and_refuses_what_they_refuse() -> None:
    got = []

    @worker_command("prefill", 50061, help="test")
    def main(worker: WorkerConfig, engine: EngineConfig) -> None:
        got.append((worker, engine))

    main.main(["--num-kv-blocks", "64", "--max-model-len", "512", "--calibration-steps", "0", "--kv-lease-ttl-s", "5"],
              standalone_mode=False)
    assert got == [(WorkerConfig(port=50061, calibration_steps=0, kv_lease_ttl_s=5.0),
                    EngineConfig(num_kv_blocks=64, max_model_len=512))]
    refused = CliRunner().invoke(main, ["--num-kv-blocks", "4"])
    assert refused.exit_code == 2 and "num_kv_blocks * block_size (64) cannot hold one max_model_len (2048)" in refused.output
