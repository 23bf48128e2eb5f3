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

# gVisor runs here only with its network off; --host-uds=open lets a sandbox
# connect to the one host socket it has mounted (its bridge) and nothing else.
ensure_daemon_json() {
  [ "$(id -u)" = 0 ] || return 1
  command -v runsc >/dev/null 2>&1 || return 1
  mkdir -p /etc/docker
  python3 - "$(command -v runsc)" <<'PY'
import json, os, sys
path = "/etc/docker/daemon.json"
try:
    with open(path) as f:
        doc = json.load(f)
except FileNotFoundError:
    doc = {"storage-driver": "overlay2"}
want = {"path": sys.argv[1], "runtimeArgs": ["--network=none", "--host-uds=open"]}
if doc.get("runtimes", {}).get("runsc") == want:
    sys.exit(1)
doc.setdefault("runtimes", {})["runsc"] = want
tmp = path + ".tmp"
with open(tmp, "w") as f:
    json.dump(doc, f, indent=2)
os.replace(tmp, path)
PY
}

if ensure_daemon_json; then
  log "registered the runsc runtime in /etc/docker/daemon.json"
  if pgrep -x dockerd >/dev/null 2>&1; then
    pkill -HUP -x dockerd && log "asked dockerd to reload its runtimes"
    sleep 1
  fi
fi

if docker info >/dev/null 2>&1; then
  log "a Docker engine answers"; exit 0
fi

if [ "$(id -u)" != 0 ]; then
  log "no Docker engine answers and starting one needs root"; exit 1
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
