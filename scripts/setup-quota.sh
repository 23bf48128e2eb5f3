#!/usr/bin/env bash
# What the per-conversation disk quota (R2) needs on a fresh Debian machine:
# mkfs.ext4 (e2fsprogs), mount/umount/losetup (util-linux, mount) and loop
# devices. Each conversation's chat dir, media and home live in one
# loop-mounted ext4 image under the gateway's state directory; the gateway
# makes and mounts them itself, as root. Idempotent: a second run only checks.
set -euo pipefail

log() { printf '[setup-quota] %s\n' "$*" >&2; }
PATH="$PATH:/usr/sbin:/sbin"

need_pkgs=()
command -v mkfs.ext4 >/dev/null 2>&1 || need_pkgs+=(e2fsprogs)
command -v losetup >/dev/null 2>&1 || need_pkgs+=(util-linux)
{ command -v mount && command -v umount; } >/dev/null 2>&1 || need_pkgs+=(mount)
if [ "${#need_pkgs[@]}" -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    log "missing ${need_pkgs[*]}; run this script as root (it uses apt-get)"; exit 1
  fi
  log "installing ${need_pkgs[*]} with apt-get"
  apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_pkgs[@]}" >&2
fi

if [ ! -e /dev/loop-control ] && [ "$(id -u)" = 0 ]; then
  log "no /dev/loop-control: loading the loop module"
  modprobe loop 2>/dev/null || true
fi
if [ ! -e /dev/loop-control ]; then
  log "no loop devices (/dev/loop-control): load the loop module (modprobe loop), or set"
  log 'gateway.quota to "off" in the config file (then one stranger can fill the disk)'
  exit 1
fi
if [ "$(id -u)" != 0 ]; then
  log "note: the gateway must run as root to mount the quota images (sandboxes stay unprivileged)"
fi
log "ready: mkfs.ext4, mount and loop devices are present"
