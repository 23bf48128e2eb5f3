#!/usr/bin/env bash
# Builds the native resident runner (sandbox/client/cellgate_runner.c) into the
# package, beside its source: sandbox/client/cellgate-runner.bin, a static binary
# that runs in any sandbox image of this machine's architecture. A gateway without it
# starts a Python runner per sandbox instead (slower first turns, same behaviour).
# Installs a C compiler and libc's static library with apt when they are missing.
# Usage: scripts/build-runner.sh [OUT]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
src="$repo/sandbox/client/cellgate_runner.c"
out="${1:-$repo/sandbox/client/cellgate-runner.bin}"
log() { printf '[build-runner] %s\n' "$*" >&2; }

if [ -x "$out" ] && [ "$out" -nt "$src" ] && [ "$out" -nt "$0" ]; then
  exit 0
fi
cc="${CC:-cc}"
static_libc() { [ -n "$("$cc" -print-file-name=libc.a 2>/dev/null | grep /)" ]; }
if ! command -v "$cc" >/dev/null 2>&1 || ! static_libc; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing a C compiler (gcc, libc6-dev)"
    apt-get update -q >&2 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends gcc libc6-dev >&2 \
      || log "could not install gcc and libc6-dev"
  fi
fi
# A runner that cannot be (re)built is removed, never left stale: the gateway then runs
# its Python runner (and says so), and this script's exit status stays 0.
if ! command -v "$cc" >/dev/null 2>&1 || ! static_libc; then
  rm -f "$out"
  log "no C compiler with a static libc: the gateway runs its Python runner instead"
  exit 0
fi
tmp="$out.tmp.$$"
trap 'rm -f "$tmp"' EXIT
if ! "$cc" -std=c11 -O2 -static -s -Wall -Wextra -o "$tmp" "$src" >&2; then
  rm -f "$out"
  log "the native runner did not build: the gateway runs its Python runner instead"
  exit 0
fi
chmod 0755 "$tmp"
mv -f "$tmp" "$out"
log "built $out"
