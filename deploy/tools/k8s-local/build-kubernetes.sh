#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy and kubectl
# from Debian bookworm's source package `kubernetes` (1.20.x, vendored Go modules) with Debian's
# Go 1.19, into OUT_DIR. No Debian or PyPI package ships a kubelet for bookworm; this is the
# source node.sh falls back to when TANDEM_K8S_BINARIES names no cache. ~10 minutes on two idle
# cores, ~1.4 GB of memory, ~3.6 GB of disk (in TANDEM_K8S_STATE_DIR/kubernetes-build, removed
# afterwards).
#
#   deploy/tools/k8s-local/build-kubernetes.sh OUT_DIR
#
# The apt lists for the deb-src entries live in the build folder: the machine's apt sources are
# not changed. Env: TANDEM_K8S_DEBIAN_MIRROR, TANDEM_K8S_DEBIAN_SECURITY_MIRROR
# (default http://deb.debian.org/debian-security).
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

out_dir="${1:?usage: build-kubernetes.sh OUT_DIR}"
security_mirror="${TANDEM_K8S_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
work="$STATE_DIR/kubernetes-build"
need_root

packages=(dpkg-dev golang-1.19-go make)
missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  log "installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

rm -rf "$work"
mkdir -p "$LOG_DIR" "$work/apt/lists/partial" "$work/apt/cache/archives/partial" "$work/src"
cat >"$work/apt/sources.list" <<EOF
deb-src $DEBIAN_MIRROR bookworm main
deb-src $DEBIAN_MIRROR bookworm-updates main
deb-src $security_mirror bookworm-security main
EOF
apt_private=(-o "Dir::Etc::SourceList=$work/apt/sources.list" -o "Dir::Etc::SourceParts=$work/apt/none"
  -o "Dir::State::Lists=$work/apt/lists" -o "Dir::Cache=$work/apt/cache")
log "fetching Debian's source package kubernetes"
apt-get "${apt_private[@]}" update -qq
(cd "$work/src" && apt-get "${apt_private[@]}" source --download-only kubernetes >/dev/null)
dsc="$(ls "$work"/src/kubernetes_*.dsc)"
dpkg-source -x "$dsc" "$work/src/kubernetes" >/dev/null
tree="$work/src/kubernetes"
# 1.20.5+really1.20.2-1.1+deb12u1 -> v1.20.2: what `kubectl version` and Helm's .Capabilities see.
debian_version="$(dpkg-parsechangelog -l "$tree/debian/changelog" -S Version)"
upstream="${debian_version%-*}"
upstream="${upstream##*really}"
log "building Kubernetes v$upstream (Debian $debian_version) with Go 1.19"

# GOPATH layout, vendored modules: what the 1.20 build scripts expect from a tree without .git.
gopath="$work/go"
mkdir -p "$gopath/src/k8s.io"
ln -sfn "$tree" "$gopath/src/k8s.io/kubernetes"
(
  cd "$gopath/src/k8s.io/kubernetes"
  export PATH="/usr/lib/go-1.19/bin:$PATH" GOPATH="$gopath" GOFLAGS=-mod=vendor GOCACHE="$work/go-cache"
  export KUBE_GIT_VERSION="v$upstream" KUBE_GIT_TREE_STATE=archive
  make WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler cmd/kubelet cmd/kube-proxy cmd/kubectl" \
    >"$LOG_DIR/build-kubernetes.log" 2>&1
) || die "the build failed: $LOG_DIR/build-kubernetes.log"
mkdir -p "$out_dir"
for name in "${K8S_BINARIES[@]}"; do
  install -m 755 "$tree/_output/bin/$name" "$out_dir/$name"
done
rm -rf "$work"
log "built ${K8S_BINARIES[*]} into $out_dir"
