"""benchmarks/quality.py without running a model: the table from given results, the samples read
from an AlpacaEval-shaped file, and the refusals of bad options and files."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from benchmarks import quality
from benchmarks.quality import VariantResult


def test_table_compares_every_variant_with_the_first():
    fp32 = VariantResult("float32", [[math.log(0.5)] * 2, [math.log(0.25)]], [[1, 2, 3], [4, 5]], 1.0, 2.0)
    int8 = VariantResult("int8", [[math.log(0.5)] * 3], [[1, 2, 9], [4, 5]], 1.0, 2.0)
    # Pooled: exp(-(2 ln 0.5 + ln 0.25) / 3) = exp(4 ln 2 / 3); int8: 2.
    assert fp32.perplexity == pytest.approx(2 ** (4 / 3)) and int8.perplexity == pytest.approx(2.0)
    lines = quality.table([fp32, int8], argparse.Namespace(greedy_tokens=3)).splitlines()
    assert lines[0].startswith("| variant | perplexity | vs float32 | greedy 3 tokens equal |")
    assert lines[2] == "| float32 | 2.520 | +0.00 % | 2/2 | 2.5 |"
    assert lines[3] == "| int8 | 2.000 | -20.63 % | 1/2 | 2.0 |"  # prefixes 2 and 2 tokens


def test_samples_are_the_chat_prompt_and_the_answers_first_tokens(tmp_path):
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps([{"instruction": "Name a colour.", "output": "Blue is a colour of the sky. " * 20},
                                {"instruction": "Say hi.", "output": "Hi."}, {"instruction": "x", "output": "y"}]))
    samples = quality.read_samples(path, 2, 16, quality.DEFAULT_MODEL)
    assert len(samples) == 2 and len(samples[0].answer_ids) == 16 and 1 <= len(samples[1].answer_ids) < 16
    from transformers import AutoTokenizer

    from core.model_source import resolve_model
    from engine.model.gguf_convert import ensure_hf_dir

    tokenizer = AutoTokenizer.from_pretrained(ensure_hf_dir(resolve_model(quality.DEFAULT_MODEL)))
    prompt = tokenizer.decode(samples[0].prompt_ids)
    assert "<|im_start|>user\nName a colour.<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(samples[1].answer_ids) == "Hi."
    path.write_text(json.dumps([{"prompt": "no instruction"}]))
    with pytest.raises(ValueError, match="expected AlpacaEval's JSON array"):
        quality.read_samples(path, 2, 16, quality.DEFAULT_MODEL)


def test_unknown_variants_and_a_missing_path_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        quality.main(["--variants", "float32,int4", "--path", str(tmp_path / "a.json")])
    assert "unknown variants ['int4']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        quality.main([])
    assert "--path" in capsys.readouterr().err


def test_every_variant_is_an_engine_config_and_the_kv_variants_keep_float32_weights():
    from engine.config import EngineConfig

    configs = {name: EngineConfig(**fields) for name, fields in quality.VARIANTS.items()}
    assert {n: (c.dtype, c.kv_cache_dtype) for n, c in configs.items() if n.startswith("kv-")} == {
        "kv-fp8": ("float32", "fp8"), "kv-int8": ("float32", "int8")}
