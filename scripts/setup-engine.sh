#!/usr/bin/env bash
# Installs and starts what cellgate's sandboxes need on a fresh Debian machine:
# the Docker engine (Debian's docker.io), gVisor (runsc, registered as the
# "runsc" runtime with network off) and debootstrap for local base images.
# Idempotent: a second run only checks. Needs root for the install steps.
set -euo pipefail

log() { printf '[setup-engine] %s\n' "$*" >&2; }

need_pkgs=()
command -v dockerd >/dev/null 2>&1 || need_pkgs+=(docker.io)
command -v runsc >/dev/null 2>&1 || need_pkgs+=(runsc)
command -v debootstrap >/dev/null 2>&1 || need_pkgs+=(debootstrap)
if [ "${#need_pkgs[@]}" -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    log "missing ${need_pkgs[*]}; run this script as root (it uses apt-get)"; exit 1
  fi
  log "installing ${need_pkgs[*]} with apt-get"
  apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_pkgs[@]}" >&2
fi

if docker info >/dev/null 2>&1; then
  log "a Docker engine already answers"; exit 0
fi

if [ "$(id -u)" != 0 ]; then
  log "no Docker engine answers and starting one needs root"; exit 1
fi

mkdir -p /etc/docker
if [ ! -f /etc/docker/daemon.json ] && command -v runsc >/dev/null 2>&1; then
  # gVisor runs here only with its network off.
  cat > /etc/docker/daemon.json <<JSON
{
  "storage-driver": "overlay2",
  "runtimes": {
    "runsc": {"path": "$(command -v runsc)", "runtimeArgs": ["--network=none"]}
  }
}
JSON
  log "wrote /etc/docker/daemon.json (overlay2, runsc runtime)"
fi

if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  systemctl start docker || true
fi
if ! docker info >/dev/null 2>&1; then
  log "starting dockerd in the background (log: /var/log/cellgate-dockerd.log)"
  nohup dockerd >/var/log/cellgate-dockerd.log 2>&1 &
fi
for _ in $(seq 1 60); do
  docker info >/dev/null 2>&1 && { log "Docker engine is up"; exit 0; }
  sleep 1
done
log "dockerd did not answer within 60 s; see /var/log/cellgate-dockerd.log"
exit 1
