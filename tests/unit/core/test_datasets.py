"""The data folder and the public data sets: where a workload's file is looked for, what a user is
told when it is missing, and docs/data.md listing every data set as core/datasets.py does."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.datasets import DATA_SETS, DEFAULT_FOR_KIND, data_dir, data_file, default_file, where_to_get

DOCS = Path(__file__).resolve().parents[3] / "docs" / "data.md"


def test_the_data_folder_is_the_option_then_the_environment_then_the_cache(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "env"))
    assert data_dir(tmp_path / "opt") == tmp_path / "opt"
    assert data_dir() == tmp_path / "env"
    monkeypatch.delenv("TANDEM_DATA_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data_dir() == tmp_path / "xdg" / "tandem" / "data"


def test_a_workloads_file_is_found_in_the_data_folder_by_its_name(tmp_path) -> None:
    assert default_file("mooncake", tmp_path) is None  # not downloaded
    (tmp_path / "mooncake_fast25_conversation_trace.jsonl").write_text("")
    assert default_file("mooncake", tmp_path) == tmp_path / "mooncake_fast25_conversation_trace.jsonl"
    assert data_file("sharegpt", tmp_path) == tmp_path / "sharegpt_v3_first_turn_500.json"
    assert default_file("prompts", tmp_path) is None  # a kind without a public data set
    assert sorted(DEFAULT_FOR_KIND) == ["alpaca", "azure", "burstgpt", "mooncake", "sharegpt"]


def test_where_to_get_names_the_source_license_and_target(tmp_path) -> None:
    assert where_to_get("mooncake", tmp_path) == (
        "the Mooncake FAST'25 conversation trace (12,031 requests, prefix hash chains of 512-token blocks): "
        "https://raw.githubusercontent.com/kvcache-ai/Mooncake/3b5a594133958449a1feaf1c9e0fc1b553e34a28/"
        f"FAST25-release/traces/conversation_trace.jsonl (Apache-2.0), saved as "
        f"{tmp_path / 'mooncake_fast25_conversation_trace.jsonl'} (--data-dir or TANDEM_DATA_DIR choose the "
        "folder; docs/data.md lists every data set)")
    assert "head -n 401" in where_to_get("burstgpt", tmp_path)  # a slice says how it is cut
    with pytest.raises(KeyError):
        where_to_get("prompts")


@pytest.mark.parametrize("data_set", DATA_SETS, ids=[d.file_name for d in DATA_SETS])
def test_docs_list_every_data_set_with_its_source_and_license(data_set) -> None:
    rows = [line for line in DOCS.read_text().splitlines() if line.startswith(f"| `{data_set.file_name}` |")]
    assert len(rows) == 1, data_set.file_name
    row = rows[0]
    for fact in (data_set.repo, data_set.path, data_set.commit, data_set.sha256, data_set.license.split(" ")[0]):
        assert fact in row, (data_set.file_name, fact)
    if data_set.commit:  # the download command is there too
        assert data_set.url.replace("https://raw.githubusercontent.com", "$raw") in DOCS.read_text()
