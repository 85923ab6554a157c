"""load_model on a tiny random Llama saved by transformers: the engine's logits equal
transformers' on the same checkpoint (fused projections, biases, tied or untied head, each
linear backend, both CPU attention backends, prefill and over a cached context)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import TorchAttentionBackend
from engine.cpu_attention import CpuAttentionBackend
from engine.model.linear import Linear
from engine.model.linear_chooser import LinearSetup
from engine.model.loader import load_model
from tests.factories import engine_logits

# Logits of magnitude ~20 (initializer_range 0.5); the engine's and transformers' float32 GEMMs
# and attention sum in different orders: measured max abs difference 2.3e-5.
LOGITS_ATOL = 1e-4
MAX_POSITIONS = 128
PROMPT = [(37 * i + 11) % 1000 for i in range(40)]  # 40 tokens: 2 full blocks of 16 and a partial one

CONFIGS = {
    # GQA (4 query heads over 2 KV heads), biases on every projection, head tied to the embedding.
    "tied-biased": dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    # No bias, separate LM head, no GQA.
    "untied": dict(tie_word_embeddings=False, num_key_value_heads=4),
}


def save_tiny_llama(folder, **overrides):
    """A 2-layer random Llama with random biases and norm weights (transformers zeroes biases and
    sets norms to 1, which would hide a bias or norm loaded into the wrong place)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.5, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**config, **overrides})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
            elif "norm" in name:
                param.normal_(1, 0.2)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_llama(folder, **CONFIGS[request.param])
    with torch.inference_mode():
        hf_logits = hf(torch.tensor([PROMPT])).logits[0]  # [len(PROMPT), vocab]
    return folder, hf_logits


LINEAR_SETUPS = {"auto": LinearSetup("auto", 8, 64), "onednn": LinearSetup("onednn"), "mkl": LinearSetup("mkl"),
                 "unplanned": None}


@pytest.mark.parametrize("linear", list(LINEAR_SETUPS))
@pytest.mark.parametrize("backend", [CpuAttentionBackend, TorchAttentionBackend], ids=["cpu", "torch"])
@pytest.mark.parametrize("num_cached", [0, 17, len(PROMPT) - 1], ids=["prefill", "after-17-cached", "decode"])
def test_logits_equal_transformers(checkpoint, linear, backend, num_cached):
    folder, hf_logits = checkpoint
    model = load_model(folder, "float32", "cpu", MAX_POSITIONS, LINEAR_SETUPS[linear])
    logits = engine_logits(model, PROMPT, backend(), num_cached=num_cached)
    assert logits.shape == (len(PROMPT) - num_cached, 1000)
    torch.testing.assert_close(logits, hf_logits[num_cached:], atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("linear", ["onednn", "mkl", "unplanned"])
def test_linear_setup_switch(checkpoint, linear):
    folder, _ = checkpoint
    model = load_model(folder, "float32", "cpu", MAX_POSITIONS, LINEAR_SETUPS[linear])
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 4 + 1  # per layer qkv, o, gate_up, down; the LM head
    expected = "torch" if linear == "unplanned" else linear
    assert all(m.backend_for(n) == expected for m in linears for n in (1, 5, 64))


def test_fused_shapes_and_tied_head(checkpoint):
    folder, _ = checkpoint
    model = load_model(folder, "float32", "cpu", MAX_POSITIONS)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv_proj.weight.shape == ((attn.num_heads + 2 * attn.num_kv_heads) * 16, 64)
    assert mlp.gate_up_proj.weight.shape == (2 * 128, 64)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == model.config.tie_word_embeddings


def test_bfloat16_load_plans_onednn_only(checkpoint):
    """MKL's packed GEMM is float32-only: a bfloat16 model forced to it keeps F.linear; oneDNN
    runs bfloat16 where the CPU has a bfloat16 path (AVX512-BW or AVX-NE-CONVERT), and elsewhere
    the forced backend falls back to F.linear instead of failing at start-up."""
    folder, _ = checkpoint
    model = load_model(folder, "bfloat16", "cpu", MAX_POSITIONS, LinearSetup("mkl"))
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(m.plan is None for m in model.modules() if isinstance(m, Linear))
    model = load_model(folder, "bfloat16", "cpu", MAX_POSITIONS, LinearSetup("onednn"))
    expected = "onednn" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "torch"
    assert all(m.backend_for(3) == expected for m in model.modules() if isinstance(m, Linear))


def test_folder_without_safetensors(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path, "float32", "cpu", 16)


def test_a_context_beyond_the_models_positions_is_refused_by_the_worker(checkpoint):
    """The workers check --max-model-len themselves (a Helm deployment has no tandem up before it)."""
    folder, _ = checkpoint
    with pytest.raises(ValueError) as info:
        load_model(folder, "float32", "cpu", 257)  # the tiny model's max_position_embeddings: 256
    assert str(info.value) == (f"--max-model-len 257 exceeds the model's max_position_embeddings (256) in {folder}; "
                               "pass --max-model-len 256 or less")
    assert load_model(folder, "float32", "cpu", 256).config.max_position_embeddings == 256
