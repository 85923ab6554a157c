"""The router's configuration: one frozen dataclass, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from core.model_source import DEFAULT_MAX_MODEL_LEN, DEFAULT_MODEL
from core.registry import DEFAULT_REDIS_URL
from core.settings import setting

# router.placement.policies's names, repeated so that the configuration imports no policy code.
ROUTING_POLICIES = ("round_robin", "least_loaded", "cache_aware", "predicted_latency")
DISAGGREGATION_MODES = ("auto", "always", "never")
DEFAULT_OPEN_PATHS = ("/health", "/metrics")  # HTTP paths served without an API key
TOOL_CALL_PARSERS = ("hermes",)  # router.output.tool_calls's formats a model writes by itself
# A held first token waits for about one decode pass; a hold of seconds is a misconfiguration.
MAX_FIRST_TOKEN_HOLD_S = 10.0


@dataclass(frozen=True)
class RouterConfig:
    """Where the router listens, which model it serves and its limits; each field's default and
    help text are ``python -m router``'s ``--flag`` and ``tandem up``'s (core.settings).

    Attributes:
        host: interface both servers bind.
        http_port: OpenAI-compatible HTTP API port (0 picks a free one).
        grpc_port: ``tandem.v1.Router`` gRPC port (0 picks a free one).
        redis_url: control-plane Redis holding the worker registry.
        model: bundled model name, ``.gguf`` file or Hugging Face folder (tokenizer source).
        served_model_name: the name clients send as ``model``; empty means the model's own name.
        max_model_len: context limit in tokens, prompt plus generated tokens.
        default_max_tokens: a completion's ``max_tokens`` when it leaves it out (clamped to the
            context); a chat that leaves it out may use the rest of the context.
        request_timeout_s: deadline of one request's worker calls, prefill through last token.
        worker_refresh_interval_s: how often the worker view is re-read from Redis.
        shutdown_grace_s: how long in-flight requests may run on after SIGTERM.
        routing_policy: round_robin, least_loaded, cache_aware or predicted_latency (router.placement.policies).
        disaggregation: auto (the policy may prefill on the decode worker when predicted faster),
            always (colocated only without a live prefill worker) or never (always colocated).
        ttft_slo_s: TTFT target in seconds for admission and placement; 0: none.
        tbt_slo_s: time-between-tokens target in seconds (a decode step); 0: none.
        first_token_hold_s: the longest the router holds a prefill's first token while the decode
            worker has not started its first pass for the request (it streams the token then, so
            tokens 1 and 2 come one decode pass apart, not the handoff plus a pass and a half);
            0: streamed as soon as the prefill answers (lowest TTFT); at most MAX_FIRST_TOKEN_HOLD_S.
        max_queue_s: admission refuses a request that cannot meet the SLOs only when the work
            queued ahead of it takes longer than this to drain (seconds).
        prefix_cache_blocks: blocks remembered per worker in the router's view of worker prefix
            caches (an LRU of what it sent there).
        api_keys: keys a client must send (``Authorization: Bearer``) on HTTP and gRPC; empty:
            the APIs are open (router.api.auth).
        open_paths: HTTP paths served without a key even when ``api_keys`` is set.
        chat_template: the chat template of every chat: a bundled name (``hermes``,
            router.chat_templates) or a Jinja file; empty: the model's own, and the bundled
            ``hermes`` for a chat involving tools the model's own cannot render (vLLM's
            ``--chat-template``).
        tool_call_parser: how calls are read from the text under ``tool_choice: "auto"``
            (vLLM's ``--tool-call-parser``; router.output.tool_calls).

    Raises:
        ValueError: on any out-of-range value, quoting it.
    """

    host: str = setting("127.0.0.1", "Interface both servers bind.")
    http_port: int = setting(8000, "OpenAI-compatible HTTP port (0 picks a free one).")
    grpc_port: int = setting(50050, "tandem.v1.Router gRPC port (0 picks a free one).")
    redis_url: str = setting(DEFAULT_REDIS_URL, "Control-plane Redis (worker registry).")
    model: str = setting(DEFAULT_MODEL, "Bundled model name, .gguf file or HF folder.")
    served_model_name: str = setting("", "The name clients send as `model` (default: the model's).")
    max_model_len: int = setting(DEFAULT_MAX_MODEL_LEN, "Context limit in tokens.")
    default_max_tokens: int = setting(16, "max_tokens of a completion that omits it (a chat may use the rest of "
                                          "the context).")
    request_timeout_s: float = setting(600.0, "Deadline of one request's worker calls.")
    worker_refresh_interval_s: float = setting(0.5, "How often the worker view is re-read from Redis.")
    shutdown_grace_s: float = setting(5.0, "How long in-flight requests may run on after SIGTERM.")
    routing_policy: str = setting("predicted_latency", "How the router places requests on workers.",
                                  choices=ROUTING_POLICIES)
    disaggregation: str = setting("auto", "auto: prefill on the decode worker when the router predicts it faster; "
                                          "always; never (colocated).", choices=DISAGGREGATION_MODES)
    ttft_slo_s: float = setting(0.0, "TTFT SLO in seconds for placement and admission (0: none).")
    tbt_slo_s: float = setting(0.0, "Time-between-tokens SLO in seconds (0: none).")
    first_token_hold_s: float = setting(0.2, "Longest hold of a prefill's first token until the decode worker starts "
                                             "the request (0: stream it at once).")
    max_queue_s: float = setting(0.5, "Refuse (429) a request that cannot meet the SLOs only when the queue ahead "
                                      "takes longer than this.")
    prefix_cache_blocks: int = setting(8192, "Blocks remembered per worker in the prefix view.")
    api_keys: tuple[str, ...] = setting((), option=False)  # secrets: --api-key, its env var or a file
    open_paths: tuple[str, ...] = setting(DEFAULT_OPEN_PATHS, "HTTP paths served without an API key, "
                                                              "comma-separated ('' for none).")
    chat_template: str = setting("", "Chat template of every chat: a bundled name (hermes) or a Jinja file; empty: "
                                     "the model's own, and hermes for a chat with tools the model's cannot render.")
    tool_call_parser: str = setting("hermes", "How tool calls are read from the text under tool_choice auto.",
                                    choices=TOOL_CALL_PARSERS)

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 1 <= self.default_max_tokens < self.max_model_len:
            raise ValueError(
                f"default_max_tokens must be in [1, max_model_len={self.max_model_len}), "
                f"got {self.default_max_tokens}"
            )
        for name in ("request_timeout_s", "worker_refresh_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        if not self.model:
            raise ValueError("model must not be empty")
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {ROUTING_POLICIES}, got {self.routing_policy!r}")
        if self.disaggregation not in DISAGGREGATION_MODES:
            raise ValueError(f"disaggregation must be one of {DISAGGREGATION_MODES}, got {self.disaggregation!r}")
        if not 0 <= self.first_token_hold_s <= MAX_FIRST_TOKEN_HOLD_S:  # also refuses NaN and inf
            raise ValueError(f"first_token_hold_s must be in [0, {MAX_FIRST_TOKEN_HOLD_S:g}], "
                             f"got {self.first_token_hold_s}")
        for name in ("ttft_slo_s", "tbt_slo_s", "max_queue_s"):
            if not getattr(self, name) >= 0:  # also refuses NaN
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.prefix_cache_blocks < 1:
            raise ValueError(f"prefix_cache_blocks must be >= 1, got {self.prefix_cache_blocks}")
        for key in self.api_keys:
            if not key or any(c.isspace() for c in key):
                raise ValueError("an API key must be non-empty and hold no whitespace")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        for path in self.open_paths:
            if not path.startswith("/"):
                raise ValueError(f"open_paths entries must start with '/', got {path!r}")
