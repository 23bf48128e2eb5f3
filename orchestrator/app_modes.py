"""L3: an app agent's isolateMemory and disableArchive come from its app.yaml, not the config.

`apply_declarations` writes each app agent's two switches from the installed
release's declaration (a release without the line: false), resets a hand
edit and logs it. It touches only agents of running apps: a stopped app's
agent keeps its entry until a start finds the app running. It runs at every
gateway start (`prepare_config`) and on every config reload (L5); install,
update, reconfigure and `apps start` write the whole entry themselves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from cellgate.errors import AppError
from orchestrator.apps import AppManifest, read_record
from orchestrator.config import (
    GatewayConfig,
    load_config,
    read_config_document,
    write_config_document,
)

logger = logging.getLogger(__name__)

SWITCHES = (("isolateMemory", "isolate_memory"), ("disableArchive", "disable_archive"))


@dataclass(frozen=True, slots=True)
class Reset:
    agent: str
    app: str
    field: str
    was: object
    now: bool

    def __str__(self) -> str:
        was = "absent" if self.was is None else repr(self.was)
        return (
            f"agent {self.agent}: {self.field} was {was} in the config; reset to "
            f"{str(self.now).lower()} as app {self.app}'s app.yaml declares (L3)"
        )


def apply_declarations(config_path: Path, state_dir: Path) -> list[Reset]:
    """Reset every running app agent's switches to its declaration; the resets made."""
    doc = read_config_document(config_path)
    agents = doc.get("agents", [])
    if not isinstance(agents, list):
        return []
    resets: list[Reset] = []
    for entry in agents:
        if not isinstance(entry, dict) or not isinstance(entry.get("app"), str):
            continue
        app, agent = entry["app"], str(entry.get("id", ""))
        try:
            record = read_record(state_dir, app)
            manifest = AppManifest.model_validate(record["manifest"])
        except (AppError, KeyError, ValidationError):
            continue  # not installed here: the agent loader says so
        if record.get("state", "running") != "running":
            logger.info(
                "agent %s: app %s is stopped; its config entry is left as it is", agent, app
            )
            continue
        svc = manifest.services.agent
        if svc.name != agent:
            continue
        for key, attr in SWITCHES:
            want = bool(getattr(svc, attr))
            have = entry.get(key)
            if have is want:
                continue
            if not (have is None and want is False):
                resets.append(Reset(agent, app, key, have, want))
            entry[key] = want
    if resets:
        for r in resets:
            logger.warning("%s", r)
        write_config_document(config_path, doc)
    return resets


def prepare_config(config_path: Path) -> GatewayConfig:
    """The config a gateway starts with: app declarations applied first (L3), so an agent
    entry they fix is not reported as skipped."""
    cfg = load_config(config_path, quiet=True)
    if apply_declarations(config_path, cfg.gateway.state_dir):
        cfg = load_config(config_path, quiet=True)
    for reason in cfg.skipped_agents:
        logger.error("%s", reason)
    return cfg
