"""The KV-load failure policy: counted with its labels under both actions, raised only under fail."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import CollectorRegistry

from engine.kv_connector.load_failure import (
    METADATA_KEY, KVLoadError, KVLoadFailurePolicy, KVLoadFailures, make_counter, reason_of,
)


class Rpc(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


def value(registry: CollectorRegistry, stage: str, reason: str, action: str) -> float | None:
    return registry.get_sample_value("tandem:kv_load_failures_total",
                                     {"stage": stage, "reason": reason, "action": action})


def test_recompute_counts_and_returns():
    registry = CollectorRegistry()
    failures = KVLoadFailures(KVLoadFailurePolicy.RECOMPUTE, make_counter(registry))
    failures.failed("manifest", KVLoadError("checksum", "block 3"), "r1")
    failures.failed("manifest", KVLoadError("checksum", "block 4"), "r2")
    assert value(registry, "manifest", "checksum", "recompute") == 2
    assert value(registry, "manifest", "checksum", "fail") is None


def test_fail_counts_and_raises_the_error_with_its_metadata():
    registry = CollectorRegistry()
    failures = KVLoadFailures(KVLoadFailurePolicy.FAIL, make_counter(registry))
    err = KVLoadError("lease_lost", "the lease lapsed")
    with pytest.raises(KVLoadError) as raised:
        failures.failed("prefix", err, "r1")
    assert raised.value is err and str(err) == "KV load failed (lease_lost): the lease lapsed"
    assert err.trailing_metadata == ((METADATA_KEY, "lease_lost"),)
    assert value(registry, "prefix", "lease_lost", "fail") == 1


@pytest.mark.parametrize(("err", "reason"), [
    (Rpc(grpc.StatusCode.UNAVAILABLE), "unreachable"), (Rpc(grpc.StatusCode.DEADLINE_EXCEEDED), "unreachable"),
    (Rpc(grpc.StatusCode.NOT_FOUND), "missing"), (Rpc(grpc.StatusCode.INTERNAL), "transfer_error"),
    (OSError("mmap failed"), "unreachable"),
])
def test_pool_errors_map_to_reasons(err, reason):
    assert reason_of(err) == reason


def test_an_unknown_policy_is_refused_quoting_it():
    with pytest.raises(ValueError, match="'retry'"):
        KVLoadFailurePolicy("retry")
