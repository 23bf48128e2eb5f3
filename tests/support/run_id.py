"""This test run's gateway id (R1): every container a test makes carries it.

Test gateways and backends use `RUN_ID` as their gateway id (seeded into each
test state directory), and cleanup removes only containers labelled with it,
so a run never lists or removes another gateway's (or another run's) sandboxes.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

from sandbox.gateway_id import write_gateway_id
from sandbox.spec import LABEL_APP, LABEL_GATEWAY

RUN_ID = f"testrun-{secrets.token_hex(5)}"


def run_labels(app: str | None = None) -> list[str]:
    """A Docker label filter for this run's containers (of `app`, when given)."""
    out = [f"{LABEL_GATEWAY}={RUN_ID}"]
    if app is not None:
        out.append(f"{LABEL_APP}={app}")
    return out


def run_containers(client: Any, app: str | None = None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = client.api.containers(all=True, filters={"label": run_labels(app)})
    return rows


REMOVE_TRIES = 4


def remove_run_containers(client: Any, app: str | None = None) -> None:
    """Force-remove this run's containers (of `app`), whatever state they are in.

    An engine slow to kill one (a gVisor sandbox on a loaded CI machine once took
    over the SDK's 60 s read timeout) is asked again until it is gone, a few times."""
    import docker.errors
    import requests

    for row in run_containers(client, app):
        for attempt in range(REMOVE_TRIES):
            try:
                client.api.remove_container(row["Id"], force=True, v=True)
                break
            except docker.errors.NotFound:
                break
            except (requests.exceptions.ReadTimeout, docker.errors.APIError) as exc:
                slow = isinstance(exc, requests.exceptions.ReadTimeout)
                if attempt == REMOVE_TRIES - 1 or not (slow or "in progress" in str(exc)):
                    raise
                time.sleep(2)


def seed_gateway_id(state_dir: Path) -> Path:
    """Make `state_dir` a gateway whose id is this run's."""
    write_gateway_id(state_dir, RUN_ID)
    return state_dir
