"""Conversions between ``tandem.v1`` messages and core domain types, for servicers and clients."""

from __future__ import annotations

from collections.abc import MutableSequence, Sequence
from typing import Any

from core.block_key import BlockKey
from core.request import FinishReason
from core.sampling_params import SAMPLING_FIELDS, SamplingParams
from core.structured_output import StructuredOutputSpec
from core.worker_load import WorkerLoad
from tandem.v1 import common_pb2, prefill_worker_pb2

_FINISH_REASON_TO_PROTO = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}
_FINISH_REASON_FROM_PROTO = {v: k for k, v in _FINISH_REASON_TO_PROTO.items()}


def finish_reason_to_proto(reason: FinishReason) -> common_pb2.FinishReason:
    return _FINISH_REASON_TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> FinishReason:
    """The wire value's reason; UNSPECIFIED or a value this build does not know reads as ABORT
    (the request ended, for no reason this router can name)."""
    return _FINISH_REASON_FROM_PROTO.get(value, FinishReason.ABORT)


# An unset optional field means SamplingParams' default, except where the wire says otherwise
# (common.proto): a gRPC caller that names no temperature gets greedy sampling.
WIRE_DEFAULTS: dict[str, Any] = {"temperature": 0.0}


def structured_output_from_proto(msg: common_pb2.StructuredOutput) -> StructuredOutputSpec:
    """Raises StructuredOutputError (a ValueError) for an unknown kind or a bad value."""
    return StructuredOutputSpec(msg.kind, msg.value, msg.strict)


def structured_output_to_proto(spec: StructuredOutputSpec) -> common_pb2.StructuredOutput:
    return common_pb2.StructuredOutput(kind=spec.kind, value=spec.value, strict=spec.strict)


# SamplingParams fields that are messages on the wire: name -> (from_proto, to_proto).
_MESSAGE_FIELDS = {"structured_outputs": (structured_output_from_proto, structured_output_to_proto)}


def sampling_fields_from_proto(msg: common_pb2.SamplingParams) -> dict[str, Any]:
    """Each SamplingParams field as ``msg`` carries it, by name, unchecked: an unset optional
    field is its WIRE_DEFAULTS value or None (SamplingParams' default), a repeated one a tuple."""
    fields: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        value = getattr(msg, name)
        if name in _MESSAGE_FIELDS:
            fields[name] = _MESSAGE_FIELDS[name][0](value) if msg.HasField(name) else None
        elif isinstance(value, MutableSequence):  # a repeated field
            fields[name] = tuple(value)
        elif msg.DESCRIPTOR.fields_by_name[name].has_presence and not msg.HasField(name):
            fields[name] = WIRE_DEFAULTS.get(name)
        else:
            fields[name] = value
    return fields


def sampling_params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Builds validated SamplingParams (see sampling_fields_from_proto for unset fields).

    Raises:
        SamplingParamsError: a field is out of range (a ValueError; see SamplingParams).
    """
    return SamplingParams.from_optional(**sampling_fields_from_proto(msg))


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Every field set, a None (no seed, no logprobs) left unset."""
    return common_pb2.SamplingParams(**{
        name: _MESSAGE_FIELDS[name][1](value) if name in _MESSAGE_FIELDS else value
        for name in SAMPLING_FIELDS if (value := getattr(params, name)) is not None
    })


def token_logprob_to_proto(
    token_id: int, logprob: float, top_logprobs: Sequence[tuple[int, float]] = ()
) -> common_pb2.TokenLogprob:
    """A sampled token's log-probability (engine ``SampledToken`` fields) as the wire message."""
    return common_pb2.TokenLogprob(
        token_id=token_id,
        logprob=logprob,
        top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top_logprobs],
    )


def token_logprob_from_proto(msg: common_pb2.TokenLogprob) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    """``(token_id, logprob, top_logprobs)`` of a wire message."""
    return msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top_logprobs)


def block_key_to_proto(key: BlockKey) -> common_pb2.BlockKey:
    if key.is_scoped:
        return common_pb2.BlockKey(
            spec_fingerprint=key.spec_fingerprint,
            scoped=common_pb2.ScopedBlockId(request_id=key.request_id, block_index=key.block_index),
        )
    return common_pb2.BlockKey(spec_fingerprint=key.spec_fingerprint, block_hash=key.block_hash)


def block_key_from_proto(msg: common_pb2.BlockKey) -> BlockKey:
    """Raises ValueError when the key names neither a hash nor a scoped block."""
    which = msg.WhichOneof("id")
    if which == "block_hash":
        return BlockKey.content(msg.spec_fingerprint, msg.block_hash)
    if which == "scoped":
        return BlockKey.scoped(msg.spec_fingerprint, msg.scoped.request_id, msg.scoped.block_index)
    raise ValueError("BlockKey has neither block_hash nor scoped id")


def worker_stats_to_proto(load: WorkerLoad, num_prefill_tokens: int, num_cached_tokens: int,
                          num_generated_tokens: int) -> prefill_worker_pb2.GetWorkerStatsResponse:
    """A worker's GetStats reply: its load plus its lifetime token counters. Fields the load
    does not report (None) are sent as 0."""
    cost = load.cost_model
    return prefill_worker_pb2.GetWorkerStatsResponse(
        num_requests_running=load.num_requests_running,
        num_requests_waiting=load.num_requests_waiting,
        num_total_blocks=load.num_total_blocks,
        num_used_blocks=load.num_used_blocks,
        num_free_blocks=load.num_free_blocks or 0,
        num_prefill_tokens=num_prefill_tokens,
        num_cached_tokens=num_cached_tokens,
        num_generated_tokens=num_generated_tokens,
        num_batched_tokens=load.num_batched_tokens,
        num_waiting_tokens=load.num_waiting_tokens,
        num_kv_tokens=load.num_kv_tokens,
        recent_step_time_s=load.recent_step_time_s,
        max_num_seqs=load.max_num_seqs or 0,
        cost_base_s=cost.base_s,
        cost_per_token_s=cost.per_token_s,
        cost_per_seq_s=cost.per_seq_s,
        cost_per_attn_s=cost.per_attn_s,
        cost_num_samples=cost.num_samples,
        cost_max_num_batched_tokens=cost.max_num_batched_tokens,
        cost_kv_load_bytes_per_s=cost.kv_load_bytes_per_s,
        cost_kv_bytes_per_token=cost.kv_bytes_per_token,
    )
