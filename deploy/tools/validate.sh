#!/usr/bin/env bash
# Validates Tandem's deployment files offline (CI runs it through tests/deploy/test_manifests.py):
#   1. hadolint on deploy/docker/Dockerfile.*
#   2. helm lint --strict of the chart with the default, the multi-node GPU and the secure values
#   3. helm template of both, kubectl kustomize of every overlay (and of the base with every
#      optional component), each piped into kubernetes-validate --strict for Kubernetes $KUBE_VERSION
#      and into check_manifests.py (selectors, ports, probes, env references)
#   4. every values file in deploy/tools/testdata/bad-values/ must be rejected by the chart
#
# Usage: deploy/tools/validate.sh [TOOLS_DIR]
# The tools (helm, kubectl, kubernetes-validate, hadolint, and a python3 with PyYAML) are used from
# PATH when all of them are there; otherwise from TOOLS_DIR (default: <repo>/.cache/k8s-tools),
# installed there on first use by install_k8s_tools.sh. Passing TOOLS_DIR always uses that folder.
# Env: KUBE_VERSION (default 1.37.0), KEEP_RENDERED=DIR keeps the rendered YAML there.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
kube_version="${KUBE_VERSION:-1.37.0}"
chart="$repo/deploy/k8s/helm/tandem"
multinode="$repo/deploy/k8s/helm/values-multinode-gpu.yaml"
secure="$repo/deploy/k8s/helm/values-secure.yaml"
single_node="$repo/deploy/k8s/helm/values-single-node-cpu.yaml"

on_path() {
  command -v helm >/dev/null && command -v kubectl >/dev/null && command -v kubernetes-validate >/dev/null \
    && command -v hadolint >/dev/null && python3 -c 'import yaml' 2>/dev/null
}
if [[ $# -eq 0 ]] && on_path; then
  echo "using helm, kubectl, kubernetes-validate and hadolint from PATH ($(command -v helm))"
  python=python3
else
  tools="${1:-$repo/.cache/k8s-tools}"
  if [[ ! -x "$tools/bin/helm" || ! -x "$tools/bin/kubernetes-validate" ]]; then
    "$repo/deploy/tools/install_k8s_tools.sh" "$tools"
  fi
  export PATH="$tools/bin:$PATH"
  python="$tools/venv/bin/python"  # has PyYAML (a kubernetes-validate dependency)
fi

out="${KEEP_RENDERED:-$(mktemp -d)}"
mkdir -p "$out"
[[ -n "${KEEP_RENDERED:-}" ]] || trap 'rm -rf "$out"' EXIT
failures=0
step() { printf '\n== %s\n' "$*"; }
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

# Schema-validates and semantically checks one rendered file.
check_rendered() {
  local name="$1" file="$2"
  kubernetes-validate --strict --quiet --kubernetes-version "$kube_version" - <"$file" \
    || fail "$name: kubernetes-validate"
  "$python" "$repo/deploy/tools/check_manifests.py" "$file" || fail "$name: check_manifests"
}

step "hadolint"
hadolint --config "$repo/deploy/docker/hadolint.yaml" \
  "$repo/deploy/docker/Dockerfile.cpu" "$repo/deploy/docker/Dockerfile.gpu" "$repo/deploy/docker/Dockerfile.redis" \
  && echo "Dockerfiles clean" \
  || fail "hadolint"

step "helm lint --strict"
helm lint --strict "$chart" || fail "helm lint (default values)"
helm lint --strict "$chart" -f "$multinode" || fail "helm lint (multinode values)"
helm lint --strict "$chart" -f "$secure" || fail "helm lint (secure values)"
helm lint --strict "$chart" -f "$single_node" || fail "helm lint (single-node CPU values)"

step "helm template | kubernetes-validate | check_manifests (Kubernetes $kube_version)"
helm template tandem "$chart" --namespace tandem --kube-version "$kube_version" >"$out/helm-default.yaml" \
  && check_rendered helm-default "$out/helm-default.yaml" || fail "helm template (default values)"
helm template tandem "$chart" --namespace tandem --kube-version "$kube_version" -f "$multinode" \
  >"$out/helm-multinode.yaml" \
  && check_rendered helm-multinode "$out/helm-multinode.yaml" || fail "helm template (multinode values)"
helm lint --strict "$chart" --set autoscaler.enabled=true || fail "helm lint (autoscaler on)"
helm template tandem "$chart" --namespace tandem --kube-version "$kube_version" --set autoscaler.enabled=true \
  >"$out/helm-autoscaler.yaml" \
  && check_rendered helm-autoscaler "$out/helm-autoscaler.yaml" || fail "helm template (autoscaler on)"
helm template tandem "$chart" --namespace tandem --kube-version "$kube_version" -f "$secure" \
  >"$out/helm-secure.yaml" \
  && check_rendered helm-secure "$out/helm-secure.yaml" || fail "helm template (secure values)"

helm template tandem "$chart" --namespace tandem --kube-version "$kube_version" -f "$single_node" \
  >"$out/helm-single-node.yaml" \
  && check_rendered helm-single-node "$out/helm-single-node.yaml" || fail "helm template (single-node CPU values)"

# The same chart for Kubernetes 1.20 (the local node of deploy/tools/k8s-local): API versions and
# probes chosen from .Capabilities. kubernetes-validate has no 1.20 schemas; the semantic checks run,
# and tests/deploy/test_manifests.py checks the API versions against what 1.20 serves.
step "helm template --kube-version 1.20.2 | check_manifests"
for values in "$single_node" "$repo/deploy/k8s/helm/values-local.yaml"; do
  name="helm-1.20-$(basename "$values" .yaml)"
  helm template tandem "$chart" --namespace tandem --kube-version 1.20.2 -f "$values" --set autoscaler.enabled=true \
    --set autoscaler.slo.ttftMs=2000 --set autoscaler.slo.tbtMs=200 >"$out/$name.yaml" \
    && "$python" "$repo/deploy/tools/check_manifests.py" "$out/$name.yaml" && echo "$name: ok" \
    || fail "helm template for 1.20 ($(basename "$values"))"
done

step "kubectl kustomize | kubernetes-validate | check_manifests"
for overlay in "$repo"/deploy/k8s/overlays/*/; do
  name="kustomize-$(basename "$overlay")"
  kubectl kustomize "$overlay" >"$out/$name.yaml" && check_rendered "$name" "$out/$name.yaml" \
    || fail "kubectl kustomize $overlay"
done
# The base with every component that no overlay uses (kustomize wants relative paths).
compose="$out/compose-components"
mkdir -p "$compose"
k8s_rel="$("$python" -c 'import os, sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))' "$repo/deploy/k8s" "$compose")"
cat >"$compose/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: tandem
resources:
  - $k8s_rel/base
components:
  - $k8s_rel/components/monitoring
  - $k8s_rel/components/external-redis
  - $k8s_rel/components/nvme-hostpath
  - $k8s_rel/components/auth
EOF
kubectl kustomize "$compose" >"$out/kustomize-components.yaml" \
  && check_rendered kustomize-components "$out/kustomize-components.yaml" \
  || fail "kubectl kustomize of base + components"

step "bad values are rejected"
# Each file's first line says what the rejection must mention: `# expect: TEXT`.
for bad in "$repo"/deploy/tools/testdata/bad-values/*.yaml; do
  name="$(basename "$bad")"
  expect="$(sed -n '1s/^# expect: //p' "$bad")"
  if [[ -z "$expect" ]]; then
    fail "$name: first line must be '# expect: TEXT'"
  elif err="$(helm template tandem "$chart" -f "$bad" 2>&1 >/dev/null)"; then
    fail "$name was accepted"
  elif [[ "$err" != *"$expect"* ]]; then
    fail "$name was rejected for another reason than '$expect': $err"
  else
    echo "rejected $name ($expect)"
  fi
done

echo
if ((failures)); then
  echo "validate.sh: $failures check(s) failed"
  exit 1
fi
echo "validate.sh: all checks passed"
