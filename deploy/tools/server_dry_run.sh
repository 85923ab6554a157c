#!/usr/bin/env bash
# Opt-in (not run in CI): sends Tandem's renderings to a real API server — server-side dry run by
# default, which runs admission, defaulting and CRD validation without creating workloads. It does
# create the namespaces `tandem` and `tandem-dev` if they are missing (a dry run into a namespace
# that does not exist fails).
#
# Usage: deploy/tools/server_dry_run.sh [--apply] [--context NAME]
#   --apply    really apply the dev overlay (namespace tandem-dev) after the dry runs pass
#   --context  kubeconfig context to use (default: the current one)
# Needs a cluster you may write to (kind, minikube, k3d, or a dev namespace elsewhere). Without the
# Prometheus Operator CRDs, the ServiceMonitors are skipped. Tools come from install_k8s_tools.sh.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
tools="${TANDEM_K8S_TOOLS:-$repo/.cache/k8s-tools}"
[[ -x "$tools/bin/kubectl" ]] || "$repo/deploy/tools/install_k8s_tools.sh" "$tools"
export PATH="$tools/bin:$PATH"

apply=0
ctx=()
while (($#)); do
  case "$1" in
    --apply) apply=1 ;;
    --context) ctx=(--context "$2"); shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

kubectl "${ctx[@]}" version >/dev/null || { echo "no reachable API server in this kubeconfig" >&2; exit 1; }
has_monitoring_crds=0
kubectl "${ctx[@]}" get crd servicemonitors.monitoring.coreos.com >/dev/null 2>&1 && has_monitoring_crds=1

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
chart="$repo/deploy/k8s/helm/tandem"
helm template tandem "$chart" --namespace tandem >"$out/helm-default.yaml"
helm template tandem "$chart" --namespace tandem -f "$repo/deploy/k8s/helm/values-multinode-gpu.yaml" \
  >"$out/helm-multinode.yaml"
for overlay in "$repo"/deploy/k8s/overlays/*/; do
  kubectl kustomize "$overlay" >"$out/kustomize-$(basename "$overlay").yaml"
done

for ns in tandem tandem-dev; do
  kubectl "${ctx[@]}" get namespace "$ns" >/dev/null 2>&1 || kubectl "${ctx[@]}" create namespace "$ns"
done
for file in "$out"/*.yaml; do
  echo "== server-side dry run: $(basename "$file")"
  if ((!has_monitoring_crds)); then
    "$tools/venv/bin/python" - "$file" <<'PY'
import sys, yaml
path = sys.argv[1]
docs = [d for d in yaml.safe_load_all(open(path)) if d and d.get("kind") != "ServiceMonitor"]
yaml.safe_dump_all(docs, open(path, "w"), sort_keys=False)
PY
  fi
  ns_args=()
  case "$(basename "$file")" in helm-*) ns_args=(--namespace tandem) ;; esac
  kubectl "${ctx[@]}" apply --dry-run=server --server-side --field-manager=tandem-dry-run \
    "${ns_args[@]}" -f "$file" >/dev/null
  echo "ok"
done

if ((apply)); then
  echo "== applying deploy/k8s/overlays/dev"
  kubectl "${ctx[@]}" apply --server-side --field-manager=tandem -k "$repo/deploy/k8s/overlays/dev"
  kubectl "${ctx[@]}" -n tandem-dev rollout status statefulset/tandem-redis --timeout=5m
  kubectl "${ctx[@]}" -n tandem-dev rollout status statefulset/tandem-kv-pool --timeout=10m
  for d in tandem-prefill tandem-decode tandem-router; do
    kubectl "${ctx[@]}" -n tandem-dev rollout status "deployment/$d" --timeout=15m
  done
  echo "ready: kubectl -n tandem-dev port-forward svc/tandem-router 8000:8000"
fi
