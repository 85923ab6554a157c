#!/usr/bin/env bash
# Installs Tandem's Helm chart on the local node and checks that it serves.
#
#   deploy/tools/k8s-local/release.sh install [HELM_ARGS...]   helm upgrade --install --wait, then
#                                         GET /health and one completion through the NodePort
#   deploy/tools/k8s-local/release.sh uninstall                 helm uninstall, namespace deleted
#
# Env: TANDEM_K8S_RELEASE (tandem), TANDEM_K8S_NAMESPACE (tandem), TANDEM_K8S_VALUES (the values
# file, default deploy/k8s/helm/values-single-node-cpu.yaml), TANDEM_K8S_TOOLS (where
# install_k8s_tools.sh put helm, default <repo>/.cache/k8s-tools), TANDEM_K8S_HELM (another helm
# binary). Needs node.sh up and images.sh.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

RELEASE="${TANDEM_K8S_RELEASE:-tandem}"
NAMESPACE="${TANDEM_K8S_NAMESPACE:-tandem}"
VALUES="${TANDEM_K8S_VALUES:-$REPO_ROOT/deploy/k8s/helm/values-single-node-cpu.yaml}"
TOOLS="${TANDEM_K8S_TOOLS:-$REPO_ROOT/.cache/k8s-tools}"
CHART="$REPO_ROOT/deploy/k8s/helm/tandem"
HTTP_NODE_PORT=30080

HELM="${TANDEM_K8S_HELM:-$TOOLS/bin/helm}"
helm_node() { "$HELM" --kubeconfig "$KUBECONFIG_ADMIN" "$@"; }

cmd_install() {
  [[ -x "$HELM" ]] || "$REPO_ROOT/deploy/tools/install_k8s_tools.sh" "$TOOLS"
  service_pid kube-apiserver >/dev/null || die "the node is not up: node.sh up"
  local tag image
  tag="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$CHART/Chart.yaml")"
  for image in "tandem-cpu:${TANDEM_K8S_IMAGE_TAG:-$tag}" tandem-redis:7.0; do
    docker_node image inspect "$image" >/dev/null 2>&1 || die "image $image is not on the node: images.sh"
  done
  local started=$SECONDS
  log "helm upgrade --install $RELEASE (values $(basename "$VALUES")), waiting for every pod"
  # Helm 4 applies server-side by default; the 1.20 API server's server-side apply rejects Service
  # ports without an explicit protocol ("associative list ... omits key field protocol").
  local apply=()
  [[ "$("$HELM" version --short)" == v3.* ]] || apply=(--server-side=false)
  helm_node upgrade --install "$RELEASE" "$CHART" --namespace "$NAMESPACE" --create-namespace \
    -f "$VALUES" "${apply[@]}" --wait --timeout 15m "$@"
  log "release $RELEASE ready in $((SECONDS - started)) s"
  kubectl_node -n "$NAMESPACE" get pods -o wide
  local url="http://127.0.0.1:$HTTP_NODE_PORT"
  log "GET $url/health"
  curl -sf "$url/health" && echo
  log "one completion through the NodePort"
  curl -sf "$url/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'
  echo
  log "serving: OpenAI base_url $url/v1, gRPC 127.0.0.1:30050"
}

cmd_uninstall() {
  service_pid kube-apiserver >/dev/null || { log "the node is not up: nothing to uninstall"; return; }
  helm_node uninstall "$RELEASE" --namespace "$NAMESPACE" --wait 2>/dev/null || true
  kubectl_node delete namespace "$NAMESPACE" --ignore-not-found --wait=true
}

case "${1:-}" in
  install) shift; cmd_install "$@" ;;
  uninstall) cmd_uninstall ;;
  *) sed -n '2,11p' "$0"; exit 2 ;;
esac
