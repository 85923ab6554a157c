#!/usr/bin/env bash
# Cluster DNS without CoreDNS (no image of it can be pulled here): keeps the hosts file that
# dnsmasq serves on the pod gateway equal to the cluster's Services, every 2 s.
#
#   NAME.NAMESPACE.svc.cluster.local            -> the ClusterIP, or every ready endpoint of a
#                                                  headless Service
#   HOSTNAME.NAME.NAMESPACE.svc.cluster.local   -> a headless endpoint with a hostname
#                                                  (StatefulSet pods)
#
# Usage (node.sh starts it): dns-sync.sh STATE_DIR RUN_DIR
set -uo pipefail
state_dir="$1"
run_dir="$2"
hosts="$state_dir/dns/hosts"
kubectl=("$state_dir/bin/kubectl" --kubeconfig "$state_dir/pki/admin.kubeconfig")

# shellcheck disable=SC2016
program='
  [.items[] | select(.kind == "Service" and .spec.clusterIP == "None")
   | "\(.metadata.namespace)/\(.metadata.name)"] as $headless
  | (.items[] | select(.kind == "Service" and (.spec.clusterIP // "None") != "None")
     | "\(.spec.clusterIP) \(.metadata.name).\(.metadata.namespace).svc.cluster.local"),
    (.items[] | select(.kind == "Endpoints")
     | "\(.metadata.namespace)/\(.metadata.name)" as $key | select(any($headless[]; . == $key))
     | .metadata as $m | (.subsets // [])[] | (.addresses // [])[]
     | "\(.ip) \($m.name).\($m.namespace).svc.cluster.local",
       (select(.hostname != null) | "\(.ip) \(.hostname).\($m.name).\($m.namespace).svc.cluster.local"))'

while true; do
  if json="$("${kubectl[@]}" get services,endpoints --all-namespaces -o json 2>/dev/null)"; then
    jq -r "$program" <<<"$json" | sort >"$hosts.next"
    if ! cmp -s "$hosts.next" "$hosts"; then
      chmod 644 "$hosts.next"
      mv "$hosts.next" "$hosts"
      [[ -f "$run_dir/dnsmasq-own.pid" ]] && kill -HUP "$(cat "$run_dir/dnsmasq-own.pid")" 2>/dev/null
    fi
  fi
  sleep 2
done
