"""`tandem up` refuses, in one line and before it starts or touches anything, what cannot work."""

from __future__ import annotations

import dataclasses
import socket

import pytest
from click.testing import CliRunner

from core.model_source import DEFAULT_MODEL, resolve_model
from core.settings import parse_bytes
from launcher.model_shape import ModelShape, check_max_model_len, read_shape
from launcher.ports import free_port, free_port_run
from launcher.preflight import PreflightError, check_ports_free
from tandem_cli.main import main


@pytest.fixture
def listening():
    """A socket listening on a free port of 127.0.0.1 (as a running router would)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def up(*args: str):
    return CliRunner().invoke(main, ["up", *args])


def test_a_port_in_use_names_its_flag(listening: int) -> None:
    with pytest.raises(PreflightError, match=rf"^port {listening} is in use \(another tandem up\?\); pass --grpc-port$"):
        check_ports_free("127.0.0.1", {"--http-port": 0, "--grpc-port": listening})
    check_ports_free("127.0.0.1", {"--http-port": free_port(), "--grpc-port": 0})  # free and "any": fine
    for port in (70000, -5):
        with pytest.raises(PreflightError, match=rf"^--http-port must be in \[0, 65535\], got {port}$"):
            check_ports_free("127.0.0.1", {"--http-port": port})


def test_tandem_up_on_a_taken_port_fails_before_touching_the_logs(listening: int, tmp_path) -> None:
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    (log_dir / "router.log").write_text("the running cluster's log\n")
    result = up("--http-port", str(listening), "--grpc-port", str(free_port()), "--log-dir", str(log_dir))
    assert (result.exit_code, result.output) == (
        1, f"Error: port {listening} is in use (another tandem up?); pass --http-port\n")
    assert [p.name for p in log_dir.iterdir()] == ["router.log"]
    assert (log_dir / "router.log").read_text() == "the running cluster's log\n"


def test_a_second_routers_port_in_use_names_its_flag() -> None:
    """--num-routers 2: router 1 listens on --http-port + 1, checked before anything starts."""
    first = free_port_run(4)  # HTTP first, first + 1; gRPC first + 2, first + 3
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first + 1))
        taken.listen()
        result = up("--num-routers", "2", "--http-port", str(first), "--grpc-port", str(first + 2))
    assert (result.exit_code, result.output) == (
        1, f"Error: port {first + 1} is in use (another tandem up?); pass --http-port + 1\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "NoSuchModel"], f"--model 'NoSuchModel' is neither the bundled '{DEFAULT_MODEL}', a .gguf file, "
                                     "nor a folder with config.json"),
        (["--num-kv-blocks", "4"], "--num-kv-blocks * --block-size (64) cannot hold one --max-model-len (2048) request "
                                   "(--num-kv-blocks 4 --block-size 16 --max-model-len 2048 --max-num-seqs 64 "
                                   "--max-num-batched-tokens 2048)"),
        (["--max-model-len", "8"], "--default-max-tokens must be in [1, --max-model-len=8), got 16"),
        (["--num-threads", "-1"], "--num-threads must be >= 0, got -1"),
    ],
)
def test_bad_settings_are_one_line_errors(args: list[str], message: str, tmp_path) -> None:
    result = up("--http-port", str(free_port()), "--grpc-port", str(free_port()), "--log-dir", str(tmp_path / "l"),
                *args)
    assert (result.exit_code, result.output) == (1, f"Error: {message}\n")
    assert not (tmp_path / "l").exists()


def test_demo_prompt_file_is_read_before_starting(tmp_path) -> None:
    ports = ["--http-port", str(free_port()), "--grpc-port", str(free_port()), "--log-dir", str(tmp_path / "l")]
    missing = up(*ports, "--demo", "--prompts", str(tmp_path / "nope.json"))
    assert missing.exit_code == 2
    assert f"Invalid value for '--prompts': File '{tmp_path / 'nope.json'}' does not exist." in missing.output
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    result = up(*ports, "--demo", "--prompts", str(broken))
    assert (result.exit_code, result.output) == (
        1, f"Error: cannot read prompts from {broken}: Expecting property name enclosed in double quotes: "
           "line 1 column 2 (char 1)\n")
    assert not (tmp_path / "l").exists()


def test_max_model_len_is_checked_against_max_position_embeddings() -> None:
    shape = ModelShape(num_params=1, num_layers=1, num_kv_heads=1, head_dim=1, max_position_embeddings=8192)
    check_max_model_len(shape, 8192)
    with pytest.raises(PreflightError) as info:
        check_max_model_len(shape, 10000)
    assert str(info.value) == ("--max-model-len 10000 exceeds the model's max_position_embeddings (8192); "
                               "pass --max-model-len 8192 or less")
    check_max_model_len(dataclasses.replace(shape, max_position_embeddings=None), 10**6)  # says none: unchecked


def test_the_bundled_model_supports_8192_positions() -> None:
    shape = read_shape(resolve_model(DEFAULT_MODEL))
    with pytest.raises(PreflightError, match=r"max_position_embeddings \(8192\)"):
        check_max_model_len(shape, 8193)


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [("2GiB", 2 * 1024**3), ("512MiB", 512 * 1024**2), ("1.5GB", 1_500_000_000), ("64k", 65536), ("1000", 1000),
     ("3 gib", 3 * 1024**3)],
)
def test_sizes(text: str, num_bytes: int) -> None:
    assert parse_bytes(text) == num_bytes


def test_bad_size() -> None:
    with pytest.raises(ValueError, match=r"^'2 parsecs' is not a size; use bytes or a unit: 2GiB, 512MiB, 1.5GB$"):
        parse_bytes("2 parsecs")


def test_help_shows_sizes_and_what_zero_threads_means() -> None:
    text = " ".join(CliRunner().invoke(main, ["up", "--help"], terminal_width=200).output.split())
    assert "--pool-capacity-bytes SIZE KV pool DRAM capacity: bytes or a size such as 512MiB, 2GiB. [default: 2GiB]" in text
    assert "0: every core of this machine. [default: 0]" in text
    result = up("--pool-capacity-bytes", "lots")
    assert result.exit_code == 2 and "'lots' is not a size" in result.output
