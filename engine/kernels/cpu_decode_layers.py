"""A float32 or bfloat16 Llama decode pass's decoder layers as one C call (``cpu/decode_layers.c``).

The C function runs, layer after layer, the same kernels the eager forward calls one by one
(RMSNorm, the float32 GEMMs, the rotary embedding, the paged KV write and decode attention,
SiLU x up; engine/model/llama.py), taking their function pointers from the libraries that
already hold them, so its result is the eager forward's bit for bit. It saves the Python between
the kernels: a batch-16 decode pass of SmolLM2-135M makes ~420 kernel and tensor calls through
the module tree, during which the OpenMP team's other thread waits (on a 2-core AMD EPYC, Zen 4,
perf found that thread in libgomp's wait 34 % of the pass).

:class:`DecodeLayerStack` takes a pass only where every piece has its C kernel: float32 or
bfloat16 hidden states, weights and KV cache, an all-decode step on the CPU attention backend's
kernel, and every layer's four GEMMs planned on ``fp32_cpu`` (bfloat16: ``bf16_linear``) or
``fp32_stream`` at the pass's M bucket; anything else (prefill, another dtype or backend, int8 or
fp8 weights, an 8-bit cache, tensor parallelism, torch.compile) returns None and the eager layers
run.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.kernels import cpu_build, cpu_decode_attention, cpu_elementwise, cpu_fp32_linear

SOURCE = Path(__file__).parent / "cpu" / "decode_layers.c"


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int, c_float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.decode_layers_fields.restype = c_int
    lib.decode_layers_fns.restype = c_int
    lib.decode_layers_scratch.restype = i64
    lib.decode_layers_scratch.argtypes = [i64] * 6 + [c_int]
    for fn in (lib.decode_layers_f32, lib.decode_layers_bf16):
        fn.restype = c_int
        fn.argtypes = [ptr, ptr, c_int, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, c_int, c_int, c_int, i64,
                       c_float, c_int, i64, c_float, c_int]


_KERNEL = cpu_build.CachedKernel(SOURCE, "CPU decode layer stack", "decode passes call the layers' kernels one by "
                                 "one", _declare, release_gil=True)

# The fields of one layer's row in the C function's table (decode_layers.c's L_* order).
_FIELDS = ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "gate_up_bias", "down", "down_bias",
           "k_cache", "v_cache", "qkv_stream", "o_stream", "gate_up_stream", "down_stream")
_GEMMS = ("qkv", "o", "gate_up", "down")
NUM_KERNELS = 7  # the entries of _kernel_table (decode_layers.c's FN_*)


def load_kernel() -> ctypes.CDLL | None:
    """The compiled library, compiling it first if needed; None (logged once) when it, or a
    library it calls into, cannot be built or loaded here. Thread-safe."""
    lib = _KERNEL.load()
    if lib is None or None in (cpu_elementwise.load_kernel(), cpu_fp32_linear.load_kernel(),
                               cpu_decode_attention.load_kernel()):
        return None
    if lib.decode_layers_fields() != len(_FIELDS) or lib.decode_layers_fns() != NUM_KERNELS:
        raise RuntimeError("decode_layers.c and cpu_decode_layers.py disagree on a layer's fields or the kernels")
    return lib


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _kernel_table(dtype: torch.dtype) -> torch.Tensor:
    """The ``dtype`` kernels' addresses in decode_layers.c's FN_* order, int64."""
    elementwise, linear = cpu_elementwise.load_kernel(), cpu_fp32_linear.load_kernel()
    attention = cpu_decode_attention.load_kernel()
    if dtype == torch.float32:
        fns = (elementwise.rms_norm_f32, elementwise.rotary_f32, attention.paged_kv_write,
               attention.paged_decode_attention_f32, elementwise.silu_mul_f32, linear.fp32_linear,
               linear.fp32_linear_stream)
    else:  # bfloat16 has one GEMM schedule
        fns = (elementwise.rms_norm_bf16, elementwise.rotary_bf16, attention.paged_kv_write,
               attention.paged_decode_attention_bf16, elementwise.silu_mul_bf16, linear.bf16_linear, linear.bf16_linear)
    return torch.tensor([_address(fn) for fn in fns], dtype=torch.int64)


DTYPES = (torch.float32, torch.bfloat16)


class DecodeLayerStack:
    """Runs a :class:`engine.model.llama.LlamaModel`'s layers over a decode pass in one C call.

    ``run(hidden, cos, sin, context)`` takes hidden ``[M, hidden_size]`` (one token per sequence;
    float32 or bfloat16, the model's dtype) and the pass's rotary tables (``[M, 1, head_dim]``,
    the same dtype) and returns the last
    layer's output ``[M, hidden_size]``, writing every layer's K/V into its cache as the eager
    layers do; or None, having changed nothing, when the pass is not one it takes (module
    docstring). Built once per model (:meth:`for_model`); bindings per M bucket are cached and
    rebuilt when a layer's plan changes.
    """

    def __init__(self, lib: ctypes.CDLL, model):
        first = model.layers[0]
        self.dtype = first.input_layernorm.weight.dtype
        self._lib, self._model, self._fns = lib, model, _kernel_table(self.dtype)
        self._run = lib.decode_layers_f32 if self.dtype == torch.float32 else lib.decode_layers_bf16
        attn, mlp = first.self_attn, first.mlp
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden_size, self.intermediate_size = first.input_layernorm.weight.shape[0], mlp.intermediate_size
        self.eps, self.scale = first.input_layernorm.eps, attn.scale
        self._tables: dict[tuple, torch.Tensor | None] = {}

    @classmethod
    def for_model(cls, model) -> DecodeLayerStack | None:
        """The stack for ``model`` (a LlamaModel), or None where its layers are not all the plain
        float32 or bfloat16 Llama layers this runs (or the kernels cannot be built)."""
        from engine.model.linear import Linear

        layers = list(model.layers)
        if not layers:
            return None
        first = layers[0]
        dtype = first.input_layernorm.weight.dtype
        if dtype not in DTYPES:
            return None
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            gemms = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(type(g) is not Linear or g.weight is None or g.weight.dtype != dtype for g in gemms) \
                    or any(n.weight.dtype != dtype or n.eps != first.input_layernorm.eps for n in norms) \
                    or (attn.num_heads, attn.num_kv_heads, attn.head_dim) != \
                    (first.self_attn.num_heads, first.self_attn.num_kv_heads, first.self_attn.head_dim):
                return None
        lib = load_kernel()
        return None if lib is None else cls(lib, model)

    def _table(self, bucket: int, kv_caches: list[torch.Tensor], plan_version: int) -> torch.Tensor | None:
        """The C function's per-layer table at M bucket ``bucket``, or None where a GEMM there runs
        on another backend than fp32_cpu / fp32_stream."""
        # Each layer's K/V addresses follow from the cache's address and shape.
        key = (bucket, kv_caches[0].data_ptr(), tuple(kv_caches[0].shape), len(kv_caches), plan_version)
        if key in self._tables:
            return self._tables[key]
        from engine.model.linear import BACKENDS

        rows = []
        for i, layer in enumerate(self._model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            row = {"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                   "k_cache": kv_caches[i][0], "v_cache": kv_caches[i][1]}
            for name, gemm in zip(_GEMMS, (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
                if gemm.plan is None:
                    row = None
                    break
                code = gemm.plan[min(bucket, len(gemm.plan) - 1)]
                backend = BACKENDS[code]
                if backend not in ("fp32_cpu", "fp32_stream") or gemm.prepared[code].dtype != self.dtype \
                        or not gemm.prepared[code].is_contiguous():
                    row = None
                    break
                row[name], row[name + "_bias"] = gemm.prepared[code], gemm.bias
                row[name + "_stream"] = int(backend == "fp32_stream")
            if row is None:
                self._tables[key] = None
                return None
            rows.append([v if isinstance(v, int) else 0 if v is None else v.data_ptr()
                         for v in (row[f] for f in _FIELDS)])
        table = torch.tensor(rows, dtype=torch.int64)
        self._tables = {k: v for k, v in self._tables.items() if k[1:] == key[1:]}  # drop stale plans / caches
        self._tables[key] = table
        return table

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context) -> torch.Tensor | None:
        """Every layer over one decode pass: hidden ``[M, hidden_size]`` and ``cos`` / ``sin``
        (``[M, 1, head_dim]`` or ``[M, head_dim]``), all in the model's dtype, ``context`` the
        pass's :class:`engine.attention.ForwardContext`. Returns a new ``[M, hidden_size]`` tensor
        and writes each layer's K/V into its cache, or returns None, changing nothing, when the
        pass is not one this runs (class docstring). ``hidden`` itself is not modified.

        Raises:
            MemoryError: a GEMM kernel could not allocate its scratch.
            ValueError: a slot of ``context.meta.slot_mapping`` lies outside the cache (the
                layers before it have run and written their K/V).
        """
        from engine.cpu_attention import CpuAttentionBackend
        from engine.model.linear import m_bucket, plan_version

        backend, meta, caches = context.backend, context.meta, context.kv_caches
        if hidden.dtype != self.dtype or hidden.dim() != 2 or hidden.device.type != "cpu" \
                or type(backend) is not CpuAttentionBackend or backend._kernel is None \
                or meta.max_query_len != 1 or caches[0].dtype != self.dtype or not caches[0].is_contiguous() \
                or (hidden.requires_grad and torch.is_grad_enabled()):
            return None
        m = hidden.shape[0]
        table = self._table(m_bucket(m), caches, plan_version())
        if table is None:
            return None
        plan = backend._plan_for(meta, caches[0].shape[2])
        if plan.decode_tables is None or plan.decode_tables.shape[0] != m or plan.decode_tables.dtype != torch.int64 \
                or plan.decode_lens.dtype != torch.int64 or meta.slot_mapping.dtype != torch.int64:
            return None
        if cos.dtype != self.dtype or sin.dtype != self.dtype:
            return None
        h, kv, d, i = self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size
        hidden = hidden.clone(memory_format=torch.contiguous_format)  # one copy, updated in place
        cos, sin = cos.reshape(m, d).contiguous(), sin.reshape(m, d).contiguous()
        slots = meta.slot_mapping.contiguous()
        scratch = torch.empty(self._lib.decode_layers_scratch(m, self.hidden_size, h, kv, d, i,
                                                              int(self.dtype == torch.bfloat16)), dtype=torch.uint8)
        _, num_blocks, block_size = caches[0].shape[:3]
        status = self._run(
            self._fns.data_ptr(), table.data_ptr(), table.shape[0], hidden.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            slots.data_ptr(), plan.decode_tables.data_ptr(), plan.decode_tables.stride(0), plan.decode_lens.data_ptr(),
            scratch.data_ptr(), m, self.hidden_size, h, kv, d, i, self.eps, block_size, num_blocks * block_size,
            self.scale, torch.get_num_threads())
        if status == -1:
            raise MemoryError("a linear kernel could not allocate its scratch")
        if status > 0:
            raise ValueError(f"layer {status - 1}: a slot of {slots.tolist()} lies outside the cache's "
                             f"{num_blocks * block_size}")
        return hidden
