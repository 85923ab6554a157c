"""router.api.auth.load_api_keys and the RouterConfig checks of keys and open paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.api.auth import load_api_keys
from router.config import RouterConfig


def test_keys_from_flags_env_style_strings_and_a_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# team A\nfile-1\n\n  file-2  \nflag-1\n")
    assert load_api_keys(["flag-1", "env-1 env-2,env-3"], str(keys)) == (
        "flag-1", "env-1", "env-2", "env-3", "file-1", "file-2")
    assert load_api_keys([]) == ()


def test_a_bad_key_file_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="api_key_file: cannot read '/nonexistent/keys'"):
        load_api_keys([], "/nonexistent/keys")
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_api_keys([], str(empty))


def test_config_refuses_bad_keys_and_paths() -> None:
    with pytest.raises(ValueError, match="an API key must be non-empty and hold no whitespace"):
        RouterConfig(api_keys=("a b",))
    with pytest.raises(ValueError, match="open_paths entries must start with '/', got 'health'"):
        RouterConfig(open_paths=("health",))
    assert RouterConfig().open_paths == ("/health", "/metrics") and RouterConfig().api_keys == ()
