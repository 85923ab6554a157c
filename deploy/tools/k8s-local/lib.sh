# Settings and helpers shared by the local single-node Kubernetes scripts (sourced, not run).
#
# Every setting is an environment variable with a default; nothing here names a machine's path.
#
#   TANDEM_K8S_STATE_DIR     certificates, etcd data, kubelet and docker roots, logs, built
#                            binaries, the machine snapshot taken before the first `up`
#                            (default /var/lib/tandem-k8s)
#   TANDEM_K8S_RUN_DIR       PID files and sockets (default /run/tandem-k8s)
#   TANDEM_K8S_BINARIES      a tarball or folder holding kube-apiserver, kube-controller-manager,
#                            kube-scheduler, kubelet, kube-proxy and kubectl 1.20 (a cache of an
#                            earlier build); unset: build them from Debian's source package
#   TANDEM_K8S_POD_CIDR      pod network, a /24 on the node's bridge (default 10.213.0.0/24)
#   TANDEM_K8S_SERVICE_CIDR  ClusterIPs, a /24 routed to an empty bridge (default 10.213.1.0/24)
#   TANDEM_K8S_APISERVER_PORT, TANDEM_K8S_ETCD_PORT, TANDEM_K8S_KUBELET_PORT   16443, 12379, 11250
#   TANDEM_K8S_NODE_NAME     the node's name (default tandem-node)
#   TANDEM_K8S_DEBIAN_MIRROR where debootstrap and the image builds get Debian packages
#                            (default http://deb.debian.org/debian)

set -euo pipefail
export LC_ALL=C  # one collation for the snapshots' sort and comm

K8S_TOOLS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$K8S_TOOLS_DIR/../../.." && pwd)"

STATE_DIR="${TANDEM_K8S_STATE_DIR:-/var/lib/tandem-k8s}"
RUN_DIR="${TANDEM_K8S_RUN_DIR:-/run/tandem-k8s}"
POD_CIDR="${TANDEM_K8S_POD_CIDR:-10.213.0.0/24}"
SERVICE_CIDR="${TANDEM_K8S_SERVICE_CIDR:-10.213.1.0/24}"
APISERVER_PORT="${TANDEM_K8S_APISERVER_PORT:-16443}"
ETCD_PORT="${TANDEM_K8S_ETCD_PORT:-12379}"
ETCD_PEER_PORT="$((ETCD_PORT + 1))"
KUBELET_PORT="${TANDEM_K8S_KUBELET_PORT:-11250}"
PROXY_HEALTHZ_PORT="$((KUBELET_PORT + 6))"
PROXY_METRICS_PORT="$((KUBELET_PORT - 1))"
NODE_NAME="${TANDEM_K8S_NODE_NAME:-tandem-node}"
DEBIAN_MIRROR="${TANDEM_K8S_DEBIAN_MIRROR:-http://deb.debian.org/debian}"

POD_BRIDGE="tandem-pods0"     # the pods' veths and the gateway address
SERVICE_BRIDGE="tandem-svc0"  # no ports: where untranslated ClusterIP traffic dies
ROUTE_TABLE=213               # policy routing table for traffic from the pod network
ROUTE_RULE_PRIORITY=2130

for cidr in "$POD_CIDR" "$SERVICE_CIDR"; do
  [[ "$cidr" =~ ^([0-9]+\.[0-9]+\.[0-9]+)\.0/24$ ]] \
    || { echo "k8s-local: $cidr is not an a.b.c.0/24 network" >&2; exit 2; }
done
GATEWAY_IP="${POD_CIDR%.0/24}.1"             # the bridge's address: node IP, API server, DNS
KUBERNETES_SERVICE_IP="${SERVICE_CIDR%.0/24}.1"

BIN_DIR="$STATE_DIR/bin"
PKI_DIR="$STATE_DIR/pki"
LOG_DIR="$STATE_DIR/logs"
BEFORE_DIR="$STATE_DIR/before"  # the machine as it was before the first `up`
KUBECONFIG_ADMIN="$PKI_DIR/admin.kubeconfig"
DOCKER_SOCK="$RUN_DIR/docker.sock"
CONTAINERS_DIR="$STATE_DIR/containers"  # buildah's storage and configuration (image builds)
K8S_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl)

# Services started by `up`, in start order; `down` stops them in reverse.
SERVICES=(etcd kube-apiserver kube-controller-manager kube-scheduler dockerd dnsmasq dns-sync kubelet kube-proxy)

# Kernel settings kubelet, kube-proxy and the bridge CNI plugin change; `down` puts them back.
SYSCTLS=(
  vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops
  kernel.keys.root_maxkeys kernel.keys.root_maxbytes
  net.ipv4.ip_forward net.ipv4.conf.all.forwarding net.ipv4.conf.default.forwarding
  net.ipv4.conf.all.route_localnet net.ipv4.conf.default.route_localnet
  net.bridge.bridge-nf-call-iptables net.bridge.bridge-nf-call-ip6tables
  net.netfilter.nf_conntrack_max net.netfilter.nf_conntrack_tcp_timeout_established
  net.netfilter.nf_conntrack_tcp_timeout_close_wait
)

# Paths the node's programs create outside the state and run folders, whatever their flags say
# (kubelet 1.20 writes pod logs under /var/log; containerd's shims put sockets in /run/containerd).
# `down` removes those that did not exist before the first `up`.
CREATED_PATHS=(/var/log/pods /var/log/containers /run/containerd /var/lib/cni /var/lib/kubelet
  /var/lib/dockershim /etc/docker/key.json /etc/cni/net.d/cni.lock /run/docker /var/lib/docker
  /usr/libexec/kubernetes)

log() { printf '[k8s-local %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[k8s-local] error: %s\n' "$*" >&2; exit 1; }

need_root() { [[ "$(id -u)" == 0 ]] || die "run as root: it starts a kubelet and changes the network"; }

pid_file() { echo "$RUN_DIR/$1.pid"; }

# The PID of a service this script started, if it still runs that program.
service_pid() {
  local file pid
  file="$(pid_file "$1")"
  [[ -f "$file" ]] || return 1
  pid="$(cat "$file")"
  [[ -n "$pid" && -d "/proc/$pid" ]] || return 1
  # A recycled PID runs something else: the command line must name the service's state.
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$STATE_DIR\|$RUN_DIR" || return 1
  echo "$pid"
}

kubectl_node() { "$BIN_DIR/kubectl" --kubeconfig "$KUBECONFIG_ADMIN" "$@"; }
docker_node() { DOCKER_HOST="unix://$DOCKER_SOCK" docker "$@"; }

# Polls "$@" until it succeeds or $timeout_s pass; returns 1 on timeout.
wait_for() {
  local timeout_s="$1" what="$2"
  shift 2
  local deadline=$((SECONDS + timeout_s))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || { log "timed out after ${timeout_s}s waiting for $what"; return 1; }
    sleep 0.5
  done
}
