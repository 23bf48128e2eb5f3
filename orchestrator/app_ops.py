"""An installed app over its life: update, reconfigure, start, stop, uninstall, inspect (S5, L3).

Each operation changes the files (workspace, record, config entry) and, when
asked, removes the app's sandboxes itself (`remove_app_sandboxes`: the CLI,
with or without a gateway running). A running gateway notices the change
(`orchestrator.reload`, L5) and restarts the agent once none of its sessions
is busy, removing its sandboxes then; a sandbox busy with a turn is left to it.

    update_app(dir, ...)       new release: template, image, record, entry;
                               the conversations' chats/ and media/ are kept
    reconfigure_app(name, ...) the operator's environment; entry rewritten (L3)
    set_state(name, running)   `apps start` / `apps stop`
    uninstall_app(name, ...)   sandboxes, image tag, agent entry; data on --purge
    inspect_app(dir or name)   the declaration (L4)
"""

from __future__ import annotations

import json
import logging
import shutil
import sqlite3
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cellgate.errors import AppError, ConfigError
from orchestrator.apps import (
    BUILT_PREFIX,
    AppManifest,
    InstalledApp,
    agent_entry,
    build_or_check_image,
    installed_apps,
    installed_manifest,
    load_manifest,
    read_record,
    replace_template,
    save_release,
    template_dir,
    write_agent_entry,
    write_record,
)
from orchestrator.config import read_config_document, write_config_document
from orchestrator.store.db import DB_FILE, Database
from sandbox.gateway_id import load_gateway_id
from sandbox.images import Progress
from sandbox.latebind import detach_under
from sandbox.spec import LABEL_APP, LABEL_CONVERSATION, LABEL_GATEWAY, LABEL_MANAGED

logger = logging.getLogger(__name__)

REMOVAL_WAIT = 60.0  # seconds: a sandbox the running gateway is removing (F1) is gone by then
PURGE_SECONDS = 30.0  # how long a purge retries a delete a serving gateway's refill got into


def _quiet(line: str) -> None:
    return None


def describe(app: InstalledApp) -> dict[str, Any]:
    return {
        "name": app.name,
        "version": app.version,
        "agent": app.agent,
        "state": app.state,
        "image": app.image,
        "imageId": app.image_id,
        "isolateMemory": app.isolate_memory,
        "disableArchive": app.disable_archive,
        "workspace": str(app.workspace),
    }


def list_apps(state_dir: Path) -> list[dict[str, Any]]:
    out = []
    for name in installed_apps(state_dir):
        try:
            out.append(describe(InstalledApp.load(state_dir, name)))
        except (AppError, KeyError, ValueError) as exc:
            out.append({"name": name, "state": "broken", "error": str(exc)})
    return out


def declaration(manifest: AppManifest) -> dict[str, Any]:
    """L4: what the app declares for its agent."""
    svc = manifest.services.agent
    return {
        "name": manifest.name,
        "version": manifest.version,
        "description": manifest.description,
        "agentDeclaration": {
            "name": svc.name,
            "isolateMemory": svc.isolate_memory,
            "disableArchive": svc.disable_archive,
            "image": svc.image,
            "build": svc.build is not None,
            "harness": svc.harness.type,
        },
    }


def inspect_app(
    state_dir: Path, *, path: Path | None = None, name: str | None = None
) -> dict[str, Any]:
    """L4: an app directory's declaration, or an installed app's (with its record)."""
    if path is not None:
        return {**declaration(load_manifest(path.expanduser().resolve())), "installed": None}
    if name is None:
        raise AppError("", "give an app directory or an installed app's name")
    manifest = installed_manifest(state_dir, name)
    return {**declaration(manifest), "installed": describe(InstalledApp.load(state_dir, name))}


def inspect_target(state_dir: Path, target: str) -> dict[str, Any]:
    """The CLI's one argument: a path (with a `/`, or `.`) is a directory; a bare word is
    an installed app's name, else a directory of that name here."""
    looks_like_path = "/" in target or target.startswith(".")
    if not looks_like_path and target in installed_apps(state_dir):
        return inspect_app(state_dir, name=target)
    if looks_like_path or Path(target).is_dir():
        return inspect_app(state_dir, path=Path(target))
    return inspect_app(state_dir, name=target)


# -- sandboxes ----------------------------------------------------------------------------


def _busy_conversations(state_dir: Path, agent: str) -> set[str]:
    db_path = state_dir / DB_FILE
    if not db_path.exists():
        return set()
    db = Database(db_path)
    try:
        with db.read() as conn:
            rows = conn.execute(
                "SELECT DISTINCT s.conversation_id FROM sessions s"
                " JOIN conversations c ON c.id = s.conversation_id"
                " JOIN turns t ON t.session_id = s.id"
                " WHERE c.agent = ? AND s.state = 'live' AND t.finished_at IS NULL",
                (agent,),
            ).fetchall()
    finally:
        db.close()
    return {str(r[0]) for r in rows}


def _recorded_conversations(state_dir: Path) -> dict[str, str]:
    """Sandbox name -> conversation, as the store records them: a pooled sandbox (F1)
    learns its conversation at its claim, after its labels were set."""
    db_path = state_dir / DB_FILE
    if not db_path.exists():
        return {}
    db = Database(db_path)
    try:
        with db.read() as conn:
            rows = conn.execute("SELECT name, conversation_id FROM sandboxes").fetchall()
    finally:
        db.close()
    return {str(r[0]): str(r[1]) for r in rows if r[1]}


def remove_app_sandboxes(
    docker: Any, state_dir: Path, app: str, agent: str, progress: Progress = _quiet
) -> list[str]:
    """S5: remove this state directory's gateway's sandboxes of `app`.

    Only containers labelled with this gateway's id (R1). A sandbox whose
    conversation has a turn running is left: the running gateway removes it
    when it restarts the agent after that turn (L5).
    """
    from docker import errors as docker_errors

    gateway = load_gateway_id(state_dir)
    labels = [f"{LABEL_MANAGED}=1", f"{LABEL_GATEWAY}={gateway}", f"{LABEL_APP}={app}"]
    busy = _busy_conversations(state_dir, agent)
    recorded = _recorded_conversations(state_dir)
    removed: list[str] = []
    for row in docker.api.containers(all=True, filters={"label": labels}):
        name = str(row["Names"][0]).lstrip("/")
        conversation = row.get("Labels", {}).get(LABEL_CONVERSATION) or recorded.get(name)
        # S6: the app's one container (no conversation label) is busy with any chat's turn
        if conversation in busy or (not conversation and busy):
            progress(f"sandbox {name} is running a turn; the gateway removes it after that turn")
            continue
        progress(f"removing sandbox {name}")
        try:
            docker.api.remove_container(row["Id"], force=True, v=True)
        except docker_errors.NotFound:
            continue
        except docker_errors.APIError as exc:
            if "already in progress" not in str(exc.explanation or ""):
                raise AppError(app, f"cannot remove sandbox {name}: {exc.explanation}") from exc
            # the running gateway removes it (its warm pool draining, F1): done when gone
            if not _gone(docker, row["Id"], REMOVAL_WAIT):
                raise AppError(
                    app, f"sandbox {name} is still being removed after {REMOVAL_WAIT:.0f} s"
                ) from exc
        removed.append(name)
    _forget_sandboxes(state_dir, removed)
    return removed


def _gone(docker: Any, container_id: str, timeout: float) -> bool:
    """Wait (bounded) for a container someone else is removing to be gone."""
    from docker import errors as docker_errors

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            docker.api.inspect_container(container_id)
        except docker_errors.NotFound:
            return True
        time.sleep(0.1)
    return False


def _forget_sandboxes(state_dir: Path, names: Sequence[str]) -> None:
    if not names or not (state_dir / DB_FILE).exists():
        return
    db = Database(state_dir / DB_FILE)
    try:
        with db.write() as conn:
            conn.executemany("DELETE FROM sandboxes WHERE name = ?", [(n,) for n in names])
    finally:
        db.close()


def remove_image_tag(docker: Any, ref: str, progress: Progress = _quiet, *, owner: str) -> bool:
    """Remove a tag this gateway built (`cellgate-app-*-<owner>`); a referenced image is
    never removed, and neither is another gateway's tag (R1)."""
    from docker import errors as docker_errors

    if not ref.startswith(BUILT_PREFIX):
        return False
    if not ref.endswith(f"-{owner}"):
        logger.info("image tag %s left in place: this gateway did not build it", ref)
        return False
    try:
        docker.api.remove_image(ref, noprune=False)
    except docker_errors.ImageNotFound:
        return False
    except docker_errors.APIError as exc:
        logger.warning("image %s not removed: %s", ref, exc.explanation)
        return False
    progress(f"removed image tag {ref}")
    return True


# -- update -------------------------------------------------------------------------------


def _log_modes(agent: str, old: InstalledApp, new: InstalledApp) -> None:
    for label, before, after in (
        ("isolateMemory", old.isolate_memory, new.isolate_memory),
        ("disableArchive", old.disable_archive, new.disable_archive),
    ):
        if before != after:
            logger.info(
                "agent %s: %s %s -> %s from the new release's app.yaml (L3)",
                agent, label, str(before).lower(), str(after).lower(),
            )  # fmt: skip


def update_app(
    app_dir: Path,
    config_path: Path,
    state_dir: Path,
    docker: Any,
    progress: Progress,
    build_args: Mapping[str, str] | None = None,
    *,
    remove_sandboxes: bool = True,
) -> tuple[InstalledApp, InstalledApp]:
    """Install a new release of an installed app; (the old, the new)."""
    app_dir = app_dir.resolve()
    manifest = load_manifest(app_dir)
    old = InstalledApp.load(state_dir, manifest.name)
    svc = manifest.services.agent
    if svc.name != old.agent:
        raise AppError(
            manifest.name,
            f"an update cannot rename the agent ({old.agent} -> {svc.name}); "
            "uninstall and install instead",
        )
    template = template_dir(app_dir, manifest)
    ref, iid = build_or_check_image(
        app_dir, manifest, docker, progress, build_args, owner=load_gateway_id(state_dir)
    )
    progress(f"replacing the workspace template of {old.agent} (chats/ and media/ kept)")
    replace_template(template, old.workspace, old.agent_root / ".release-staging")
    new = InstalledApp(
        name=manifest.name,
        version=manifest.version,
        agent=svc.name,
        image=ref,
        image_id=iid,
        user=svc.user,
        environment={**svc.environment, **_operator_env(state_dir, old.name)},
        networks=svc.networks,
        isolate_memory=svc.isolate_memory,
        disable_archive=svc.disable_archive,
        workspace=old.workspace,
        agent_root=old.agent_root,
        state=old.state,
        record_dir=old.record_dir,
    )
    record_dir = state_dir / "apps" / manifest.name
    save_release(app_dir, record_dir)
    write_record(record_dir, new, manifest, operator_env=_operator_env(state_dir, old.name))
    write_agent_entry(config_path, agent_entry(manifest))
    _log_modes(new.agent, old, new)
    if remove_sandboxes:
        remove_app_sandboxes(docker, state_dir, new.name, new.agent, progress)
        if old.image != ref:
            remove_image_tag(docker, old.image, progress, owner=load_gateway_id(state_dir))
    logger.info("updated app %s %s -> %s (image %s)", new.name, old.version, new.version, ref)
    return old, new


# -- reconfigure, start, stop -------------------------------------------------------------


def _operator_env(state_dir: Path, name: str) -> dict[str, str]:
    env = read_record(state_dir, name).get("operator_environment", {})
    return {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {}


def reconfigure_app(
    name: str,
    config_path: Path,
    state_dir: Path,
    *,
    set_env: Mapping[str, str] | None = None,
    unset_env: Sequence[str] = (),
    docker: Any = None,
    progress: Progress = _quiet,
) -> InstalledApp:
    """The operator's environment for the app; the agent entry rewritten from app.yaml (L3)."""
    app = InstalledApp.load(state_dir, name)
    manifest = installed_manifest(state_dir, name)
    operator = _operator_env(state_dir, name)
    operator.update(set_env or {})
    for key in unset_env:
        operator.pop(key, None)
    env = {**manifest.services.agent.environment, **operator}
    for key in unset_env:
        if key not in operator:
            env.pop(key, None)
    new = _with(app, environment=env)
    write_record(state_dir / "apps" / name, new, manifest, operator_env=operator)
    write_agent_entry(config_path, agent_entry(manifest))
    if docker is not None:
        remove_app_sandboxes(docker, state_dir, name, app.agent, progress)
    logger.info("reconfigured app %s", name)
    return new


def _with(app: InstalledApp, **changes: Any) -> InstalledApp:
    import dataclasses

    return dataclasses.replace(app, **changes)


def set_state(
    name: str,
    config_path: Path,
    state_dir: Path,
    running: bool,
    *,
    docker: Any = None,
    progress: Progress = _quiet,
) -> InstalledApp:
    """`apps start` (the entry rewritten from app.yaml, L3) or `apps stop` (sandboxes removed)."""
    app = InstalledApp.load(state_dir, name)
    manifest = installed_manifest(state_dir, name)
    new = _with(app, state="running" if running else "stopped")
    write_record(
        state_dir / "apps" / name, new, manifest, operator_env=_operator_env(state_dir, name)
    )
    if running:
        write_agent_entry(config_path, agent_entry(manifest))
    elif docker is not None:
        remove_app_sandboxes(docker, state_dir, name, app.agent, progress)
    logger.info("app %s %s", name, new.state)
    return new


# -- uninstall ----------------------------------------------------------------------------


def remove_agent_entry(config_path: Path, agent: str, app: str) -> bool:
    doc = read_config_document(config_path)
    agents = doc.get("agents", [])
    if not isinstance(agents, list):
        raise ConfigError(str(config_path), "agents", "must be a list of agent objects")
    kept = [
        a
        for a in agents
        if not (isinstance(a, dict) and a.get("id") == agent and a.get("app") == app)
    ]
    if len(kept) == len(agents):
        return False
    doc["agents"] = kept
    write_config_document(config_path, doc)
    return True


def delete_agent_rows(state_dir: Path, agent: str) -> int:
    """Every store row of the agent's conversations (uninstall --purge)."""
    if not (state_dir / DB_FILE).exists():
        return 0
    db = Database(state_dir / DB_FILE)
    statements = (
        "DELETE FROM turns WHERE session_id IN (SELECT s.id FROM sessions s JOIN conversations c"
        " ON c.id = s.conversation_id WHERE c.agent = ?)",
        "DELETE FROM shares WHERE conversation_id IN"
        " (SELECT id FROM conversations WHERE agent = ?)",
        "DELETE FROM replies WHERE conversation_id IN"
        " (SELECT id FROM conversations WHERE agent = ?)",
        "DELETE FROM sessions WHERE conversation_id IN"
        " (SELECT id FROM conversations WHERE agent = ?)",
        "DELETE FROM messages WHERE conversation_id IN"
        " (SELECT id FROM conversations WHERE agent = ?)",
        "DELETE FROM attachments WHERE conversation_id IN"
        " (SELECT id FROM conversations WHERE agent = ?)",
        "DELETE FROM sandboxes WHERE conversation_id IN"
        " (SELECT id FROM conversations WHERE agent = ?)",
        "DELETE FROM api_chat_keys WHERE conversation_id IN"
        " (SELECT id FROM conversations WHERE agent = ?)",
        "DELETE FROM cron_jobs WHERE agent = ?",
        "DELETE FROM conversations WHERE agent = ?",
    )
    try:
        with db.write() as conn:
            n = conn.execute("SELECT count(*) FROM conversations WHERE agent = ?", (agent,))
            count = int(n.fetchone()[0])
            for sql in statements:
                conn.execute(sql, (agent,))
    except sqlite3.Error as exc:
        raise AppError(agent, f"cannot delete its store rows: {exc}") from exc
    finally:
        db.close()
    return count


def uninstall_app(
    name: str,
    config_path: Path,
    state_dir: Path,
    docker: Any,
    progress: Progress,
    *,
    purge: bool = False,
    backup_to: Path | None = None,
    remove_sandboxes: bool = True,
) -> Path | None:
    """Remove the app's sandboxes, image tag and agent entry; with `purge`, after writing a
    backup (returned), its workspace, homes, quota images and store rows too."""
    from orchestrator.app_backup import backup_app, default_backup_path
    from sandbox.quota import release_all

    app = InstalledApp.load(state_dir, name)
    archive: Path | None = None
    if purge:
        archive = backup_to or default_backup_path(state_dir, name)
        backup_app(name, state_dir, archive, progress)
    if remove_sandboxes:
        remove_app_sandboxes(docker, state_dir, name, app.agent, progress)
    if remove_agent_entry(config_path, app.agent, name):
        progress(f"removed agent {app.agent} from {config_path}")
    remove_image_tag(docker, app.image, progress, owner=load_gateway_id(state_dir))
    record_dir = state_dir / "apps" / name
    (record_dir / "app.json").unlink()
    quota = state_dir / "quota" / app.agent
    # a sandbox left running a turn keeps its mounts until the gateway removes it (a purge
    # deletes the data regardless); otherwise nothing uses them now, and the data stays in
    # the image files
    busy = set() if purge else _busy_conversations(state_dir, app.agent)
    if busy:
        progress(f"{len(busy)} conversation(s) still run a turn; their mounts stay until then")
    else:
        for root in (app.agent_root, quota):
            release_all(root)
        pool = state_dir / "pool" / load_gateway_id(state_dir) / app.agent
        detach_under(pool.resolve())  # its warm pool's stage and slots (F1)
    if purge:
        progress(f"deleting {app.agent_root} and the store rows of {app.agent}")
        for path in (app.agent_root, quota, record_dir):
            _purge_dir(path)
        delete_agent_rows(state_dir, app.agent)
    else:
        progress(f"kept the data of {app.agent} in {app.agent_root} (--purge deletes it)")
    logger.info("uninstalled app %s%s", name, " (purged)" if purge else "")
    return archive


def _purge_dir(path: Path) -> None:
    """Delete `path`. A gateway that still serves the app until its config reload drops
    it (a moment) may be making a spare quota image in it meanwhile (F1): a file made
    under the delete, or a spare mounted, fails it; the mounts under `path` are then
    released and the delete tried again, for at most `PURGE_SECONDS`."""
    from sandbox.quota import release_all

    deadline = time.monotonic() + PURGE_SECONDS
    while path.exists():
        try:
            shutil.rmtree(path)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            release_all(path)


def dump(doc: Any) -> str:
    return json.dumps(doc, indent=2)
