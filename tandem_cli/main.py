"""``tandem``: the command-line entry point; each subcommand lives with what it runs."""

from __future__ import annotations

import click

from bench.cli import bench
from chaos.cli import chaos
from sim.cli import plan, sim
from tandem_cli.status import status_command
from tandem_cli.up import up


@click.group()
def main() -> None:
    """Tandem: disaggregated prefill/decode LLM serving."""


main.add_command(up)
main.add_command(status_command)
main.add_command(bench)
main.add_command(sim)
main.add_command(plan)
main.add_command(chaos)

if __name__ == "__main__":
    main()
