"""engine.structured_output on the bundled model's tokenizer (no model): compile and cache, the
batch bitmask with row indices, the mask in the sampler, a vocabulary padded past the
tokenizer's, matchers rebuilt from output tokens."""

from __future__ import annotations

import threading

import pytest
import torch

from core.request import Request
from core.sampling_params import SamplingParams
from core.structured_output import StructuredOutputSpec
from engine.kv_connector.blocks import ArenaBlock, LoadGuard
from engine.outputs import ExternalKV, SamplingInput
from engine.sampler import Sampler
from engine.structured_output import StructuredOutputManager, choice_grammar
from tests import reference

VOCAB = 49152  # the bundled tokenizer's
PADDED_VOCAB = VOCAB + 64  # a model whose logits are wider than its tokenizer


@pytest.fixture(scope="module")
def manager() -> StructuredOutputManager:
    return StructuredOutputManager(reference.hf_dir, PADDED_VOCAB)


def admitted(manager: StructuredOutputManager, spec: StructuredOutputSpec, rid: str,
             output: list[int] = ()) -> tuple[Request, list]:
    """Adds a request, waits for its grammar (the compile thread), admits it."""
    request = Request(rid, [1, 2, 3], SamplingParams(temperature=0, max_tokens=32, structured_outputs=spec))
    request.output_token_ids += output
    ready = threading.Event()
    manager.on_ready = ready.set
    manager.add(request, None)
    assert ready.wait(60)
    scheduled: list = []
    failed = manager.admit_ready(lambda r, kv: scheduled.append(r))
    return request, failed or scheduled


def sampling(request: Request) -> SamplingInput:
    return SamplingInput(request.request_id, request.sampling_params, request.num_output_tokens,
                         frozenset({2}), request.prompt_token_ids, [])


def token_ids(text: str) -> list[int]:
    return reference.tokenizer().encode(text)


def test_choice_grammar_quotes_each_choice_as_a_literal() -> None:
    assert choice_grammar(['say "hi"', "a\nb", "ça"]) == 'root ::= "say \\"hi\\"" | "a\\nb" | "ça"'


def test_the_mask_allows_only_what_continues_the_grammar_padding_never(manager) -> None:
    yes_no, scheduled = admitted(manager, StructuredOutputSpec.choice(["yes", "no"]), "c")
    free = Request("free", [1], SamplingParams(temperature=0))
    rows = [sampling(free), sampling(yes_no)]
    mask = manager.fill(rows)
    assert (scheduled, mask.rows) == ([yes_no], [1])  # the free row is not filled
    logits = torch.zeros(2, PADDED_VOCAB)
    logits[:, VOCAB + 5] = 100.0  # a padded id: the best logit of both rows
    tokens = Sampler().sample(logits, rows, mask)
    assert tokens[0].token_id == VOCAB + 5  # free text: untouched
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert reference.tokenizer().decode([tokens[1].token_id]) in ("y", "ye", "yes", "n", "no")
    assert all("yes".startswith(t) or "no".startswith(t) for t in reference.tokenizer().convert_ids_to_tokens(allowed))
    assert VOCAB + 5 not in allowed and 2 not in allowed  # EOS only once a choice is complete
    manager.accept(rows, tokens)
    manager.discard("c")


def test_a_matcher_is_rebuilt_from_the_output_tokens_and_ends_with_eos(manager) -> None:
    spec = StructuredOutputSpec("regex", "[0-9]{2}")
    request, _ = admitted(manager, spec, "r", token_ids("4") + token_ids("2"))
    mask = manager.fill([sampling(request)])
    allowed = torch.isfinite(_masked(mask)).nonzero()[:, 1].tolist()
    assert allowed == [2]  # the regex is complete: only EOS
    manager.discard("r")


def _masked(mask) -> torch.Tensor:
    logits = torch.zeros(mask.bitmask.shape[0], PADDED_VOCAB)
    mask.apply(logits)
    return logits[mask.rows]


def test_output_tokens_outside_the_grammar_are_refused(manager) -> None:
    request, failed = admitted(manager, StructuredOutputSpec("regex", "[0-9]+"), "bad", token_ids("x"))
    assert [(o.request_id, o.finished, o.error) for o in failed] == [
        ("bad", True, f"output token 0 (id {token_ids('x')[0]}) does not fit the structured output")]


def test_a_spec_is_compiled_once_and_refusals_carry_the_library_reason(manager) -> None:
    before = (manager.stats.num_compiled, manager.stats.num_cache_hits)
    spec = StructuredOutputSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    admitted(manager, spec, "a")
    admitted(manager, spec, "b")
    assert (manager.stats.num_compiled, manager.stats.num_cache_hits) == (before[0] + 1, before[1] + 1)
    _, failed = admitted(manager, StructuredOutputSpec.json_schema({"$ref": "#/$defs/missing"}), "ref")
    assert failed[0].error.startswith("the json schema cannot be compiled: ")
    for rid in ("a", "b"):
        manager.discard(rid)


def test_a_refused_request_lets_go_of_its_external_kv(manager) -> None:
    # The prefix a prefill worker loaded from the pool: views whose guard keeps the pool leases
    # renewed until it is done. A refusal must drop them while the failed grammar stays cached.
    released = []
    guard = LoadGuard(lambda: released.append(True))
    external = ExternalKV(16, [ArenaBlock.wrap(memoryview(bytearray(64)), guard)])
    del guard
    spec = StructuredOutputSpec("regex", "(?<=a)b")
    request = Request("lookbehind", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, structured_outputs=spec))
    ready = threading.Event()
    manager.on_ready = ready.set
    manager.add(request, external)
    del external
    assert ready.wait(60)
    failed = manager.admit_ready(lambda r, kv: None)
    assert failed[0].error.startswith("the regex cannot be compiled: ")
    assert spec in manager._grammars and released == [True]  # no gc.collect: nothing holds it
