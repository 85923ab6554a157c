"""The engine times every forward pass as one StepSample with the cost model's exact features,
and publishes the load the router reads (engine.stats / worker.stats.worker_load)."""

from __future__ import annotations

import json

import pytest

from core.model_source import resolve_model
from core.request import Request
from core.sampling_params import SamplingParams
from engine.config import EngineConfig
from core.cost_model import StepSample
from engine import calibration
from engine.calibration import Probe, calibrate, calibration_probes
from engine.engine import LLMEngine

TINY_CONFIG = dict(
    vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.5, rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, source) of a tiny random-weight Llama, shared by every engine of this module."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.model.loader import load_model

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(LlamaConfig(**TINY_CONFIG)).save_pretrained(folder)
    return load_model(folder, "float32", "cpu", 64), resolve_model(str(folder))


def make_engine(tiny, **overrides) -> LLMEngine:
    model, source = tiny
    config = dict(block_size=4, num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    return LLMEngine(EngineConfig(**{**config, **overrides}), model, source)


def request(rid: str, num_prompt_tokens: int, max_tokens: int, first: int = 0) -> Request:
    """Prompts with different ``first`` share no prefix (no prefix-cache hit between them)."""
    prompt = [(11 * i + 5) % 500 + 3 for i in range(first, first + num_prompt_tokens)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    return Request(rid, prompt, params)


def drain(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("steps", [1, 4], ids=["steps1", "steps4"])
def test_one_sample_per_pass_with_exact_features(tiny, overlap, steps):
    engine = make_engine(tiny, enable_overlap=overlap, num_scheduler_steps=steps)
    engine.add_request(request("a", 20, max_tokens=3))
    drain(engine)
    samples = list(engine.step_stats.fit.samples())
    # chunks 8, 8, 4 (the third samples token 1), then two decodes after 20 and 21 tokens
    assert [(s.num_new_tokens, s.num_seqs) for s in samples] == [(8, 1), (8, 1), (4, 1), (1, 1), (1, 1)]
    assert [s.attn_pairs for s in samples] == pytest.approx(
        [8 * 4.5 / 1000, 8 * 12.5 / 1000, 4 * 18.5 / 1000, 21 / 1000, 22 / 1000], rel=1e-12)
    assert all(s.duration_s > 0 for s in samples)
    assert engine.step_stats.num_steps == 5


def test_mixed_batch_features(tiny):
    """A decode and a new prompt's chunk in one pass: tokens, sequences and pairs add up."""
    engine = make_engine(tiny)
    engine.add_request(request("a", 6, max_tokens=3))
    engine.step_stream().__next__()  # 6-token prefill, samples a's first token
    engine.add_request(request("b", 10, max_tokens=1, first=100))
    drain(engine)
    samples = [(s.num_new_tokens, s.num_seqs, round(s.attn_pairs * 1000, 6)) for s in engine.step_stats.fit.samples()]
    # pass 2: a decodes (1 token after 6) + b's first 7-token chunk; pass 3: a after 7 + b's last 3 after 7
    assert samples == [(6, 1, 21.0), (8, 2, 7.0 + 28.0), (4, 2, 8.0 + 3 * 9.0)]


def test_stats_report_load_and_cost_model(tiny):
    engine = make_engine(tiny, max_num_batched_tokens=8)
    assert engine.stats().cost_model.num_samples == 0
    engine.add_request(request("a", 20, max_tokens=4))
    engine.add_request(request("b", 5, max_tokens=4, first=100))
    stream = engine.step_stream()
    next(stream)  # a's first chunk of 8
    stats = engine.stats()
    assert stats.num_batched_tokens == 8
    assert stats.num_waiting_tokens == 12 + 5  # a's 12 left + b (waiting)
    assert stats.num_kv_tokens == 8
    assert stats.cost_model.num_samples == 1
    assert stats.cost_model.max_num_batched_tokens == 8
    assert stats.cost_model.kv_bytes_per_token == engine.spec.block_bytes / 4 == 2 * 2 * 2 * 8 * 4
    assert stats.recent_step_time_s == engine.step_stats.last.duration_s
    for _ in stream:
        pass
    drain(engine)
    idle = engine.stats()
    assert (idle.num_batched_tokens, idle.num_waiting_tokens, idle.num_kv_tokens, idle.num_used_blocks) == (0, 0, 0, 0)
    assert idle.cost_model.num_samples == engine.step_stats.num_steps


def test_calibration_probes_fit_the_config():
    config = EngineConfig(block_size=4, num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    assert calibration_probes(config) == [
        Probe(1, 16, 1), Probe(2, 16, 4), Probe(1, 63, 1), Probe(4, 16, 4), Probe(1, 60, 4),
    ]
    default = calibration_probes(EngineConfig())
    assert default == [Probe(1, 16, 1), Probe(2, 16, 4), Probe(1, 128, 1), Probe(8, 16, 4), Probe(1, 256, 1),
                       Probe(1, 192, 4), Probe(16, 16, 4)]


def test_calibration_leaves_the_engine_idle_and_outputs_unchanged(tiny):
    engine = make_engine(tiny, enable_prefix_caching=True)
    result = calibrate(engine, num_steps=10, max_duration_s=float("inf"))
    # after the untimed warm-up, budget 8: 16 tokens (2 passes), then 2 x (16 tokens + 3 decodes)
    # where the second prompt's chunks ride beside the first one's decodes (8 passes): 10 >= 10
    assert result.num_steps == len(engine.step_stats.fit) == 2 + 8
    stats = engine.stats()
    assert (stats.num_used_blocks, stats.num_free_blocks) == (0, 32)
    kv = engine.scheduler.kv
    assert (kv.block_pool.num_cached_blocks, kv.block_pool.num_evictions) == (0, 0)
    assert (kv.num_prefix_queries_tokens, kv.num_prefix_hit_tokens, engine.runner.busy_time_s) == (0, 0, 0.0)
    assert (stats.num_requests_running, stats.num_requests_waiting, stats.num_preemptions) == (0, 0, 0)
    assert (stats.num_batched_tokens, stats.num_waiting_tokens, stats.num_kv_tokens) == (0, 0, 0)
    assert stats.recent_step_time_s == 0.0 and engine.scheduler.requests == {}
    assert stats.cost_model.num_samples == result.num_steps
    assert stats.cost_model.step_s(8, 1, 0.036) > 0

    fresh = make_engine(tiny, enable_prefix_caching=True)
    for e in (engine, fresh):
        e.add_request(request("after", 20, max_tokens=6))
    tokens = {}
    for name, e in (("calibrated", engine), ("fresh", fresh)):
        out = []
        while e.has_unfinished_requests():
            out += [t for o in e.step() for t in o.new_token_ids]
        tokens[name] = out
    assert tokens["calibrated"] == tokens["fresh"] and len(tokens["fresh"]) == 6


def test_calibration_stops_starting_probes_after_its_time_budget(tiny):
    engine = make_engine(tiny)
    result = calibrate(engine, num_steps=1000, max_duration_s=0.0)
    assert result.num_steps == 0 and engine.stats().num_used_blocks == 0  # only the warm-up ran


def test_calibration_zero_steps_is_a_no_op(tiny):
    engine = make_engine(tiny)
    assert calibrate(engine, 0).num_steps == 0 and engine.step_stats.num_steps == 0
    with pytest.raises(ValueError, match="num_steps must be >= 0, got -1"):
        calibrate(engine, -1)


def test_cached_calibration_gives_an_engine_built_alike_the_same_fit(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "other_cores_now", lambda: 1.0)  # the machine busy now: any samples do
    first = make_engine(tiny)
    timed = calibrate(first, num_steps=10, max_duration_s=float("inf"), cache=True)
    path = calibration.samples_path(first, 10, float("inf"))
    assert not timed.cached and timed.num_steps == 10 and path.is_file()
    assert [p.name for p in (tmp_path / "calibration").iterdir()] == [path.name]

    second = make_engine(tiny)
    read = calibrate(second, num_steps=10, max_duration_s=float("inf"), cache=True)
    assert read.cached and read.num_steps == 10
    assert second.step_stats.fit.samples() == first.step_stats.fit.samples()
    assert second.stats().cost_model == first.stats().cost_model
    stats = second.stats()  # idle as after a timed calibration: only the warm-up probe ran
    assert (stats.num_used_blocks, stats.num_free_blocks, stats.recent_step_time_s) == (0, 32, 0.0)

    other = make_engine(tiny, max_num_batched_tokens=16)  # built otherwise: timed, cached apart
    assert calibration.samples_path(other, 10, float("inf")) != path
    assert not calibrate(other, num_steps=10, max_duration_s=float("inf"), cache=True).cached
    assert len(list((tmp_path / "calibration").iterdir())) == 2


def test_samples_timed_on_a_busy_machine_are_timed_again_once_it_is_quiet(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    engine = make_engine(tiny)
    path = calibration.samples_path(engine, 10, float("inf"))
    calibration._write_samples(path, [StepSample(8, 1, 0.036, 0.5)] * 10, other_cores=1.0)
    monkeypatch.setattr(calibration, "other_cores_now", lambda: 1.0)
    assert calibrate(engine, num_steps=10, max_duration_s=float("inf"), cache=True).cached
    monkeypatch.setattr(calibration, "other_cores_now", lambda: 0.0)
    result = calibrate(make_engine(tiny), num_steps=10, max_duration_s=float("inf"), cache=True)
    assert not result.cached and result.num_steps == 10
    assert [row[3] for row in json.loads(path.read_text())["samples"]] != [0.5] * 10  # rewritten: the new ones
    path.write_text("not json")
    assert calibration._read_samples(path) is None


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_sample_times_the_whole_pass_but_not_the_idle_time_before_it(tiny, overlap):
    """duration_s runs from the previous forward's end (or the stream's start) to this forward's
    end: it holds forward_s and the host work between passes, never the time the engine sat idle."""
    engine = make_engine(tiny, enable_overlap=overlap)
    engine.add_request(request("a", 6, max_tokens=3))
    drain(engine)
    engine._pass_started_s = -1e6  # as if the last pass ended long ago: idle time must not count
    engine.add_request(request("b", 6, max_tokens=2, first=100))
    drain(engine)
    samples = engine.step_stats.fit.samples()
    assert len(samples) == 5
    assert all(0 < s.forward_s <= s.duration_s < 60 for s in samples)
    assert all(s.host_s == pytest.approx(s.duration_s - s.forward_s) for s in samples)
