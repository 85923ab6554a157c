"""GrpcService binds its port exclusively: a second server on a taken port fails, naming it."""

from __future__ import annotations

import pytest

from core.grpc_service import GrpcService, run_until_signalled


async def test_a_second_service_on_a_taken_port_fails_naming_the_port() -> None:
    first = GrpcService("127.0.0.1", 0, ["tandem.v1.Test"], grace_s=0)
    port = await first.start()
    second = GrpcService("127.0.0.1", port, ["tandem.v1.Test"], grace_s=0)
    try:
        with pytest.raises(RuntimeError) as info:
            await second.start()
        assert str(info.value) == (
            f"cannot bind gRPC server to 127.0.0.1:{port}: port {port} is in use (another Tandem service?) "
            "or the host is not an interface of this machine")
    finally:
        await first.stop()


async def test_a_failed_start_up_stops_what_started_and_raises() -> None:
    """A start-up that fails after its server started (Redis refusing the registration, say)
    stops the server, so the process exits instead of serving unready forever."""
    service = GrpcService("127.0.0.1", 0, ["tandem.v1.Test"], grace_s=0)
    stopped = []

    async def start() -> None:
        await service.start()
        raise RuntimeError("registration refused")

    async def stop() -> None:
        await service.stop()
        stopped.append(True)

    with pytest.raises(RuntimeError, match="registration refused"):
        await run_until_signalled(start, stop)
    assert stopped == [True]
