#!/usr/bin/env bash
# A Docker engine for the image checks on a bare machine (CI), and the local base image CI builds on.
#
#   eval "$(bash scripts/docker_engine.sh start)"   # reuse a running engine, else install docker.io and start
#                                                   # a private dockerd; prints the DOCKER_HOST/DOCKER export lines
#   bash scripts/docker_engine.sh base              # reprotune-base:bookworm from 'debootstrap --variant=minbase'
#   bash scripts/docker_engine.sh stop              # stop the dockerd this script started
#
# Why a private dockerd: CI machines have no engine and no registry. Its state lives under $ROOT (own
# --data-root/--exec-root/socket) so it never touches a system Docker. Why a debootstrap base: with no registry
# reachable, the pinned debian:12.12-slim cannot be pulled; the same Dockerfile then builds FROM this local
# bookworm (passed as BASE_IMAGE), which has the same distribution and Python 3.11.
set -euo pipefail

ROOT=${REPROTUNE_DOCKER_ROOT:-/var/lib/reprotune-docker}
SOCK="unix://$ROOT/docker.sock"
BASE_TAG=${REPROTUNE_DOCKER_BASE:-reprotune-base:bookworm}
# Debian's docker.io (20.10) client: its builtin BuildKit frontend needs no '# syntax=' image from Docker Hub.
DOCKER=${DOCKER:-/usr/bin/docker}

log() { echo "docker-engine: $*" >&2; }
engine_up() { DOCKER_HOST=$1 timeout 20 "$DOCKER" info >/dev/null 2>&1; }

install_packages() {
  local missing=()
  [ -x /usr/bin/docker ] && [ -x /usr/sbin/dockerd ] || missing+=(docker.io)
  command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" = 0 ] || { log "need ${missing[*]} (apt-get install as root)"; exit 1; }
  log "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

start() {
  if [ -n "${DOCKER_HOST:-}" ] && [ -x "$DOCKER" ] && engine_up "$DOCKER_HOST"; then
    echo "export DOCKER_HOST=$DOCKER_HOST DOCKER=$DOCKER DOCKER_BUILDKIT=1"; return 0
  fi
  install_packages
  if ! engine_up "$SOCK"; then
    [ "$(id -u)" = 0 ] || { log "starting dockerd needs root"; exit 1; }
    mkdir -p "$ROOT"
    log "starting dockerd (state in $ROOT, log $ROOT/dockerd.log)"
    # setsid: the engine outlives this script and the CI step's process group
    setsid /usr/sbin/dockerd --data-root "$ROOT/data" --exec-root "$ROOT/exec" -H "$SOCK" \
      --pidfile "$ROOT/dockerd.pid" >>"$ROOT/dockerd.log" 2>&1 < /dev/null &
    for _ in $(seq 60); do engine_up "$SOCK" && break; sleep 1; done
    engine_up "$SOCK" || { log "dockerd did not come up; see $ROOT/dockerd.log"; tail -5 "$ROOT/dockerd.log" >&2; exit 1; }
  fi
  echo "export DOCKER_HOST=$SOCK DOCKER=$DOCKER DOCKER_BUILDKIT=1"
}

base() {
  export DOCKER_HOST=${DOCKER_HOST:-$SOCK}
  if "$DOCKER" image inspect "$BASE_TAG" >/dev/null 2>&1; then log "$BASE_TAG present"; return 0; fi
  install_packages
  local rootfs="$ROOT/rootfs-bookworm"
  rm -rf "$rootfs"
  log "debootstrap --variant=minbase bookworm (a minute or two)"
  debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >"$ROOT/debootstrap.log" 2>&1 \
    || { log "debootstrap failed; see $ROOT/debootstrap.log"; tail -5 "$ROOT/debootstrap.log" >&2; exit 1; }
  # the same apt sources as debian:12.12-slim (with security updates); no apt caches in the image
  printf 'deb http://deb.debian.org/debian bookworm main\ndeb http://deb.debian.org/debian bookworm-updates main\ndeb http://deb.debian.org/debian-security bookworm-security main\n' \
    > "$rootfs/etc/apt/sources.list"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" --numeric-owner -c . | "$DOCKER" import --change 'CMD ["bash"]' - "$BASE_TAG" >/dev/null
  rm -rf "$rootfs"
  log "imported $BASE_TAG"
}

stop() {
  [ -f "$ROOT/dockerd.pid" ] || { log "no dockerd started here"; return 0; }
  kill "$(cat "$ROOT/dockerd.pid")" && log "stopped dockerd $(cat "$ROOT/dockerd.pid")"
}

case "${1:-start}" in
  start) start ;;
  base) base ;;
  stop) stop ;;
  *) echo "usage: $0 start|base|stop" >&2; exit 2 ;;
esac
