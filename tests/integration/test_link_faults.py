"""Network faults between two gRPC ends, played by chaos.link_proxy.LinkProxy, and what the
cluster's channels do about them: keepalive pings detect a silent partition (a stream fails
UNAVAILABLE instead of hanging), and the channel serves again once the link heals."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chaos.link_proxy import LinkFault, LinkProxies, LinkProxy
from core.grpc_service import (CHANNEL_OPTIONS, KEEPALIVE_TIME_S, KEEPALIVE_TIMEOUT_S, MAX_MESSAGE_BYTES,
                               SERVER_OPTIONS, GrpcService, cluster_aio_channel, keepalive_channel_options,
                               keepalive_server_options)

# Short keepalive for the tests: a silent peer is detected within 2 x 0.5 + 0.5 s.
TIME_S, TIMEOUT_S = 0.5, 0.5
# Far beyond the bound: a stream still silent this long has not been detected (without keepalive
# it would wait for TCP to give up, ~15 minutes).
NEVER_S = 20.0


async def _served_through_proxy(keepalive: bool = True):
    limits = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    server_options = [*limits, *keepalive_server_options(TIME_S, TIMEOUT_S)] if keepalive else limits
    service = GrpcService("127.0.0.1", 0, ["tandem.v1.Test"], grace_s=0, server_options=server_options)
    port = await service.start()
    proxy = LinkProxy(f"127.0.0.1:{port}")
    await proxy.start()
    options = [*limits, *keepalive_channel_options(TIME_S, TIMEOUT_S)] if keepalive else limits
    channel = cluster_aio_channel(proxy.address, options=options)
    return service, proxy, channel


async def _close(service, proxy, channel) -> None:
    await channel.close()
    await proxy.stop()
    await service.stop()


def test_the_cluster_channels_and_servers_keep_alive_within_the_stated_bound():
    assert 2 * KEEPALIVE_TIME_S + KEEPALIVE_TIMEOUT_S <= 10.0  # a silent partition detected within 10 s
    assert set(keepalive_channel_options()) <= set(CHANNEL_OPTIONS)
    assert set(keepalive_server_options()) <= set(SERVER_OPTIONS)
    assert {("grpc.keepalive_time_ms", 2000), ("grpc.http2.ping_timeout_ms", 5000)} <= set(CHANNEL_OPTIONS)


async def test_a_silent_partition_fails_an_open_server_stream_unavailable():
    """A health Watch stream (server streaming, as Decode is) gets its first answer; then the link
    drops every packet both ways without closing: the next read fails UNAVAILABLE after the
    keepalive ping goes unanswered, instead of waiting forever."""
    service, proxy, channel = await _served_through_proxy()
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        stream = stub.Watch(health_pb2.HealthCheckRequest(service="tandem.v1.Test"))
        first = await stream.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        proxy.set_fault(LinkFault("blackhole"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(stream.read(), NEVER_S)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await _close(service, proxy, channel)


async def test_a_one_way_partition_is_detected_too():
    """Only the server's answers are dropped (the client's pings still arrive): the client hears
    no ping acknowledgement and fails the stream the same way."""
    service, proxy, channel = await _served_through_proxy()
    try:
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="tandem.v1.Test"))
        assert (await stream.read()).status == health_pb2.HealthCheckResponse.SERVING
        proxy.set_fault(LinkFault("blackhole", direction="to_client"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(stream.read(), NEVER_S)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await _close(service, proxy, channel)


async def test_the_channel_serves_again_once_the_partition_heals():
    """After a detected partition heals, the same channel reconnects: no stale state."""
    service, proxy, channel = await _served_through_proxy()
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        stream = stub.Watch(health_pb2.HealthCheckRequest(service="tandem.v1.Test"))
        await stream.read()
        proxy.set_fault(LinkFault("blackhole"))
        with pytest.raises(grpc.aio.AioRpcError):
            await asyncio.wait_for(stream.read(), NEVER_S)
        proxy.set_fault(LinkFault("pass"))
        # A call that lands on the connection the keepalive is still closing fails UNAVAILABLE
        # once ("Delayed close due to in-progress write (ping timeout)"); the next one reconnects.
        deadline = asyncio.get_running_loop().time() + NEVER_S
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Test"), timeout=NEVER_S,
                                         wait_for_ready=True)
                break
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE or asyncio.get_running_loop().time() > deadline:
                    raise
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert proxy.num_connections >= 2  # the dead connection was given up, a new one made
    finally:
        await _close(service, proxy, channel)


async def test_without_keepalive_a_silent_partition_is_not_seen_by_the_stream():
    """The control: the same partition under a channel and server without keepalive leaves the
    stream waiting (here for 3 s, 3x the keepalive bound above) — what the options fix."""
    service, proxy, channel = await _served_through_proxy(keepalive=False)
    try:
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="tandem.v1.Test"))
        await stream.read()
        proxy.set_fault(LinkFault("blackhole"))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(stream.read(), 3 * (TIME_S + TIMEOUT_S))
    finally:
        await _close(service, proxy, channel)


async def test_delay_reset_and_bad_faults():
    service, proxy, channel = await _served_through_proxy()
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="tandem.v1.Test")
        assert (await stub.Check(request, timeout=NEVER_S)).status == health_pb2.HealthCheckResponse.SERVING
        proxy.set_fault(LinkFault("delay", delay_s=0.2))
        with pytest.raises(grpc.aio.AioRpcError) as info:  # a deadline shorter than the link's latency
            await stub.Check(request, timeout=0.1)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert (await stub.Check(request, timeout=NEVER_S)).status == health_pb2.HealthCheckResponse.SERVING
        proxy.set_fault(LinkFault("reset"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Check(request, timeout=NEVER_S)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await _close(service, proxy, channel)
    with pytest.raises(ValueError, match="mode must be one of"):
        LinkFault("flap")
    with pytest.raises(ValueError, match="direction must be one of"):
        LinkFault("blackhole", direction="sideways")
    with pytest.raises(ValueError, match="delay_s > 0"):
        LinkFault("delay")
    with pytest.raises(ValueError, match="bytes_per_s > 0"):
        LinkFault("bandwidth")


async def test_link_proxies_in_their_own_thread_drop_and_heal():
    """The campaign's proxies live in a thread of their own (each scenario runs its own event
    loop): a blocking client through one sees a blackhole as a deadline, and heal_all undoes it."""
    service = GrpcService("127.0.0.1", 0, ["tandem.v1.Test"], grace_s=0)
    port = await service.start()
    request = health_pb2.HealthCheckRequest(service="tandem.v1.Test")

    def through_proxies() -> list[grpc.StatusCode | int]:
        seen = []
        with LinkProxies() as links:
            address = links.add("decode-1", f"127.0.0.1:{port}")
            with grpc.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                seen.append(stub.Check(request, timeout=NEVER_S).status)
                links.set_fault("decode-1", LinkFault("blackhole"))
                try:
                    stub.Check(request, timeout=0.5)
                except grpc.RpcError as err:
                    seen.append(err.code())
                links.heal_all()
                seen.append(stub.Check(request, timeout=NEVER_S).status)
        return seen

    try:
        assert await asyncio.to_thread(through_proxies) == [
            health_pb2.HealthCheckResponse.SERVING, grpc.StatusCode.DEADLINE_EXCEEDED, health_pb2.HealthCheckResponse.SERVING]
    finally:
        await service.stop()
