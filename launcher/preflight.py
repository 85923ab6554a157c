"""Checks ``tandem up`` runs before it starts (or touches) anything: free ports, sizes that fit,
a model that exists and a context it supports. Each failure is one line naming the flag to change.
"""

from __future__ import annotations

import errno
import socket


class PreflightError(ValueError):
    """A setting ``tandem up`` cannot start with; the message is one line for the user."""


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    """Raises PreflightError for the first port (by its flag, e.g. ``--http-port``) outside
    [0, 65535] or that another process listens on; port 0 (pick a free one) is skipped.

    Binds with SO_REUSEADDR as the servers do, so a port left in TIME_WAIT by a stopped cluster
    counts as free.
    """
    for flag, port in ports.items():
        if not 0 <= port <= 65535:
            raise PreflightError(f"{flag} must be in [0, 65535], got {port}")
        if port == 0:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    raise PreflightError(f"port {port} is in use (another tandem up?); pass {flag}") from None
                raise PreflightError(f"cannot bind {host}:{port} ({err.strerror}); check --host and {flag}") from None


def check_engine_sizes(block_size: int, num_kv_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
                       max_model_len: int) -> None:
    """The workers' engine limits, checked as the workers will (engine.config.EngineConfig).

    Raises:
        PreflightError: with the flags and numbers.
    """
    from engine.config import EngineConfig  # torch-free

    try:
        EngineConfig(block_size=block_size, num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len)
    except ValueError as err:
        flags = (f"--num-kv-blocks {num_kv_blocks} --block-size {block_size} --max-model-len {max_model_len} "
                 f"--max-num-seqs {max_num_seqs} --max-num-batched-tokens {max_num_batched_tokens}")
        raise PreflightError(f"{err} ({flags})") from None
