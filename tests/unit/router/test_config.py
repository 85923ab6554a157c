"""RouterConfig rejects bad values, quoting them."""

from __future__ import annotations

import pytest

from router.config import RouterConfig


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"http_port": 70000}, "http_port must be in [0, 65535], got 70000"),
        ({"max_model_len": 1}, "max_model_len must be >= 2, got 1"),
        ({"default_max_tokens": 2048}, "default_max_tokens must be in [1, max_model_len=2048), got 2048"),
        ({"request_timeout_s": 0}, "request_timeout_s must be > 0, got 0"),
        ({"redis_url": "localhost:6379"}, "redis_url must start with redis://, rediss:// or unix://, got 'localhost:6379'"),
        ({"routing_policy": "random"}, "routing_policy must be one of ('round_robin', 'least_loaded', "
                                       "'cache_aware', 'predicted_latency'), got 'random'"),
        ({"disaggregation": "maybe"}, "disaggregation must be one of ('auto', 'always', 'never'), got 'maybe'"),
        ({"ttft_slo_s": -1.0}, "ttft_slo_s must be >= 0, got -1.0"),
        ({"tbt_slo_s": float("nan")}, "tbt_slo_s must be >= 0, got nan"),
        ({"max_queue_s": -0.1}, "max_queue_s must be >= 0, got -0.1"),
        ({"first_token_hold_s": -1.0}, "first_token_hold_s must be in [0, 10], got -1.0"),
        ({"first_token_hold_s": float("inf")}, "first_token_hold_s must be in [0, 10], got inf"),
        ({"first_token_hold_s": float("nan")}, "first_token_hold_s must be in [0, 10], got nan"),
        ({"prefix_cache_blocks": 0}, "prefix_cache_blocks must be >= 1, got 0"),
        ({"tool_call_parser": "mistral"}, "tool_call_parser must be one of ('hermes',), got 'mistral'"),
    ],
)
def test_bad_values(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        RouterConfig(**overrides)
    assert str(info.value) == message


def test_defaults() -> None:
    config = RouterConfig()
    assert (config.http_port, config.grpc_port, config.max_model_len, config.default_max_tokens) == (8000, 50050, 2048, 16)
    assert (config.routing_policy, config.disaggregation, config.ttft_slo_s, config.tbt_slo_s) == (
        "predicted_latency", "auto", 0.0, 0.0)
    assert (config.chat_template, config.tool_call_parser) == ("", "hermes")
    assert config.first_token_hold_s == 0.2
