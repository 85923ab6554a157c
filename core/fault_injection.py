"""A fault-injecting gRPC server interceptor, for chaos runs and tests only.

Off unless the process starts with ``TANDEM_CHAOS_FAULT_FILE`` set (read once, in
:func:`interceptors_from_env`, by ``core.grpc_service.GrpcService``): production never sets it,
and without it no interceptor is installed at all. The file holds JSON that the chaos harness
rewrites while the service runs (re-read when its mtime changes)::

    {"rules": [{"methods": ["GetBlocks"], "mode": "corrupt", "probability": 1.0}]}

A rule applies to RPCs whose method name (``GetBlocks``, ``LocateBlocks``, ...; empty list: all
but ``Check``/``Watch`` of grpc.health) is listed, with ``probability`` (0-1, a seeded RNG):

- ``delay``: sleeps ``delay_s`` seconds before the handler runs (a slowed transfer);
- ``error``: aborts with ``code`` (a grpc.StatusCode name, default UNAVAILABLE) before the handler;
- ``truncate``: a streaming response ends after its first message (a cut-off transfer);
- ``corrupt``: flips one byte of every ``data`` field of the responses (checksums must catch it).

A missing or empty file means no faults. A malformed file is logged and treated as empty.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

log = logging.getLogger(__name__)

ENV_VAR = "TANDEM_CHAOS_FAULT_FILE"
MODES = ("delay", "error", "truncate", "corrupt")
_HEALTH_METHODS = frozenset({"Check", "Watch"})


@dataclass(frozen=True)
class FaultRule:
    """One fault; see the module docstring. Raises ValueError quoting a bad field."""

    mode: str
    methods: tuple[str, ...] = ()
    probability: float = 1.0
    delay_s: float = 0.0
    code: str = "UNAVAILABLE"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {self.probability!r}")
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s!r}")
        if self.code not in grpc.StatusCode.__members__:
            raise ValueError(f"code must be a grpc.StatusCode name, got {self.code!r}")

    @classmethod
    def from_dict(cls, data: dict) -> FaultRule:
        return cls(data.get("mode", ""), tuple(data.get("methods", ())), float(data.get("probability", 1.0)),
                   float(data.get("delay_s", 0.0)), str(data.get("code", "UNAVAILABLE")))

    def matches(self, method: str) -> bool:
        return method in self.methods if self.methods else method not in _HEALTH_METHODS


def write_rules(path: str, rules: list[FaultRule]) -> None:
    """Replaces the fault file atomically (the services re-read it on their next RPC)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"rules": [r.__dict__ | {"methods": list(r.methods)} for r in rules]}, f)
    os.replace(tmp, path)


class FaultFile:
    """The rules in ``path``, re-read when its mtime changes."""

    def __init__(self, path: str):
        self.path = path
        self._mtime_ns = -1
        self._rules: tuple[FaultRule, ...] = ()

    def rules(self) -> tuple[FaultRule, ...]:
        try:
            mtime_ns = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            self._mtime_ns, self._rules = -1, ()
            return ()
        if mtime_ns != self._mtime_ns:
            self._mtime_ns = mtime_ns
            try:
                with open(self.path) as f:
                    self._rules = tuple(FaultRule.from_dict(r) for r in (json.load(f) or {}).get("rules", []))
            except (OSError, ValueError, TypeError, AttributeError):
                log.warning("bad chaos fault file %s; no faults", self.path, exc_info=True)
                self._rules = ()
        return self._rules


def _corrupt(message):
    """A copy of ``message`` with the first byte of its ``data`` field flipped (if it has one)."""
    if "data" not in message.DESCRIPTOR.fields_by_name or not message.data:
        return message
    copy = type(message)()
    copy.CopyFrom(message)
    copy.data = bytes([copy.data[0] ^ 0xFF]) + copy.data[1:]
    return copy


class FaultInterceptor(grpc.aio.ServerInterceptor):
    """Applies the fault file's rules to unary and server-streaming RPCs."""

    def __init__(self, faults: FaultFile, seed: int = 0):
        self.faults = faults
        self.rng = random.Random(seed)
        self.num_injected = 0

    def _pick(self, method: str) -> list[FaultRule]:
        rules = [r for r in self.faults.rules() if r.matches(method) and self.rng.random() < r.probability]
        self.num_injected += len(rules)
        return rules

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler is None or not self.faults.rules():
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, method), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream, method), handler.request_deserializer, handler.response_serializer)
        return handler  # client-streaming RPCs (PutBlocks) are faulted through their peers' reads

    async def _before(self, rules: list[FaultRule], context) -> None:
        for rule in rules:
            if rule.mode == "delay":
                await asyncio.sleep(rule.delay_s)
            elif rule.mode == "error":
                await context.abort(grpc.StatusCode[rule.code], f"chaos: injected {rule.code}")

    def _unary(self, behavior, method: str):
        async def handle(request, context):
            rules = self._pick(method)
            await self._before(rules, context)
            response = await behavior(request, context)
            return _corrupt(response) if any(r.mode == "corrupt" for r in rules) else response

        return handle

    def _stream(self, behavior, method: str):
        async def handle(request, context) -> AsyncIterator:
            rules = self._pick(method)
            await self._before(rules, context)
            corrupt = any(r.mode == "corrupt" for r in rules)
            truncate = any(r.mode == "truncate" for r in rules)
            async for response in behavior(request, context):
                yield _corrupt(response) if corrupt else response
                if truncate:
                    return

        return handle


def interceptors_from_env() -> list[grpc.aio.ServerInterceptor]:
    """``[FaultInterceptor]`` when ``TANDEM_CHAOS_FAULT_FILE`` is set, else ``[]`` (production)."""
    path = os.environ.get(ENV_VAR, "")
    if not path:
        return []
    log.warning("chaos fault injection is ON (fault file %s)", path)
    return [FaultInterceptor(FaultFile(path), seed=os.getpid())]
