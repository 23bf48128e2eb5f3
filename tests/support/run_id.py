"""This test run's gateway id (R1): every container a test makes carries it.

Test gateways and backends use `RUN_ID` as their gateway id (seeded into each
test state directory), and cleanup removes only containers labelled with it,
so a run never lists or removes another gateway's (or another run's) sandboxes.
"""

from __future__ import annotations

import contextlib
import secrets
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


def remove_run_containers(client: Any, app: str | None = None) -> None:
    """Force-remove this run's containers (of `app`), whatever state they are in."""
    import docker.errors

    for row in run_containers(client, app):
        with contextlib.suppress(docker.errors.NotFound):
            client.api.remove_container(row["Id"], force=True, v=True)


def seed_gateway_id(state_dir: Path) -> Path:
    """Make `state_dir` a gateway whose id is this run's."""
    write_gateway_id(state_dir, RUN_ID)
    return state_dir
