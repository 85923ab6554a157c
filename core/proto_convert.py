"""Conversions between ``tandem.v1`` messages and core domain types, for servicers and clients."""

from __future__ import annotations

from core.block_key import BlockKey
from core.sampling_params import SamplingParams
from tandem.v1 import common_pb2


def sampling_params_from_proto(msg: common_pb2.SamplingParams, default_temperature: float = 1.0) -> SamplingParams:
    """Builds validated SamplingParams; unset optional fields take their defaults.

    Raises:
        ValueError: a field is out of range (see SamplingParams).
    """
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else default_temperature,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else 16,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
    )


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


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
