#!/bin/sh
# The gateway container's entrypoint (compose.yaml, O1): `cellgate ARGS...`, after
# checking that the state directory is mounted at the path the config names.
# Sandboxes' bind mounts name host paths, and the engine resolves them on the
# host: the state directory must be the same path inside and outside.
set -eu
/opt/cellgate/bin/python - "$@" <<'PY'
import os
import sys
from pathlib import Path

args = sys.argv[1:]
if not args or args[0] != "serve" or "--config" not in args:
    sys.exit(0)
config = Path(args[args.index("--config") + 1])
want = os.environ.get("CELLGATE_STATE_DIR", "")


def stop(why: str) -> None:
    print(f"cellgate-entrypoint: {why}", file=sys.stderr)
    sys.exit(2)


if not want or not os.path.isabs(want):
    stop("CELLGATE_STATE_DIR must be the absolute host path of the state directory")
if not os.path.ismount(want):
    stop(f"{want} is not a mount: bind-mount the host's {want} at the same path")
from orchestrator.config import load_config  # noqa: E402

try:
    state = load_config(config).gateway.state_dir
except Exception as exc:  # the gateway would say the same, later and louder
    stop(str(exc))
if os.path.realpath(state) != os.path.realpath(want):
    stop(f'{config}: gateway.stateDir is {state}; under Compose it must be "{want}"')
PY
exec cellgate "$@"
