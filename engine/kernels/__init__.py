"""Triton kernels for the engine's hot paths, each beside the torch reference it must match.

Every module holds one kernel and a plain Python wrapper that allocates the output and launches
it. Without a GPU the kernels run only under Triton's interpreter, which must be switched on
(``TRITON_INTERPRET=1``) before any module of this package is imported: ``triton.jit`` picks
compiled or interpreted at decoration time.
"""

from __future__ import annotations

import torch


def check_launchable(kernel, tensor: torch.Tensor) -> None:
    """Raises RuntimeError when ``kernel`` cannot run on ``tensor``'s device.

    A compiled kernel needs CUDA tensors; an interpreted one (``TRITON_INTERPRET=1``) takes any.
    """
    if tensor.is_cuda or is_interpreted(kernel):
        return
    raise RuntimeError(
        f"Triton kernel {getattr(kernel, '__name__', kernel)} got a "
        f"{tensor.device} tensor: run on a CUDA device, or set TRITON_INTERPRET=1 before "
        "engine.kernels is imported"
    )


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` was decorated while ``TRITON_INTERPRET=1`` was set."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)
