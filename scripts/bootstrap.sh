#!/usr/bin/env bash
# Shared by demo.sh and test.sh: the Docker engine, a virtualenv with cellgate
# installed, and a base image for the sample app. Source it; it sets
# CELLGATE_PY (the venv's python) and CELLGATE_BASE_IMAGE.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"

bash "$here/setup-engine.sh"
bash "$here/setup-quota.sh"

venv="${CELLGATE_VENV:-$repo/.venv}"
if [ ! -x "$venv/bin/python" ]; then
  echo "[bootstrap] creating $venv" >&2
  python3 -m venv "$venv"
fi
stamp="$venv/.cellgate-installed"
if [ ! -f "$stamp" ] || [ "$repo/pyproject.toml" -nt "$stamp" ]; then
  echo "[bootstrap] installing cellgate and its test dependencies into $venv" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$repo[test]" >&2
  touch "$stamp"
fi
CELLGATE_PY="$venv/bin/python"
# the native resident runner, into the (editable) package; without a C compiler the
# gateway runs its Python runner
bash "$here/build-runner.sh"

# The sample app's base: the one asked for, else the official Python image if
# this engine has it, else a local Debian base built from apt's own mirror.
if [ -z "${CELLGATE_BASE_IMAGE:-}" ]; then
  if docker image inspect python:3.12-slim >/dev/null 2>&1; then
    CELLGATE_BASE_IMAGE=python:3.12-slim
  else
    bash "$here/build-base-image.sh" cellgate-base:bookworm
    CELLGATE_BASE_IMAGE=cellgate-base:bookworm
  fi
fi
export CELLGATE_PY CELLGATE_BASE_IMAGE
