#!/usr/bin/env bash
# Builds the local base image `cellgate-base:bookworm` when no container
# registry is reachable: a minimal Debian rootfs made by debootstrap from the
# apt mirror this machine is already configured with, with python3 (the
# in-sandbox bridge client is stdlib-only), then `docker import`.
# Usage: scripts/build-base-image.sh [TAG]   (default cellgate-base:bookworm)
set -euo pipefail
tag="${1:-cellgate-base:bookworm}"
log() { printf '[build-base-image] %s\n' "$*" >&2; }

if docker image inspect "$tag" >/dev/null 2>&1; then
  log "$tag already exists"; exit 0
fi

# The mirror and suite come from the system's own apt configuration.
mirror="" suite=""
if [ -f /etc/apt/sources.list.d/debian.sources ]; then
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  suite=$(awk '/^Suites:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
fi
if [ -z "$mirror" ] && [ -f /etc/apt/sources.list ]; then
  read -r mirror suite < <(awk '$1=="deb" && $2 !~ /^\[/ {print $2, $3; exit}' /etc/apt/sources.list)
fi
if [ -z "$mirror" ]; then
  log "no Debian mirror found in /etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list"
  exit 1
fi
suite="${suite:-bookworm}"
command -v debootstrap >/dev/null 2>&1 || { log "debootstrap is missing: run scripts/setup-engine.sh"; exit 1; }

root=$(mktemp -d /var/tmp/cellgate-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
log "debootstrap $suite from the configured mirror into $root (a few minutes)"
debootstrap --variant=minbase --include=python3,ca-certificates "$suite" "$root" "$mirror" >&2
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
log "importing as $tag"
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/sh"]' - "$tag" >/dev/null
log "built $tag"
