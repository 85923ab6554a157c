"""core.tracing: off unless an OTLP endpoint (or an exporter) is given; while off, servers and
channels get no interceptor and calls carry no trace header."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from core import grpc_auth, tracing
from core.grpc_auth import ClusterSecurity
from core.grpc_service import GrpcService


async def test_off_by_default_adds_nothing() -> None:
    assert not tracing.enabled()
    assert tracing.configure_from_env("x", env={}) is False and not tracing.enabled()
    assert grpc_auth._metadata_fn(ClusterSecurity()) is None
    service = GrpcService("127.0.0.1", 0, ["tandem.v1.Test"], security=ClusterSecurity())
    assert service.interceptors == ()
    assert tracing.inject_metadata() == []


async def test_an_endpoint_turns_it_on_and_reset_turns_it_off() -> None:
    try:
        assert tracing.configure_from_env("tandem.v1.KVPool", env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
        assert tracing.enabled()
        assert tracing.configure("again", exporter=InMemorySpanExporter()) is False  # once per process
        service = GrpcService("127.0.0.1", 0, ["tandem.v1.Test"], security=ClusterSecurity(token="t"))
        assert [type(i).__name__ for i in service.interceptors] == ["TracingInterceptor", "MetadataGate"]
    finally:
        tracing.reset()  # no span was recorded: nothing to send to the (absent) collector
    assert not tracing.enabled()


async def test_channels_carry_the_current_span_as_traceparent() -> None:
    exporter = InMemorySpanExporter()
    try:
        assert tracing.configure("tandem-test", exporter=exporter)
        extra = grpc_auth._metadata_fn(ClusterSecurity(token="t"))
        assert dict(extra()) == {"x-tandem-cluster-token": "t"}  # no span: no traceparent
        with tracing.tracer().start_as_current_span("outer") as span:
            metadata = dict(extra())
        context = span.context
        assert metadata["x-tandem-cluster-token"] == "t"
        assert metadata["traceparent"] == f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
        assert [s.name for s in exporter.get_finished_spans()] == ["outer"]
    finally:
        tracing.reset()
