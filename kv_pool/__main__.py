"""``python -m kv_pool``: run one KV pool node. Every flag can also come from ``TANDEM_POOL_<FLAG>``;
the flags are PoolConfig's fields (kv_pool.config)."""

from __future__ import annotations

import asyncio
import logging
import sys

import click

from core.grpc_service import exit_after
from core.logging_setup import setup_logging
from core.settings import options
from kv_pool.config import PoolConfig
from kv_pool.server import serve

ENV_PREFIX = "TANDEM_POOL_"


@click.command()
@options(PoolConfig, envvar_prefix=ENV_PREFIX)
@click.option("--log-level", default="INFO", envvar=ENV_PREFIX + "LOG_LEVEL", show_envvar=True, show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def main(log_level: str, **flags) -> None:
    """Run one KV pool node (docs/design.md §4-§6) until SIGTERM."""
    try:
        config = PoolConfig(**flags)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    setup_logging("kv_pool", log_level)
    try:
        asyncio.run(serve(config))
    except Exception:  # e.g. Redis unreachable, port taken: say why as a JSON line
        logging.getLogger("kv_pool").exception("kv_pool failed")
        sys.exit(1)


if __name__ == "__main__":
    exit_after(main)
