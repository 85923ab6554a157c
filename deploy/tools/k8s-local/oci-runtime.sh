#!/bin/sh
# The node's OCI runtime: runc, with a negative process.oomScoreAdj raised to 0 first.
#
# kubelet asks for -998 (pause containers) and -997 (Guaranteed pods); lowering an OOM score
# needs CAP_SYS_RESOURCE, which a sandboxed machine may not grant, and runc then fails every pod
# ("can't get final child's PID from pipe: EOF"). docker runs this as its default runtime
# (node.sh); everything else goes to runc unchanged.
bundle=""
previous=""
for arg in "$@"; do
  case "$previous" in --bundle | -b) bundle="$arg" ;; esac
  case "$arg" in --bundle=*) bundle="${arg#--bundle=}" ;; esac
  previous="$arg"
done
config="$bundle/config.json"
if [ -n "$bundle" ] && [ -f "$config" ]; then
  adj="$(jq '.process.oomScoreAdj // 0' "$config")"
  if [ "$adj" -lt 0 ]; then
    jq -c '.process.oomScoreAdj = 0' "$config" >"$config.tandem" && mv "$config.tandem" "$config"
  fi
fi
exec runc "$@"
