"""Structured outputs in the engine (xgrammar): grammars compiled off the step loop, one matcher
per request, the batch's token bitmask filled beside the forward pass.

A request with ``SamplingParams.structured_outputs`` waits here, not in the scheduler, until its
grammar is compiled (a compile thread; the step loop never waits, other requests keep running).
It then gets a :class:`xgrammar.GrammarMatcher` that first accepts the request's output tokens
so far, so a matcher is rebuilt from tokens wherever a request lands: the decode worker replays
the prefill worker's first token, a resumed stream its tokens before the failure. A preempted
request keeps its matcher (it stays in the engine).

Per pass (``ModelRunner.run``)::

    fill thread:   accept pass k-1's tokens, fill the bitmask (two batched C++ calls)
    runner thread: forward ........................ | wait fill | apply mask, sample | queue tokens

The matchers are only touched in that order: pass k+1's fill job starts after pass k queued its
tokens, since passes run one after another, overlapped or not.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import xgrammar as xgr

from core.request import FinishReason, Request
from core.structured_output import StructuredOutputError, StructuredOutputSpec
from engine.outputs import ExternalKV, RequestOutput, SampledToken, SamplingInput

log = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 512  # compiled grammars kept, least recently used dropped first


@dataclass
class GrammarStats:
    """Lifetime counters of one engine's grammar compiler."""

    num_compiled: int = 0  # grammars compiled
    num_cache_hits: int = 0  # requests whose grammar was already compiled (or compiling)
    compile_time_s: float = 0.0  # seconds spent compiling


@dataclass(frozen=True)
class TokenMask:
    """The bitmask of one pass: ``bitmask`` rows ``rows`` (indices into the pass's sampling
    rows) hold the allowed tokens of a structured row; other rows are not read.

    ``bitmask``: ``[num_rows >= max(rows) + 1, ceil(vocab_size / 32)]``, int32, bit ``j % 32`` of
    word ``j // 32`` set when token ``j`` is allowed."""

    bitmask: torch.Tensor
    rows: list[int]
    vocab_size: int

    def apply(self, logits: torch.Tensor) -> None:
        """Sets the disallowed logits of the structured rows to -inf in one vectorised call.
        ``logits``: ``[num_rows, >= vocab_size]`` float32 on CPU; mutated in place."""
        xgr.apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=self.vocab_size, indices=self.rows)


def _library_message(err: Exception) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix."""
    return re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", str(err).strip())


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly ``choices`` (JSON string literals are EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class StructuredOutputManager:
    """Compiles, caches and matches the grammars of one engine.

    ``tokenizer_dir``: called once, on the compile thread, for the Hugging Face folder whose
    tokenizer the model uses (a GGUF is converted on first use). ``vocab_size``: the model's
    logits width, which may exceed the tokenizer's (the extra ids are never allowed).
    ``on_ready``: called (from the compile thread) when a grammar is compiled or failed, so an
    idle step loop wakes up to admit the request.
    """

    def __init__(self, tokenizer_dir: Callable[[], Path], vocab_size: int,
                 on_ready: Callable[[], None] = lambda: None):
        self.vocab_size = vocab_size
        self.on_ready = on_ready
        self.stats = GrammarStats()
        self._tokenizer_dir = tokenizer_dir
        self._compiler: xgr.GrammarCompiler | None = None  # built on the compile thread
        self._compile_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-fill")
        self._grammars: OrderedDict[StructuredOutputSpec, Future] = OrderedDict()
        # Requests waiting for their grammar: request_id -> (request, its external KV, grammar).
        self._waiting: dict[str, tuple[Request, ExternalKV | None, Future]] = {}
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._batch: xgr.BatchGrammarMatcher | None = None
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32, grown on demand
        # (matcher, request_id, token_id) sampled by the last pass, accepted by the next fill.
        self._to_accept: list[tuple[xgr.GrammarMatcher, str, int]] = []

    # -- admission (engine thread) --------------------------------------------------------

    def add(self, request: Request, external_kv: ExternalKV | None) -> None:
        """Holds ``request`` until its grammar is compiled (:meth:`admit_ready`)."""
        spec = request.sampling_params.structured_outputs
        grammar = self._grammars.get(spec)
        if grammar is None:
            grammar = self._compile_thread.submit(self._compile, spec)
            self._grammars[spec] = grammar
            while len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(spec)
            self.stats.num_cache_hits += 1
        self._waiting[request.request_id] = (request, external_kv, grammar)
        grammar.add_done_callback(lambda _: self.on_ready())

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_ready(self) -> bool:
        """True when a waiting request's grammar is compiled (or failed): admit_ready has work."""
        return any(grammar.done() for _, _, grammar in self._waiting.values())

    def waiting_ids(self) -> list[str]:
        return list(self._waiting)

    def admit_ready(self, admit: Callable[[Request, ExternalKV | None], None]) -> list[RequestOutput]:
        """Gives every request whose grammar is ready a matcher that accepted its output tokens
        so far, and passes it to ``admit`` (the scheduler's add_request), in arrival order.
        Returns the failed ones' outputs (``error`` set): a grammar that does not compile, output
        tokens the grammar refuses, or ``admit`` raising ValueError."""
        failed = []
        for request_id, (request, external_kv, grammar) in list(self._waiting.items()):
            if not grammar.done():
                continue
            del self._waiting[request_id]
            if (error := grammar.exception()) is not None:
                # Not grammar.result(): re-raising the cached future's exception would chain this
                # frame, and with it the request's external KV, to the grammar cache.
                failed.append(self._refuse(request_id, external_kv, error))
                continue
            try:
                self._matchers[request_id] = self._matcher(grammar.result(), request)
                admit(request, external_kv)
            except ValueError as err:
                self._matchers.pop(request_id, None)
                failed.append(self._refuse(request_id, external_kv, err))
        return failed

    @staticmethod
    def _refuse(request_id: str, external_kv: ExternalKV | None, error: Exception) -> RequestOutput:
        """The refused request's output; its external KV will never be loaded: its pool views are
        let go now (their leases stop being renewed)."""
        if external_kv is not None:
            external_kv.let_go()
        return RequestOutput(request_id, [], True, FinishReason.ABORT, error=str(error))

    def discard(self, request_id: str) -> bool:
        """Forgets the request (finished, aborted); True when it was still waiting for its grammar."""
        self._matchers.pop(request_id, None)
        waiting = self._waiting.pop(request_id, None)
        if waiting is not None and waiting[1] is not None:  # its pool views go now, not at a collection
            waiting[1].let_go()
        return waiting is not None

    def _matcher(self, compiled: xgr.CompiledGrammar, request: Request) -> xgr.GrammarMatcher:
        matcher = xgr.GrammarMatcher(compiled)
        for i, token_id in enumerate(request.output_token_ids):
            if not matcher.accept_token(token_id):
                raise StructuredOutputError(f"output token {i} (id {token_id}) does not fit the structured output")
        return matcher

    # -- compilation (compile thread) -----------------------------------------------------

    def _compile(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        """Raises StructuredOutputError when xgrammar refuses the spec."""
        started = time.perf_counter()
        if self._compiler is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_dir())
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        compiler = self._compiler
        try:
            if spec.kind == "json_schema":
                # Compact JSON: a small model offered free whitespace may never stop emitting it.
                compiled = compiler.compile_json_schema(spec.value, any_whitespace=False, strict_mode=spec.strict)
            elif spec.kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.value)
            elif spec.kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(spec.choices))
            else:
                compiled = compiler.compile_grammar(spec.value)
        except RuntimeError as err:
            raise StructuredOutputError(f"the {spec.kind.replace('_', ' ')} cannot be compiled: "
                                        f"{_library_message(err)}") from None
        self.stats.num_compiled += 1
        self.stats.compile_time_s += time.perf_counter() - started
        log.debug("compiled a %s grammar in %.1f ms", spec.kind, (time.perf_counter() - started) * 1e3)
        return compiled

    # -- per pass (runner thread, fill thread) --------------------------------------------

    def fill_async(self, sampling: list[SamplingInput]) -> Future | None:
        """Starts filling the pass's bitmask on the fill thread; None when no row is structured.
        The future's result is a :class:`TokenMask` (or None)."""
        if not any(s.sampling_params.structured_outputs is not None for s in sampling):
            return None
        return self._fill_thread.submit(self.fill, sampling)

    def fill(self, sampling: list[SamplingInput]) -> TokenMask | None:
        """The bitmask of the structured rows of ``sampling``, filled by one batched C++ call
        (no Python work per vocabulary entry), after accepting the tokens the previous passes
        queued (:meth:`accept`). A row whose matcher is gone (its request aborted while the pass
        was prepared) is left out."""
        self._accept_queued()
        rows, matchers = [], []
        for i, item in enumerate(sampling):
            matcher = self._matchers.get(item.request_id)
            if matcher is not None and item.sampling_params.structured_outputs is not None:
                rows.append(i)
                matchers.append(matcher)
        if not rows:
            return None
        if self._bitmask is None or self._bitmask.shape[0] < len(sampling):
            self._bitmask = xgr.allocate_token_bitmask(max(len(sampling), 16), self.vocab_size)
            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._batch.batch_fill_next_token_bitmask(matchers, self._bitmask, rows)
        return TokenMask(self._bitmask, rows, self.vocab_size)

    def accept(self, sampling: list[SamplingInput], tokens: list[SampledToken]) -> None:
        """Queues each structured row's sampled token for its matcher (runner thread). The next
        :meth:`fill` accepts them first, in one batched C++ call on the fill thread, beside that
        pass's forward: off the critical path."""
        self._to_accept += [(matcher, item.request_id, token.token_id) for item, token in zip(sampling, tokens)
                            if item.sampling_params.structured_outputs is not None
                            and (matcher := self._matchers.get(item.request_id)) is not None]

    def _accept_queued(self) -> None:
        rows, self._to_accept = self._to_accept, []
        if not rows:
            return
        accepted = xgr.BatchGrammarMatcher.batch_accept_token([m for m, _, _ in rows], [t for _, _, t in rows])
        for (_, request_id, token_id), ok in zip(rows, accepted):
            if not ok:
                log.error("request %s: sampled token %d is outside its grammar", request_id, token_id)

    def shutdown(self) -> None:
        self._compile_thread.shutdown(wait=False, cancel_futures=True)
        self._fill_thread.shutdown(wait=False)
