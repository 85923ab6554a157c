"""Per-block checksums (docs/design.md §4 integrity): computed by the writer, kept by the pool, checked
by the reader.

xxh3-64 of the block's bytes (~25 GB/s on one core here). 0 means "no checksum": a writer without
``xxhash`` installed sends 0 and readers skip the check, so a mixed cluster never reports false
corruption. Whether readers verify is the reader's choice (``verify_enabled``).
"""

from __future__ import annotations

import os

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a dependency; degrade to "no checksums"
    xxhash = None

# Readers verify unless this is "0" (tests run with it on, the default).
VERIFY_ENV = "TANDEM_KV_VERIFY_CHECKSUMS"


def block_checksum(data: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of ``data``, never 0 (0 is "none"); 0 when xxhash is not installed."""
    if xxhash is None:
        return 0
    return xxhash.xxh3_64_intdigest(data) or 1


def matches(data: bytes | bytearray | memoryview, checksum: int) -> bool:
    """True when ``checksum`` is 0 (none) or equals the checksum of ``data``."""
    return checksum == 0 or xxhash is None or block_checksum(data) == checksum


def verify_enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether readers verify checksums (environment read here, once per caller)."""
    return (os.environ if environ is None else environ).get(VERIFY_ENV, "1") != "0"
