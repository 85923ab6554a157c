"""Iteration-level Scheduler (Orca) with a token budget (Sarathi-Serve) over a paged KV cache.

Every step: running requests first (decodes, continuing prompt chunks), then waiting requests
admitted while the token budget, ``max_num_seqs`` and free blocks allow. A request that cannot get
a block preempts a running request (:class:`PreemptionPolicy`: the victim, and whether its KV is
swapped out or recomputed; its output is unchanged either way).

The scheduler does no I/O: swapped-out KV comes back through the engine before ``schedule()``
(:meth:`Scheduler.swap_in_candidates`, :meth:`Scheduler.resume_swapped`), and a swapped request
is admitted only once its KV is resident. Its output, :class:`SchedulerOutput`, is plain data
copied from the requests (ids, token ids, positions, block ids, sampling inputs).
"""

from __future__ import annotations

import itertools
from collections import deque

from core.request import FinishReason, Request, RequestStatus
from engine.config import EngineConfig
from engine.batching_policy import make_batching_policy
from engine.kv_cache.kv_cache_manager import KVCacheManager, PrefixHit
from engine.outputs import (
    PLACEHOLDER_TOKEN_ID, ExternalKV, KVLoad, ModelRunnerOutput, PromptLogprobsInput, RequestOutput, SampledToken,
    SamplingInput, ScheduledRequest, SchedulerOutput, SwapOut,
)
from engine.preemption import PreemptionMode, PreemptionPolicy


def token_slice(request: Request, start: int, end: int) -> list[int]:
    """``request.all_token_ids[start:end]`` without building all_token_ids (a new list)."""
    prompt, num_prompt = request.prompt_token_ids, request.num_prompt_tokens
    if start >= num_prompt:
        return request.output_token_ids[start - num_prompt : end - num_prompt]
    if end <= num_prompt:
        return prompt[start:end]
    return prompt[start:] + request.output_token_ids[: end - num_prompt]


def scheduled_request(request: Request, num_new_tokens: int, block_ids: list[int]) -> ScheduledRequest:
    """``request``'s share of a step as plain data, copied now (see ScheduledRequest)."""
    start = request.num_computed_tokens
    sampling = None
    if start + num_new_tokens == request.num_tokens:
        params = request.sampling_params
        outputs = list(request.output_token_ids) if params.has_penalties else []
        sampling = SamplingInput(request.request_id, params, request.num_output_tokens, request.stop_token_ids,
                                 request.prompt_token_ids, outputs)
    return ScheduledRequest(request.request_id, token_slice(request, start, start + num_new_tokens), start,
                            list(block_ids), sampling, _prompt_logprobs_input(request, start, num_new_tokens))


def _prompt_logprobs_input(request: Request, start: int, num_new_tokens: int) -> PromptLogprobsInput | None:
    """The prompt tokens this step's positions ``[start, start + num_new_tokens)`` predict,
    when the request asked for prompt logprobs and has no output token yet (they go out with
    the first; a recompute or a resumed request has them already): position ``p`` predicts
    prompt token ``p + 1``::

        prompt:     t0  t1  t2  t3  t4
        position:   0   1   2   3          (4 predicts the first output token)
    """
    num_top = request.sampling_params.prompt_logprobs
    end = min(start + num_new_tokens, request.num_prompt_tokens - 1)
    if num_top is None or request.num_output_tokens or end <= start:
        return None
    return PromptLogprobsInput(request.prompt_token_ids[start + 1 : end + 1], num_top)


class Scheduler:
    """``preemption``: default recompute (a swap needs a swap space, which the engine holds)."""

    def __init__(self, config: EngineConfig, preemption: PreemptionPolicy | None = None):
        self.config = config
        self.preemption = preemption or PreemptionPolicy("recompute")
        self.kv = KVCacheManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.batching = make_batching_policy(config.scheduling_policy)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.external_kv: dict[str, ExternalKV] = {}
        self._prefill_budget = config.max_num_batched_tokens  # prompt tokens the step being built may still take
        # Every request until it is freed or aborted.
        self.requests: dict[str, Request] = {}
        # Preempted requests whose KV is in the engine's swap space, not yet back (resume_swapped).
        self.swapped: set[str] = set()
        # Prompt logprobs collected so far, by request (handed out with the first token).
        self.prompt_logprobs: dict[str, list[SampledToken]] = {}
        self.num_preemptions = 0
        # The share of the worker's cores its next step runs on (engine.core_share: a decode worker
        # on its own cores while prefill holds the rest): a prompt token costs 1 / share as much
        # there, so the mixed-step cap shrinks with it and a decoding stream waits as long.
        self.mixed_prefill_share = 1.0
        # A disaggregated decode worker: streams whose prompt a prefill worker computes join at any
        # step, so every step that computes prompt tokens keeps to the mixed-step cap (else a
        # whole burst of local prompts in one long step holds their second token).
        self.decodes_may_join = False

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request, external_kv: ExternalKV | None = None) -> None:
        """Queues ``request``; ``external_kv`` is loaded into its blocks when it is admitted.

        Raises:
            ValueError: the request cannot fit ``max_model_len``, or its external KV covers more
                tokens than it has.
        """
        limit = self.config.max_model_len
        if request.num_prompt_tokens + request.sampling_params.max_tokens - request.num_output_tokens > limit:
            raise ValueError(
                f"request {request.request_id}: prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.sampling_params.max_tokens}) exceeds max_model_len ({limit})"
            )
        if external_kv is not None:
            if external_kv.num_tokens > request.num_tokens:
                raise ValueError(f"external KV covers {external_kv.num_tokens} tokens of {request.num_tokens}")
            self.external_kv[request.request_id] = external_kv
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        """Builds one step. Mutates the queues, block tables and preempted requests' state."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._prefill_budget = self._mixed_prefill_budget(budget)
        budget = self._schedule_running(out, budget)
        if not out.preempted_request_ids:
            self._schedule_waiting(out, budget)
        return out

    def _mixed_prefill_budget(self, budget: int) -> int:
        """The prompt tokens this step may compute: ``max_mixed_prefill_tokens`` (times
        :attr:`mixed_prefill_share`, at least 1) when a request decodes in it (Sarathi-Serve's bound
        on what a decode waits for), else the whole token budget. A request decodes in it when it
        runs with one token to compute or waits with its prompt's KV loaded from the pool (its
        first decode is this step); with :attr:`decodes_may_join`, every step counts as one. A
        chunk of one token is not counted."""
        cap = self.config.max_mixed_prefill_tokens if self.config.enable_chunked_prefill else 0
        if cap and (self.decodes_may_join
                    or any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running
                           if r.status is RequestStatus.RUNNING)
                    or any(ext.num_tokens >= self.requests[rid].num_tokens - 1
                           for rid, ext in self.external_kv.items() if rid in self.requests)):
            return min(max(1, int(cap * self.mixed_prefill_share)), budget)
        return budget

    def _prefill_chunk(self, n: int, budget: int) -> int:
        """Tokens of a prompt with ``n`` left to compute that this step takes (a decode's 1 always
        fits the budget); spends them from the step's prompt-token budget."""
        if n <= 1:
            return min(n, budget)
        n = min(n, budget, self._prefill_budget)
        self._prefill_budget -= n
        return n

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        scheduled_ids: set[str] = set()
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted by an earlier one
                continue
            n = self._prefill_chunk(request.num_tokens - request.num_computed_tokens, budget)
            if n == 0:
                continue
            table = self._allocate_with_lookahead(request, n)
            while table is None:
                victim = self.preemption.victim(self.running)
                if victim.request_id in scheduled_ids:
                    raise RuntimeError("KV cache too small for the requests already scheduled this step")
                self._preempt(victim, out)
                if victim is request:
                    break
                table = self.kv.allocate_slots(request.request_id, request.num_computed_tokens + n)
            if table is None:
                continue
            out.scheduled.append(scheduled_request(request, n, table.block_ids))
            scheduled_ids.add(request.request_id)
            budget -= n
        return budget

    def _allocate_with_lookahead(self, request: Request, n: int):
        """Room for this step's ``n`` tokens and, for a decode under multi-step, the tokens of the
        decision's later steps (best effort: without room the request sits those steps out)."""
        needed = request.num_computed_tokens + n
        lookahead = self._lookahead(request)
        if n == 1 and lookahead:
            limit = self.config.max_model_len
            table = self.kv.allocate_slots(request.request_id, min(needed + lookahead, limit))
            if table is not None:
                return table
        return self.kv.allocate_slots(request.request_id, needed)

    def _lookahead(self, request: Request) -> int:
        """Tokens a sampling request may still add after this step within one decision."""
        remaining = request.sampling_params.max_tokens - request.num_output_tokens
        return min(self.config.num_scheduler_steps - 1, max(0, remaining - 1))

    def continue_decode(self, previous: SchedulerOutput) -> SchedulerOutput:
        """The next step of a multi-step decision: every request that sampled in ``previous``,
        is still running and already has room for one more token decodes it. No admission, no
        allocation, no preemption. Mutates nothing."""
        out = SchedulerOutput()
        for item in previous.scheduled:
            request = self.requests.get(item.request_id)
            if not item.samples or request is None or request.status is not RequestStatus.RUNNING:
                continue
            table = self.kv.get(request.request_id)
            if table.capacity_tokens >= request.num_tokens:
                out.scheduled.append(scheduled_request(request, 1, table.block_ids))
        return out

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self.batching.admission_open(self.running):
            return
        whole_batch = self.batching.admits_whole_batch
        # Prompts that wait for the next step's prompt tokens keep their place in line; a request
        # behind them whose KV is already here (loaded from the pool) needs none and starts now.
        held: list[Request] = []
        while self.waiting and (budget > 0 or whole_batch) and len(self.running) < self.config.max_num_seqs:
            scheduled = self._admit(self.waiting[0], budget, out)
            if scheduled is _PROMPT_TOKENS_SPENT:
                held.append(self.waiting.popleft())
                continue
            if scheduled is None:
                break
            self.waiting.popleft()
            budget -= scheduled
        self.waiting.extendleft(reversed(held))

    def _admit(self, request: Request, budget: int, out: SchedulerOutput) -> int | object | None:
        """Gives ``request`` its blocks (prefix-cache hits shared, external KV loaded) and
        schedules its first chunk (none when the budget is spent: a static batch admits all its
        requests at once and prefills them over the next steps). Returns the tokens scheduled,
        ``_PROMPT_TOKENS_SPENT`` if its prompt needs tokens this step has no more of, None if it
        cannot start now for another reason (no blocks, KV still swapped out)."""
        if request.request_id in self.swapped:  # its KV is not back from the swap space yet
            return None
        bs = self.config.block_size
        # Prompt logprobs need the logits of every prompt position: no prefix-cache hit.
        hit = self.kv.find_prefix(request) if request.sampling_params.prompt_logprobs is None else PrefixHit([], 0)
        ext = self.external_kv.get(request.request_id)
        num_loaded = ext.num_tokens if ext else 0
        # The last token is always computed: its logits give the next token.
        num_computed = min(max(hit.num_tokens, num_loaded), request.num_tokens - 1)
        n = request.num_tokens - num_computed
        if n > budget and not self.config.enable_chunked_prefill and budget > 0:
            return None
        if n > 1 and self._prefill_budget == 0 and not self.batching.admits_whole_batch:
            return _PROMPT_TOKENS_SPENT  # it starts next step
        n = self._prefill_chunk(n, budget)
        # A hit covering the last token: that block is rewritten, so it is copied first.
        cow_last = hit.num_tokens > num_computed and num_computed // bs < len(hit.block_ids)
        total = max(num_computed + n, num_loaded)
        lookahead = self._lookahead(request) if num_computed + n == request.num_tokens else 0
        admitted = self.kv.admit(request.request_id, hit, min(total + lookahead, self.config.max_model_len), cow_last)
        if admitted is None and lookahead:
            admitted = self.kv.admit(request.request_id, hit, total, cow_last)
        if admitted is None:
            return None
        table, copies = admitted
        out.block_copies += copies
        if ext is not None:
            del self.external_kv[request.request_id]
            first = len(hit.block_ids) - (1 if cow_last else 0)
            if first < len(ext.payloads):
                out.kv_loads.append(KVLoad(table.block_ids[first : len(ext.payloads)], ext.payloads[first:]))
            else:  # the prefix cache holds all of it: nothing to copy, the pool views go now
                ext.let_go()
        request.num_computed_tokens = num_computed
        request.num_cached_tokens = max(request.num_cached_tokens, num_computed)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if n:
            out.scheduled.append(scheduled_request(request, n, table.block_ids))
            out.admitted_request_ids.append(request.request_id)
        return n

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Frees ``request``'s blocks and puts it first in line; when the policy swaps it, its KV
        is listed in ``out.swap_outs`` (packed by the engine before the blocks are reused) and it
        waits for :meth:`resume_swapped`, else it is recomputed."""
        self.running.remove(request)
        if self.preemption.mode_for(request) is PreemptionMode.SWAP:
            table = self.kv.get(request.request_id)
            num_blocks = -(-request.num_computed_tokens // self.config.block_size)
            out.swap_outs.append(SwapOut(request.request_id, table.block_ids[:num_blocks], request.num_computed_tokens))
            self.swapped.add(request.request_id)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        out.preempted_request_ids.append(request.request_id)
        self.num_preemptions += 1

    def update_from_output(self, out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[RequestOutput]:
        """commit_scheduled + resolve_sampled, for a step whose tokens are already known."""
        self.commit_scheduled(out)
        return self.resolve_sampled(out, runner_out)

    def commit_scheduled(self, out: SchedulerOutput) -> None:
        """Phase 1 of applying a step, valid before its tokens are known (overlap scheduling):
        advances ``num_computed_tokens``, indexes newly full blocks, appends a placeholder for
        each token being sampled, and takes requests that will stop on length out of ``running``.
        """
        for item in out.scheduled:
            request = self.requests.get(item.request_id)
            if (request is None or request.status is not RequestStatus.RUNNING  # aborted while its step ran
                    or request.num_computed_tokens != item.num_computed_tokens):  # (and the id reused)
                continue
            request.num_computed_tokens += item.num_new_tokens
            self.kv.cache_full_blocks(request)
            if not item.samples:
                continue
            request.output_token_ids.append(PLACEHOLDER_TOKEN_ID)
            at_length = (request.num_output_tokens >= request.sampling_params.max_tokens
                         or request.num_tokens >= self.config.max_model_len)
            if at_length and request in self.running:
                self.running.remove(request)

    def resolve_sampled(self, out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[RequestOutput]:
        """Phase 2: replaces placeholders with the sampled tokens and finishes requests that stop.

        Finished requests leave ``running`` (or ``waiting``, if preempted meanwhile) but keep
        their blocks until :meth:`free` (so the engine can save their KV first).
        """
        self._add_prompt_logprobs(out, runner_out)
        outputs = []
        for item in out.scheduled:
            request = self.requests.get(item.request_id)
            sampled = runner_out.sampled.get(item.request_id)
            if sampled is None or request is None or not _awaits_token(request):
                continue
            request.output_token_ids.pop()  # the placeholder
            reason = request.append_output_token(sampled.token_id)
            if reason is None and request.num_tokens >= self.config.max_model_len:
                request.finish(FinishReason.LENGTH)
            if request.is_finished:
                for queue in (self.running, self.waiting):
                    if request in queue:
                        queue.remove(request)
            output = RequestOutput(
                request.request_id, [sampled.token_id], request.is_finished, request.finish_reason,
                request.num_cached_tokens,
            )
            if sampled.logprob is not None:
                output.logprobs.append(sampled)
            if request.sampling_params.prompt_logprobs is not None and request.num_output_tokens == 1:
                output.prompt_logprobs = self.prompt_logprobs.pop(request.request_id, [])
            outputs.append(output)
        return outputs

    def _add_prompt_logprobs(self, out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        """Appends the step's prompt logprobs to each request's, once per position: a position
        computed again (a recompute after preemption before the first token) is not added twice.
        Mutates ``prompt_logprobs``."""
        for item in out.scheduled:
            step_logprobs = runner_out.prompt_logprobs.get(item.request_id)
            if step_logprobs is None or item.request_id not in self.requests:
                continue
            collected = self.prompt_logprobs.setdefault(item.request_id, [])
            # collected[k] is prompt token k + 1's, so this step's first is at item.num_computed_tokens.
            if len(collected) >= item.num_computed_tokens:
                collected += step_logprobs[len(collected) - item.num_computed_tokens :]

    def free(self, request_id: str) -> None:
        """Returns a finished request's blocks and forgets it (the engine discards its swapped
        KV, if any). Idempotent."""
        self.kv.free(request_id)
        self.requests.pop(request_id, None)
        self.swapped.discard(request_id)
        self.prompt_logprobs.pop(request_id, None)

    def abort(self, request_id: str) -> Request | None:
        """Removes the request wherever it is and frees its blocks; None if unknown."""
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self.free(request_id)
                    ext = self.external_kv.pop(request_id, None)
                    if ext is not None:  # never loaded: its pool views go now, not at a collection
                        ext.let_go()
                    request.finish(FinishReason.ABORT)
                    return request
        return None

    # Swap-in, between steps (the engine moves the bytes; the scheduler only decides).

    def swap_in_candidates(self) -> list[str]:
        """Swapped-out requests among the waiting ones the next ``schedule()`` may admit (one per
        free seat, in queue order): the engine brings their KV back before it. Reads only."""
        seats = self.config.max_num_seqs - len(self.running)
        return [r.request_id for r in itertools.islice(self.waiting, max(0, seats)) if r.request_id in self.swapped]

    def resume_swapped(self, request_id: str, kv: ExternalKV | None) -> None:
        """A swapped request's KV is resident again (``kv``), or was lost (None: it is recomputed).
        Mutates ``swapped`` and ``external_kv``."""
        if request_id not in self.swapped:
            return
        self.swapped.discard(request_id)
        if kv is not None:
            self.external_kv[request_id] = kv

    def reset_cache_and_counters(self) -> None:
        """Forgets the prefix cache and zeroes the counters (after calibration passes). Call with
        no request in flight. Mutates the block pool's cache and counters."""
        kv = self.kv
        kv.block_pool.reset_prefix_cache()
        kv.block_pool.num_evictions = 0
        kv.num_prefix_queries_tokens = kv.num_prefix_hit_tokens = 0
        self.num_preemptions = 0

    # Read-only views for the engine and its callers.

    def request_ids(self) -> list[str]:
        """Every request not yet freed or aborted."""
        return list(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a copy). Raises KeyError for a request without blocks."""
        return list(self.kv.get(request_id).block_ids)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def block_usage(self) -> tuple[int, int]:
        """(used, free) KV blocks."""
        return self.kv.num_used_blocks, self.kv.num_free_blocks

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose KV the running requests hold."""
        return sum(r.num_computed_tokens for r in self.running)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens to compute before each waiting or prefilling request samples (a request with
        one token left is decoding and counts 0)."""
        total = 0
        for request in (*self.waiting, *self.running):
            ext = self.external_kv.get(request.request_id)
            left = request.num_tokens - max(request.num_computed_tokens, ext.num_tokens if ext else 0)
            total += left if left > 1 else 0
        return total


_PROMPT_TOKENS_SPENT = object()  # _admit: the request's prompt waits for the next step's prompt tokens


def _awaits_token(request: Request) -> bool:
    """True while ``request`` holds the placeholder of a token being sampled."""
    return not request.is_finished and bool(request.output_token_ids) and request.output_token_ids[-1] == PLACEHOLDER_TOKEN_ID
