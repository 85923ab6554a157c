"""Who releases a request's pool state, path by path (engine/kv_connector/connector.py): the real
prefill and decode servicers and their KV connectors against a real pool process, with a
stand-in engine (it copies the KV it is given into a small paged cache, as the real one does, and
answers with fixed tokens). After every path the pool is back at idle (no lease, no leased,
scoped or writing block; exactly the prompt's full blocks stored) and the request was released
exactly once, by the one connector that held it — for a manifest never delivered, by the decode
connector the router drops it at (DropManifest), or by the pool's own lease deadline when no
worker is left to drop it at.
"""

from __future__ import annotations

import asyncio
import collections
import uuid

import grpc
import pytest
import torch

from core.kv_cache_spec import KVCacheSpec
from core.pool_client import PoolClient
from core.proto_convert import sampling_params_to_proto
from core.request import FinishReason
from core.sampling_params import SamplingParams
from decode_worker.servicer import DecodeServicer
from engine.kv_connector import KVConnector, PoolIO, PoolLocator, unpack_blocks
from engine.outputs import ExternalKV, RequestOutput
from prefill_worker.servicer import PrefillServicer
from tandem.v1 import decode_worker_pb2, prefill_worker_pb2
from tests.conftest import poll_until
from tests.integration.test_kv_pool_server import start_pool  # noqa: F401

BLOCK_SIZE = 16
PROMPT = list(range(3, 3 + 2 * BLOCK_SIZE + 5))  # 37 tokens: 2 full blocks and a tail
EOS = 2
DECODE_TOKENS = [6, 7, 8]


def make_spec() -> KVCacheSpec:
    return KVCacheSpec(f"m-{uuid.uuid4().hex[:8]}", "r", "float32", 2, 2, 8, BLOCK_SIZE)  # 4 KiB blocks


@pytest.fixture(scope="module")
def pool(start_pool):
    return start_pool(64 * 4096)


class CountingPoolIO(PoolIO):
    """PoolIO that counts the ReleaseRequest fan-outs it sends, per request id."""

    def __init__(self, spec, releases: collections.Counter, **kwargs):
        super().__init__(spec, **kwargs)
        self.releases = releases

    def _release(self, ring, request_id):
        self.releases[request_id] += 1
        super()._release(ring, request_id)


class FakeEngine:
    """What the servicers use of AsyncEngine. A prefill (max_tokens 1) answers token 5 with the
    prompt's blocks packed; a decode answers DECODE_TOKENS. External KV is copied into a paged
    cache first (which lets go of shm views, as the real model runner does)."""

    def __init__(self, spec: KVCacheSpec):
        self.spec, self.eos_token_id = spec, EOS
        self.kv_cache = torch.zeros(2, 2, 8, BLOCK_SIZE, 2, 8)
        self.external: list = []
        self.fail_with: BaseException | None = None
        self.notified: list[bool] = []  # notify_start of each generate call

    async def generate(self, request, external_kv, notify_start=False):
        self.external.append(external_kv)
        self.notified.append(notify_start)
        if external_kv is not None:
            unpack_blocks(self.kv_cache, list(range(len(external_kv.payloads))), external_kv.payloads)
        if self.fail_with is not None:
            raise self.fail_with
        if request.sampling_params.max_tokens == 1:
            request.append_output_token(5)
            num_blocks = -(-request.num_prompt_tokens // BLOCK_SIZE)
            saved = [bytes([i + 1]) * self.spec.block_bytes for i in range(num_blocks)]
            yield RequestOutput(request.request_id, [5], True, FinishReason.LENGTH, saved_kv=saved)
            return
        if notify_start:
            yield RequestOutput(request.request_id, [], started=True)
        for token_id in DECODE_TOKENS:
            request.append_output_token(token_id)
            yield RequestOutput(request.request_id, [token_id], request.is_finished, request.finish_reason)
            if request.is_finished:
                return

    def abort(self, request_id: str) -> bool:
        return False


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self):
        self.code = None

    async def abort(self, code, details, trailing_metadata=()):
        self.code = code
        raise Aborted(details)

    def add_done_callback(self, callback) -> None:
        pass


class Worker:
    """A worker's servicer, connector and engine, releases counted in ``releases``."""

    def __init__(self, role: str, pool_address: str, spec: KVCacheSpec, releases, lease_ttl_s: float = 30.0):
        io = CountingPoolIO(spec, releases, transfer="grpc", lease_ttl_s=lease_ttl_s, verify_checksums=True)
        self.connector = KVConnector(spec, PoolLocator(None, pool_address, "grpc"), io)
        self.engine = FakeEngine(spec)
        servicer_type = PrefillServicer if role == "prefill" else DecodeServicer
        self.servicer = servicer_type(self.engine, self.connector)


class Cluster:
    def __init__(self, pool_address: str, lease_ttl_s: float = 30.0):
        self.spec = make_spec()
        self.releases: collections.Counter = collections.Counter()
        self.prefill = Worker("prefill", pool_address, self.spec, self.releases, lease_ttl_s)
        self.decode = Worker("decode", pool_address, self.spec, self.releases)
        self.client = PoolClient(pool_address, timeout_s=30)

    def close(self) -> None:
        self.prefill.connector.close()
        self.decode.connector.close()
        self.client.close()

    def prefill_request(self, rid: str, max_tokens: int = len(DECODE_TOKENS) + 1) -> prefill_worker_pb2.PrefillRequest:
        params = sampling_params_to_proto(SamplingParams(temperature=0.0, max_tokens=max_tokens))
        return prefill_worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=PROMPT, sampling_params=params)

    def decode_request(self, rid: str, prefill=None, output_token_ids=()) -> decode_worker_pb2.DecodeRequest:
        params = sampling_params_to_proto(SamplingParams(temperature=0.0, max_tokens=len(DECODE_TOKENS) + 1))
        message = decode_worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=PROMPT, sampling_params=params,
                                                  output_token_ids=list(output_token_ids))
        if prefill is not None:
            message.first_token_id = prefill.first_token_id
            message.manifest.CopyFrom(prefill.manifest)
        return message

    async def run_prefill(self, rid: str, context=None, max_tokens: int = len(DECODE_TOKENS) + 1):
        return await self.prefill.servicer.Prefill(self.prefill_request(rid, max_tokens), context or FakeContext())

    async def run_decode(self, message, context=None, max_responses: int | None = None) -> list:
        responses = []
        stream = self.decode.servicer.Decode(message, context or FakeContext())
        try:
            async for response in stream:
                responses.append(response)
                if max_responses is not None and len(responses) == max_responses:
                    break  # the client went away: the stream is closed here
        finally:
            await stream.aclose()
        return responses

    def pool_state(self) -> tuple[int, int, int, int, int]:
        """(leases, leased, scoped, writing, stored) blocks in the pool."""
        s = self.client.stats()
        return (s["num_leases"], s["num_leased_blocks"], s["num_scoped_blocks"], s["num_writing_blocks"],
                s["num_stored_blocks"])

    def assert_idle(self, num_stored: int) -> None:
        assert self.pool_state() == (0, 0, 0, 0, num_stored)


@pytest.fixture
def cluster(pool):
    c = Cluster(pool.address)
    c.baseline = c.pool_state()[4]  # stored blocks of earlier tests (other specs)
    yield c
    c.close()


def stored(cluster: Cluster, n: int) -> int:
    return cluster.baseline + n


def test_finish_the_decode_connector_releases_once_after_loading(cluster):
    prefill = asyncio.run(cluster.run_prefill("req-finish"))
    # Handed off: 2 full blocks stored and the scoped tail, all 3 leased to the request, not released.
    assert cluster.pool_state() == (1, 3, 1, 0, stored(cluster, 2))
    assert cluster.releases == {} and prefill.manifest.pool_address
    responses = asyncio.run(cluster.run_decode(cluster.decode_request("req-finish", prefill)))
    # A handed-over request: told started (the router releases the first token on it), then its tokens.
    assert cluster.decode.engine.notified == [True] and responses[0].WhichOneof("event") == "started"
    assert [r.tokens.token_ids[0] for r in responses[1:-1]] == DECODE_TOKENS
    assert responses[-1].finished.num_output_tokens == 1 + len(DECODE_TOKENS)
    assert cluster.decode.engine.external[0].num_tokens == len(PROMPT)  # every block came from the pool
    assert cluster.releases == {"req-finish": 1}
    assert (cluster.prefill.connector.num_releases, cluster.decode.connector.num_releases) == (0, 1)
    cluster.assert_idle(stored(cluster, 2))  # the content blocks stay, readable; the tail is gone


def test_abort_during_prefill_the_prefill_connector_releases_once(cluster):
    asyncio.run(cluster.run_decode(cluster.decode_request("warm", asyncio.run(cluster.run_prefill("warm")))))
    cluster.releases.clear()
    cluster.prefill.engine.fail_with = asyncio.CancelledError()  # the router cancelled the RPC
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cluster.run_prefill("req-abort"))
    assert cluster.prefill.engine.external[-1].num_tokens == 2 * BLOCK_SIZE  # it had leased the cached prefix
    assert cluster.releases == {"req-abort": 1}
    cluster.assert_idle(stored(cluster, 2))


def test_abort_during_decode_is_not_released_again(cluster):
    prefill = asyncio.run(cluster.run_prefill("req-gone"))
    responses = asyncio.run(cluster.run_decode(cluster.decode_request("req-gone", prefill), max_responses=1))
    assert len(responses) == 1  # the client left after the started event
    assert cluster.releases == {"req-gone": 1}
    cluster.assert_idle(stored(cluster, 2))


def test_failure_refused_prefill_releases_once(cluster):
    cluster.prefill.engine.fail_with = ValueError("token ids outside the vocabulary")
    context = FakeContext()
    with pytest.raises(Aborted):
        asyncio.run(cluster.run_prefill("req-refused", context))
    assert context.code is grpc.StatusCode.INVALID_ARGUMENT
    assert cluster.releases == {"req-refused": 1}
    cluster.assert_idle(stored(cluster, 0))


def test_failure_refused_manifest_is_released_by_the_decode_connector(cluster):
    prefill = asyncio.run(cluster.run_prefill("req-badspec"))
    prefill.manifest.spec_fingerprint = "another-spec"
    context = FakeContext()
    with pytest.raises(Aborted):
        asyncio.run(cluster.run_decode(cluster.decode_request("req-badspec", prefill), context))
    assert context.code is grpc.StatusCode.INVALID_ARGUMENT
    assert cluster.decode.engine.external == []  # nothing loaded
    assert cluster.releases == {"req-badspec": 1}
    cluster.assert_idle(stored(cluster, 2))


def test_finish_on_the_first_token_releases_without_loading(cluster):
    prefill = asyncio.run(cluster.run_prefill("req-eos"))
    prefill.first_token_id = EOS
    responses = asyncio.run(cluster.run_decode(cluster.decode_request("req-eos", prefill)))
    assert len(responses) == 1 and responses[0].HasField("finished")
    assert responses[0].finished.num_output_tokens == 1 and cluster.decode.engine.external == []
    assert cluster.releases == {"req-eos": 1}
    cluster.assert_idle(stored(cluster, 2))


def test_finish_at_the_first_token_the_prefill_connector_releases_once(cluster):
    """max_tokens 1: the router streams the first token and sends no Decode."""
    prefill = asyncio.run(cluster.run_prefill("req-one", max_tokens=1))
    assert prefill.first_token_id == 5
    assert cluster.releases == {"req-one": 1} and cluster.prefill.connector.num_releases == 1
    cluster.assert_idle(stored(cluster, 2))


def test_migration_the_resumed_attempt_leases_loads_and_releases_once(cluster):
    prefill = asyncio.run(cluster.run_prefill("req-a1"))
    asyncio.run(cluster.run_decode(cluster.decode_request("req-a1", prefill), max_responses=1))  # then it died
    cluster.releases.clear()
    resumed = cluster.decode_request("req-a2", output_token_ids=[5, DECODE_TOKENS[0]])
    responses = asyncio.run(cluster.run_decode(resumed))
    assert len(responses) == 3 and responses[-1].finished.num_output_tokens == 4  # 2 more tokens, Finished
    assert cluster.decode.engine.external[-1].num_tokens == 2 * BLOCK_SIZE  # the stored full blocks
    assert cluster.releases == {"req-a2": 1}
    cluster.assert_idle(stored(cluster, 2))


def drop_manifest(cluster: Cluster, rid: str, prefill) -> bool:
    request = decode_worker_pb2.DropManifestRequest(request_id=rid, manifest=prefill.manifest)
    return asyncio.run(cluster.decode.servicer.DropManifest(request, FakeContext())).released


def test_undelivered_manifest_dropped_by_the_router_the_decode_connector_releases_once(cluster):
    """The client left before the router sent the manifest on, or its Decode was cancelled before
    the (hung) decode worker ran it: DropManifest releases it at once, not the lease deadline."""
    prefill = asyncio.run(cluster.run_prefill("req-dropped"))
    assert cluster.pool_state() == (1, 3, 1, 0, stored(cluster, 2))  # handed off, held by nobody yet
    assert drop_manifest(cluster, "req-dropped", prefill) is True
    assert cluster.releases == {"req-dropped": 1} and cluster.decode.connector.num_releases == 1
    cluster.assert_idle(stored(cluster, 2))
    assert drop_manifest(cluster, "req-dropped", prefill) is False  # settled once
    context = FakeContext()  # the cancelled Decode reaches the worker after all: refused, not loaded
    with pytest.raises(Aborted):
        asyncio.run(cluster.run_decode(cluster.decode_request("req-dropped", prefill), context))
    assert context.code is grpc.StatusCode.INVALID_ARGUMENT and cluster.decode.engine.external == []
    assert cluster.releases == {"req-dropped": 1}
    cluster.assert_idle(stored(cluster, 2))


def test_drop_after_the_decode_took_the_manifest_over_is_a_no_op(cluster):
    """The router could not tell the Decode reached the worker (cancelled before its first
    answer): the Decode's own release stands, DropManifest releases nothing."""
    prefill = asyncio.run(cluster.run_prefill("req-taken"))
    asyncio.run(cluster.run_decode(cluster.decode_request("req-taken", prefill)))
    assert drop_manifest(cluster, "req-taken", prefill) is False
    assert cluster.releases == {"req-taken": 1} and cluster.decode.connector.num_releases == 1
    cluster.assert_idle(stored(cluster, 2))


@pytest.fixture(scope="module")
def short_lease_pool(start_pool):
    """A pool whose scoped blocks live 1 s without a release (the default is 60 s)."""
    return start_pool(64 * 4096, "--lease-ttl-s", "1")


def test_handoff_never_delivered_ends_by_the_pools_lease_deadline(short_lease_pool):
    cluster = Cluster(short_lease_pool.address, lease_ttl_s=1.0)
    try:
        baseline = cluster.pool_state()[4]
        asyncio.run(cluster.run_prefill("req-orphan"))  # answered; the router (or its decode worker) died
        assert cluster.pool_state() == (1, 3, 1, 0, baseline + 2)
        poll_until(lambda: cluster.pool_state() == (0, 0, 0, 0, baseline + 2), timeout_s=15,
                   message="the orphaned request's leases and scoped tail expired")
        assert cluster.releases == {}  # nobody released: the deadline did
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def second_pool(start_pool):
    return start_pool(64 * 4096)


@pytest.mark.parametrize("transfer", ["grpc", "shm"])
def test_swap_goes_through_the_ring_checksummed_and_is_released_once_back(pool, second_pool, transfer):
    """Swap out / swap in through the connector: the victim's blocks spread over both pool nodes
    under ``<id>#swap``, verified on the way back, and released once they are in the KV cache."""
    spec = make_spec()
    ring_nodes = {pool.address: pool.address, second_pool.address: second_pool.address}
    releases: collections.Counter = collections.Counter()
    io = CountingPoolIO(spec, releases, transfer=transfer, verify_checksums=True)
    connector = KVConnector(spec, PoolLocator(None, ",".join(ring_nodes), transfer), io)
    clients = [PoolClient(a, timeout_s=30) for a in ring_nodes]
    scoped = lambda: [c.stats()["num_scoped_blocks"] for c in clients]  # noqa: E731
    try:
        swap = connector.swap_space()
        assert sorted(swap.ring.addresses) == sorted(ring_nodes)  # every node, not the first one only
        payloads = [bytes([i + 1]) * spec.block_bytes for i in range(6)]
        assert swap.put("victim", ExternalKV(5 * BLOCK_SIZE + 3, payloads))
        # Each block on the node the ring names for its key (the ring's ports are random, so how
        # many land on each node varies from run to run; the placement must follow the ring).
        owners = collections.Counter(swap.ring.address_for(k) for k in swap._keys("victim", 6))
        assert scoped() == [owners[a] for a in ring_nodes] and sum(scoped()) == 6
        kv = swap.take("victim")
        assert kv.num_tokens == 5 * BLOCK_SIZE + 3 and [bytes(p) for p in kv.payloads] == payloads
        cache = torch.zeros(2, 2, 8, BLOCK_SIZE, 2, 8)
        unpack_blocks(cache, list(range(6)), kv.payloads)  # the engine's copy lets go of shm views
        poll_until(lambda: scoped() == [0, 0], timeout_s=10, message="swap blocks released")
        assert releases == {"victim#swap": 1} and swap.take("victim") is None
        assert swap.put("other", ExternalKV(BLOCK_SIZE, payloads[:1]))
        swap.discard("other")  # finished or aborted while swapped out
        assert scoped() == [0, 0] and releases["other#swap"] == 1
        for client in clients:
            s = client.stats()
            assert (s["num_leases"], s["num_leased_blocks"], s["num_writing_blocks"]) == (0, 0, 0)
    finally:
        connector.close()
        for client in clients:
            client.close()
