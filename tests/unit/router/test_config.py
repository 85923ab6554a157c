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
    ],
)
def test_bad_values(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        RouterConfig(**overrides)
    assert str(info.value) == message


def test_defaults() -> None:
    config = RouterConfig()
    assert (config.http_port, config.grpc_port, config.max_model_len, config.default_max_tokens) == (8000, 50050, 2048, 16)
