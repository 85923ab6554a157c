#!/usr/bin/env bash
# A real single-node Kubernetes 1.20 on this machine, for trying Tandem's chart on a real node.
#
#   deploy/tools/k8s-local/node.sh up       install what is missing, start etcd, the control
#                                           plane, docker, kubelet, kube-proxy and the DNS shim;
#                                           a second `up` reuses what runs
#   deploy/tools/k8s-local/node.sh down     stop what `up` started and put the machine back as it
#                                           was (kernel settings, iptables chains, bridges, routes,
#                                           mounts, cgroups), then check that it is; [--purge] also
#                                           deletes the state folder (images, etcd, certificates)
#   deploy/tools/k8s-local/node.sh status   the services, the node and the pods
#   deploy/tools/k8s-local/node.sh check    compare the machine with the state recorded before `up`
#   deploy/tools/k8s-local/node.sh env      export lines: KUBECONFIG, PATH (kubectl 1.20), DOCKER_HOST
#
# Settings: lib.sh. The node's network stays on this machine: pods live on the bridge
# tandem-pods0, traffic from the pod network to any address that is not a pod, a ClusterIP or this
# machine is unreachable (a policy routing table), ClusterIPs are routed to an empty bridge, and
# NodePorts listen on 127.0.0.1 only.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=machine-state.sh
source "$K8S_TOOLS_DIR/machine-state.sh"

DEBIAN_PACKAGES=(docker.io runc containerd containernetworking-plugins etcd-server conntrack socat
  dnsmasq-base jq iptables nftables openssl gcc libc6-dev buildah debootstrap curl ca-certificates)

install_packages() {
  local missing=() pkg
  for pkg in "${DEBIAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  ((${#missing[@]})) || return 0
  log "installing Debian packages: ${missing[*]}"
  # No daemon may start from a package's postinst: the node starts its own, privately configured.
  local policy=/usr/sbin/policy-rc.d made_policy=0
  if [[ ! -e "$policy" ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made_policy=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  ((made_policy)) && rm -f "$policy"
  return 0
}

# kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy, kubectl into BIN_DIR:
# from TANDEM_K8S_BINARIES (a tarball or a folder) when set, else built from Debian's source.
install_binaries() {
  local name have=1
  for name in "${K8S_BINARIES[@]}"; do [[ -x "$BIN_DIR/$name" ]] || have=0; done
  ((have)) && return 0
  mkdir -p "$BIN_DIR"
  local source="${TANDEM_K8S_BINARIES:-}"
  if [[ -n "$source" && -f "$source" ]]; then
    log "unpacking the Kubernetes binaries from $source"
    tar -xzf "$source" -C "$BIN_DIR" "${K8S_BINARIES[@]}"
  elif [[ -n "$source" && -d "$source" ]]; then
    log "copying the Kubernetes binaries from $source"
    for name in "${K8S_BINARIES[@]}"; do install -m 755 "$source/$name" "$BIN_DIR/$name"; done
  else
    [[ -z "$source" ]] || die "TANDEM_K8S_BINARIES=$source is neither a file nor a folder"
    log "no TANDEM_K8S_BINARIES: building Kubernetes 1.20 from Debian's source package (~10-20 minutes)"
    "$K8S_TOOLS_DIR/build-kubernetes.sh" "$BIN_DIR"
  fi
  "$BIN_DIR/kubectl" version --client --short 2>/dev/null | grep -q 'v1\.20\.' \
    || die "the binaries in $BIN_DIR are not Kubernetes 1.20"
}

# Another Kubernetes node on this machine would fight over the same iptables chains.
refuse_foreign_node() {
  local running=0 name
  for name in "${SERVICES[@]}"; do service_pid "$name" >/dev/null && running=1; done
  ((running)) && return 0
  if pgrep -x kubelet >/dev/null || pgrep -x kube-proxy >/dev/null; then
    die "a kubelet or kube-proxy that this script did not start runs here: stop that node first"
  fi
  if nft list ruleset 2>/dev/null | grep -q 'chain KUBE-'; then
    die "KUBE-* iptables chains exist but no node of this script runs: another node's, or a failed
     'down' (run: $0 down)"
  fi
  for name in "$POD_BRIDGE" "$SERVICE_BRIDGE"; do
    ip link show "$name" >/dev/null 2>&1 && ! [[ -f "$BEFORE_DIR/complete" ]] \
      && die "the bridge $name exists but this script has no record of making it"
  done
  return 0
}

# --- certificates and kubeconfigs ------------------------------------------------------------

# make_cert NAME SUBJECT EXTENSIONS: a key and a certificate signed by the node's CA.
make_cert() {
  local name="$1" subject="$2" extensions="$3"
  [[ -f "$PKI_DIR/$name.crt" ]] && return 0
  openssl req -new -newkey rsa:2048 -nodes -keyout "$PKI_DIR/$name.key" -subj "$subject" \
    -out "$PKI_DIR/$name.csr" 2>/dev/null
  openssl x509 -req -in "$PKI_DIR/$name.csr" -CA "$PKI_DIR/ca.crt" -CAkey "$PKI_DIR/ca.key" \
    -CAcreateserial -days 3650 -sha256 -out "$PKI_DIR/$name.crt" \
    -extfile <(printf '%s\n' "$extensions") 2>/dev/null
  rm -f "$PKI_DIR/$name.csr"
}

write_kubeconfig() {
  local name="$1"
  write_file "$PKI_DIR/$name.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
  - name: tandem-local
    cluster:
      certificate-authority: $PKI_DIR/ca.crt
      server: https://$GATEWAY_IP:$APISERVER_PORT
users:
  - name: $name
    user:
      client-certificate: $PKI_DIR/$name.crt
      client-key: $PKI_DIR/$name.key
contexts:
  - name: tandem-local
    context:
      cluster: tandem-local
      user: $name
current-context: tandem-local
EOF
}

make_pki() {
  mkdir -p "$PKI_DIR"
  chmod 700 "$PKI_DIR"
  if [[ ! -f "$PKI_DIR/ca.crt" ]]; then
    openssl req -x509 -new -newkey rsa:2048 -nodes -keyout "$PKI_DIR/ca.key" -days 3650 -sha256 \
      -subj "/CN=tandem-local-ca" -out "$PKI_DIR/ca.crt" 2>/dev/null
  fi
  [[ -f "$PKI_DIR/sa.key" ]] || { openssl genrsa -out "$PKI_DIR/sa.key" 2048 2>/dev/null \
    && openssl rsa -in "$PKI_DIR/sa.key" -pubout -out "$PKI_DIR/sa.pub" 2>/dev/null; }
  local client="basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  make_cert apiserver "/CN=kube-apiserver" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:$GATEWAY_IP,IP:$KUBERNETES_SERVICE_IP,IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  make_cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$client"
  make_cert admin "/O=system:masters/CN=tandem-local-admin" "$client"
  make_cert controller-manager "/CN=system:kube-controller-manager" "$client"
  make_cert scheduler "/CN=system:kube-scheduler" "$client"
  make_cert kubelet "/O=system:nodes/CN=system:node:$NODE_NAME" "$client"
  make_cert kube-proxy "/CN=system:kube-proxy" "$client"
  local name
  for name in admin controller-manager scheduler kubelet kube-proxy; do write_kubeconfig "$name"; done
}

# --- network ---------------------------------------------------------------------------------

setup_network() {
  if ! ip link show "$POD_BRIDGE" >/dev/null 2>&1; then
    ip link add "$POD_BRIDGE" type bridge
    ip addr add "$GATEWAY_IP/24" dev "$POD_BRIDGE"
    ip link set "$POD_BRIDGE" up
  fi
  if ! ip link show "$SERVICE_BRIDGE" >/dev/null 2>&1; then
    ip link add "$SERVICE_BRIDGE" type bridge
    ip link set "$SERVICE_BRIDGE" up
  fi
  ip route replace "$SERVICE_CIDR" dev "$SERVICE_BRIDGE"
  # From the pod network only pods, ClusterIPs (on the empty bridge when kube-proxy did not
  # translate them) and this machine's own addresses (the local table, looked up first) are reachable.
  ip route replace "$POD_CIDR" dev "$POD_BRIDGE" table "$ROUTE_TABLE"
  ip route replace "$SERVICE_CIDR" dev "$SERVICE_BRIDGE" table "$ROUTE_TABLE"
  ip route replace unreachable default table "$ROUTE_TABLE"
  ip rule show priority "$ROUTE_RULE_PRIORITY" | grep -q "lookup $ROUTE_TABLE" \
    || ip rule add from "$POD_CIDR" lookup "$ROUTE_TABLE" priority "$ROUTE_RULE_PRIORITY"
}

# --- configuration files ---------------------------------------------------------------------

# write_file PATH < CONTENT: replaces PATH only when the content differs (kube-proxy exits when its
# configuration file is rewritten, even with the same bytes).
write_file() {
  local path="$1" next
  next="$(mktemp "$path.XXXXXX")"
  cat >"$next"
  if cmp -s "$next" "$path"; then rm -f "$next"; else chmod 644 "$next"; mv "$next" "$path"; fi
}

write_configs() {
  mkdir -p "$STATE_DIR/cni/net.d" "$STATE_DIR/dns" "$STATE_DIR/kubelet" "$LOG_DIR"
  install -m 755 "$K8S_TOOLS_DIR/oci-runtime.sh" "$BIN_DIR/tandem-oci-runtime"
  write_file "$STATE_DIR/cni/net.d/10-tandem.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "tandem-pods",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$POD_BRIDGE",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$GATEWAY_IP"}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": "$STATE_DIR/cni/networks"
      }
    }
  ]
}
EOF
  write_file "$STATE_DIR/docker-daemon.json" <<EOF
{
  "hosts": ["unix://$DOCKER_SOCK"],
  "data-root": "$STATE_DIR/docker",
  "exec-root": "$RUN_DIR/docker",
  "pidfile": "$RUN_DIR/docker/dockerd.pid",
  "bridge": "none",
  "iptables": false,
  "ip-forward": false,
  "ip-masq": false,
  "userland-proxy": false,
  "storage-driver": "overlay2",
  "exec-opts": ["native.cgroupdriver=cgroupfs"],
  "runtimes": {"tandem-oci-runtime": {"path": "$BIN_DIR/tandem-oci-runtime"}},
  "default-runtime": "tandem-oci-runtime",
  "oom-score-adjust": 0,
  "log-level": "warn"
}
EOF
  write_file "$STATE_DIR/kubelet-config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $GATEWAY_IP
port: $KUBELET_PORT
readOnlyPort: 0
healthzPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI_DIR/ca.crt}
authorization: {mode: Webhook}
cgroupDriver: cgroupfs
clusterDNS: [$GATEWAY_IP]
clusterDomain: cluster.local
resolvConf: ""  # pods never learn the host's resolvers
failSwapOn: false
oomScoreAdj: 0
maxPods: 40
serializeImagePulls: false
evictionHard: {memory.available: 500Mi, nodefs.available: 3%, imagefs.available: 3%}
imageGCHighThresholdPercent: 97
imageGCLowThresholdPercent: 95
EOF
  write_file "$STATE_DIR/kube-proxy-config.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $PKI_DIR/kube-proxy.kubeconfig}
mode: iptables
bindAddress: $GATEWAY_IP
clusterCIDR: $POD_CIDR
hostnameOverride: $NODE_NAME
healthzBindAddress: 127.0.0.1:$PROXY_HEALTHZ_PORT
metricsBindAddress: 127.0.0.1:$PROXY_METRICS_PORT
nodePortAddresses: [127.0.0.0/8]  # NodePorts on loopback only
oomScoreAdj: 0
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}  # 0: leave as is
EOF
  [[ -f "$STATE_DIR/dns/hosts" ]] || : >"$STATE_DIR/dns/hosts"
  chmod 644 "$STATE_DIR/dns/hosts"
}

# --- services --------------------------------------------------------------------------------

# start_service NAME COMMAND...: runs COMMAND in its own session, logging to LOG_DIR/NAME.log.
start_service() {
  local name="$1" pid
  shift
  if pid="$(service_pid "$name")"; then
    log "$name already runs (pid $pid)"
    return 1
  fi
  mkdir -p "$RUN_DIR" "$LOG_DIR"
  setsid "$@" >>"$LOG_DIR/$name.log" 2>&1 </dev/null &
  echo $! >"$(pid_file "$name")"
  log "started $name (pid $!, log $LOG_DIR/$name.log)"
}

stop_service() {
  local name="$1" timeout_s="${2:-20}" pid
  if pid="$(service_pid "$name")"; then
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + timeout_s))
    while [[ -d "/proc/$pid" ]] && ((SECONDS < deadline)); do sleep 0.2; done
    if [[ -d "/proc/$pid" ]]; then
      log "$name did not stop within ${timeout_s}s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    log "stopped $name"
  fi
  rm -f "$(pid_file "$name")"
}

start_etcd() {
  start_service etcd etcd --name tandem-local --data-dir "$STATE_DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "tandem-local=http://127.0.0.1:$ETCD_PEER_PORT" || true
  wait_for 60 "etcd" curl -sf "http://127.0.0.1:$ETCD_PORT/health"
}

start_control_plane() {
  start_service kube-apiserver "$BIN_DIR/kube-apiserver" \
    --advertise-address="$GATEWAY_IP" --bind-address="$GATEWAY_IP" --secure-port="$APISERVER_PORT" \
    --insecure-port=0 --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --service-cluster-ip-range="$SERVICE_CIDR" \
    --client-ca-file="$PKI_DIR/ca.crt" \
    --tls-cert-file="$PKI_DIR/apiserver.crt" --tls-private-key-file="$PKI_DIR/apiserver.key" \
    --kubelet-client-certificate="$PKI_DIR/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$PKI_DIR/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types=InternalIP \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$PKI_DIR/sa.pub" --service-account-signing-key-file="$PKI_DIR/sa.key" \
    --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
    --profiling=false --logtostderr=true --v=1 || true
  wait_for 90 "the API server" kubectl_node get --raw /readyz
  start_service kube-controller-manager "$BIN_DIR/kube-controller-manager" \
    --kubeconfig="$PKI_DIR/controller-manager.kubeconfig" \
    --service-account-private-key-file="$PKI_DIR/sa.key" --root-ca-file="$PKI_DIR/ca.crt" \
    --cluster-signing-cert-file="$PKI_DIR/ca.crt" --cluster-signing-key-file="$PKI_DIR/ca.key" \
    --use-service-account-credentials=true --leader-elect=false --port=0 --secure-port=0 \
    --profiling=false --logtostderr=true --v=1 || true
  start_service kube-scheduler "$BIN_DIR/kube-scheduler" --kubeconfig="$PKI_DIR/scheduler.kubeconfig" \
    --leader-elect=false --port=0 --secure-port=0 --profiling=false --logtostderr=true --v=1 || true
}

start_docker() {
  mkdir -p "$RUN_DIR/docker" "$STATE_DIR/docker"
  start_service dockerd dockerd --config-file "$STATE_DIR/docker-daemon.json" || true
  wait_for 60 "dockerd" docker_node version
  if ! docker_node image inspect tandem-pause:1.0 >/dev/null 2>&1; then
    "$K8S_TOOLS_DIR/images.sh" pause
  fi
}

start_dns() {
  start_service dnsmasq dnsmasq --keep-in-foreground --conf-file=/dev/null \
    --pid-file="$RUN_DIR/dnsmasq-own.pid" --listen-address="$GATEWAY_IP" --bind-interfaces --port=53 \
    --no-resolv --no-hosts --addn-hosts="$STATE_DIR/dns/hosts" --local=/cluster.local/ \
    --domain-needed --bogus-priv --no-negcache --log-facility=- || true
  start_service dns-sync "$K8S_TOOLS_DIR/dns-sync.sh" "$STATE_DIR" "$RUN_DIR" || true
}

start_node() {
  mkdir -p "$STATE_DIR/kubelet-plugins"
  start_service kubelet "$BIN_DIR/kubelet" --config="$STATE_DIR/kubelet-config.yaml" \
    --kubeconfig="$PKI_DIR/kubelet.kubeconfig" --container-runtime=docker \
    --docker-endpoint="unix://$DOCKER_SOCK" --network-plugin=cni --cni-bin-dir=/usr/lib/cni \
    --cni-conf-dir="$STATE_DIR/cni/net.d" --cni-cache-dir="$STATE_DIR/cni/cache" \
    --pod-infra-container-image=tandem-pause:1.0 --root-dir="$STATE_DIR/kubelet" \
    --cert-dir="$STATE_DIR/kubelet-pki" --volume-plugin-dir="$STATE_DIR/kubelet-plugins" \
    --experimental-dockershim-root-directory="$STATE_DIR/dockershim" \
    --node-ip="$GATEWAY_IP" --hostname-override="$NODE_NAME" --logtostderr=true --v=1 || true
  start_service kube-proxy "$BIN_DIR/kube-proxy" --config="$STATE_DIR/kube-proxy-config.yaml" \
    --logtostderr=true --v=1 || true
  wait_for 120 "node $NODE_NAME Ready" \
    kubectl_node wait --for=condition=Ready "node/$NODE_NAME" --timeout=2s
}

cmd_up() {
  need_root
  local started=$SECONDS
  install_packages
  install_binaries
  refuse_foreign_node
  snapshot_machine
  make_pki
  setup_network
  write_configs
  start_etcd
  start_control_plane
  start_docker
  start_dns
  start_node
  log "node $NODE_NAME Ready after $((SECONDS - started)) s; use it with:"
  cmd_env | sed 's/^/  /'
}

# --- down ------------------------------------------------------------------------------------

# Processes of the node: their command line names its folders, or they live in kubelet's cgroups.
node_processes() {
  local pid cmd
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    [[ "$pid" == "$$" || "$pid" == "$PPID" ]] && continue
    cmd="$( { tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null)" || continue
    [[ -n "$cmd" ]] || continue
    if [[ "$cmd" == *"$STATE_DIR"* || "$cmd" == *"$RUN_DIR"* ]] \
      || grep -q ':/kubepods' "/proc/$pid/cgroup" 2>/dev/null; then
      # Not this script, nor a shell or tool that merely mentions the folders.
      [[ "$cmd" == *node.sh* || "$cmd" =~ ^(bash|sh|grep|ls|cat|tail|less|find)\  ]] && continue
      echo "$pid $cmd" | cut -c1-160
    fi
  done
}

remove_pod_containers() {
  service_pid dockerd >/dev/null || return 0
  local ids
  ids="$(docker_node ps -aq --filter label=io.kubernetes.pod.name 2>/dev/null || true)"
  [[ -n "$ids" ]] || return 0
  log "removing $(wc -w <<<"$ids") pod containers"
  # shellcheck disable=SC2086
  docker_node rm -f $ids >/dev/null 2>&1 || true
}

cmd_down() {
  need_root
  local purge=0
  [[ "${1:-}" == "--purge" ]] && purge=1
  [[ -f "$BEFORE_DIR/complete" ]] || {
    log "no record of an 'up' on this machine ($BEFORE_DIR): nothing to stop"
    ((purge)) && rm -rf "$STATE_DIR" "$RUN_DIR"
    return 0
  }
  # Nothing may recreate pods or rules while they are removed.
  stop_service kube-proxy
  stop_service kube-controller-manager
  stop_service kube-scheduler
  stop_service kubelet 30
  remove_pod_containers
  stop_service dockerd 60
  stop_service dns-sync
  stop_service dnsmasq
  stop_service kube-apiserver
  stop_service etcd
  local pid rest
  while read -r pid rest; do
    [[ -n "$pid" ]] || continue
    log "stopping leftover process $pid: $rest"
    kill -KILL "$pid" 2>/dev/null || true
  done < <(node_processes)
  sleep 1
  restore_machine
  rm -rf "$RUN_DIR" "$STATE_DIR/cni/networks" "$STATE_DIR/cni/cache"
  log "checking the machine against the state recorded before 'up'"
  if ! check_machine; then
    die "the machine differs from its recorded state (above); 'down' again retries"
  fi
  rm -rf "$BEFORE_DIR"
  ((purge)) && rm -rf "$STATE_DIR"
  log "down: nothing of the node is left (no process, bridge, route, iptables chain, mount, kernel setting)"
}

cmd_check() {
  [[ -f "$BEFORE_DIR/complete" ]] || die "no recorded state ($BEFORE_DIR): 'up' records it"
  check_machine && log "the machine matches its recorded state"
}

cmd_status() {
  local name pid
  for name in "${SERVICES[@]}"; do
    if pid="$(service_pid "$name")"; then printf '  %-24s running (pid %s)\n' "$name" "$pid"
    else printf '  %-24s stopped\n' "$name"; fi
  done
  if service_pid kube-apiserver >/dev/null; then
    kubectl_node get nodes -o wide || true
    kubectl_node get pods -A -o wide || true
  fi
}

cmd_env() {
  echo "export KUBECONFIG=$KUBECONFIG_ADMIN"
  echo "export PATH=$BIN_DIR:\$PATH  # kubectl 1.20"
  echo "export DOCKER_HOST=unix://$DOCKER_SOCK"
}

case "${1:-}" in
  up) cmd_up ;;
  down) shift; cmd_down "$@" ;;
  status) cmd_status ;;
  check) cmd_check ;;
  env) cmd_env ;;
  *) sed -n '2,17p' "$0"; exit 2 ;;
esac
