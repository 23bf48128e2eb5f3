#!/usr/bin/env bash
# Headless Chromium from Debian's packages, for the dashboard's browser test (O3).
# Idempotent: does nothing when `chromium` is already installed. Prints its path.
set -euo pipefail
if ! command -v chromium >/dev/null 2>&1; then
  echo "[setup-browser] installing chromium (Debian package)" >&2
  sudo_cmd=()
  if [ "$(id -u)" != 0 ]; then sudo_cmd=(sudo); fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq >&2
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >&2
fi
command -v chromium
