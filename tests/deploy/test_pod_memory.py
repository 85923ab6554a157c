"""The memory check of `tandem up` on the chart's rendering: each pod's memory limit against what
its process will take (launcher.machine_fit.pod_shortfalls), for the shipped values files and a
values file whose CPU decode pods cannot hold their KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.model_source import DEFAULT_MODEL, resolve_model
from launcher.machine_fit import pod_shortfalls
from launcher.model_shape import read_shape
from tests.deploy.test_manifests import DEPLOY, helm_template
from tests.deploy.test_manifests import tools  # noqa: F401  (the fixture)


@pytest.fixture(scope="module")
def smollm2():
    try:
        return read_shape(resolve_model(DEFAULT_MODEL))
    except FileNotFoundError as err:
        pytest.skip(f"the bundled model is not installed: {err}")


@pytest.mark.parametrize("values", ["values-local.yaml", "values-multinode-gpu.yaml", "values-secure.yaml", None])
def test_the_shipped_values_give_every_pod_the_memory_it_takes(tools, smollm2, values) -> None:  # noqa: F811
    args = ["-f", str(DEPLOY / "k8s" / "helm" / values)] if values else []
    assert pod_shortfalls(helm_template(tools, *args), smollm2) == []


def test_cpu_decode_pods_too_small_for_their_kv_cache_are_named(tools, smollm2, tmp_path: Path) -> None:  # noqa: F811
    values = tmp_path / "small-pods.yaml"
    values.write_text("decode: {device: cpu, gpus: 0, numKvBlocks: 16384, tolerations: [],\n"
                      "         resources: {requests: {cpu: '2', memory: 4Gi}, limits: {memory: 4Gi}}}\n"
                      "kvPool: {dram: 1Gi, arenaPercent: 95}\n")
    assert pod_shortfalls(helm_template(tools, "-f", str(values)), smollm2) == [
        "Deployment tandem-decode: memory 4Gi is below the 13.5 GiB its decode worker will take (decode worker: 1 x "
        "13.5 GiB (weights 513.1 MiB + GEMM copies (2 x weights, --linear-backend auto) 1.0 GiB + KV cache (16384 "
        "blocks x 720.0 KiB) 11.2 GiB + process 768.0 MiB)  [decode.numKvBlocks 16384, model.dtype float32, "
        "decode.device cpu, engine.linearBackend auto])",
        "StatefulSet tandem-kv-pool: memory 1Gi is below the 1.0 GiB its KV pool node will take (KV pool node: 1 x "
        "1.0 GiB (DRAM arena 972.8 MiB + process 64.0 MiB)  [kvPool.dram 1Gi, kvPool.arenaPercent 95])",
    ]
