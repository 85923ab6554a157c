"""`tandem up` refuses contradictory flags before anything starts."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import tandem_cli.main


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--colocated", "--num-prefill-workers", "2"],
         "--colocated starts no prefill worker; drop --num-prefill-workers or --colocated"),
        (["--colocated", "--num-prefill-workers", "1"],
         "--colocated starts no prefill worker; drop --num-prefill-workers or --colocated"),
        (["--ray", "--num-decode-workers", "2"],
         "--ray starts one worker per role; --num-prefill/decode-workers > 1 need the local launcher"),
        (["--address", "auto"], "--address needs --ray"),
        (["--ray", "--num-routers", "2"], "--ray starts one router; --num-routers > 1 needs the local launcher"),
    ],
)
def test_contradictory_flags_are_a_usage_error(flags: list[str], message: str) -> None:
    result = CliRunner().invoke(tandem_cli.main.main, ["up", *flags], terminal_width=200)
    assert result.exit_code == 2
    assert result.output.splitlines()[-1] == f"Error: {message}"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-mixed-prefill-tokens", "-3"],
         "--max-mixed-prefill-tokens must be >= 0 (0: the token budget), got -3"),
        (["--quantization", "int8", "--dtype", "bfloat16"],
         "--quantization 'int8' takes float32 activations: it needs --dtype 'float32', got 'bfloat16'"),
        (["--quantization", "fp8"], "--quantization 'fp8' runs on CUDA GPUs with float8 GEMMs (compute capability "
                                    "8.9 or later), not on --device 'cpu': use 'int8' or 'w8a16' there"),
    ],
)
def test_a_refused_setting_is_named_by_its_flag(flags: list[str], message: str) -> None:
    """The engine's check names the field (max_mixed_prefill_tokens, dtype 'float32'); tandem up
    names the flag the user typed."""
    ports = ["--http-port", "0", "--grpc-port", "0"]  # port 0 is not checked: a taken default port cannot answer first
    result = CliRunner().invoke(tandem_cli.main.main, ["up", *ports, *flags], terminal_width=200)
    assert result.exit_code == 1
    assert result.output.splitlines()[-1] == f"Error: {message}"
