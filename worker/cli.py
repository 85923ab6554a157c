"""The command line of a worker process, generated from WorkerConfig and EngineConfig: every
field is a ``--flag`` (and, through click's ``auto_envvar_prefix``, ``TANDEM_<ROLE>_<FLAG>``)."""

from __future__ import annotations

from collections.abc import Callable

import click

from core.settings import options, take
from engine.config import EngineConfig
from worker.config import WorkerConfig


def worker_command(role: str, default_port: int, help: str) -> Callable[[Callable], click.Command]:
    """A decorator making ``f(worker: WorkerConfig, engine: EngineConfig)`` the ``python -m
    <role>_worker`` command: flags of both configs (``--port`` defaulting to ``default_port``),
    env ``TANDEM_<ROLE>_<FLAG>``; a value either config refuses is a usage error."""

    def decorate(f: Callable[[WorkerConfig, EngineConfig], None]) -> click.Command:
        @click.command(help=help, context_settings={"auto_envvar_prefix": f"TANDEM_{role.upper()}",
                                                    "show_default": True})
        @options(WorkerConfig, defaults={"port": default_port})
        @options(EngineConfig)
        def main(**params) -> None:
            try:
                worker = WorkerConfig(**take(WorkerConfig, params))
                engine = EngineConfig(**take(EngineConfig, params))
            except ValueError as err:
                raise click.UsageError(str(err)) from None
            f(worker, engine)

        return main

    return decorate
