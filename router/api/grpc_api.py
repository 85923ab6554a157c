"""The ``tandem.v1.Router`` gRPC servicer: converts messages and delegates to generation.

Errors end the RPC with a status: bad input INVALID_ARGUMENT, unknown model NOT_FOUND, worker
overload RESOURCE_EXHAUSTED, no healthy worker or a worker failure UNAVAILABLE (also mid-stream,
after some deltas were sent), a router shutting down UNAVAILABLE "router shutting down" (new
requests at once, running ones after the grace period; router.shutdown). Absent ``temperature``
means greedy here (0), unlike OpenAI's 1.0.
With ``n`` > 1 the choices' events interleave, each carrying its ``index``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import grpc

from core.proto_convert import finish_reason_to_proto, sampling_fields_from_proto, token_logprob_to_proto
from router.errors import RouterError
from router.api.choices import ChoiceEvent, generate_choices
from router.generation import Finished, Generation
from router.metrics import RouterMetrics
from router.api.request_ids import client_request_id
from core.structured_output import StructuredOutputError
from router.api.validation import InvalidRequestError, RequestInput, Validator, name_structured_param
from tandem.v1 import router_pb2, router_pb2_grpc

SERVICE_NAME = "tandem.v1.Router"
STRUCTURED_PARAM = "sampling_params.structured_outputs"


def request_input_from_proto(msg: router_pb2.GenerateRequest) -> RequestInput:
    """The request's fields as the validator takes them; unset optionals take gRPC defaults
    (core.proto_convert.WIRE_DEFAULTS: greedy unless a temperature is sent)."""
    prompt = msg.WhichOneof("prompt")
    try:
        sampling = sampling_fields_from_proto(msg.sampling_params)
    except StructuredOutputError as err:
        raise InvalidRequestError(f"{STRUCTURED_PARAM}: {err}", STRUCTURED_PARAM) from None
    return RequestInput(
        model=msg.model or None,
        prompt=msg.text if prompt == "text" else None,
        prompt_token_ids=tuple(msg.token_ids.ids) if prompt == "token_ids" else None,
        messages=tuple({"role": m.role, "content": m.content} for m in msg.chat.messages) if prompt == "chat" else None,
        sampling=sampling,
        stop=tuple(msg.stop),
        n=msg.n or 1,
        structured_param=STRUCTURED_PARAM if msg.sampling_params.HasField("structured_outputs") else None,
    )


def response_to_proto(choice: ChoiceEvent, request_id: str) -> router_pb2.GenerateResponse:
    event = choice.event
    if isinstance(event, Finished):
        usage = router_pb2.Usage(
            prompt_tokens=event.usage.prompt_tokens,
            completion_tokens=event.usage.completion_tokens,
            cached_tokens=event.usage.cached_tokens,
        )
        finished = router_pb2.GenerateFinished(
            finish_reason=finish_reason_to_proto(event.finish_reason), usage=usage, request_id=request_id, ttft_s=event.ttft_s,
            index=choice.index,
        )
        return router_pb2.GenerateResponse(finished=finished)
    logprobs = [token_logprob_to_proto(lp.token_id, lp.logprob, lp.top_logprobs) for lp in event.logprobs]
    prompt = [token_logprob_to_proto(lp.token_id, lp.logprob, lp.top_logprobs) for lp in event.prompt_logprobs]
    delta = router_pb2.TextDelta(text=event.text, token_ids=event.token_ids, logprobs=logprobs, index=choice.index,
                                 prompt_logprobs=prompt)
    return router_pb2.GenerateResponse(delta=delta)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, validator: Validator, generation: Generation, metrics: RouterMetrics):
        self.validator, self.generation, self.metrics = validator, generation, metrics

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        arrival_time_s = time.monotonic()
        try:
            request_id = client_request_id(request.request_id, "request_id", "gen-")  # traced, never a key
            validated = await self.validator.validate_async(request_input_from_proto(request))
        except InvalidRequestError as err:
            self.metrics.rejected(err.kind.value)
            await context.abort(err.grpc_code, err.message)
        events = generate_choices(self.generation, request_id, [validated], arrival_time_s)
        async with contextlib.aclosing(events):
            try:
                async for event in events:
                    yield response_to_proto(event, request_id)
            except RouterError as err:
                name_structured_param(err, validated)
                if err.retry_after is not None:  # SLO admission: when to come back
                    context.set_trailing_metadata(err.grpc_trailing_metadata())
                await context.abort(err.grpc_code, err.message)
