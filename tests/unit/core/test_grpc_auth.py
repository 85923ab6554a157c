"""core.grpc_auth: internal RPCs need the cluster token, public ones an API key, TLS/mTLS refuse
strangers; health stays open. Real servers on 127.0.0.1 with a bytes-in/bytes-out test service."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.grpc_auth import ClusterSecurity, api_key_gate, bearer_token, token_matches
from core.grpc_service import GrpcService, cluster_aio_channel, cluster_channel

TLS = Path(__file__).resolve().parents[2] / "data" / "tls"  # made by tests/data/tls/make_certs.sh


def _pem(name: str) -> bytes:
    return (TLS / name).read_bytes()


async def _echo(request: bytes, _context) -> bytes:
    return b"echo:" + request


async def _count(request: bytes, _context):
    for i in range(int(request)):
        yield str(i).encode()


async def _serve(security: ClusterSecurity | None = None, **kwargs) -> GrpcService:
    service = GrpcService("127.0.0.1", 0, ["tandem.v1.Test"], grace_s=0,
                          security=security or ClusterSecurity(), **kwargs)
    service.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("tandem.v1.Test", {
        "Echo": grpc.unary_unary_rpc_method_handler(_echo),
        "Count": grpc.unary_stream_rpc_method_handler(_count),
    })])
    await service.start()
    return service


async def _call(channel: grpc.aio.Channel, payload: bytes = b"hi", metadata=None) -> bytes:
    return await channel.unary_unary("/tandem.v1.Test/Echo")(payload, metadata=metadata, timeout=10)


def _blocking_calls(address: str, security: ClusterSecurity) -> list[bytes]:
    with cluster_channel(address, security) as channel:
        return [channel.unary_unary("/tandem.v1.Test/Echo")(b"x", timeout=10),
                *channel.unary_stream("/tandem.v1.Test/Count")(b"2", timeout=10)]


async def _status(awaitable) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await awaitable
    return info.value.code(), info.value.details()


async def test_internal_rpcs_need_the_cluster_token_and_health_stays_open() -> None:
    service = await _serve(ClusterSecurity(token="s3cret"))
    address = f"127.0.0.1:{service.bound_port}"
    try:
        async with cluster_aio_channel(address, ClusterSecurity()) as anonymous:
            code, details = await _status(_call(anonymous))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            assert details == "this RPC is internal to the cluster: missing or wrong cluster token"
            stream = anonymous.unary_stream("/tandem.v1.Test/Count")(b"3", timeout=10)
            code, _ = await _status(stream.read())
            assert code == grpc.StatusCode.UNAUTHENTICATED
            reply = await health_pb2_grpc.HealthStub(anonymous).Check(health_pb2.HealthCheckRequest(service="tandem.v1.Test"))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        async with cluster_aio_channel(address, ClusterSecurity(token="wrong")) as wrong:
            assert (await _status(_call(wrong)))[0] == grpc.StatusCode.UNAUTHENTICATED
        async with cluster_aio_channel(address, ClusterSecurity(token="s3cret")) as member:
            assert await _call(member) == b"echo:hi"
            counted = [m async for m in member.unary_stream("/tandem.v1.Test/Count")(b"3", timeout=10)]
            assert counted == [b"0", b"1", b"2"]
        # Blocking channels (the pool client's) on a thread: the server runs on this loop.
        assert await asyncio.to_thread(_blocking_calls, address, ClusterSecurity(token="s3cret")) == [b"echo:x", b"0", b"1"]
        with pytest.raises(grpc.RpcError) as info:
            await asyncio.to_thread(_blocking_calls, address, ClusterSecurity())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await service.stop()


async def test_a_public_service_takes_api_keys_not_the_cluster_token() -> None:
    service = await _serve(ClusterSecurity(token="s3cret"), internal=False, gates=[api_key_gate(["k1", "k2"])])
    address = f"127.0.0.1:{service.bound_port}"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            code, details = await _status(_call(channel))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            assert details == "missing or invalid API key: send metadata 'authorization: Bearer <key>'"
            assert (await _status(_call(channel, metadata=[("authorization", "Bearer k3")])))[0] == \
                grpc.StatusCode.UNAUTHENTICATED
            assert (await _status(_call(channel, metadata=[("x-tandem-cluster-token", "s3cret")])))[0] == \
                grpc.StatusCode.UNAUTHENTICATED
            assert await _call(channel, metadata=[("authorization", "Bearer k2")]) == b"echo:hi"
            assert await _call(channel, metadata=[("authorization", "bearer k1")]) == b"echo:hi"
    finally:
        await service.stop()


def _tls(cert: str = "server", ca: bool = True, **kwargs) -> ClusterSecurity:
    return ClusterSecurity(tls_cert_pem=_pem(f"{cert}.pem"), tls_key_pem=_pem(f"{cert}.key"),
                           tls_ca_pem=_pem("ca.pem") if ca else b"", **kwargs)


async def test_mtls_admits_only_clients_with_a_certificate_from_the_cluster_ca() -> None:
    service = await _serve(_tls("server", token="s3cret"))
    address = f"127.0.0.1:{service.bound_port}"
    try:
        async with cluster_aio_channel(address, _tls("client", token="s3cret")) as member:
            assert await _call(member) == b"echo:hi"
        stranger = ClusterSecurity(tls_cert_pem=_pem("other.pem"), tls_key_pem=_pem("other.key"),
                                   tls_ca_pem=_pem("ca.pem"), token="s3cret")
        async with cluster_aio_channel(address, stranger) as channel:
            assert (await _status(_call(channel)))[0] == grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.insecure_channel(address) as plaintext:
            assert (await _status(_call(plaintext, metadata=[("x-tandem-cluster-token", "s3cret")])))[0] == \
                grpc.StatusCode.UNAVAILABLE
    finally:
        await service.stop()


async def test_tls_without_a_client_ca_serves_any_client_that_trusts_the_server() -> None:
    service = await _serve(_tls("server", ca=False))
    address = f"127.0.0.1:{service.bound_port}"
    try:
        client = ClusterSecurity(tls_cert_pem=_pem("client.pem"), tls_key_pem=_pem("client.key"),
                                 tls_ca_pem=_pem("ca.pem"))
        async with cluster_aio_channel(address, client) as channel:
            assert await _call(channel) == b"echo:hi"
        wrong_name = ClusterSecurity(tls_cert_pem=_pem("client.pem"), tls_key_pem=_pem("client.key"),
                                     tls_ca_pem=_pem("ca.pem"), tls_server_name="someone-else")
        async with cluster_aio_channel(address, wrong_name) as channel:
            assert (await _status(_call(channel)))[0] == grpc.StatusCode.UNAVAILABLE
    finally:
        await service.stop()


def test_from_env_reads_the_token_file_and_certificates(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    security = ClusterSecurity.from_env({
        "TANDEM_CLUSTER_TOKEN_FILE": str(token_file), "TANDEM_GRPC_TLS_CERT_FILE": str(TLS / "server.pem"),
        "TANDEM_GRPC_TLS_KEY_FILE": str(TLS / "server.key"), "TANDEM_GRPC_TLS_CA_FILE": str(TLS / "ca.pem"),
    })
    assert security.token == "from-file"
    assert security.tls and security.tls_ca_pem == _pem("ca.pem")
    assert security.tls_server_name == "tandem-internal"
    assert ClusterSecurity.from_env({"TANDEM_CLUSTER_TOKEN": "direct", "TANDEM_CLUSTER_TOKEN_FILE": "/nope"}).token == "direct"
    assert ClusterSecurity.from_env({}) == ClusterSecurity()


def test_from_env_refuses_inconsistent_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="TLS needs both a certificate and its key"):
        ClusterSecurity.from_env({"TANDEM_GRPC_TLS_CERT_FILE": str(TLS / "server.pem")})
    with pytest.raises(ValueError, match="TANDEM_GRPC_TLS_KEY_FILE: cannot read '/nonexistent/key'"):
        ClusterSecurity.from_env({"TANDEM_GRPC_TLS_CERT_FILE": str(TLS / "server.pem"),
                                  "TANDEM_GRPC_TLS_KEY_FILE": "/nonexistent/key"})
    with pytest.raises(ValueError, match="TANDEM_GRPC_TLS_CA_FILE is set without"):
        ClusterSecurity.from_env({"TANDEM_GRPC_TLS_CA_FILE": str(TLS / "ca.pem")})


def test_token_helpers() -> None:
    assert bearer_token("Bearer abc") == "abc" and bearer_token("Basic abc") == "" and bearer_token("") == ""
    assert token_matches("abc", ["x", "abc"]) and not token_matches("", [""]) and not token_matches("ab", ["abc"])
