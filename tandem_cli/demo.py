"""Sends real prompts concurrently to a running router and prints each answer with its timings."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class DemoResult:
    prompt: str
    text: str = ""
    ttft_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)
    finish_reason: str = ""
    error: str = ""

    @property
    def mean_tbt_s(self) -> float:
        gaps = [b - a for a, b in zip(self.token_times_s, self.token_times_s[1:])]
        return sum(gaps) / len(gaps) if gaps else 0.0


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> DemoResult:
    result = DemoResult(prompt)
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    start = time.monotonic()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"]
            if not choice:
                continue
            delta = choice[0].get("delta", {}).get("content") or ""
            if delta:
                now = time.monotonic() - start
                result.ttft_s = result.ttft_s or now
                result.token_times_s.append(now)
                result.text += delta
            result.finish_reason = choice[0].get("finish_reason") or result.finish_reason
    return result


async def run_demo(url: str, model: str, prompts: list[str], max_tokens: int) -> list[DemoResult]:
    """All prompts at once; returns results in prompt order."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        return await asyncio.gather(*(_one(client, url, model, p, max_tokens) for p in prompts))
