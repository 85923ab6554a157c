"""Builds an engine model from a Hugging Face folder (config.json + safetensors)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.model.linear_chooser import LinearSetup, plan_linears
from engine.model.llama import LlamaForCausalLM, fuse_checkpoint

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_model(hf_dir: Path, dtype: str, device: str, max_positions: int,
               linear: LinearSetup | None = LinearSetup(),
               shard: Callable[[LlamaForCausalLM], None] | None = None) -> LlamaForCausalLM:
    """Loads weights from every ``*.safetensors`` file in ``hf_dir`` (transformers' layout: the
    separate Q/K/V and gate/up projections are fused on load), then, with ``linear``, gives every
    linear layer its GEMM backend per M bucket, measured or cached per machine
    (:mod:`engine.model.linear_chooser`); ``linear=None`` leaves plain ``F.linear``.

    ``shard``: called on the loaded model while it is still on the CPU, before it moves to
    ``device`` and its linear layers are planned (a tensor-parallel rank keeps its slice: engine.parallel.layers).

    Raises:
        FileNotFoundError: no safetensors file in the folder.
        ValueError: unsupported model_type, or a weight missing from the checkpoint.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions)
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    state = fuse_checkpoint(state)
    expected = set(model.state_dict())
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    if tied:
        expected.discard("lm_head.weight")
    missing = expected - set(state)
    if missing:
        raise ValueError(f"checkpoint {hf_dir} lacks {sorted(missing)[:5]}")
    torch_dtype = TORCH_DTYPES[dtype]
    state = {k: v.to(torch_dtype) for k, v in state.items() if k in expected}
    model.load_state_dict(state, assign=True, strict=False)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Rotary tables are buffers built on "meta": rebuild them on the target device.
    rotary = model.model.rotary
    model.model.rotary = type(rotary)(config, rotary.cos.shape[-1], max_positions)
    if shard is not None:
        shard(model)
    model = model.to(device).eval()
    if linear is not None:
        plan_linears(model, linear)
    return model
