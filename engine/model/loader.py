"""Builds an engine model from a Hugging Face folder (config.json + safetensors); a GGUF file is
converted to one first (engine.model.gguf_convert)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.config import INT8_QUANTIZATIONS
from engine.model.fp8_linear import check_cuda_fp8
from engine.model.linear import planned_layers
from engine.model.linear_chooser import LinearSetup, plan_linears
from engine.model.llama import LlamaForCausalLM, fuse_checkpoint

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_model(hf_dir: Path, dtype: str, device: str, max_positions: int,
               linear: LinearSetup | None = LinearSetup(),
               shard: Callable[[LlamaForCausalLM], None] | None = None,
               quantization: str = "none") -> LlamaForCausalLM:
    """Loads weights from every ``*.safetensors`` file in ``hf_dir`` (transformers' layout: the
    separate Q/K/V and gate/up projections are fused on load), then, with ``linear``, gives every
    linear layer its GEMM backend per M bucket, measured or cached per machine
    (:mod:`engine.model.linear_chooser`); ``linear=None`` leaves plain ``F.linear``.

    ``shard``: called on the loaded model while it is still on the CPU, before it moves to
    ``device`` and its linear layers are planned (a tensor-parallel rank keeps its slice: engine.parallel.layers).

    ``quantization="w8a16"``: every linear layer (the fused QKV and gate/up projections, O, down
    and the LM head) is quantised from the float32 checkpoint after sharding, before planning
    (:func:`quantize_linears`); the embedding, the norms and the biases stay float32; activations
    keep 16 bits or more. ``quantization="int8"``: the same, and the O and gate/up projections
    also round their activations to 8 bits per row (W8A8 there: :data:`W8A8_LAYERS`).
    ``quantization="fp8"``: every linear layer's weight in float8 e4m3 and its input rows rounded
    to float8 at each GEMM (:mod:`engine.model.fp8_linear`), any float ``dtype``; its GEMMs are
    ``torch._scaled_mm`` on a CUDA GPU of compute capability 8.9 or later, the dequantised
    reference on the CPU (tests); no backend plan.

    Raises:
        FileNotFoundError: no safetensors file in the folder.
        ValueError: unsupported model_type, a weight missing from the checkpoint,
            ``max_positions`` beyond the model's ``max_position_embeddings``, a quantization
            other than "none", "int8", "w8a16" and "fp8" (the int8 ones with a dtype other than
            float32), or "fp8" on a CUDA GPU without float8 GEMMs (engine.model.fp8_linear.check_cuda_fp8).
    """
    int8 = quantization in INT8_QUANTIZATIONS
    if not (quantization in ("none", "fp8") or int8) or (int8 and dtype != "float32"):
        raise ValueError(f"quantization must be 'none', 'fp8', or {' or '.join(map(repr, INT8_QUANTIZATIONS))} with "
                         f"dtype float32; got {quantization!r} with {dtype!r}")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max_positions > limit:
        raise ValueError(f"--max-model-len {max_positions} exceeds the model's max_position_embeddings ({limit}) "
                         f"in {hf_dir}; pass --max-model-len {limit} or less")
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
    if int8:
        quantize_linears(model, w8a8=quantization == "int8")
    if quantization == "fp8":
        layers = planned_layers(model)
        if torch.device(device).type == "cuda":
            check_cuda_fp8(device, [tuple(layer.gemm_weight.shape) for layer in layers])
        for layer in layers:
            layer.quantize_fp8()
    elif linear is not None:
        plan_linears(model, linear)
    return model


# The layers whose activations ``--quantization int8`` rounds to 8 bits: the attention output and
# the MLP's gate/up, 59 % of a decoder layer's multiply-adds. QKV's input (the attention norm's
# output) costs the most perplexity at 8 bits; down's (SiLU(gate) x up, with its outlier channels)
# and the LM head's next; with down at 8 bits too a plain question got a wrong answer
# (docs/quantization.md).
W8A8_LAYERS = ("self_attn.o_proj", "mlp.gate_up_proj")


def quantize_linears(model: LlamaForCausalLM, w8a8: bool = False) -> None:
    """Quantises every linear layer's weight to int8, per output channel, symmetric
    (:meth:`engine.model.linear.Linear.quantize_int8`); with ``w8a8`` the :data:`W8A8_LAYERS`
    round their activations to 8 bits per row too. Mutates ``model``.

    The LM head is quantised too: it is the largest GEMM of a small model (49152 x 576 in
    SmolLM2-135M, a fifth of its weights) and its int8 error measured no worse than the decoder
    layers' (docs/quantization.md). A tied LM head gets its own int8 copy; the embedding stays
    float32, since a lookup reads one row per token and float rows keep it exact.
    """
    w8a8_layers = {id(module) for name, module in model.named_modules() if w8a8 and name.endswith(W8A8_LAYERS)}
    for layer in planned_layers(model):
        layer.quantize_int8(8 if id(layer) in w8a8_layers else 16)
