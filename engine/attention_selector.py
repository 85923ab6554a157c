"""Chooses a worker's attention backend from its config (vLLM's ``attention/selector.py``).

The engine (rank 0) and every other tensor-parallel rank build their ModelRunner with the
backend chosen here, so all ranks of a worker attend the same way.
"""

from __future__ import annotations

from engine.attention import AttentionBackend, TorchAttentionBackend
from engine.config import EngineConfig
from engine.cpu_attention import CpuAttentionBackend


def make_attention_backend(config: EngineConfig) -> AttentionBackend:
    """``auto`` picks Triton on a CUDA device and the CPU backend elsewhere.

    Raises:
        ValueError: ``config.attention_backend`` names no backend of this build, or Triton is
            not installed.
    """
    name = config.attention_backend
    if name == "auto":
        name = "triton" if config.device.startswith("cuda") else "cpu"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        return CpuAttentionBackend()
    if name == "triton":
        try:
            from engine.triton_attention import TritonAttentionBackend  # imports triton: only when chosen
        except ModuleNotFoundError as err:
            if err.name != "triton":
                raise
            raise ValueError("the triton attention backend needs Triton: pip install 'tandem-serve[gpu]'") from None
        return TritonAttentionBackend()
    raise ValueError(f"attention backend {name!r} is not available in this build")
