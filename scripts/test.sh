#!/usr/bin/env bash
# The test command of the README and of CI: engine, install, lint, types, tests.
# Extra arguments go to pytest. Fails when no test ran.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
# shellcheck source=bootstrap.sh
source "$here/bootstrap.sh"
bash "$here/setup-browser.sh" >/dev/null  # the dashboard's test drives headless Chromium (O3)
cd "$repo"
bin="$(dirname "$CELLGATE_PY")"

echo "== ruff" >&2
"$bin/ruff" check .
"$bin/ruff" format --check .
echo "== mypy --strict" >&2
"$bin/mypy" --strict
echo "== pytest (base image $CELLGATE_BASE_IMAGE)" >&2
set +e
CELLGATE_REQUIRE_DOCKER=1 "$CELLGATE_PY" -m pytest -p no:cacheprovider -ra "$@"
code=$?
set -e
if [ "$code" = 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$code"
