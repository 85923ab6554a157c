"""How a request reaches a decode worker: the checks of a resumed request's outputs and of the
three ways' pieces (engine.kv_connector.decode_start)."""

from __future__ import annotations

import pytest

from core.block_key import BlockKey
from core.kv_cache_spec import KVCacheSpec
from core.request import FinishReason
from engine.kv_connector import DecodeStart, KVConnector, Manifest, PoolLocator
from engine.kv_connector.decode_start import append_outputs
from tests.factories import make_request


def test_resumed_outputs_count_toward_max_tokens():
    request = make_request(5, max_tokens=4)
    append_outputs(request, [10, 11, 12])
    assert request.output_token_ids == [10, 11, 12] and not request.is_finished


def test_outputs_ending_exactly_at_max_tokens_finish_the_request():
    request = make_request(5, max_tokens=2)
    append_outputs(request, [10, 11])
    assert request.finish_reason is FinishReason.LENGTH  # the servicer answers Finished at once


@pytest.mark.parametrize(("max_tokens", "outputs", "reason"), [
    (2, [10, 11, 12], "length"),  # one token past max_tokens
    (8, [10, 2, 12], "stop"),  # a token after EOS
])
def test_outputs_running_past_the_end_are_refused(max_tokens, outputs, reason):
    with pytest.raises(ValueError) as info:
        append_outputs(make_request(5, max_tokens=max_tokens), outputs)
    assert str(info.value) == f"output_token_ids end the request at index 1 of 3 ({reason})"


SPEC = KVCacheSpec("m", "r", "float32", 2, 2, 8, 4)  # 4 tokens a block, as make_request's prompts need


def _manifest(num_tokens: int) -> Manifest:
    keys = [BlockKey.content(SPEC.fingerprint, i + 1) for i in range(-(-num_tokens // SPEC.block_size))]
    return Manifest(SPEC.fingerprint, "127.0.0.1:1", keys, num_tokens)


@pytest.mark.parametrize(("start", "message"), [
    (DecodeStart(manifest=_manifest(8)), "first_token_id and manifest come together"),
    (DecodeStart(first_token_id=5), "first_token_id and manifest come together"),
    (DecodeStart(_manifest(8), 5, (6, 7)), "output_token_ids resume a request"),
    (DecodeStart(_manifest(9), 5), "manifest covers 9 tokens, prompt has 8"),
])
def test_pieces_that_fit_none_of_the_three_ways_are_refused(start, message):
    with pytest.raises(ValueError, match=message):
        start.validate(SPEC, 8)


class _ReleaseLog:
    """Stands in for PoolIO: records releases; any load would fail the test."""

    def __init__(self):
        self.released: list[str] = []

    async def release(self, ring, request_id: str) -> None:
        self.released.append(request_id)


def _connector() -> tuple[KVConnector, _ReleaseLog]:
    io = _ReleaseLog()
    return KVConnector(SPEC, PoolLocator(None, "", "grpc"), io=io), io


async def test_a_first_token_that_ends_the_request_releases_the_manifest_once_and_loads_nothing():
    connector, io = _connector()
    request = make_request(8, max_tokens=1)
    assert await connector.load_for_decode(request, DecodeStart(_manifest(8), 5)) is None
    assert request.finish_reason is FinishReason.LENGTH and request.output_token_ids == [5]
    assert io.released == [request.request_id] and connector.num_releases == 1


async def test_a_refused_manifest_is_released_and_colocated_or_finished_resumed_requests_take_nothing():
    connector, io = _connector()
    request = make_request(8, max_tokens=2)
    with pytest.raises(ValueError, match="manifest covers 4 tokens"):
        await connector.load_for_decode(request, DecodeStart(_manifest(4), 5))
    await connector.refuse(request.request_id, DecodeStart(_manifest(4), 5))
    assert io.released == [request.request_id]
    assert await connector.load_for_decode(make_request(8), DecodeStart()) is None  # colocated: the engine prefills
    finished = make_request(8, max_tokens=2)
    assert await connector.load_for_decode(finished, DecodeStart(output_token_ids=(10, 11))) is None
    assert finished.is_finished and io.released == [request.request_id] and connector.num_releases == 1
