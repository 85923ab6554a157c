"""``python -m prefill_worker``: serve tandem.v1.PrefillWorker."""

from __future__ import annotations

from core.grpc_service import exit_after
from engine.config import EngineConfig
from prefill_worker.servicer import PrefillServicer
from tandem.v1 import prefill_worker_pb2_grpc
from worker.cli import worker_command
from worker.config import WorkerConfig
from worker.runtime import serve_worker

SERVICE_NAME = "tandem.v1.PrefillWorker"
DEFAULT_PORT = 50061


def _add(service, engine, connector) -> None:
    prefill_worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(engine, connector), service.server)


@worker_command("prefill", DEFAULT_PORT,
                help="Stateless prefill worker: computes prompt KV into the pool and samples the first token.")
def main(worker: WorkerConfig, engine: EngineConfig) -> None:
    serve_worker("prefill", worker, engine, SERVICE_NAME, _add, save_kv_on_finish=True)


if __name__ == "__main__":
    exit_after(main)
