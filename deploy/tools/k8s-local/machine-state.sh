# The machine as it was before the node started, and putting it back (sourced by node.sh).
#
# `snapshot_machine` records, once, before anything is changed: kernel settings, the nftables
# ruleset (iptables-nft writes there; kube-proxy, kubelet and the CNI plugins add KUBE-*/CNI-*
# chains), links, routes and policy rules, mount points, which of CREATED_PATHS exist, and the
# cgroups. `restore_machine` undoes what the node changed; `check_machine` compares the machine
# with the snapshot and prints every difference (exit status 1 if any).

# Kernel settings that move by themselves (counters, random values, per-boot state): not compared.
VOLATILE_SYSCTLS='^(fs\.(dentry-state|file-nr|inode-nr|inode-state|aio-nr|quota\.)|kernel\.(random\.|ns_last_pid|pty\.nr|sched_domain|tainted)|net\.ipv4\.tcp_fastopen_key|net\.netfilter\.nf_conntrack_count|net\.ipv4\.(tcp_mem|udp_mem)|vm\.(stat_refresh|drop_caches))'

sysctl_snapshot() { sysctl -a 2>/dev/null | grep -Ev "$VOLATILE_SYSCTLS" | sort; }

# The ruleset without packet counters and rule handles.
ruleset_snapshot() { nft list ruleset 2>/dev/null | sed -E 's/ counter packets [0-9]+ bytes [0-9]+//; s/ # handle [0-9]+//'; }

links_snapshot() { ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | sort; }
routes_snapshot() { { ip -4 route show table all; ip -6 route show table all; } | grep -v ' cache' | sort; }
rules_snapshot() { { ip -4 rule show; ip -6 rule show; } | sort; }
mounts_snapshot() { awk '{print $5}' /proc/self/mountinfo | sort -u; }
cgroups_snapshot() { find /sys/fs/cgroup -mindepth 2 -maxdepth 2 -type d 2>/dev/null | sort; }

existing_paths() {
  local path
  for path in "${CREATED_PATHS[@]}"; do
    [[ -e "$path" ]] && echo "$path"
  done
  return 0
}

snapshot_machine() {
  if [[ -f "$BEFORE_DIR/complete" ]]; then
    return
  fi
  log "recording the machine's state before the node starts ($BEFORE_DIR)"
  mkdir -p "$BEFORE_DIR"
  sysctl_snapshot >"$BEFORE_DIR/sysctl"
  ruleset_snapshot >"$BEFORE_DIR/ruleset"
  links_snapshot >"$BEFORE_DIR/links"
  routes_snapshot >"$BEFORE_DIR/routes"
  rules_snapshot >"$BEFORE_DIR/rules"
  mounts_snapshot >"$BEFORE_DIR/mounts"
  cgroups_snapshot >"$BEFORE_DIR/cgroups"
  existing_paths >"$BEFORE_DIR/paths"
  nft list tables 2>/dev/null | sort >"$BEFORE_DIR/nft-tables"
  touch "$BEFORE_DIR/complete"
}

# Unmounts every mount point that appeared since the snapshot under the node's folders (kubelet's
# volumes, docker's overlays and network namespaces, buildah's storage), deepest first.
unmount_new_mounts() {
  local mount_point
  comm -13 "$BEFORE_DIR/mounts" <(mounts_snapshot) | awk '{print length, $0}' | sort -rn | cut -d' ' -f2- \
    | while read -r mount_point; do
      case "$mount_point" in
        "$STATE_DIR"/* | "$RUN_DIR"/* | /run/containerd/* | /run/docker/* | /var/lib/kubelet/* | /var/lib/docker/*)
          umount "$mount_point" 2>/dev/null || umount -l "$mount_point" 2>/dev/null || true ;;
      esac
    done
}

# Deletes the KUBE-*, CNI-* and TANDEM-* chains (and every rule jumping to them) from every
# iptables table, then the nftables tables iptables-nft created that are now empty.
remove_iptables_chains() {
  local save restore table
  for pair in "iptables-nft-save iptables-nft-restore" "ip6tables-nft-save ip6tables-nft-restore"; do
    read -r save restore <<<"$pair"
    command -v "$save" >/dev/null || continue
    for table in filter nat mangle raw; do
      local dump
      dump="$("$save" -t "$table" 2>/dev/null)" || continue
      grep -Eq '(KUBE|CNI|TANDEM)-' <<<"$dump" || continue
      grep -Ev '^:(KUBE|CNI|TANDEM)-|-j (KUBE|CNI|TANDEM)-|-A (KUBE|CNI|TANDEM)-' <<<"$dump" | "$restore" -T "$table"
    done
  done
  local family name
  while read -r _ family name; do
    [[ -n "$name" ]] || continue
    grep -qx "table $family $name" "$BEFORE_DIR/nft-tables" && continue
    # Only base chains with no rules left: the table exists only because iptables-nft made it.
    if ! nft list table "$family" "$name" | grep -Eqv '^\s*(table |chain |type |policy |}|$)'; then
      nft delete table "$family" "$name"
    fi
  done < <(nft list tables 2>/dev/null)
}

restore_sysctls() {
  local key value
  # ip_forward first: writing it resets every interface's forwarding, which the loop then restores.
  for key in net.ipv4.ip_forward "${SYSCTLS[@]}"; do
    value="$(grep -m1 "^$key = " "$BEFORE_DIR/sysctl" | cut -d' ' -f3-)" || continue
    [[ -n "$value" ]] || continue
    [[ "$(sysctl -n "$key" 2>/dev/null)" == "$value" ]] || sysctl -q -w "$key=$value" >/dev/null
  done
  # Per-interface keys of interfaces that existed before (ip_forward rewrote them).
  while IFS= read -r line; do
    key="${line%% = *}"
    value="${line#* = }"
    [[ "$key" == net.ipv4.conf.*.forwarding ]] || continue
    [[ "$(sysctl -n "$key" 2>/dev/null)" == "$value" ]] || sysctl -q -w "$key=$value" >/dev/null 2>&1 || true
  done <"$BEFORE_DIR/sysctl"
}

remove_created_paths() {
  local path
  for path in "${CREATED_PATHS[@]}"; do
    grep -qx "$path" "$BEFORE_DIR/paths" && continue
    [[ -e "$path" ]] && rm -rf "$path"
  done
  return 0
}

# Removes the cgroups that appeared since the snapshot (kubelet's kubepods, docker's), deepest first;
# a cgroup that still holds a process is left, and check_machine reports it.
remove_new_cgroups() {
  local top dir
  comm -13 "$BEFORE_DIR/cgroups" <(cgroups_snapshot) | while read -r top; do
    find "$top" -depth -type d 2>/dev/null | while read -r dir; do rmdir "$dir" 2>/dev/null || true; done
  done
}

restore_network() {
  ip rule del priority "$ROUTE_RULE_PRIORITY" 2>/dev/null || true
  ip route flush table "$ROUTE_TABLE" 2>/dev/null || true
  local link
  for link in "$POD_BRIDGE" "$SERVICE_BRIDGE"; do
    ip link show "$link" >/dev/null 2>&1 && ip link del "$link"
  done
  # veths left by pods whose network namespace outlived the bridge (none normally).
  { comm -13 "$BEFORE_DIR/links" <(links_snapshot) | grep '^veth' || true; } | while read -r link; do
    ip link del "$link" 2>/dev/null || true
  done
  return 0
}

restore_machine() {
  unmount_new_mounts
  remove_iptables_chains
  restore_network
  restore_sysctls
  remove_created_paths
  remove_new_cgroups
}

# Prints "<what>: <difference>" lines; returns 1 when the machine differs from the snapshot.
check_machine() {
  local differences=0 diff_out
  report() {
    local what="$1" out="$2"
    [[ -z "$out" ]] && return
    differences=1
    sed "s/^/  $what: /" <<<"$out"
  }
  # Keys present both times whose value differs, and keys that exist only now.
  diff_out="$(diff <(sysctl_snapshot) "$BEFORE_DIR/sysctl" | grep '^<' | sed 's/^< //' | grep -v '^net\.ipv[46]\.\(conf\|neigh\)\.veth' || true)"
  report "kernel setting now" "$diff_out"
  report "nftables (- before, + now)" "$(diff "$BEFORE_DIR/ruleset" <(ruleset_snapshot) | grep '^[<>]' | sed 's/^</-/; s/^>/+/' || true)"
  report "link added" "$(comm -13 "$BEFORE_DIR/links" <(links_snapshot))"
  report "link gone" "$(comm -23 "$BEFORE_DIR/links" <(links_snapshot))"
  report "route added" "$(comm -13 "$BEFORE_DIR/routes" <(routes_snapshot))"
  report "route gone" "$(comm -23 "$BEFORE_DIR/routes" <(routes_snapshot))"
  report "policy rule added" "$(comm -13 "$BEFORE_DIR/rules" <(rules_snapshot))"
  report "policy rule gone" "$(comm -23 "$BEFORE_DIR/rules" <(rules_snapshot))"
  report "mount added" "$(comm -13 "$BEFORE_DIR/mounts" <(mounts_snapshot))"
  report "cgroup added" "$(comm -13 "$BEFORE_DIR/cgroups" <(cgroups_snapshot))"
  report "path created" "$(comm -13 "$BEFORE_DIR/paths" <(existing_paths))"
  report "process left" "$(node_processes)"
  return "$differences"
}
