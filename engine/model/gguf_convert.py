"""Converts a GGUF checkpoint once into a Hugging Face folder (config, safetensors, tokenizer),
which engine.model.loader then loads; a Hugging Face folder passes through as it is."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from core.model_source import ModelSource

log = logging.getLogger(__name__)


def ensure_hf_dir(source: ModelSource) -> Path:
    """Returns a Hugging Face folder (config, safetensors, tokenizer) for ``source``.

    A GGUF file is dequantized to float32 through transformers (15-30 s) and saved once under
    ``source.converted_dir``; later calls return that folder at once. The folder appears
    atomically (written to a temporary sibling, then renamed), so concurrent callers never see
    half a conversion.
    """
    target = source.converted_dir
    if not source.is_gguf or (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to %s (once)", source.path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        kwargs = dict(gguf_file=source.path.name)
        model = AutoModelForCausalLM.from_pretrained(source.path.parent, dtype=torch.float32, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source.path.parent, **kwargs)
        # save_pretrained refuses a GGUF-quantized model; the weights are already dequantized.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
