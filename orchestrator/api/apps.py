"""`/api/v1/apps`: the operator's app lifecycle over HTTP, admin keys only (L3, L4, L5, S5).

The same operations as `cellgate apps ...`, run inside the gateway: a change
is followed at once (`Reloader.reload`), so an agent whose app changed
restarts when none of its sessions is busy, its sandboxes removed then (L5,
S5). Each answer carries the progress lines of the long steps (`steps`).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field, field_validator

from cellgate.errors import AppError, ConfigError, ImageError, SandboxError
from orchestrator import app_backup, app_ops
from orchestrator.api.auth import CallerKey, require
from orchestrator.api.context import ApiContext, context
from orchestrator.api.errors import ApiError
from orchestrator.apps import InstalledApp, install_app, load_manifest
from orchestrator.config import AGENT_ID_RE
from sandbox.images import docker_client

__all__ = ["router"]

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/api/v1/apps", tags=["apps"])

Ctx = Annotated[ApiContext, Depends(context)]
AppName = Annotated[str, PathParam(pattern=AGENT_ID_RE)]
T = TypeVar("T")
RETIRE_SECONDS = 600.0
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


HostPath = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00]+$")]
"""A path on the gateway host (admin keys only): no NUL, bounded."""


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class InspectIn(_In):
    path: HostPath | None = Field(None, description="An app directory on the host.")
    name: str | None = Field(None, pattern=AGENT_ID_RE, description="An installed app.")


class DirIn(_In):
    path: HostPath = Field(description="The release's directory on the host.")


class ReconfigureIn(_In):
    env: dict[str, str] = Field(default_factory=dict, max_length=200)
    unset_env: list[str] = Field(default_factory=list, alias="unsetEnv", max_length=200)

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for name, value in v.items():
            if not ENV_NAME.fullmatch(name) or "\x00" in value or len(value) > 8192:
                raise ValueError(f"{name[:60]!r}: a variable name, and a value without NUL")
        return v


class UninstallIn(_In):
    purge: bool = False
    backup_path: HostPath | None = Field(None, alias="backupPath")


class BackupIn(_In):
    path: HostPath | None = None


class RestoreIn(_In):
    archive: HostPath


def _config_path(ctx: ApiContext) -> Path:
    path = ctx.gateway.config_path
    if path is None:
        raise ApiError(409, "no_config_file", "this gateway was started without a config file")
    return path


def _state(ctx: ApiContext) -> Path:
    return ctx.gateway.config.gateway.state_dir


def _build_args(ctx: ApiContext) -> dict[str, str] | None:
    base = ctx.gateway.config.gateway.base_image
    return {"BASE_IMAGE": base} if base else None


async def _run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """A synchronous app operation in a thread, its errors as 4xx answers for the operator."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except (AppError, ConfigError, ImageError) as exc:
        raise ApiError(409, "app_error", str(exc)) from exc
    except OSError as exc:  # a path the operator gave that cannot be used
        raise ApiError(400, "bad_path", f"{exc.strerror}: {str(exc.filename)[:300]}") from exc
    except SandboxError as exc:
        raise ApiError(502, "engine_error", str(exc)) from exc


class _Steps:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        if len(self.lines) < 500:
            self.lines.append(line)
        logger.info("%s", line)


async def _with_docker(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    client = await _run(docker_client)
    try:
        return await _run(fn, *args, client, **kwargs)
    finally:
        client.close()


@router.get("")
async def list_apps(who: CallerKey, ctx: Ctx) -> list[dict[str, Any]]:
    require(ctx, who, "", "admin")
    return await _run(app_ops.list_apps, _state(ctx))


@router.post("/inspect")
async def inspect(body: InspectIn, who: CallerKey, ctx: Ctx) -> dict[str, Any]:
    """L4: the app's `agentDeclaration` (isolateMemory, disableArchive) and its record."""
    require(ctx, who, "", "admin")
    if (body.path is None) == (body.name is None):
        raise ApiError(400, "bad_request", "give `path` (an app directory) or `name`, one of them")
    path = Path(body.path) if body.path is not None else None
    return await _run(app_ops.inspect_app, _state(ctx), path=path, name=body.name)


def _done(app: InstalledApp, steps: _Steps, **extra: Any) -> dict[str, Any]:
    return {**app_ops.describe(app), **extra, "steps": steps.lines}


@router.post("/install", status_code=201)
async def install(body: DirIn, who: CallerKey, ctx: Ctx) -> dict[str, Any]:
    require(ctx, who, "", "admin", is_write=True)
    steps = _Steps()
    client = await _run(docker_client)
    try:
        app = await _run(install_app, Path(body.path), _config_path(ctx), _state(ctx), client,
                         steps, _build_args(ctx))  # fmt: skip
    finally:
        client.close()
    await ctx.gateway.reloader.reload()
    return _done(app, steps)


@router.post("/{name}/update")
async def update(name: AppName, body: DirIn, who: CallerKey, ctx: Ctx) -> dict[str, Any]:
    """A new release; the agent restarts (sandboxes removed) once none of its sessions is busy."""
    require(ctx, who, "", "admin", is_write=True)
    steps = _Steps()
    source = Path(body.path)
    manifest = await _run(lambda: load_manifest(source.resolve()))
    if manifest.name != name:
        raise ApiError(409, "app_error", f"{body.path} holds app {manifest.name!r}, not {name!r}")
    client = await _run(docker_client)
    try:
        old, app = await _run(app_ops.update_app, source, _config_path(ctx), _state(ctx), client,
                              steps, _build_args(ctx), remove_sandboxes=False)  # fmt: skip
        waiting = await ctx.gateway.reloader.reload()
        if old.image != app.image and app.agent not in waiting:  # its sandboxes are gone now
            owner = ctx.gateway.gateway_id
            await _run(app_ops.remove_image_tag, client, old.image, steps, owner=owner)
    finally:
        client.close()
    return _done(app, steps, restartPending=app.agent in waiting)


@router.post("/{name}/reconfigure")
async def reconfigure(
    name: AppName, body: ReconfigureIn, who: CallerKey, ctx: Ctx
) -> dict[str, Any]:
    require(ctx, who, "", "admin", is_write=True)
    steps = _Steps()
    app = await _run(app_ops.reconfigure_app, name, _config_path(ctx), _state(ctx),
                     set_env=body.env, unset_env=body.unset_env)  # fmt: skip
    waiting = await ctx.gateway.reloader.reload()
    return _done(app, steps, restartPending=app.agent in waiting)


async def _set_state(ctx: ApiContext, name: str, running: bool) -> dict[str, Any]:
    steps = _Steps()
    app = await _run(app_ops.set_state, name, _config_path(ctx), _state(ctx), running)
    waiting = await ctx.gateway.reloader.reload()
    return _done(app, steps, restartPending=app.agent in waiting)


@router.post("/{name}/start")
async def start(name: AppName, who: CallerKey, ctx: Ctx) -> dict[str, Any]:
    require(ctx, who, "", "admin", is_write=True)
    return await _set_state(ctx, name, True)


@router.post("/{name}/stop")
async def stop(name: AppName, who: CallerKey, ctx: Ctx) -> dict[str, Any]:
    require(ctx, who, "", "admin", is_write=True)
    return await _set_state(ctx, name, False)


async def _retire(ctx: ApiContext, app: InstalledApp) -> None:
    """Take no new turns; wait (bounded) until none is busy; stop its warm pool (no refill
    may make a sandbox or mount a spare quota image under the uninstall); remove the
    sandboxes."""
    rt = ctx.gateway.agents.get(app.agent)
    if rt is None:
        return
    rt.unavailable = f"its app {app.name} is being uninstalled"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RETIRE_SECONDS
    while await ctx.gateway.reloader.busy(app.agent):
        if loop.time() > deadline:
            raise ApiError(409, "busy", f"agent {app.agent} stayed busy; try again")
        await asyncio.sleep(0.2)
    await ctx.gateway.pools.stop(app.agent)
    await ctx.gateway.sandboxes.remove_app(app.name, app.agent)


@router.post("/{name}/uninstall")
async def uninstall(name: AppName, body: UninstallIn, who: CallerKey, ctx: Ctx) -> dict[str, Any]:
    """Sandboxes, image tag, agent entry; the data only with `purge`, after a backup."""
    require(ctx, who, "", "admin", is_write=True)
    steps = _Steps()
    app = await _run(InstalledApp.load, _state(ctx), name)
    await _retire(ctx, app)
    backup = Path(body.backup_path) if body.backup_path else None
    archive = await _with_docker(
        _uninstall, name, _config_path(ctx), _state(ctx), steps, body.purge, backup
    )
    await ctx.gateway.reloader.reload()
    return {"name": name, "purged": body.purge, "backup": archive and str(archive),
            "steps": steps.lines}  # fmt: skip


def _uninstall(
    name: str, config: Path, state: Path, steps: _Steps, purge: bool, backup: Path | None,
    client: Any,
) -> Path | None:  # fmt: skip
    return app_ops.uninstall_app(name, config, state, client, steps, purge=purge,
                                 backup_to=backup, remove_sandboxes=False)  # fmt: skip


@router.post("/{name}/backup")
async def backup(name: AppName, body: BackupIn, who: CallerKey, ctx: Ctx) -> dict[str, Any]:
    require(ctx, who, "", "admin", is_write=True)
    steps = _Steps()
    target = Path(body.path) if body.path else app_backup.default_backup_path(_state(ctx), name)
    archive = await _run(app_backup.backup_app, name, _state(ctx), target, steps)
    return {"name": name, "archive": str(archive), "steps": steps.lines}


@router.post("/restore", status_code=201)
async def restore(body: RestoreIn, who: CallerKey, ctx: Ctx) -> dict[str, Any]:
    require(ctx, who, "", "admin", is_write=True)
    steps = _Steps()
    client = await _run(docker_client)
    try:
        app = await _run(app_backup.restore_app, Path(body.archive), _config_path(ctx),
                         _state(ctx), client, steps, _build_args(ctx))  # fmt: skip
    finally:
        client.close()
    await ctx.gateway.reloader.reload()
    return _done(app, steps)
