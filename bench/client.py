"""One streaming request against an OpenAI-compatible endpoint, timed chunk by chunk.

Token-id prompts go to ``/v1/completions`` (exact lengths); text prompts to
``/v1/chat/completions``. Timing: TTFT is the arrival of the first chunk carrying non-empty text;
every later non-empty chunk adds one inter-token gap (TBT). A server that holds back bytes (an
incomplete UTF-8 character) may put two tokens in one chunk: then one gap covers both, and token
counts come from the final ``usage`` chunk, not from the chunks.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from bench.workloads import BenchRequest


@dataclass(frozen=True)
class ClientConfig:
    url: str  # base URL without /v1, e.g. http://127.0.0.1:8000
    model: str
    ignore_eos: bool = False  # send ignore_eos (vLLM/Tandem extension) so outputs run to max_tokens
    temperature: float = 0.0
    timeout_s: float = 600.0
    api_key: str = ""

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")


@dataclass
class RequestRecord:
    index: int  # position in the workload
    start_s: float  # send time, seconds after the run started
    ttft_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # non-empty chunks, s after start_s
    e2e_s: float | None = None
    prompt_tokens: int = 0  # from usage (0 if the server sent none)
    output_tokens: int = 0  # from usage, else the number of non-empty chunks
    finish_reason: str = ""
    error_kind: str = ""  # "" ok; http_<status>; an exception class name; stream_error; incomplete
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error_kind

    @property
    def gaps_s(self) -> list[float]:
        """Inter-token gaps (TBT), in order."""
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]


def request_body(request: BenchRequest, config: ClientConfig) -> tuple[str, dict]:
    """(path, JSON body) of one streaming request."""
    body: dict = {"model": config.model, "max_tokens": request.max_tokens, "temperature": config.temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if config.ignore_eos:
        body["ignore_eos"] = True
    if isinstance(request.prompt, str):
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": request.prompt}]}
    return "/v1/completions", {**body, "prompt": request.prompt}


async def send(http: httpx.AsyncClient, config: ClientConfig, request: BenchRequest, index: int,
               run_start_s: float) -> RequestRecord:
    """Sends one request and records its timings; never raises for a failed request."""
    path, body = request_body(request, config)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    start = time.perf_counter()
    record = RequestRecord(index, start - run_start_s)
    try:
        async with http.stream("POST", config.url.rstrip("/") + path, json=body, headers=headers,
                               timeout=config.timeout_s) as response:
            if response.status_code != 200:
                record.error_kind = f"http_{response.status_code}"
                record.error = (await response.aread()).decode(errors="replace")[:300]
                return record
            async for line in response.aiter_lines():
                if _on_line(record, line, time.perf_counter() - start):
                    break
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as err:
        record.error_kind, record.error = type(err).__name__, str(err)[:300]
        return record
    record.e2e_s = time.perf_counter() - start
    if not record.error_kind and not record.finish_reason:
        record.error_kind, record.error = "incomplete", "stream ended without a finish_reason"
    record.output_tokens = record.output_tokens or len(record.chunk_times_s)
    return record


def _on_line(record: RequestRecord, line: str, now_s: float) -> bool:
    """Folds one SSE line into ``record`` (mutates it); True at the end of the stream."""
    if not line.startswith("data:"):
        return False
    data = line[5:].strip()
    if data == "[DONE]":
        return True
    payload = json.loads(data)
    if "error" in payload:
        record.error_kind, record.error = "stream_error", json.dumps(payload["error"])[:300]
        return True
    if payload.get("usage"):
        record.prompt_tokens = payload["usage"].get("prompt_tokens", 0)
        record.output_tokens = payload["usage"].get("completion_tokens", 0)
    for choice in payload.get("choices") or []:
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            if record.ttft_s is None:
                record.ttft_s = now_s
            record.chunk_times_s.append(now_s)
        record.finish_reason = choice.get("finish_reason") or record.finish_reason
    return False
