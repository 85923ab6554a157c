"""Failure handling and request identity in Generation, with scripted fake workers (no gRPC).

Each fake decode worker streams a fixed answer from where the request says it is (after the
prefill's first token, or after a resumed request's ``output_token_ids``) and may break after some
tokens; the tests check what the client sees, what the router sent on and who was marked down.
The fake clients have no pool release: the router never releases (the workers' KV connectors do,
engine/kv_connector/connector.py); they record the manifests the router drops at a decode worker
because no Decode answered for them.
"""

from __future__ import annotations

import asyncio
import time
import re

import grpc
import pytest

from core.registry import WorkerInfo
from core.request import FinishReason
from core.sampling_params import SamplingParams
from router.errors import ErrorKind, RouterError, WorkerFailedError
from router.generation import MAX_MIGRATIONS, Finished, Generation, TextDelta
from router.metrics import RouterMetrics
from router.api.request_ids import MAX_REQUEST_ID_CHARS, client_request_id
from router.placement.placer import Placer
from router.placement.state import PlacementBook
from router.placement.policies import make_policy
from router.api.validation import InvalidRequestError, ValidatedRequest
from router.workers.clients import (
    DecodeFinished, DecodeTokens, PrefillResult, _router_error,
)
from router.workers.view import Health, WorkerView
from tandem.v1 import common_pb2

POOL = "pool:1"
CLIENT_ID = "client-7"


class FakeRegistry:
    def __init__(self, workers: list[WorkerInfo]):
        self.workers = workers
        self.run_id = "redis-1"  # the Redis server's run_id (a restart changes it)

    async def list_workers(self, role: str) -> list[WorkerInfo]:
        return sorted((w for w in self.workers if w.role == role), key=lambda w: w.worker_id)

    async def server_id(self) -> str:
        return self.run_id


class FakeStream:
    """Streams ``answer[start:]`` two tokens a message; raises WorkerFailedError after
    ``break_after`` tokens (None: never), else ends with DecodeFinished."""

    def __init__(self, address: str, answer: list[int], start: int, break_after: int | None):
        self.address, self.answer, self.start, self.break_after = address, answer, start, break_after
        self.cancelled = False

    async def __aiter__(self):
        sent = 0
        for i in range(self.start, len(self.answer), 2):
            if self.break_after is not None and sent >= self.break_after:
                break
            chunk = self.answer[i : i + 2]
            sent += len(chunk)
            yield DecodeTokens(tuple(chunk))
            await asyncio.sleep(0)  # let concurrent requests interleave
        if self.break_after is not None:
            raise WorkerFailedError("decode worker failed (UNAVAILABLE): Socket closed", self.address)
        yield DecodeFinished(FinishReason.LENGTH, len(self.answer))

    def cancel(self) -> None:
        self.cancelled = True


class FakeClients:
    """Workers by address: ``failing_prefills`` raise WorkerFailedError; decode worker ``a``
    breaks after ``decode_breaks[a]`` tokens."""

    def __init__(self, answer: list[int]):
        self.answer = answer
        self.failing_prefills: set[str] = set()
        self.refusing_prefills: set[str] = set()
        self.decode_breaks: dict[str, int] = {}
        self.prefill_calls: list[tuple[str, str]] = []  # (address, request id)
        self.decode_calls: list[tuple[str, str, bool, tuple[int, ...]]] = []  # (address, id, has prefill, resume)
        self.health_of: dict[str, Health] = {}  # default SERVING
        self.drop_calls: list[tuple[str, str]] = []  # DropManifest (address, request id)

    async def prefill(self, address, request_id, request, timeout_s):
        self.prefill_calls.append((address, request_id))
        await asyncio.sleep(0)
        if address in self.failing_prefills:
            raise WorkerFailedError("prefill worker failed (UNAVAILABLE): Connection reset by peer", address)
        if address in self.refusing_prefills:
            raise RouterError("prefill worker failed (RESOURCE_EXHAUSTED): full", ErrorKind.RESOURCE_EXHAUSTED)
        return PrefillResult(self.answer[0], 0, POOL, common_pb2.KVManifest())

    def decode(self, address, request_id, request, prefill, timeout_s, output_token_ids=()):
        self.decode_calls.append((address, request_id, prefill is not None, tuple(output_token_ids)))
        start = 1 if prefill is not None else len(output_token_ids)
        # What a real worker needs: the resumed tokens are exactly the answer's beginning.
        assert list(output_token_ids) == self.answer[: len(output_token_ids)]
        return FakeStream(address, self.answer, start, self.decode_breaks.get(address))

    def drop_manifest(self, address, request_id, prefill):
        assert isinstance(prefill, PrefillResult)
        self.drop_calls.append((address, request_id))

    async def health(self, address):
        return self.health_of.get(address, Health.SERVING)


def workers(num_prefill: int, num_decode: int) -> list[WorkerInfo]:
    out = [WorkerInfo(f"p{i}", "prefill", f"prefill:{i}", heartbeat_time_s=1.0) for i in range(num_prefill)]
    out += [WorkerInfo(f"d{i}", "decode", f"decode:{i}", heartbeat_time_s=1.0) for i in range(num_decode)]
    return out + [WorkerInfo("pool", "pool", POOL, heartbeat_time_s=1.0)]


async def make_generation(tokenizer, num_prefill=2, num_decode=2, answer=None):
    answer = answer or tokenizer.encode(" one two three four five six seven eight nine ten eleven twelve")[:12]
    assert len(answer) == 12
    clients = FakeClients(answer)
    registry = FakeRegistry(workers(num_prefill, num_decode))
    view = WorkerView(registry, probe=clients.health)
    await view.refresh()
    metrics = RouterMetrics()
    # least_loaded: ties go to the first worker_id, so the first choices are prefill:0, decode:0.
    book = PlacementBook()
    placer = Placer(book, make_policy("least_loaded", book.view, "always"), metrics=metrics)
    generation = Generation(view, clients, tokenizer, metrics, placer, timeout_s=30.0)
    return generation, clients, view, registry


def request(max_tokens: int = 12) -> ValidatedRequest:
    return ValidatedRequest([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), ())


async def run(generation, request_id=CLIENT_ID, req=None) -> tuple[list[int], Finished]:
    tokens, finished = [], None
    async for event in generation.generate(request_id, req or request(), time.monotonic()):
        if isinstance(event, TextDelta):
            tokens += event.token_ids
        else:
            finished = event
    return tokens, finished


def counter(generation, name: str, **labels) -> float:
    return generation.metrics.registry.get_sample_value(name, labels or None) or 0.0


def addresses(view, role) -> list[str]:
    return [w.address for w in view.workers(role)]


async def test_broken_decode_stream_resumes_on_another_worker_without_repeats(tokenizer):
    generation, clients, view, _ = await make_generation(tokenizer)
    clients.decode_breaks["decode:0"] = 4
    tokens, finished = await run(generation)
    assert tokens == clients.answer  # one stream: nothing repeated, nothing missing
    assert finished.finish_reason is FinishReason.LENGTH and finished.usage.completion_tokens == 12
    (a, a_id, a_prefill, a_resume), (b, b_id, b_prefill, b_resume) = clients.decode_calls
    assert (a, a_prefill, a_resume) == ("decode:0", True, ())
    # Resumed from the prefill's first token and the 4 tokens decode:0 sent before it broke.
    assert (b, b_prefill, b_resume) == ("decode:1", False, tuple(clients.answer[:5]))
    assert a_id == clients.prefill_calls[0][1] and b_id != a_id
    assert addresses(view, "decode") == ["decode:1"]
    assert counter(generation, "tandem:migrations_total") == 1
    assert counter(generation, "tandem:worker_failures_total", role="decode") == 1


async def test_a_manifest_no_decode_worker_answered_for_is_dropped_where_it_was_sent(tokenizer):
    generation, clients, view, _ = await make_generation(tokenizer)
    tokens, _ = await run(generation)  # answered: the decode worker's connector released it
    assert tokens == clients.answer and clients.drop_calls == []
    clients.decode_calls.clear()
    clients.decode_breaks["decode:0"] = 0  # broke (hung, cancelled) before answering anything
    tokens, _ = await run(generation)
    assert tokens == clients.answer  # resumed on decode:1 from the first token
    (_, prefill_id, _, _), (_, resumed_id, _, _) = clients.decode_calls
    assert clients.drop_calls == [("decode:0", prefill_id)] and resumed_id != prefill_id


async def test_a_client_gone_at_the_first_token_drops_the_manifest_at_the_planned_decode_worker(tokenizer):
    generation, clients, _, _ = await make_generation(tokenizer)
    events = generation.generate(CLIENT_ID, request(), time.monotonic())
    first = await anext(events)
    assert first.token_ids == (clients.answer[0],)
    await events.aclose()  # the client left before any Decode was sent
    assert clients.decode_calls == []
    assert clients.drop_calls == [("decode:0", clients.prefill_calls[0][1])]


async def test_failed_prefill_is_retried_once_on_another_worker(tokenizer):
    generation, clients, view, _ = await make_generation(tokenizer)
    clients.failing_prefills.add("prefill:0")
    tokens, _ = await run(generation)
    assert tokens == clients.answer
    (first, first_id), (second, second_id) = clients.prefill_calls
    assert (first, second) == ("prefill:0", "prefill:1")
    assert first_id != second_id and all(re.fullmatch(f"{CLIENT_ID}-[0-9a-f]{{12}}", i) for i in (first_id, second_id))
    assert clients.decode_calls[0][1] == second_id  # decode reads the successful attempt's blocks
    assert addresses(view, "prefill") == ["prefill:1"]
    assert counter(generation, "tandem:prefill_retries_total") == 1


async def test_two_failed_prefills_end_with_an_explicit_error(tokenizer):
    generation, clients, view, _ = await make_generation(tokenizer, num_prefill=3)
    clients.failing_prefills.update({"prefill:0", "prefill:1", "prefill:2"})
    with pytest.raises(RouterError) as info:
        await run(generation)
    assert (info.value.kind, info.value.message) == (
        ErrorKind.UNAVAILABLE, "prefill worker failed (UNAVAILABLE): Connection reset by peer (after 2 attempts)")
    assert [a for a, _ in clients.prefill_calls] == ["prefill:0", "prefill:1"]
    assert addresses(view, "prefill") == ["prefill:2"] and clients.decode_calls == []


async def test_prefill_failure_with_no_prefill_worker_left_prefills_on_the_decode_worker(tokenizer):
    generation, clients, view, _ = await make_generation(tokenizer, num_prefill=1)
    clients.failing_prefills.add("prefill:0")
    tokens, _ = await run(generation)
    assert tokens == clients.answer
    assert clients.decode_calls[0][2:] == (False, ())  # colocated: the decode worker prefills
    assert view.workers("prefill") == []


async def test_request_errors_are_not_retried_and_mark_nobody_down(tokenizer):
    generation, clients, view, _ = await make_generation(tokenizer)
    clients.refusing_prefills.update({"prefill:0", "prefill:1"})
    with pytest.raises(RouterError) as info:
        await run(generation)
    assert info.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert len(clients.prefill_calls) == 1
    assert addresses(view, "prefill") == ["prefill:0", "prefill:1"]


async def test_migrations_are_bounded(tokenizer):
    generation, clients, view, _ = await make_generation(tokenizer, num_decode=MAX_MIGRATIONS + 2)
    clients.decode_breaks.update({f"decode:{i}": 2 for i in range(MAX_MIGRATIONS + 2)})
    tokens = []
    with pytest.raises(RouterError) as info:
        async for event in generation.generate(CLIENT_ID, request(), time.monotonic()):
            tokens += event.token_ids
    assert info.value.message == f"decode worker failed (UNAVAILABLE): Socket closed (after {MAX_MIGRATIONS} migrations)"
    assert len(clients.decode_calls) == MAX_MIGRATIONS + 1
    assert tokens == clients.answer[: 1 + 2 * (MAX_MIGRATIONS + 1)]  # what was sent stays valid


async def test_decode_failure_with_no_decode_worker_left_is_an_explicit_error(tokenizer):
    generation, clients, _, _ = await make_generation(tokenizer, num_decode=1)
    clients.decode_breaks["decode:0"] = 4
    with pytest.raises(RouterError) as info:
        await run(generation)
    assert info.value.message == "decode worker failed (UNAVAILABLE): Socket closed; no other decode worker to resume on"


async def test_a_stream_broken_after_its_last_token_finishes_without_migrating(tokenizer):
    generation, clients, _, _ = await make_generation(tokenizer)
    clients.decode_breaks["decode:0"] = 11  # every token after the first, then no Finished
    tokens, finished = await run(generation)
    assert tokens == clients.answer and finished.finish_reason is FinishReason.LENGTH
    assert len(clients.decode_calls) == 1


async def test_concurrent_requests_with_one_client_id_share_no_worker_state(tokenizer):
    generation, clients, _, _ = await make_generation(tokenizer)
    results = await asyncio.gather(run(generation), run(generation))
    assert [tokens for tokens, _ in results] == [clients.answer, clients.answer]
    prefill_ids = [rid for _, rid in clients.prefill_calls]
    assert len(set(prefill_ids)) == 2 and all(rid.startswith(f"{CLIENT_ID}-") for rid in prefill_ids)


async def test_marked_down_worker_returns_after_a_newer_heartbeat_and_a_healthy_probe(tokenizer):
    _, clients, view, registry = await make_generation(tokenizer)
    view.mark_down("decode:0", "test")
    assert addresses(view, "decode") == ["decode:1"]
    await view.refresh()  # same heartbeat: still down
    assert addresses(view, "decode") == ["decode:1"]
    registry.workers[2].heartbeat_time_s = 2.0  # decode:0 beats again ...
    clients.health_of["decode:0"] = Health.UNKNOWN  # ... but its health check does not answer
    await view.refresh()
    assert addresses(view, "decode") == ["decode:1"]
    clients.health_of["decode:0"] = Health.SERVING
    await view.refresh()
    assert addresses(view, "decode") == ["decode:0", "decode:1"]


async def test_a_failed_health_check_marks_down_and_a_slow_one_does_not(tokenizer):
    _, clients, view, _ = await make_generation(tokenizer)
    view.health_interval_s = 0.0  # a health sweep at every refresh
    clients.health_of.update({"prefill:0": Health.NOT_SERVING, "decode:1": Health.UNKNOWN})
    await view.refresh()
    assert addresses(view, "prefill") == ["prefill:1"]
    assert addresses(view, "decode") == ["decode:0", "decode:1"]


async def test_worker_gone_from_the_registry_is_forgotten(tokenizer):
    _, _, view, registry = await make_generation(tokenizer)
    view.mark_down("decode:0", "test")
    registry.workers = [w for w in registry.workers if w.address != "decode:0"]
    await view.refresh()
    assert addresses(view, "decode") == ["decode:1"]
    registry.workers.append(WorkerInfo("d0", "decode", "decode:0", heartbeat_time_s=1.0))  # a restart, same beat
    await view.refresh()
    assert addresses(view, "decode") == ["decode:0", "decode:1"]  # no longer down: back without a newer beat


@pytest.mark.parametrize(("code", "worker_failed"), [
    (grpc.StatusCode.UNAVAILABLE, True), (grpc.StatusCode.INTERNAL, True), (grpc.StatusCode.UNKNOWN, True),
    (grpc.StatusCode.INVALID_ARGUMENT, False), (grpc.StatusCode.RESOURCE_EXHAUSTED, False),
    (grpc.StatusCode.DEADLINE_EXCEEDED, False),
])
def test_which_grpc_statuses_mean_the_worker_failed(code, worker_failed):
    err = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")
    error = _router_error("prefill", "prefill:0", err, 5.0)
    assert isinstance(error, WorkerFailedError) is worker_failed
    if worker_failed:
        assert error.address == "prefill:0" and error.kind is ErrorKind.UNAVAILABLE


def test_a_workers_refusal_reaches_the_client_as_its_message_and_the_log_names_the_worker(caplog):
    """INVALID_ARGUMENT is the request's fault (a grammar the library cannot compile): the 400
    says only what the worker said; the router's log says which worker."""
    details = "the json schema cannot be compiled: Unsupported keyword"
    err = grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               details=details)
    with caplog.at_level("INFO", logger="router.workers.clients"):
        error = _router_error("decode", "decode:0", err, 5.0, "chatcmpl-1")
    assert (type(error), error.kind, error.message, error.http_status) == (
        RouterError, ErrorKind.INVALID_REQUEST, details, 400)
    (record,) = caplog.records
    assert (record.getMessage(), record.request_id) == (
        f"decode worker decode:0 refused the request (INVALID_ARGUMENT): {details}", "chatcmpl-1")


def test_client_request_ids_are_checked():
    assert client_request_id("trace-1", "x-request-id", "cmpl-") == "trace-1"
    assert re.fullmatch("cmpl-[0-9a-f]{32}", client_request_id(None, "x-request-id", "cmpl-"))
    with pytest.raises(InvalidRequestError, match="x-request-id has 129 characters; at most 128"):
        client_request_id("a" * (MAX_REQUEST_ID_CHARS + 1), "x-request-id", "")
    with pytest.raises(InvalidRequestError) as info:
        client_request_id("a b", "request_id", "")
    assert info.value.message == 'request_id "a b" must be printable ASCII without spaces'


def test_a_kv_load_failure_is_the_requests_error_not_the_workers():
    """--kv-load-failure-policy fail: the worker answers UNAVAILABLE with the reason in trailing
    metadata; the router answers 503 kv_load_failed, marks nobody down and does not retry."""
    trailing = grpc.aio.Metadata(("tandem-kv-load-failure", "checksum"))
    err = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), trailing,
                               details="KV load failed (checksum): block ... failed its checksum")
    error = _router_error("decode", "decode:0", err, 5.0)
    assert not isinstance(error, WorkerFailedError)
    assert error.kind is ErrorKind.KV_LOAD_FAILED
    assert (error.http_status, error.grpc_code) == (503, grpc.StatusCode.UNAVAILABLE)
    assert error.to_openai()["error"]["code"] == "kv_load_failed"
    assert error.message == ("decode worker could not load the KV cache (checksum): "
                             "KV load failed (checksum): block ... failed its checksum")


async def test_a_prefill_kv_load_failure_is_not_retried_and_marks_nobody_down(tokenizer):
    generation, clients, view, _ = await make_generation(tokenizer)

    async def failing_prefill(address, request_id, request, timeout_s):
        clients.prefill_calls.append((address, request_id))
        raise RouterError("prefill worker could not load the KV cache (unreachable): x", ErrorKind.KV_LOAD_FAILED)

    clients.prefill = failing_prefill
    with pytest.raises(RouterError) as info:
        await run(generation)
    assert info.value.kind is ErrorKind.KV_LOAD_FAILED
    assert len(clients.prefill_calls) == 1 and clients.decode_calls == []
    assert addresses(view, "prefill") == ["prefill:0", "prefill:1"]
