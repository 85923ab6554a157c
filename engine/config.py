"""Engine configuration: one frozen dataclass, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from core.kv_cache_spec import DTYPE_BYTES, KV_CACHE_DTYPES
from core.model_source import DEFAULT_MAX_MODEL_LEN, DEFAULT_MODEL
from core.settings import setting

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
# engine.model.linear.BACKENDS: float weights (onednn, mkl, torch, fp32_cpu, fp32_stream), then int8 weights
# (int8_cpu, ...).
LINEAR_BACKEND_CHOICES = ("auto", "onednn", "mkl", "torch", "fp32_cpu", "fp32_stream", "int8_cpu", "int8_dequant", "int8pack",
                          "int8_onednn")
# Weight quantisation (vLLM's --quantization): both int8 modes quantise the linear layers' weights at
# load (engine.model.linear.quantize_int8). "int8" also rounds the attention output's and the MLP
# gate/up's activations to 8 bits per row (W8A8 there, engine.model.loader.W8A8_LAYERS; W8A16
# elsewhere); "w8a16" keeps every activation at 16 bits or more (weight-only); "fp8" (CUDA only)
# stores the weights in float8 e4m3 and rounds every GEMM's input rows to float8
# (engine.model.fp8_linear).
QUANTIZATIONS = ("none", "int8", "w8a16", "fp8")
INT8_QUANTIZATIONS = ("int8", "w8a16")
SCHEDULING_POLICIES = ("continuous", "static")
PREEMPTION_MODES = ("swap", "recompute")
DTYPES = tuple(DTYPE_BYTES)


@dataclass(frozen=True)
class EngineConfig:
    """Sizes and switches of one engine (a prefill or a decode worker's model + KV cache): each
    field's default and help text are the workers' ``--flag`` and ``tandem up``'s (core.settings).

    Raises:
        ValueError: quoting the offending value.
    """

    model: str = setting(DEFAULT_MODEL, "Bundled name, .gguf file or HF folder.")
    dtype: str = setting("float32", "Weights and KV cache.", choices=DTYPES)
    device: str = setting("cpu", "torch device: cpu, cuda, cuda:1, ...")
    block_size: int = setting(16, "Tokens per KV block.")
    num_kv_blocks: int = setting(1024, "Blocks in this worker's paged KV cache.")
    max_num_seqs: int = setting(64, "Most requests in one step's batch.")
    max_num_batched_tokens: int = setting(2048, "Token budget of one step (Sarathi-Serve); prompts are chunked "
                                                "to fit.")
    max_model_len: int = setting(DEFAULT_MAX_MODEL_LEN, "Longest prompt + output in tokens; at most the model's "
                                                        "max_position_embeddings.")
    # Sarathi-Serve's stall bound for a step that also decodes: a prompt prefilled beside running
    # decodes (a decode worker's local prefill, a colocated engine's) is chunked to at most this
    # many tokens per step, so no running stream waits a long prompt chunk's compute; steps
    # without running decodes keep the whole token budget. 0: the token budget.
    max_mixed_prefill_tokens: int = setting(0, "Most prompt tokens a step computes beside running decodes (0: the "
                                               "token budget); longer prompts are chunked over more steps, so "
                                               "decoding streams never wait a long chunk. tandem up gives a decode "
                                               "worker that shares one machine's cores with a prefill worker 12 "
                                               "where this is 0 (--no-share-cores: none).")
    enable_chunked_prefill: bool = setting(True, "Split prompts over steps to fit the token budget.")
    enable_prefix_caching: bool = setting(True, "Reuse the KV of identical prompt prefixes in this worker's cache "
                                                "(vLLM prefix caching).")
    # "continuous": requests join and leave at every step (Orca); "static": a batch is admitted
    # only when the previous one has completely finished (request-level batching, the baseline).
    scheduling_policy: str = setting("continuous", "continuous (Orca) or static batching (the baseline).",
                                     choices=SCHEDULING_POLICIES)
    # Decode steps run per scheduling decision (vLLM multi-step); 1 schedules every step.
    num_scheduler_steps: int = setting(1, "Decode passes per scheduling decision (multi-step).")
    # Prepare step k+1 (admission, allocation, input tensors) while step k runs (SGLang's
    # overlap scheduler); tokens sampled by step k are patched in when it completes.
    enable_overlap: bool = setting(False, "Schedule step k+1 while step k runs.")
    # What preemption does with the victim's KV: "swap" it out (to the KV pool on a worker with
    # one, else host memory) and load it back on resume, or "recompute" it.
    preemption_mode: str = setting("swap", "A preempted request's KV: swapped to the pool (or host memory) or "
                                           "recomputed.", choices=PREEMPTION_MODES)
    swap_space_bytes: int = setting(1 << 30, "Host-memory swap space when no pool is attached.", byte_size=True)
    attention_backend: str = setting("auto", "auto: triton on CUDA, cpu elsewhere; torch is the readable "
                                             "reference.", choices=ATTENTION_BACKENDS)
    # Run the model eagerly (True) or torch.compile'd per layer (False); None: compiled on CUDA,
    # eager on the CPU, where the compiled forward measured no faster (its GEMMs and attention
    # are opaque MKL / C calls either way, and the custom-op boundaries cost what fusing the
    # elementwise ops saves; docs/bench.md).
    enforce_eager: bool | None = setting(
        None, "Eager model (--enforce-eager) or torch.compile'd per layer (--no-enforce-eager; ~5-10 s on the "
              "first start, cached afterwards). Default: compiled on CUDA, eager on the CPU, where compiling "
              "measured no faster.")
    # GEMM backend of the linear layers (engine.model.linear): "auto" measures the candidates on
    # the model's shapes once per machine and keeps the fastest per shape and M bucket; "onednn",
    # "mkl", "torch", "fp32_cpu" or "fp32_stream" forces one wherever it can run.
    linear_backend: str = setting("auto", "GEMM backend of the linear layers; auto measures them once per machine "
                                          "on the model's shapes and keeps the fastest per shape and batch size.",
                                  choices=LINEAR_BACKEND_CHOICES)
    quantization: str = setting("none", "Weight quantisation: int8 quantises the linear layers' weights at load "
                                        "(per output channel, symmetric) and rounds the attention output's and "
                                        "the MLP gate/up's activations to 8 bits per token (W8A8 there, fast "
                                        "where the CPU has VNNI); w8a16 quantises the same weights and keeps "
                                        "every activation at 16 bits or more (weight-only, closer to float32); "
                                        "fp8 (CUDA GPUs of compute capability 8.9+) stores the weights in "
                                        "float8 e4m3 and rounds every GEMM's input rows to float8.",
                                choices=QUANTIZATIONS)
    # KV cache element type (vLLM's --kv-cache-dtype): "auto" is the model's dtype; "fp8" (float8
    # e4m3fn) and "int8" store 8-bit K/V with one float32 scale per token and head
    # (engine.kv_cache.kv_quant, docs/quantization.md).
    kv_cache_dtype: str = setting("auto", "KV cache dtype: auto (the model's dtype), fp8 (float8 e4m3) or int8, "
                                          "8-bit values with a float32 scale per token and head.",
                                  choices=KV_CACHE_DTYPES)
    num_threads: int = setting(0, "torch intra-op threads (0: torch's default).")
    seed: int = setting(0, "Seed of the generator used by requests without their own seed.")
    # Rank processes that shard the model (engine.parallel); 1: one process, no process group.
    tensor_parallel_size: int = setting(1, "Rank processes sharding the model (one GPU each on CUDA; gloo on the "
                                           "CPU). --num-threads is per rank.")

    @property
    def compiled(self) -> bool:
        """Whether the engine runs the torch.compile'd forward."""
        if self.enforce_eager is None:
            return self.device.startswith("cuda")
        return not self.enforce_eager

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be 'swap' or 'recompute', got {self.preemption_mode!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "num_scheduler_steps", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_mixed_prefill_tokens < 0:
            raise ValueError(f"max_mixed_prefill_tokens must be >= 0 (0: the token budget), got "
                             f"{self.max_mixed_prefill_tokens}")
        if self.enable_overlap and self.tensor_parallel_size > 1:
            # Overlap packs finished requests' KV on the engine thread while the forward thread
            # runs the next pass: two threads would drive the ranks' collectives at once.
            raise ValueError(f"enable_overlap needs tensor_parallel_size 1, got {self.tensor_parallel_size}")
        if self.linear_backend not in LINEAR_BACKEND_CHOICES:
            raise ValueError(f"linear_backend must be one of {LINEAR_BACKEND_CHOICES}, got {self.linear_backend!r}")
        self._check_quantization()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )
        if self.num_kv_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"num_kv_blocks * block_size ({self.num_kv_blocks * self.block_size}) cannot hold "
                f"one max_model_len ({self.max_model_len}) request"
            )

    def _check_quantization(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization == "fp8" and not self.device.startswith("cuda"):
            raise ValueError(f"quantization 'fp8' runs on CUDA GPUs with float8 GEMMs (compute capability 8.9 or "
                             f"later), not on device {self.device!r}: use 'int8' or 'w8a16' there")
        if self.quantization in INT8_QUANTIZATIONS and self.dtype != "float32":
            raise ValueError(f"quantization {self.quantization!r} takes float32 activations: it needs dtype "
                             f"'float32', got {self.dtype!r}")
