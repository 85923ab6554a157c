"""Llama-family decoder (Llama, SmolLM, Qwen2-style configs) over a paged KV cache.

Tokens of every request in a step are flattened into one ``[num_tokens, hidden]`` batch (no
padding); attention reads each request's context through the forward context's block tables.

Q, K and V are one fused projection (``qkv_proj``), and so are the MLP's gate and up
(``gate_up_proj``): one GEMM reads the input once instead of three or two times.
:func:`engine.model.loader.load_model` fuses transformers' ``LlamaForCausalLM`` checkpoints
(``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``) on load, so they load unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import get_forward_context, paged_attention
from engine.kernels import cpu_elementwise
from engine.kernels.cpu_decode_layers import DecodeLayerStack
from engine.model.linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = cpu_elementwise.usable(x)
        if kernel is not None and self.weight.dtype == x.dtype:  # one C loop per row (torch: six ops or more)
            return cpu_elementwise.rms_norm(kernel, x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused op; bitwise equal to the lines below in float32
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer), half-split layout as in transformers' Llama.

    Non-default rope types (llama3, yarn, ...) take their inverse frequencies from transformers'
    ``ROPE_INIT_FUNCTIONS``, so scaled variants match the reference exactly.
    """

    def __init__(self, config, head_dim: int, max_positions: int):
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)  # [max_positions, head_dim]
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of ``positions`` ([num_tokens]): two [num_tokens, 1, head_dim] in ``dtype``,
        looked up once per forward and shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates ``x`` ([num_tokens, num_heads, head_dim]) by the positions' angles: a new tensor,
        or on the CPU in float32 and bfloat16 ``x`` itself, rotated in place (one C loop, bitwise
        the same)."""
        kernel = cpu_elementwise.usable(x)
        if kernel is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2] and cos.dtype == sin.dtype == x.dtype:
            return cpu_elementwise.rotary_(kernel, x, cos, sin)
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        qkv_bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        hidden = config.hidden_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Rows: [q (num_heads x head_dim) | k (num_kv_heads x head_dim) | v (same)].
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden, bias=getattr(config, "attention_bias", False))

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        """rope: (cos, sin) of this step's positions (RotaryEmbedding.tables); hidden
        [num_tokens, hidden_size] -> [num_tokens, hidden_size]."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [num_tokens, (num_heads + 2 x num_kv_heads) x head_dim]
        # Q and K are adjacent in the fused output: rotate them together, in one pass.
        qk, v = qkv.split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        qk = RotaryEmbedding.apply(qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), *rope)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, self.layer_idx, self.scale)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.intermediate_size = config.intermediate_size
        # Rows: [gate (intermediate) | up (intermediate)].
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        kernel = cpu_elementwise.usable(gate_up)
        if kernel is not None and gate_up.dim() == 2:
            return self.down_proj(cpu_elementwise.silu_mul(kernel, gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(config, head_dim, max_positions)  # tables looked up once per pass
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    # Decode passes on the CPU run every layer in one C call where they can (bit for bit the
    # loop below; engine.kernels.cpu_decode_layers); False always runs the loop.
    fused_decode_layers = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, hidden.dtype)
        stack = self._decode_stack() if hidden.device.type == "cpu" else None
        fused = None if stack is None else stack.run(hidden, *rope, get_forward_context())
        if fused is not None:
            hidden = fused
        else:
            for layer in self.layers:
                hidden = layer(rope, hidden)
        return self.norm(hidden)

    def _decode_stack(self) -> DecodeLayerStack | None:
        """This model's DecodeLayerStack, built on the first call; None where it cannot run here
        (also under torch.compile, which traces the loop)."""
        if not self.fused_decode_layers or torch.compiler.is_compiling():
            return None
        if not hasattr(self, "_stack"):
            self._stack = DecodeLayerStack.for_model(self)
        return self._stack


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [num_tokens], positions [num_tokens], logits_indices [num_seqs])``
    returns logits ``[num_seqs, vocab_size]`` in float32 for the selected tokens only."""

    SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")

    def __init__(self, config, max_positions: int):
        super().__init__()
        if config.model_type not in self.SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r} is not one of {self.SUPPORTED_MODEL_TYPES}")
        self.config = config
        self.model = LlamaModel(config, max_positions)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids, positions)
        return self.lm_head(hidden[logits_indices]).float()


# transformers' per-projection weights -> the fused ones: (fused, [parts in row order]).
FUSED_PROJECTIONS = (
    ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
)


def fuse_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rewrites a transformers Llama state dict's separate projections into the fused ones
    (weights and biases concatenated along the output dim); other keys pass through. Returns a
    new dict; a checkpoint already fused passes unchanged."""
    fused = dict(state)
    for key in list(state):
        for target, parts in FUSED_PROJECTIONS:
            first = parts[0]
            for suffix in (".weight", ".bias"):
                if not key.endswith(first + suffix):
                    continue
                prefix = key[: -len(first + suffix)]
                names = [prefix + part + suffix for part in parts]
                if all(name in fused for name in names):
                    fused[prefix + target + suffix] = torch.cat([fused.pop(name) for name in names], dim=0)
    return fused
