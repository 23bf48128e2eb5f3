#!/usr/bin/env bash
# Prepares what compose.yaml's images are built from (O1), with no container
# registry: the local base image, this machine's Debian sources (so apt in the
# image uses the same mirror) and a wheelhouse of cellgate and its dependencies
# built here with this machine's own pip configuration. Then:
#   docker-compose up -d --build
# Usage: scripts/compose-prepare.sh   (CELLGATE_PY: the python whose pip builds
# the wheels; its version must be the base image's python3, 3.11 on bookworm)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
log() { printf '[compose-prepare] %s\n' "$*" >&2; }

command -v docker-compose >/dev/null 2>&1 || {
  log "docker-compose is missing: run scripts/setup-engine.sh as root"; exit 1; }
bash "$here/build-base-image.sh" "${CELLGATE_BASE_IMAGE:-cellgate-base:bookworm}"

out="$repo/.compose"
mkdir -p "$out/apt" "$out/wheels"
rm -f "$out"/apt/* "$out"/wheels/cellgate-*.whl
# Debian's own sources only (a third-party source would need its keyring).
if [ "$(. /etc/os-release && echo "${ID:-}")" = debian ]; then
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    cp /etc/apt/sources.list.d/debian.sources "$out/apt/"
  elif [ -f /etc/apt/sources.list ]; then
    grep -E '^[[:space:]]*deb[[:space:]]' /etc/apt/sources.list >"$out/apt/sources.list" || true
  fi
fi
touch "$out/apt/.keep"

bash "$here/build-runner.sh"  # the native runner goes into the wheel with the package
py="${CELLGATE_PY:-$repo/.venv/bin/python}"
[ -x "$py" ] || py=python3
log "building the wheelhouse in $out/wheels with $("$py" -V 2>&1)"
"$py" -m pip wheel -q --disable-pip-version-check -w "$out/wheels" "$repo" >&2
log "ready: $(find "$out/wheels" -name '*.whl' | wc -l) wheels"
