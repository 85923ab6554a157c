"""The CPU image as the worker pods run it: the service user (uid 10001, the chart's
securityContext) reads every file of the baked model, and the files the installed packages read at
run time (the C attention kernel's source, the chat templates) are in the image."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.k8s

# Run inside a worker container: who it runs as, the baked model's files it cannot read, and the
# installed package data.
PROBE = """
import json, os, sys
from pathlib import Path
from importlib import resources
from engine.kernels import cpu_decode_attention
model = Path(os.environ[sys.argv[1]])
files = sorted(p for p in model.rglob("*") if p.is_file())
unreadable = []
for path in files:
    try:
        with open(path, "rb") as f:
            while f.read(1 << 20):
                pass
    except OSError as err:
        unreadable.append(f"{path}: {err}")
print(json.dumps({
    "uid": os.getuid(), "gid": os.getgid(), "model": str(model), "model_files": [p.name for p in files],
    "unreadable": unreadable,
    "kernel_source": cpu_decode_attention.SOURCE.is_file(),
    "chat_template": resources.files("router.chat_templates").joinpath("hermes.jinja").is_file(),
}))
"""


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_service_user_reads_the_baked_model_and_the_package_data(node, role):
    (pod,) = [p for p in node.pods(role) if not p.deleting]
    found = json.loads(node.kubectl("exec", pod.name, "-c", role, "--", "python", "-c", PROBE,
                                    f"TANDEM_{role.upper()}_MODEL"))
    assert (found["uid"], found["gid"]) == (10001, 10001)
    assert found["model"].startswith("/opt/tandem/models/")
    assert {"config.json", "tokenizer.json"} <= set(found["model_files"]), found["model_files"]
    assert any(name.endswith(".safetensors") for name in found["model_files"]), found["model_files"]
    assert found["unreadable"] == []
    assert found["kernel_source"] and found["chat_template"]
