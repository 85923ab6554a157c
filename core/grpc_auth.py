"""Who may call a Tandem gRPC server: the cluster token, API keys, TLS / mTLS.

Two gates, both as ``grpc.aio`` server interceptors (:class:`MetadataGate`):

- **internal** (pool and worker RPCs): the caller sends the shared cluster token in the metadata
  key ``x-tandem-cluster-token``; channels made by :func:`channel` / :func:`aio_channel` attach it.
- **public** (the router's ``tandem.v1.Router``): ``authorization: Bearer <api key>``, as OpenAI's
  HTTP API takes it (router.api.auth checks the same keys on HTTP).

``grpc.health.v1`` is always open: Kubernetes' gRPC probes send no metadata, and a health answer
reveals nothing. TLS (server certificate, and mTLS when a CA for clients is given) wraps either.

Cluster settings come from the environment, read here and nowhere else (the Helm chart sets them
from Secrets, ``tandem up`` for its children):

| variable | meaning |
|---|---|
| ``TANDEM_CLUSTER_TOKEN`` / ``TANDEM_CLUSTER_TOKEN_FILE`` | the shared token (or a file holding it); unset: internal RPCs are open |
| ``TANDEM_GRPC_TLS_CERT_FILE`` / ``TANDEM_GRPC_TLS_KEY_FILE`` | PEM certificate chain and key: servers serve TLS, clients present them (mTLS) |
| ``TANDEM_GRPC_TLS_CA_FILE`` | PEM CA that signed the peers' certificates: clients verify servers, servers require client certificates |
| ``TANDEM_GRPC_TLS_SERVER_NAME`` | the name checked in a server's certificate (workers register pod IPs, not names); default ``tandem-internal`` |
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from core import tracing

CLUSTER_TOKEN_METADATA = "x-tandem-cluster-token"
AUTHORIZATION_METADATA = "authorization"
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
DEFAULT_TLS_SERVER_NAME = "tandem-internal"
# Every variable this module reads (the deploy tests check each one set on a pod is read here).
CLUSTER_ENV_VARS = (
    "TANDEM_CLUSTER_TOKEN", "TANDEM_CLUSTER_TOKEN_FILE", "TANDEM_GRPC_TLS_CERT_FILE",
    "TANDEM_GRPC_TLS_KEY_FILE", "TANDEM_GRPC_TLS_CA_FILE", "TANDEM_GRPC_TLS_SERVER_NAME",
)


def _read_file(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{what}: cannot read {path!r}: {err.strerror}") from err


@dataclass(frozen=True)
class ClusterSecurity:
    """The cluster-internal credentials of this process.

    Attributes:
        token: the shared secret every internal RPC carries; empty: no token checked or sent.
        tls_cert_pem / tls_key_pem: this process's certificate chain and private key (PEM bytes);
            servers serve TLS with them, clients present them. Both or neither.
        tls_ca_pem: the CA that signed the peers' certificates; clients verify servers against it
            and servers then require a client certificate signed by it (mTLS).
        tls_server_name: the name a client expects in the server's certificate.

    Raises:
        ValueError: only one of certificate and key, or a CA without them on a server.
    """

    token: str = ""
    tls_cert_pem: bytes = b""
    tls_key_pem: bytes = b""
    tls_ca_pem: bytes = b""
    tls_server_name: str = DEFAULT_TLS_SERVER_NAME

    def __post_init__(self) -> None:
        if bool(self.tls_cert_pem) != bool(self.tls_key_pem):
            raise ValueError("TLS needs both a certificate and its key (TANDEM_GRPC_TLS_CERT_FILE, "
                             "TANDEM_GRPC_TLS_KEY_FILE), got only one")
        if self.tls_ca_pem and not self.tls_cert_pem:
            raise ValueError("TANDEM_GRPC_TLS_CA_FILE is set without TANDEM_GRPC_TLS_CERT_FILE/_KEY_FILE")
        if any(c.isspace() for c in self.token):
            raise ValueError("the cluster token must not contain whitespace")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_pem)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClusterSecurity:
        """Reads CLUSTER_ENV_VARS (``os.environ`` by default).

        Raises:
            ValueError: a named file cannot be read, or the settings are inconsistent.
        """
        env = os.environ if env is None else env
        token = env.get("TANDEM_CLUSTER_TOKEN", "")
        if not token and env.get("TANDEM_CLUSTER_TOKEN_FILE"):
            token = _read_file(env["TANDEM_CLUSTER_TOKEN_FILE"], "TANDEM_CLUSTER_TOKEN_FILE").decode().strip()
        pem = {name: _read_file(env[name], name) if env.get(name) else b""
               for name in ("TANDEM_GRPC_TLS_CERT_FILE", "TANDEM_GRPC_TLS_KEY_FILE", "TANDEM_GRPC_TLS_CA_FILE")}
        return cls(token.strip(), pem["TANDEM_GRPC_TLS_CERT_FILE"], pem["TANDEM_GRPC_TLS_KEY_FILE"],
                   pem["TANDEM_GRPC_TLS_CA_FILE"],
                   env.get("TANDEM_GRPC_TLS_SERVER_NAME") or DEFAULT_TLS_SERVER_NAME)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for ``add_secure_port`` (client certificates required when a CA is
        set); None without TLS."""
        if not self.tls:
            return None
        return grpc.ssl_server_credentials(
            [(self.tls_key_pem, self.tls_cert_pem)], root_certificates=self.tls_ca_pem or None,
            require_client_auth=bool(self.tls_ca_pem))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.tls_ca_pem or None, private_key=self.tls_key_pem or None,
            certificate_chain=self.tls_cert_pem or None)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.tls_server_name)] if self.tls else []


def token_matches(presented: str, accepted: Iterable[str]) -> bool:
    """Whether ``presented`` equals one of ``accepted`` (constant time per key)."""
    presented_bytes = presented.encode()
    return any(hmac.compare_digest(presented_bytes, key.encode()) for key in accepted) and bool(presented)


def bearer_token(value: str) -> str:
    """The token of an ``Authorization: Bearer <token>`` value ('' when it is not one)."""
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


# ---- server side -------------------------------------------------------------------------------

def _denying_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming shape as ``handler`` that ends the RPC with ``code``."""

    async def deny(_request, context: grpc.aio.ServicerContext):
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class MetadataGate(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED and ``message``, every RPC whose invocation metadata
    ``allow`` rejects, except methods under OPEN_METHOD_PREFIXES (health)."""

    def __init__(self, allow: Callable[[dict[str, str]], bool], message: str):
        self.allow, self.message = allow, message

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        metadata = {key: value for key, value in handler_call_details.invocation_metadata or ()
                    if isinstance(value, str)}
        if self.allow(metadata):
            return handler
        return _denying_handler(handler, grpc.StatusCode.UNAUTHENTICATED, self.message)


def cluster_gate(token: str) -> MetadataGate:
    """The internal gate: the metadata must carry ``token`` under CLUSTER_TOKEN_METADATA."""
    return MetadataGate(lambda md: token_matches(md.get(CLUSTER_TOKEN_METADATA, ""), (token,)),
                        "this RPC is internal to the cluster: missing or wrong cluster token")


def api_key_gate(api_keys: Sequence[str]) -> MetadataGate:
    """The public gate: ``authorization: Bearer <key>`` with one of ``api_keys``."""
    return MetadataGate(lambda md: token_matches(bearer_token(md.get(AUTHORIZATION_METADATA, "")), api_keys),
                        "missing or invalid API key: send metadata 'authorization: Bearer <key>'")


# ---- client side -------------------------------------------------------------------------------

MetadataFn = Callable[[], Sequence[tuple[str, str]]]  # what to add to one call, computed per call


def _with_metadata(details, extra: Sequence[tuple[str, str]]):
    metadata = [*(details.metadata or ()), *extra]
    return details._replace(metadata=metadata)


class _AioMetadata:
    def __init__(self, extra_fn: MetadataFn):
        self.extra_fn = extra_fn

    @property
    def extra(self) -> Sequence[tuple[str, str]]:
        return self.extra_fn()


# grpc.aio files an interceptor under the first of the four kinds it is an instance of, so each
# kind is its own class.
class _AioUnaryUnary(_AioMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_metadata(details, self.extra), request)


class _AioUnaryStream(_AioMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_metadata(details, self.extra), request)


class _AioStreamUnary(_AioMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_metadata(details, self.extra), request_iterator)


class _AioStreamStream(_AioMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_metadata(details, self.extra), request_iterator)


def _aio_interceptors(extra_fn: MetadataFn) -> list:
    """Interceptors adding ``extra_fn()`` metadata to every call of an asyncio channel."""
    return [kind(extra_fn) for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, details, metadata):
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)
        self.metadata = metadata


class _SyncTokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                            grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``extra_fn()`` metadata to every call of a blocking channel."""

    def __init__(self, extra_fn: MetadataFn):
        self.extra_fn = extra_fn

    def _details(self, details):
        return _SyncDetails(details, [*(details.metadata or ()), *self.extra_fn()])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def _metadata_fn(security: ClusterSecurity) -> MetadataFn | None:
    """What every call of a new channel carries: the cluster token, and the current span's
    ``traceparent`` while tracing is on (core.tracing); None: nothing."""
    token = [(CLUSTER_TOKEN_METADATA, security.token)] if security.token else []
    if tracing.enabled():
        return lambda: [*token, *tracing.inject_metadata()]
    return (lambda: token) if token else None


def channel(address: str, options: Sequence[tuple], security: ClusterSecurity) -> grpc.Channel:
    """A blocking channel to a cluster-internal server: TLS when configured, the token attached."""
    options = [*options, *security.channel_options()]
    if security.tls:
        raw = grpc.secure_channel(address, security.channel_credentials(), options=options)
    else:
        raw = grpc.insecure_channel(address, options=options)
    extra_fn = _metadata_fn(security)
    return grpc.intercept_channel(raw, _SyncTokenInterceptor(extra_fn)) if extra_fn else raw


def aio_channel(address: str, options: Sequence[tuple], security: ClusterSecurity) -> grpc.aio.Channel:
    """An asyncio channel to a cluster-internal server: TLS when configured, the token attached."""
    options = [*options, *security.channel_options()]
    extra_fn = _metadata_fn(security)
    interceptors = _aio_interceptors(extra_fn) if extra_fn else None
    if security.tls:
        return grpc.aio.secure_channel(address, security.channel_credentials(), options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
