"""What ``tandem up`` needs to know of a model before it starts anything: its size (for the
memory check, :mod:`launcher.machine_fit`) and the context it supports (``--max-model-len``),
read from the Hugging Face folder or, before the one-time conversion, from the GGUF file's
metadata. Never imports torch.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from core.kv_cache_spec import DTYPE_BYTES, kv_bytes_per_token
from core.model_source import ModelSource
from launcher.preflight import PreflightError

_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class ModelShape:
    """A decoder's size: parameters, and the attention shape that sets its KV cache."""

    num_params: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None  # None: the model does not say

    def weight_bytes(self, dtype: str) -> int:
        """Bytes of the weights in ``dtype`` (float32, bfloat16, float16)."""
        return self.num_params * DTYPE_BYTES[dtype]

    def kv_block_bytes(self, block_size: int, dtype: str, kv_cache_dtype: str = "auto") -> int:
        """Bytes of one paged-KV block: K and V of every layer for ``block_size`` tokens, in
        ``dtype``, or with an 8-bit ``kv_cache_dtype`` (fp8, int8) one byte per value plus a
        4-byte scale per (token, head) row: core.kv_cache_spec.kv_bytes_per_token, as
        KVCacheSpec.block_bytes counts it."""
        return block_size * kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, DTYPE_BYTES[dtype],
                                               kv_cache_dtype)

    @classmethod
    def from_hf_dir(cls, folder: Path) -> ModelShape:
        """From ``config.json`` and the safetensors files' headers (the parameter count; from the
        config's shapes when there is no safetensors file).

        Raises:
            FileNotFoundError: no config.json. KeyError: a config without the Llama-family fields.
        """
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        kv_heads = config.get("num_key_value_heads") or heads
        files = sorted(folder.glob("*.safetensors"))
        params = sum(_safetensors_numel(f) for f in files) if files else _llama_params(config, head_dim, kv_heads)
        return cls(params, config["num_hidden_layers"], kv_heads, head_dim, config.get("max_position_embeddings"))

    @classmethod
    def from_gguf(cls, path: Path) -> ModelShape:
        """From a GGUF file's metadata and tensor shapes (the ``gguf`` reader: a few seconds)."""
        from gguf import GGUFReader

        reader = GGUFReader(path)

        def field(key: str) -> int | None:
            entry = reader.fields.get(key)
            return None if entry is None else int(entry.parts[entry.data[0]][0])

        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
        heads = field(f"{arch}.attention.head_count")
        head_dim = field(f"{arch}.attention.key_length") or field(f"{arch}.embedding_length") // heads
        params = sum(int(_product(t.shape)) for t in reader.tensors)
        return cls(params, field(f"{arch}.block_count"), field(f"{arch}.attention.head_count_kv") or heads, head_dim,
                   field(f"{arch}.context_length"))


def read_shape(source: ModelSource) -> ModelShape:
    """``source``'s shape: from its Hugging Face folder (a converted GGUF's too), else from the GGUF.

    Raises:
        FileNotFoundError: neither exists.
    """
    folder = source.converted_dir
    if (folder / "config.json").is_file():
        return ModelShape.from_hf_dir(folder)
    if source.is_gguf:
        return ModelShape.from_gguf(source.path)
    raise FileNotFoundError(f"no config.json in {folder}")


def check_max_model_len(shape: ModelShape, max_model_len: int, flag: str = "--max-model-len") -> None:
    """``max_model_len`` against the model's ``max_position_embeddings`` (a model that states
    none is not checked).

    Raises:
        PreflightError: the context is longer than the model supports, naming ``flag``.
    """
    limit = shape.max_position_embeddings
    if limit is not None and max_model_len > limit:
        raise PreflightError(f"{flag} {max_model_len} exceeds the model's max_position_embeddings ({limit}); "
                             f"pass {flag} {limit} or less")


def _product(shape) -> int:
    out = 1
    for n in shape:
        out *= int(n)
    return out


def _safetensors_numel(path: Path) -> int:
    """Elements of every tensor in a safetensors file, from its JSON header (8-byte length first)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(_product(t["shape"]) for name, t in header.items() if name != "__metadata__")


def _llama_params(config: dict, head_dim: int, kv_heads: int) -> int:
    """Parameters of a Llama-family decoder from its config (embeddings, attention, MLP, norms)."""
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    attention = hidden * head_dim * (2 * config["num_attention_heads"] + 2 * kv_heads)
    mlp = 3 * hidden * config["intermediate_size"]
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return embeddings + layers * (attention + mlp + 2 * hidden) + hidden
