"""``python -m router``: the Tandem router. Every flag can also come from ``TANDEM_ROUTER_<FLAG>``."""

from __future__ import annotations

import asyncio

import click

from core.grpc_service import run_until_signalled
from core.logging_setup import setup_logging
from core.model_source import DEFAULT_MODEL
from router.api.auth import load_api_keys
from router.config import DEFAULT_OPEN_PATHS, DISAGGREGATION_MODES, ROUTING_POLICIES, RouterConfig
from router.server import RouterServer


def _option(name: str, **kwargs):
    env = "TANDEM_ROUTER_" + name.lstrip("-").replace("-", "_").upper()
    return click.option(name, envvar=env, show_envvar=True, show_default=True, **kwargs)


@click.command()
@_option("--host", default="127.0.0.1", help="Interface both servers bind.")
@_option("--http-port", default=8000, type=int, help="OpenAI-compatible HTTP port.")
@_option("--grpc-port", default=50050, type=int, help="tandem.v1.Router gRPC port.")
@_option("--redis-url", default="redis://127.0.0.1:6379/0", help="Control-plane Redis (worker registry).")
@_option("--model", default=DEFAULT_MODEL, help="Bundled model name, .gguf file or HF folder.")
@_option("--served-model-name", default="", help="Name clients send as `model` (default: the model's).")
@_option("--max-model-len", default=2048, type=int, help="Context limit in tokens.")
@_option("--default-max-tokens", default=16, type=int, help="max_tokens of a completion that omits it (a chat may use the rest of the context).")
@_option("--request-timeout-s", default=600.0, type=float, help="Deadline of one request's worker calls.")
@_option("--routing-policy", default="predicted_latency", type=click.Choice(list(ROUTING_POLICIES)),
         help="How requests are placed on workers.")
@_option("--disaggregation", default="auto", type=click.Choice(list(DISAGGREGATION_MODES)),
         help="auto: prefill on the decode worker when predicted faster; always; never (colocated).")
@_option("--ttft-slo-s", default=0.0, type=float, help="TTFT SLO in seconds for placement and admission (0: none).")
@_option("--tbt-slo-s", default=0.0, type=float, help="Time-between-tokens SLO in seconds (0: none).")
@_option("--max-queue-s", default=0.5, type=float,
         help="Refuse (429) a request that cannot meet the SLOs only when the queue ahead takes longer than this.")
@_option("--prefix-cache-blocks", default=8192, type=int, help="Blocks remembered per worker in the prefix view.")
@click.option("--api-key", "api_keys", multiple=True, envvar=["TANDEM_ROUTER_API_KEY", "TANDEM_API_KEY"],
              show_envvar=True, help="A key clients must send as 'Authorization: Bearer <key>' on HTTP and gRPC "
                                     "(repeat, or separate with spaces/commas, for several). Unset: open.")
@_option("--api-key-file", default="", help="A file of API keys, one a line (# comments), added to --api-key.")
@_option("--open-paths", default=",".join(DEFAULT_OPEN_PATHS),
         help="HTTP paths served without an API key, comma-separated ('' for none).")
@_option("--log-level", default="INFO", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def main(log_level: str, api_keys: tuple[str, ...], api_key_file: str, open_paths: str, **flags) -> None:
    """Runs the router until SIGTERM/SIGINT."""
    setup_logging("router", log_level)
    try:
        keys = load_api_keys(api_keys, api_key_file)
        config = RouterConfig(**flags, api_keys=keys, open_paths=tuple(p for p in open_paths.split(",") if p))
    except ValueError as err:
        raise click.BadParameter(str(err)) from err
    server = RouterServer(config)
    asyncio.run(run_until_signalled(server.start, server.stop))


if __name__ == "__main__":
    main()
