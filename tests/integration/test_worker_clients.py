"""router.workers.clients against a real gRPC server that dies and comes back on the same port."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from core.proto_convert import finish_reason_to_proto
from core.request import FinishReason
from core.sampling_params import SamplingParams
from router.api.validation import ValidatedRequest
from router.workers.clients import DecodeFinished, DecodeTokens, WorkerClients
from router.workers.view import Health
from tandem.v1 import decode_worker_pb2, decode_worker_pb2_grpc
from tests.conftest import find_free_port

WAIT_S = 10.0


async def _health_server(port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)  # SERVING
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    await server.start()
    return server


async def test_a_worker_restarted_on_its_port_is_reached_at_once() -> None:
    port = find_free_port()
    address = f"127.0.0.1:{port}"
    clients = WorkerClients(replaced_channel_grace_s=WAIT_S)
    server = await _health_server(port)
    try:
        assert await clients.health(address) is Health.SERVING
        await server.stop(0)
        for _ in range(3):  # the router keeps probing a dead worker; nothing listens
            assert await clients.health(address) is Health.NOT_SERVING
        channel = clients._channels[address]  # the cached one: backing off before it reconnects

        async def backing_off() -> None:
            while channel.get_state() != grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                await channel.wait_for_state_change(channel.get_state())

        await asyncio.wait_for(backing_off(), WAIT_S)
        server = await _health_server(port)  # the worker is back, same address
        # Neither the old channel's reconnect backoff nor its subchannel's delays this call.
        assert await clients.health(address) is Health.SERVING
    finally:
        await server.stop(0)
        await clients.close()


NUM_TOKENS = 6


class _HeldDecode(decode_worker_pb2_grpc.DecodeWorkerServicer):
    """Streams NUM_TOKENS tokens: two at once, the rest once ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def Decode(self, request, context):
        for token_id in range(NUM_TOKENS):
            if token_id == 2:
                await self.release.wait()
            yield decode_worker_pb2.DecodeResponse(tokens=decode_worker_pb2.TokenChunk(token_ids=[token_id]))
        yield decode_worker_pb2.DecodeResponse(finished=decode_worker_pb2.Finished(
            finish_reason=finish_reason_to_proto(FinishReason.LENGTH), num_output_tokens=NUM_TOKENS))


async def test_a_draining_workers_stream_outlives_the_replacement_of_its_channel() -> None:
    """A worker stopping gracefully (SIGTERM in a rolling update) refuses new connections while
    its streams finish on the open one; the router's channel to it goes TRANSIENT_FAILURE and is
    replaced at the next call. The stream still running on the old channel must end normally:
    closing that channel at once cancelled it mid-stream (a request lost on a real node)."""
    port = find_free_port()
    address = f"127.0.0.1:{port}"
    servicer = _HeldDecode()
    server = grpc.aio.server()
    decode_worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    assert server.add_insecure_port(address) == port
    await server.start()
    clients = WorkerClients(replaced_channel_grace_s=WAIT_S)
    request = ValidatedRequest([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True), ())
    stopping = None
    try:
        events = aiter(clients.decode(address, "r1", request, None, WAIT_S))
        assert [await anext(events) for _ in range(2)] == [DecodeTokens((0,)), DecodeTokens((1,))]
        stopping = asyncio.ensure_future(server.stop(WAIT_S))  # draining: the stream goes on
        first_channel = clients._channels[address]

        async def replaced() -> None:
            while clients._channels[address] is first_channel:
                assert await clients.health(address) is not Health.SERVING  # nothing new connects

        await asyncio.wait_for(replaced(), WAIT_S)
        servicer.release.set()
        rest = [event async for event in events]
        assert rest == [*(DecodeTokens((i,)) for i in range(2, NUM_TOKENS)), DecodeFinished(FinishReason.LENGTH, NUM_TOKENS)]
    finally:
        servicer.release.set()
        if stopping is not None:
            await stopping
        await server.stop(0)
        await clients.close()
