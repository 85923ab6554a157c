"""``python -m decode_worker``: serve tandem.v1.DecodeWorker."""

from __future__ import annotations

from core.grpc_service import exit_after
from decode_worker.servicer import DecodeServicer
from engine.config import EngineConfig
from tandem.v1 import decode_worker_pb2_grpc
from worker.cli import worker_command
from worker.config import WorkerConfig
from worker.runtime import serve_worker

SERVICE_NAME = "tandem.v1.DecodeWorker"
DEFAULT_PORT = 50071


def _add(service, engine, connector) -> None:
    decode_worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(engine, connector), service.server)
    swap = connector.swap_space()  # preempted KV goes to the pool when its nodes are fixed by flag
    if swap is not None:
        engine.use_swap_space(swap)


@worker_command("decode", DEFAULT_PORT,
                help="Continuous-batching decode worker: loads prompt KV from the pool and streams tokens.")
def main(worker: WorkerConfig, engine: EngineConfig) -> None:
    serve_worker("decode", worker, engine, SERVICE_NAME, _add, save_kv_on_finish=False)


if __name__ == "__main__":
    exit_after(main)
