#!/usr/bin/env bash
# The demo on a fresh machine: engine, install, sample app, then `cellgate demo`.
# Extra arguments go to `cellgate demo` (e.g. --once, --port 9000).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=bootstrap.sh
source "$here/bootstrap.sh"
exec "$(dirname "$CELLGATE_PY")/cellgate" demo --base-image "$CELLGATE_BASE_IMAGE" "$@"
