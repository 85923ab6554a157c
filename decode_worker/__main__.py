"""``python -m decode_worker``: serve tandem.v1.DecodeWorker."""

from __future__ import annotations

import click

from decode_worker.servicer import DecodeServicer
from engine.worker_runtime import engine_options, serve_worker, split_config, worker_options
from tandem.v1 import decode_worker_pb2_grpc

SERVICE_NAME = "tandem.v1.DecodeWorker"


def _add(service, engine, connector) -> None:
    decode_worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(engine, connector), service.server)
    swap = connector.swap_space()  # preempted KV goes to the pool when its nodes are fixed by flag
    if swap is not None and engine.engine.config.preemption_mode == "swap":
        engine.engine.use_swap_space(swap)


@click.command(context_settings={"auto_envvar_prefix": "TANDEM_DECODE", "show_default": True})
@worker_options(default_port=50071)
@engine_options
def main(**kwargs) -> None:
    """Continuous-batching decode worker: loads prompt KV from the pool and streams tokens."""
    worker, engine_config, log_level = split_config("decode", kwargs)
    serve_worker(worker, engine_config, log_level, SERVICE_NAME, _add, save_kv_on_finish=False)


if __name__ == "__main__":
    main()
