"""The public data sets Tandem's benchmarks, simulator and demo read, and the data folder they
are read from.

No data set ships with Tandem: each is a file published by a third party (its repository, path,
commit and license below and in docs/data.md), downloaded by the user into the data folder:
``--data-dir``, else ``$TANDEM_DATA_DIR``, else ``~/.cache/tandem/data`` (:func:`data_dir`). A
workload without ``--path`` reads its data set from there under :attr:`DataSet.file_name`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DATA_DIR_ENV = "TANDEM_DATA_DIR"


@dataclass(frozen=True)
class DataSet:
    """One public file: where it comes from and the name it has in the data folder."""

    file_name: str  # in the data folder
    kind: str  # the workload kind that reads it (bench.workloads): mooncake, azure, burstgpt, sharegpt, alpaca
    what: str
    repo: str  # GitHub owner/name
    path: str  # in the repository ("" for a release asset)
    commit: str  # the commit the file was taken from ("" for a release asset)
    license: str
    slice: str = ""  # how the file differs from the upstream one ("": byte for byte)
    sha256: str = ""  # of the file as named here

    @property
    def url(self) -> str:
        """Where to download it: the raw file at ``commit``, or the repository for a release asset."""
        if not self.commit:
            return f"https://github.com/{self.repo}/releases"
        return f"https://raw.githubusercontent.com/{self.repo}/{self.commit}/{self.path}"


DATA_SETS: tuple[DataSet, ...] = (
    DataSet("mooncake_fast25_conversation_trace.jsonl", "mooncake",
            "Mooncake FAST'25 conversation trace (12,031 requests, prefix hash chains of 512-token blocks)",
            "kvcache-ai/Mooncake", "FAST25-release/traces/conversation_trace.jsonl",
            "3b5a594133958449a1feaf1c9e0fc1b553e34a28", "Apache-2.0",
            sha256="b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"),
    DataSet("AzureLLMInferenceTrace_conv.csv", "azure", "Azure LLM inference trace 2023, conversation (19,366 requests)",
            "Azure/AzurePublicDataset", "data/AzureLLMInferenceTrace_conv.csv",
            "b469a113cedca53ddc3bdea71a143dc4b7d8700c", "CC-BY-4.0",
            sha256="2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8"),
    DataSet("AzureLLMInferenceTrace_code.csv", "azure", "Azure LLM inference trace 2023, code (8,819 requests)",
            "Azure/AzurePublicDataset", "data/AzureLLMInferenceTrace_code.csv",
            "b469a113cedca53ddc3bdea71a143dc4b7d8700c", "CC-BY-4.0",
            sha256="54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6"),
    DataSet("BurstGPT_1_first400.csv", "burstgpt", "BurstGPT trace 1 (ChatGPT and GPT-4 API and conversation logs)",
            "HPMLL/BurstGPT", "data/BurstGPT_1.csv", "e92f533b6c85ea7f4164fb3d97d1aa2c3edacbc8", "CC-BY-4.0",
            slice="the header and the first 400 rows (`head -n 401`)",
            sha256="7865fda5dac50938a84dfccb06c405e2f5202969ecfbd671c8399de00f4335f0"),
    DataSet("BurstGPT_3_first400.csv", "burstgpt", "BurstGPT trace 3 (with conversation session ids)",
            "HPMLL/BurstGPT", "", "", "CC-BY-4.0",
            slice="the header and the first 400 rows of the release v2.0 asset `BurstGPT_3.csv` (`head -n 401`)",
            sha256="5465fc4c38b0815b8f75d126a120c229ae93632d62e3adf1792f5e8401a73559"),
    DataSet("sharegpt_v3_first_turn_500.json", "sharegpt",
            "500 ShareGPT V3 first-turn prompts (prompts only, 4-800 tokens)",
            "ml-energy/leaderboard-v2", "sharegpt/ShareGPT_V3_filtered_500.json",
            "2afd5bf312915146348fdcba80d7e8c189ee5856",
            "Apache-2.0 (the repository); the texts are from the public ShareGPT dump, which states no license",
            sha256="1dfcb9e6a6b794145128a3d2dd2f3c83aff8f11c806654e77aede2b0cda30e0e"),
    DataSet("sharegpt_90k_first_turn_2978_sorted.json", "sharegpt",
            "2,978 ShareGPT first-turn prompts, longest first (long, prefill-heavy prompts)",
            "ml-energy/leaderboard-v2", "sharegpt/sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json",
            "2afd5bf312915146348fdcba80d7e8c189ee5856",
            "Apache-2.0 (the repository); the texts are from the public ShareGPT dump, which states no license",
            sha256="e95458dfb016a21e5ced20ced9b1694e8d8eeb7c9442005f588563fdd53318c9"),
    DataSet("alpaca_eval_805_gpt4_1106_preview_outputs.json", "alpaca",
            "the 805 AlpacaEval instructions with GPT-4-1106-preview's reference answers",
            "tatsu-lab/alpaca_eval", "results/gpt4_1106_preview/model_outputs.json",
            "cd543a149df89434d8a54582c0151c0b945c3d20", "CC-BY-NC-4.0 (the data; the code is Apache-2.0)",
            sha256="83db546b872ddebee8965fd05fa48461ee3c32bc695c62fb57f2d214ff741ec4"),
)

# The data set a workload kind reads when no --path is given (the first of its kind above).
DEFAULT_FOR_KIND: dict[str, DataSet] = {}
for _data_set in DATA_SETS:
    DEFAULT_FOR_KIND.setdefault(_data_set.kind, _data_set)


def data_dir(option: str | os.PathLike | None = None) -> Path:
    """The data folder: ``option`` (``--data-dir``), else ``$TANDEM_DATA_DIR``, else
    ``$XDG_CACHE_HOME/tandem/data`` (``~/.cache/tandem/data``). It need not exist."""
    if option:
        return Path(option).expanduser()
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tandem" / "data"


def data_file(kind: str, folder: Path | None = None) -> Path:
    """Where workload ``kind``'s data set is (or would be) in the data folder (``folder``: default
    :func:`data_dir`). Raises KeyError for a kind without a public data set."""
    return (folder if folder is not None else data_dir()) / DEFAULT_FOR_KIND[kind].file_name


def default_file(kind: str, folder: Path | None = None) -> Path | None:
    """:func:`data_file` when that file exists; None when it does not or the kind has no public
    data set."""
    if kind not in DEFAULT_FOR_KIND:
        return None
    path = data_file(kind, folder)
    return path if path.is_file() else None


def where_to_get(kind: str, folder: Path | None = None) -> str:
    """One sentence: which file workload ``kind`` reads by default, where it is published and
    under which license, and where to save it. Raises KeyError for a kind without a data set."""
    data_set = DEFAULT_FOR_KIND[kind]
    target = (folder if folder is not None else data_dir()) / data_set.file_name
    cut = f", {data_set.slice}" if data_set.slice else ""
    return (f"the {data_set.what}: {data_set.url} ({data_set.license}{cut}), saved as {target} "
            "(--data-dir or TANDEM_DATA_DIR choose the folder; docs/data.md lists every data set)")
