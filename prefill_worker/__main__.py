"""``python -m prefill_worker``: serve tandem.v1.PrefillWorker."""

from __future__ import annotations

import click

from engine.worker_runtime import engine_options, serve_worker, split_config, worker_options
from prefill_worker.servicer import PrefillServicer
from tandem.v1 import prefill_worker_pb2_grpc

SERVICE_NAME = "tandem.v1.PrefillWorker"


def _add(service, engine, connector) -> None:
    prefill_worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(engine, connector), service.server)


@click.command(context_settings={"auto_envvar_prefix": "TANDEM_PREFILL", "show_default": True})
@worker_options(default_port=50061)
@engine_options
def main(**kwargs) -> None:
    """Stateless prefill worker: computes prompt KV into the pool and samples the first token."""
    worker, engine_config, log_level = split_config("prefill", kwargs)
    serve_worker(worker, engine_config, log_level, SERVICE_NAME, _add, save_kv_on_finish=True)


if __name__ == "__main__":
    main()
