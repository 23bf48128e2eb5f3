"""Apps: a directory with `app.yaml` that declares one agent service.

`install_app` copies the agent's workspace template under the state directory,
builds or checks its image, records the app, and writes the app agent's entry
into the gateway config from the declaration (L3). Update, reconfigure,
uninstall and backup build on the same record (`apps/<name>/app.json`).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from cellgate.errors import AppError, ConfigError
from orchestrator.config import (
    AGENT_ID_RE,
    HarnessConfig,
    ShellHarness,
    every_validation_error,
    read_config_document,
    write_config_document,
)
from sandbox.gateway_id import load_gateway_id
from sandbox.images import Progress, build_image, image_id

logger = logging.getLogger(__name__)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AppBuild(_Model):
    context: str = "."
    dockerfile: str = "Dockerfile"
    args: dict[str, str] = Field(default_factory=dict)


class AgentService(_Model):
    path: str
    name: str = Field(pattern=AGENT_ID_RE)
    isolate_memory: StrictBool = False
    disable_archive: StrictBool = False
    image: str | None = None
    build: AppBuild | None = None
    user: str | None = Field(None, pattern=r"^[0-9]{1,10}(:[0-9]{1,10})?$")
    environment: dict[str, str] = Field(default_factory=dict)
    networks: tuple[str, ...] = ()
    harness: HarnessConfig = ShellHarness(type="shell")

    @model_validator(mode="after")
    def _one_image_source(self) -> AgentService:
        if (self.image is None) == (self.build is None):
            raise ValueError("declare exactly one of `image` (a reference) or `build` (a context)")
        return self


class AppServices(_Model):
    agent: AgentService


class AppManifest(_Model):
    name: str = Field(pattern=AGENT_ID_RE)
    version: str = "0"
    description: str = ""
    services: AppServices


def _inside(base: Path, rel: str, what: str, source: str) -> Path:
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts:
        raise ConfigError(source, what, f"{rel!r} must be a path inside the app directory")
    return base / p


def load_manifest(app_dir: Path) -> AppManifest:
    path = app_dir / "app.yaml"
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(str(path), "", "no app.yaml in this directory") from exc
    except OSError as exc:
        raise ConfigError(str(path)[:300], "", f"cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), "", f"not valid YAML: {exc}") from exc
    try:
        manifest = AppManifest.model_validate(doc)
    except ValidationError as exc:
        field, msg = every_validation_error(exc)
        raise ConfigError(str(path), field, msg) from exc
    svc = manifest.services.agent
    _inside(app_dir, svc.path, "services.agent.path", str(path))
    if svc.build:
        _inside(app_dir, svc.build.context, "services.agent.build.context", str(path))
    return manifest


@dataclass(frozen=True, slots=True)
class InstalledApp:
    name: str
    version: str
    agent: str
    image: str
    image_id: str
    user: str | None
    environment: Mapping[str, str]
    networks: tuple[str, ...]
    isolate_memory: bool
    disable_archive: bool
    workspace: Path
    agent_root: Path
    state: str = "running"  # "running" or "stopped" (`cellgate apps stop`)
    record_dir: Path | None = None

    @property
    def running(self) -> bool:
        return self.state == "running"

    @staticmethod
    def load(state_dir: Path, name: str) -> InstalledApp:
        record = state_dir / "apps" / name / "app.json"
        try:
            doc = json.loads(record.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise AppError(
                name, f"not installed (no {record}); run `cellgate apps install`"
            ) from exc
        agent_root = state_dir / "agents" / doc["agent"]
        return InstalledApp(
            name=doc["name"],
            version=doc["version"],
            agent=doc["agent"],
            image=doc["image"],
            image_id=doc["image_id"],
            user=doc.get("user"),
            environment=doc.get("environment", {}),
            networks=tuple(doc.get("networks", ())),
            isolate_memory=bool(doc["isolate_memory"]),
            disable_archive=bool(doc["disable_archive"]),
            workspace=agent_root / "workspace",
            agent_root=agent_root,
            state=str(doc.get("state", "running")),
            record_dir=record.parent,
        )


def _record(app: InstalledApp, manifest: AppManifest) -> dict[str, Any]:
    return {
        "name": app.name,
        "version": app.version,
        "agent": app.agent,
        "image": app.image,
        "image_id": app.image_id,
        "user": app.user,
        "environment": dict(app.environment),
        "networks": list(app.networks),
        "isolate_memory": app.isolate_memory,
        "disable_archive": app.disable_archive,
        "state": app.state,
        "manifest": manifest.model_dump(mode="json"),
    }


def read_record(state_dir: Path, name: str) -> dict[str, Any]:
    """The raw `apps/<name>/app.json` of an installed app."""
    path = state_dir / "apps" / name / "app.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise AppError(name, f"not installed (no {path}); run `cellgate apps install`") from exc
    except (OSError, ValueError) as exc:
        raise AppError(name, f"its record {path} is unreadable: {exc}") from exc
    if not isinstance(doc, dict):
        raise AppError(name, f"its record {path} is not a JSON object")
    return doc


def write_record(
    record_dir: Path,
    app: InstalledApp,
    manifest: AppManifest,
    *,
    operator_env: Mapping[str, str] | None = None,
) -> None:
    """Write `app.json` atomically (a crash leaves the old or the new record).

    `operator_env` is what `apps reconfigure` set; it outlives updates."""
    record_dir.mkdir(parents=True, exist_ok=True)
    doc = {**_record(app, manifest), "operator_environment": dict(operator_env or {})}
    tmp = record_dir / ".app.json.tmp"
    tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    tmp.replace(record_dir / "app.json")


def installed_manifest(state_dir: Path, name: str) -> AppManifest:
    """The manifest of the installed release, as recorded at install or update."""
    doc = read_record(state_dir, name)
    try:
        return AppManifest.model_validate(doc["manifest"])
    except (KeyError, ValidationError) as exc:
        raise AppError(name, "its record holds no valid manifest; update the app") from exc


def installed_apps(state_dir: Path) -> list[str]:
    """The names of the apps installed in this state directory."""
    root = state_dir / "apps"
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "app.json").is_file())


def agent_entry(manifest: AppManifest) -> dict[str, Any]:
    """The app agent's config entry, as the declaration says (L3)."""
    svc = manifest.services.agent
    return {
        "id": svc.name,
        "app": manifest.name,
        "isolateMemory": svc.isolate_memory,
        "disableArchive": svc.disable_archive,
        "harness": svc.harness.model_dump(by_alias=True),
    }


def write_agent_entry(config_path: Path, entry: dict[str, Any]) -> None:
    """Insert or reset the app agent's entry in the gateway config file."""
    doc = read_config_document(config_path)
    agents = doc.get("agents", [])
    if not isinstance(agents, list):
        raise ConfigError(str(config_path), "agents", "must be a list of agent objects")
    for i, a in enumerate(agents):
        if isinstance(a, dict) and a.get("id") == entry["id"]:
            if a.get("app") not in (None, entry["app"]):
                raise AppError(
                    entry["app"],
                    f"agent id {entry['id']!r} already belongs to app {a.get('app')!r}",
                )
            merged = {**a, **entry}
            agents[i] = merged
            break
    else:
        agents.append(entry)
    doc["agents"] = agents
    write_config_document(config_path, doc)


KEPT_ON_UPDATE = ("chats", "media", "memory", "MEMORY.md", "USER.md", "kb.sqlite")
"""What an update keeps of the workspace: the conversations and the agent's own memory."""


def replace_template(template: Path, workspace: Path, staging: Path) -> None:
    """Replace the workspace's release files with the template's; keep KEPT_ON_UPDATE."""
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(template, staging, symlinks=True)
    for entry in list(workspace.iterdir()):
        if entry.name in KEPT_ON_UPDATE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    for entry in list(staging.iterdir()):
        if entry.name in KEPT_ON_UPDATE and (workspace / entry.name).exists():
            continue
        entry.rename(workspace / entry.name)
    shutil.rmtree(staging, ignore_errors=True)


def save_release(app_dir: Path, record_dir: Path) -> None:
    """Keep the release's source (app.yaml, template, build context) beside the record,
    so a backup carries what restore needs to rebuild the image on another machine."""
    record_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(app_dir / "app.yaml", record_dir / "app.yaml")
    staged = record_dir / ".release.new"
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(app_dir, staged, symlinks=True)
    old = record_dir / "release"
    if old.exists():
        shutil.rmtree(old)
    staged.rename(old)


BUILT_PREFIX = "cellgate-app-"
"""The tags cellgate builds: `cellgate-app-<app>:<version>-<gateway id>`."""


def own_tag(manifest: AppManifest, owner: str) -> str:
    """The tag gateway `owner` gives the image it builds for this release."""
    return f"{BUILT_PREFIX}{manifest.name}:{manifest.version}-{owner}"


def build_or_check_image(
    app_dir: Path,
    manifest: AppManifest,
    docker: Any,
    progress: Progress,
    build_args: Mapping[str, str] | None = None,
    *,
    owner: str,
) -> tuple[str, str]:
    """The release's image reference and id: built from its context, or checked present.

    A built image's tag names the gateway that owns it (`owner`, its id): two gateways on
    one engine installing the same app must not untag each other's image (an update or
    uninstall removes its old tag, and an image left without tags and sandboxes is gone)."""
    svc = manifest.services.agent
    if svc.build is not None:
        tag = own_tag(manifest, owner)
        progress(f"building image {tag} for app {manifest.name}")
        context = _inside(app_dir, svc.build.context, "services.agent.build.context", "app.yaml")
        args = {**svc.build.args, **(build_args or {})}
        return tag, build_image(docker, context, svc.build.dockerfile, tag, args, progress)
    assert svc.image is not None
    progress(f"checking image {svc.image}")
    return svc.image, image_id(docker, svc.image)


def template_dir(app_dir: Path, manifest: AppManifest) -> Path:
    svc = manifest.services.agent
    template = _inside(app_dir, svc.path, "services.agent.path", str(app_dir / "app.yaml"))
    if not template.is_dir():
        raise ConfigError(
            str(app_dir / "app.yaml"), "services.agent.path", f"{template} is not a directory"
        )
    return template


def kept_agent(record_dir: Path) -> str | None:
    """The agent whose data an uninstall without --purge kept, from the release it left
    beside its record (`app.yaml` stays, `app.json` goes); None when there is none."""
    if (record_dir / "app.json").exists():
        return None
    try:
        doc = yaml.safe_load((record_dir / "app.yaml").read_text(encoding="utf-8"))
        name = doc["services"]["agent"]["name"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    return name if isinstance(name, str) else None


def install_app(
    app_dir: Path,
    config_path: Path,
    state_dir: Path,
    docker: Any,
    progress: Progress,
    build_args: Mapping[str, str] | None = None,
) -> InstalledApp:
    """Install the app in `app_dir`: workspace, image, record, config entry."""
    app_dir = app_dir.resolve()
    manifest = load_manifest(app_dir)
    svc = manifest.services.agent
    record_dir = state_dir / "apps" / manifest.name
    if (record_dir / "app.json").exists():
        raise AppError(manifest.name, "already installed; uninstall it or use an update")
    agent_root = state_dir / "agents" / svc.name
    workspace = agent_root / "workspace"
    kept = workspace.exists()
    if kept and kept_agent(record_dir) != svc.name:
        raise AppError(
            manifest.name,
            f"agent {svc.name} already has a workspace ({workspace}) that no uninstall of "
            f"app {manifest.name} kept: move it away (or, to bring back that data, restore "
            "its backup with `cellgate apps restore` on a state dir without it)",
        )
    template = template_dir(app_dir, manifest)
    ref, iid = build_or_check_image(
        app_dir, manifest, docker, progress, build_args, owner=load_gateway_id(state_dir)
    )

    agent_root.mkdir(parents=True, exist_ok=True)
    if kept:
        progress(
            f"found the data an uninstall kept for {svc.name} in {workspace}: installing over "
            "it (chats/, media/ and memory kept; --purge at uninstall deletes them)"
        )
        replace_template(template, workspace, agent_root / ".release-staging")
    else:
        shutil.copytree(template, workspace, symlinks=True)
    app = InstalledApp(
        name=manifest.name,
        version=manifest.version,
        agent=svc.name,
        image=ref,
        image_id=iid,
        user=svc.user,
        environment=dict(svc.environment),
        networks=svc.networks,
        isolate_memory=svc.isolate_memory,
        disable_archive=svc.disable_archive,
        workspace=workspace,
        agent_root=agent_root,
        record_dir=record_dir,
    )
    save_release(app_dir, record_dir)
    write_record(record_dir, app, manifest)
    write_agent_entry(config_path, agent_entry(manifest))
    logger.info("installed app %s (agent %s, image %s)", app.name, app.agent, ref)
    return app
