"""Every bad input gets one InvalidRequestError with the exact message and param."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from core.model_source import DEFAULT_MODEL
from router.errors import ErrorKind
from core.sampling_params import SAMPLING_FIELDS
from router.api.validation import InvalidRequestError, RequestInput, Validator
from router.tokenizer import ChatOptions

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def validator(tokenizer) -> Validator:
    return Validator(tokenizer, DEFAULT_MODEL, MAX_MODEL_LEN, default_max_tokens=16)


def make_input(**kwargs) -> RequestInput:
    """A RequestInput; the SamplingParams fields among ``kwargs`` go into its ``sampling``."""
    sampling = {name: kwargs.pop(name) for name in SAMPLING_FIELDS if name in kwargs}
    return RequestInput(sampling=sampling, **kwargs)


def ids(n: int) -> tuple[int, ...]:
    return tuple(100 + i for i in range(n))


@pytest.mark.parametrize(
    ("request_input", "message", "param"),
    [
        (make_input(prompt=""), "prompt is empty", "prompt"),
        (make_input(prompt_token_ids=()), "prompt is empty", "prompt"),
        (make_input(prompt_token_ids=ids(70)), "prompt has 70 tokens but the context is 64", "prompt"),
        (
            make_input(prompt_token_ids=ids(60), max_tokens=10),
            "prompt has 60 tokens and max_tokens is 10: 70 tokens exceed the context of 64",
            "max_tokens",
        ),
        (
            make_input(prompt_token_ids=ids(64)),
            "prompt has 64 tokens, which fills the context of 64; no room is left to generate",
            "prompt",
        ),
        (make_input(prompt="hi", max_tokens=0), "max_tokens must be >= 1, got 0", "max_tokens"),
        (make_input(prompt="hi", temperature=-0.5), "temperature must be in [0, 2], got -0.5", "temperature"),
        (make_input(prompt="hi", temperature=float("nan")), "temperature must be in [0, 2], got nan", "temperature"),
        (make_input(prompt="hi", temperature=2.5), "temperature must be in [0, 2], got 2.5", "temperature"),
        (make_input(prompt="hi", temperature=float("inf")), "temperature must be in [0, 2], got inf", "temperature"),
        (make_input(prompt="hi", top_p=float("nan")), "top_p must be in (0, 1], got nan", "top_p"),
        (make_input(prompt="hi", presence_penalty=float("-inf")), "presence_penalty must be in [-2, 2], got -inf",
         "presence_penalty"),
        (make_input(prompt="hi", top_p=0.0), "top_p must be in (0, 1], got 0.0", "top_p"),
        (make_input(prompt="hi", top_p=1.5), "top_p must be in (0, 1], got 1.5", "top_p"),
        (make_input(prompt="hi", top_k=-2), "top_k must be -1, 0 (disabled) or positive, got -2", "top_k"),
        (make_input(prompt="hi", seed=-1), "seed must be in [0, 2**64), got -1", "seed"),
        (make_input(prompt="hi", stop=("ok", "")), "stop strings must not be empty", "stop"),
        (
            make_input(prompt_token_ids=(1, 49152)),
            "prompt has token id 49152, outside the vocabulary [0, 49152)",
            "prompt",
        ),
        (
            make_input(prompt="hi", stop_token_ids=(-3,)),
            "stop_token_ids has token id -3, outside the vocabulary [0, 49152)",
            "stop_token_ids",
        ),
        (make_input(messages=()), "messages must not be empty", "messages"),
        (make_input(prompt="hi", min_tokens=-1), "min_tokens must be >= 0, got -1", "min_tokens"),
        (make_input(prompt="hi", max_tokens=3, min_tokens=4), "min_tokens (4) must not exceed max_tokens (3)",
         "min_tokens"),
        (make_input(prompt="hi", presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5",
         "presence_penalty"),
        (make_input(prompt="hi", frequency_penalty=-2.1), "frequency_penalty must be in [-2, 2], got -2.1",
         "frequency_penalty"),
        (make_input(prompt="hi", repetition_penalty=0.0), "repetition_penalty must be > 0 and finite, got 0.0",
         "repetition_penalty"),
        (make_input(prompt="hi", repetition_penalty=float("inf")),
         "repetition_penalty must be > 0 and finite, got inf", "repetition_penalty"),
        (make_input(prompt="hi \ud800"), "prompt is not valid Unicode: lone surrogate U+D800 at character 3",
         "prompt"),
        (make_input(messages=({"role": "user", "content": "ok"}, {"role": "user", "content": "a\udfffb"})),
         "messages.1.content is not valid Unicode: lone surrogate U+DFFF at character 1", "messages.1.content"),
        (make_input(prompt="hi", stop=("x", "\ud83d")),
         "stop.1 is not valid Unicode: lone surrogate U+D83D at character 0", "stop.1"),
        (make_input(messages=({"role": "bot", "content": "x"},)),
         'messages.0.role must be one of "system", "user", "assistant", "developer", "tool", got "bot"',
         "messages.0.role"),
        (make_input(messages=({"role": "user", "content": "x"}, {"role": "function", "content": "42"})),
         'messages.1.role "function" is not supported: send a function\'s result as a "tool" message',
         "messages.1.role"),
        (make_input(prompt="hi", logprobs=21), "logprobs must be in [0, 20], got 21", "logprobs"),
        (make_input(prompt="hi", logprobs=-1), "logprobs must be in [0, 20], got -1", "logprobs"),
        (make_input(prompt="hi", n=0), "n must be in [1, 64], got 0", "n"),
        (make_input(prompt="hi", n=65), "n must be in [1, 64], got 65", "n"),
    ],
)
def test_bad_input(validator: Validator, request_input: RequestInput, message: str, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validator.validate(request_input)
    assert (info.value.message, info.value.param, info.value.kind) == (message, param, ErrorKind.INVALID_REQUEST)
    assert info.value.http_status == 400


def test_unknown_model_is_not_found(validator: Validator) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validator.validate(make_input(model="gpt-4", prompt="hi"))
    assert info.value.message == f'model "gpt-4" does not exist; this cluster serves "{DEFAULT_MODEL}"'
    assert (info.value.param, info.value.kind, info.value.http_status) == ("model", ErrorKind.MODEL_NOT_FOUND, 404)
    assert info.value.to_openai()["error"]["code"] == "model_not_found"


def test_long_chat_names_messages(validator: Validator) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validator.validate(make_input(messages=({"role": "user", "content": "word " * 80},)))
    assert info.value.param == "messages"
    assert info.value.message.startswith("prompt has ") and info.value.message.endswith(" but the context is 64")


def test_completion_prompt_is_tokenized_and_params_kept(validator: Validator, tokenizer) -> None:
    request = validator.validate(
        make_input(model=DEFAULT_MODEL, prompt="Hello world", max_tokens=5, temperature=0.0, top_p=0.9,
                     top_k=20, seed=7, stop=("\n",), stop_token_ids=(13,), ignore_eos=True)
    )
    assert request.prompt_token_ids == tokenizer.encode("Hello world")
    params = request.sampling_params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (5, 0.0, 0.9, 20, 7)
    assert (params.stop_token_ids, params.ignore_eos, request.stop) == ((13,), True, ("\n",))


def test_default_max_tokens_is_clamped_to_the_context(validator: Validator) -> None:
    assert validator.validate(make_input(prompt_token_ids=ids(10))).sampling_params.max_tokens == 16
    assert validator.validate(make_input(prompt_token_ids=ids(60))).sampling_params.max_tokens == 4


def test_chat_default_max_tokens_is_the_rest_of_the_context(validator: Validator) -> None:
    request = validator.validate(make_input(messages=({"role": "user", "content": "hi"},)))
    assert request.sampling_params.max_tokens == MAX_MODEL_LEN - len(request.prompt_token_ids)
    explicit = validator.validate(make_input(messages=({"role": "user", "content": "hi"},), max_tokens=5))
    assert explicit.sampling_params.max_tokens == 5


def test_developer_role_is_rendered_as_system(validator: Validator) -> None:
    as_developer = validator.validate(make_input(messages=({"role": "developer", "content": "Be brief."},
                                                             {"role": "user", "content": "hi"})))
    as_system = validator.validate(make_input(messages=({"role": "system", "content": "Be brief."},
                                                          {"role": "user", "content": "hi"})))
    assert as_developer.prompt_token_ids == as_system.prompt_token_ids


class CountingHF:
    """Wraps a HF tokenizer and counts encode / apply_chat_template calls."""

    def __init__(self, hf):
        self.hf, self.calls = hf, 0
        self.chat_template = hf.chat_template

    def encode(self, text, **kwargs):
        self.calls += 1
        return self.hf.encode(text, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        return self.hf.apply_chat_template(*args, **kwargs)


def test_smollm_tokens_cover_at_most_81_characters(tokenizer) -> None:
    # The longest SmolLM2 vocabulary entry: a newline and 80 spaces (byte-level BPE).
    assert tokenizer.max_token_chars == 81
    assert tokenizer.min_num_tokens(81 * 64) == 64 and tokenizer.min_num_tokens(81 * 64 + 1) == 65


@pytest.mark.parametrize("chat", [False, True])
def test_text_that_cannot_fit_is_refused_without_tokenizing(tokenizer, chat: bool) -> None:
    hf = CountingHF(tokenizer.hf)
    counting = dataclasses.replace(tokenizer, hf=hf)
    validator = Validator(counting, DEFAULT_MODEL, MAX_MODEL_LEN, default_max_tokens=16)
    text = "lorem ipsum dolor sit amet " * 200  # 5400 characters: at least 67 tokens > 64
    request = make_input(messages=({"role": "user", "content": text},)) if chat else make_input(prompt=text)
    with pytest.raises(InvalidRequestError) as info:
        validator.validate(request)
    param = "messages" if chat else "prompt"
    assert (info.value.message, info.value.param) == (
        f"{param} has 5400 characters, so at least 67 tokens (a token covers at most 81 characters), "
        "but the context is 64", param)
    assert hf.calls == 0
    validator.validate(make_input(prompt="lorem ipsum"))  # short text is tokenized as before
    assert hf.calls == 1


def test_more_messages_than_context_tokens_are_refused_before_the_template_renders(tokenizer) -> None:
    """A message renders to one token or more, so 65 messages cannot fit 64 tokens: refused
    without rendering (10^5 messages took the template seconds, holding the router's GIL);
    64 messages are rendered, then refused by their real token count."""
    hf = CountingHF(tokenizer.hf)
    validator = Validator(dataclasses.replace(tokenizer, hf=hf), DEFAULT_MODEL, MAX_MODEL_LEN, default_max_tokens=16)
    with pytest.raises(InvalidRequestError) as info:
        validator.validate(make_input(messages=({"role": "user", "content": ""},) * 65))
    assert (info.value.message, info.value.param) == (
        "messages has 65 messages, more than the context's 64 tokens (each message is one token or more)", "messages")
    assert hf.calls == 0
    with pytest.raises(InvalidRequestError) as info:
        validator.validate(make_input(messages=({"role": "user", "content": ""},) * 64))
    assert info.value.message == "prompt has 345 tokens but the context is 64" and hf.calls > 0


def test_an_empty_model_name_is_not_found_and_an_absent_one_is_the_served_model(validator: Validator) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validator.validate(make_input(model="", prompt="hi"))
    assert (info.value.message, info.value.http_status) == (
        f'model "" does not exist; this cluster serves "{DEFAULT_MODEL}"', 404)
    assert validator.validate(make_input(model=None, prompt="hi")).prompt_token_ids


async def test_validate_async_tokenizes_off_the_event_loop(validator: Validator) -> None:
    loop_thread = threading.get_ident()
    threads = []
    original = validator.tokenizer.hf.encode

    class Spy:
        def __getattr__(self, name):
            return getattr(validator.tokenizer.hf, name)

        def encode(self, text, **kwargs):
            threads.append(threading.get_ident())
            return original(text, **kwargs)

    spied = Validator(dataclasses.replace(validator.tokenizer, hf=Spy()), DEFAULT_MODEL, MAX_MODEL_LEN, 16)
    request = await spied.validate_async(make_input(prompt="Hello world"))
    assert request.prompt_token_ids == validator.tokenizer.encode("Hello world")
    assert threads and loop_thread not in threads


def test_chat_uses_the_template_with_generation_prompt(validator: Validator, tokenizer) -> None:
    request = validator.validate(make_input(messages=({"role": "user", "content": "hi"},)))
    text = tokenizer.hf.decode(request.prompt_token_ids)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_sampling_extras_reach_the_params(validator: Validator) -> None:
    request = validator.validate(
        make_input(prompt="hi", max_tokens=8, min_tokens=8, presence_penalty=-2.0, frequency_penalty=2.0,
                     repetition_penalty=1.3, logprobs=0, n=4)
    )
    params = request.sampling_params
    assert (params.min_tokens, params.presence_penalty, params.frequency_penalty) == (8, -2.0, 2.0)
    assert (params.repetition_penalty, params.logprobs, request.n) == (1.3, 0, 4)


@pytest.mark.parametrize(
    ("request_input", "message", "param"),
    [
        (make_input(prompt="x", n=3, best_of=2), "best_of must be in [n, 64] (n is 3), got 2", "best_of"),
        (make_input(prompt="x", best_of=65), "best_of must be in [n, 64] (n is 1), got 65", "best_of"),
        (make_input(prompt="x", min_p=1.5), "min_p must be in [0, 1], got 1.5", "min_p"),
        (make_input(messages=({"role": "user", "content": "x"},), chat=ChatOptions(template_kwargs={"tokenize": 1})),
         "chat_template_kwargs may not set tokenize", "chat_template_kwargs"),
    ],
)
def test_completion_options_out_of_range(validator: Validator, request_input, message: str, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        validator.validate(request_input)
    assert (info.value.message, info.value.param) == (message, param)


def test_best_of_asks_the_workers_for_logprobs_to_rank_the_candidates(validator: Validator) -> None:
    ranked = validator.validate(make_input(prompt="x", n=2, best_of=3))
    assert (ranked.n, ranked.best_of, ranked.num_candidates, ranked.sampling_params.logprobs) == (2, 3, 3, 0)
    asked = validator.validate(make_input(prompt="x", best_of=2, logprobs=4))
    assert asked.sampling_params.logprobs == 4
    same = validator.validate(make_input(prompt="x", n=2, best_of=2))
    assert (same.num_candidates, same.sampling_params.logprobs) == (2, None)


def test_chat_template_kwargs_and_special_tokens_options(validator: Validator, tokenizer) -> None:
    chat = ({"role": "user", "content": "hi"},)
    plain = validator.validate(make_input(messages=chat)).prompt_token_ids
    extra = ChatOptions(template_kwargs={"enable_thinking": False})  # a variable this template does not use
    assert validator.validate(make_input(messages=chat, chat=extra)).prompt_token_ids == plain
    # tokenize() renders without the generation prompt when asked, and never checks the context.
    no_prompt = validator.tokenize(make_input(messages=chat, chat=ChatOptions(add_generation_prompt=False)))
    assert tokenizer.hf.decode(no_prompt).endswith("<|im_start|>user\nhi<|im_end|>\n")
    assert plain[: len(no_prompt)] == no_prompt and len(plain) > len(no_prompt)
    assert validator.tokenize(make_input(prompt="hi" * 100)) == tokenizer.encode("hi" * 100)
    assert len(tokenizer.encode("hi" * 100)) > MAX_MODEL_LEN  # over the context: counted all the same
    kept = validator.validate(make_input(prompt="x", skip_special_tokens=False))
    assert (kept.skip_special_tokens, validator.validate(make_input(prompt="x")).skip_special_tokens) == (False, True)
