"""``python -m router``: the Tandem router. Every flag can also come from ``TANDEM_ROUTER_<FLAG>``;
the flags are RouterConfig's fields (router.config)."""

from __future__ import annotations

import asyncio

import click

from core.grpc_service import exit_after, run_until_signalled
from core.logging_setup import setup_logging
from core.settings import options
from router.api.auth import load_api_keys
from router.config import RouterConfig
from router.server import RouterServer

ENV_PREFIX = "TANDEM_ROUTER_"


@click.command()
@options(RouterConfig, envvar_prefix=ENV_PREFIX)
@click.option("--api-key", "api_keys", multiple=True, envvar=["TANDEM_ROUTER_API_KEY", "TANDEM_API_KEY"],
              show_envvar=True, help="A key clients must send as 'Authorization: Bearer <key>' on HTTP and gRPC "
                                     "(repeat, or separate with spaces/commas, for several). Unset: open.")
@click.option("--api-key-file", default="", envvar=ENV_PREFIX + "API_KEY_FILE", show_envvar=True,
              help="A file of API keys, one a line (# comments), added to --api-key.")
@click.option("--log-level", default="INFO", envvar=ENV_PREFIX + "LOG_LEVEL", show_envvar=True, show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def main(log_level: str, api_keys: tuple[str, ...], api_key_file: str, **flags) -> None:
    """Runs the router until SIGTERM/SIGINT."""
    setup_logging("router", log_level)
    try:
        config = RouterConfig(**flags, api_keys=load_api_keys(api_keys, api_key_file))
    except ValueError as err:
        raise click.BadParameter(str(err)) from err
    server = RouterServer(config)
    asyncio.run(run_until_signalled(server.start, server.stop))


if __name__ == "__main__":
    exit_after(main)
