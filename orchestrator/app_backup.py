"""One archive of an app: its workspace and its store rows; restore anywhere (issue 11).

    backup_app(name, state_dir, archive)        -> Path (tar.gz, 0600)
    restore_app(archive, config_path, state_dir) -> InstalledApp

The archive holds `cellgate-backup.json` (what it is), `app/` (the record and
the release source, so restore can rebuild the image elsewhere), `workspace/`
(every conversation's memory, media and transcripts; the persona) and
`store/rows.json` (the agent's conversations, messages, replies, cron jobs).

Backup walks the workspace without following a link: a symlink, FIFO, socket
or device a sandbox planted in its directories is left out and said so, a
file is opened `O_NOFOLLOW | O_NONBLOCK` and read up to its size at open.
Restore treats the archive as hostile (`policies.archive`): it unpacks into
a staging directory, member by member, refusing links, devices, absolute
paths, `..` and anything past the size bounds, before anything is moved in.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import os
import re
import secrets
import shutil
import sqlite3
import stat
import tarfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, Any

from cellgate.errors import AppError, ConversationError, QuotaError
from cellgate.models import ConversationKey
from orchestrator.apps import (
    BUILT_PREFIX,
    InstalledApp,
    agent_entry,
    build_or_check_image,
    installed_manifest,
    own_tag,
    read_record,
    write_agent_entry,
    write_record,
)
from orchestrator.config import AGENT_ID_RE
from orchestrator.sandboxes import reader_targets
from orchestrator.store.db import DB_FILE, Database
from policies.archive import ArchiveLimits, MemberFacts, member_allowed
from sandbox.gateway_id import load_gateway_id
from sandbox.images import Progress, image_exists
from sandbox.quota import LoopQuota, QuotaLimits

logger = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "cellgate-backup.json"
ROWS = "store/rows.json"
MAX_ROWS_BYTES = 512 * 1024 * 1024
_CHUNK = 1024 * 1024
DEFAULT_LIMITS = ArchiveLimits()


def default_backup_path(state_dir: Path, name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return state_dir / "backups" / f"{name}-{stamp}.tar.gz"


# -- backup -------------------------------------------------------------------------------


class _Exact(io.RawIOBase):
    """Exactly `size` bytes of `fh`: zeros when the file shrank, cut when it grew."""

    def __init__(self, fh: IO[bytes], size: int) -> None:
        self._fh = fh
        self._left = size

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self._left <= 0:
            return 0
        n = min(len(b), self._left)
        data = self._fh.read(n) or b"\0" * n
        b[: len(data)] = data
        self._left -= len(data)
        return len(data)


Held = Callable[[], AbstractContextManager[object]]


class _Walker:
    """`held` maps a directory's arcname to what must be held while it is opened: a
    conversation's quota image (R2), mounted for the open if it is not (an open
    descriptor keeps reading it after)."""

    def __init__(
        self,
        tar: tarfile.TarFile,
        progress: Progress,
        limits: ArchiveLimits,
        held: Mapping[str, Held] | None = None,
    ) -> None:
        self.tar = tar
        self.progress = progress
        self.limits = limits
        self.held = held or {}
        self.unreadable: list[str] = []  # dirs whose quota image could not be held
        self.files = 0
        self.bytes = 0
        self.left_out: list[str] = []
        self._last = time.monotonic()

    def _tick(self) -> None:
        if time.monotonic() - self._last >= 2.0:
            self._last = time.monotonic()
            self.progress(f"backup: {self.files} files, {self.bytes // (1024 * 1024)} MB so far")

    def _info(self, arcname: str, st: os.stat_result, kind: bytes) -> tarfile.TarInfo:
        info = tarfile.TarInfo(arcname)
        info.type = kind
        info.mode = stat.S_IMODE(st.st_mode) & 0o755
        info.mtime = int(st.st_mtime)
        info.uid = info.gid = 0
        return info

    def add_tree(self, dir_fd: int, arcname: str, depth: int = 0) -> None:
        """Add the directory open at `dir_fd` as `arcname`, never following a link."""
        st = os.fstat(dir_fd)
        self.tar.addfile(self._info(arcname, st, tarfile.DIRTYPE))
        if depth >= self.limits.max_depth - 2:
            self.left_out.append(f"{arcname}/ (nested too deep)")
            return
        with os.scandir(dir_fd) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            name = f"{arcname}/{entry.name}"
            est = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(est.st_mode):
                try:
                    fd = self._open_held(dir_fd, entry.name, name)
                except OSError as exc:
                    self.left_out.append(f"{name}/ ({exc.strerror})")
                    continue
                except QuotaError as exc:
                    self.unreadable.append(f"{name}/ ({exc.reason})")
                    continue
                try:
                    self.add_tree(fd, name, depth + 1)
                finally:
                    os.close(fd)
            elif stat.S_ISREG(est.st_mode):
                self.add_file(dir_fd, entry.name, name)
            else:
                self.left_out.append(f"{name} (not a plain file or directory)")

    def _subdir(self, dir_fd: int, entry: str) -> int:
        return os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)

    def _open_held(self, dir_fd: int, entry: str, arcname: str) -> int:
        """Open a subdir, holding its quota image first if it has one: any failure of the
        hold itself is a QuotaError (the backup then fails: that memory would be missing)."""
        hold = self.held.get(arcname)
        if hold is None:
            return self._subdir(dir_fd, entry)
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(hold())
        except QuotaError:
            raise
        except Exception as exc:
            raise QuotaError(f"holding its quota image: {exc}") from exc
        with stack:
            return self._subdir(dir_fd, entry)

    def add_file(self, dir_fd: int, entry: str, arcname: str) -> None:
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as exc:
            self.left_out.append(f"{arcname} ({exc.strerror})")
            return
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self.left_out.append(f"{arcname} (not a plain file)")
                return
            if st.st_size > self.limits.max_member_bytes:
                self.left_out.append(f"{arcname} ({st.st_size} bytes, over the bound)")
                return
            info = self._info(arcname, st, tarfile.REGTYPE)
            info.size = st.st_size
            self.tar.addfile(info, io.BufferedReader(_Exact(fh, st.st_size), _CHUNK))
        self.files += 1
        self.bytes += st.st_size
        self._tick()


def _rows(db: Database, agent: str) -> dict[str, list[dict[str, Any]]]:
    queries = {
        "conversations": "SELECT * FROM conversations WHERE agent = ?",
        "messages": "SELECT m.* FROM messages m JOIN conversations c"
        " ON c.id = m.conversation_id WHERE c.agent = ? ORDER BY m.id",
        "replies": "SELECT r.* FROM replies r JOIN conversations c"
        " ON c.id = r.conversation_id WHERE c.agent = ? ORDER BY r.id",
        "api_chat_keys": "SELECT k.* FROM api_chat_keys k JOIN conversations c"
        " ON c.id = k.conversation_id WHERE c.agent = ?",
        "cron_jobs": "SELECT * FROM cron_jobs WHERE agent = ?",
    }
    out: dict[str, list[dict[str, Any]]] = {}
    with db.read() as conn:
        for table, sql in queries.items():
            cur = conn.execute(sql, (agent,))
            cols = [d[0] for d in cur.description]
            out[table] = [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]
    return out


def _add_bytes(tar: tarfile.TarFile, arcname: str, data: bytes) -> None:
    info = tarfile.TarInfo(arcname)
    info.size = len(data)
    info.mode = 0o600
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data))


def _quota_holds(
    state_dir: Path, app: InstalledApp, convs: list[dict[str, Any]], sessions: dict[str, list[str]]
) -> dict[str, Held]:
    """The arcnames of the conversations' chat and media dirs, each with the hold of its
    quota image (R2): after a reboot, or once a sandbox is gone, it is not mounted there.
    `sessions` are the API conversations' session ids (one media dir each)."""
    root = state_dir / "quota"
    if not app.isolate_memory or not (root / app.agent).is_dir():
        return {}  # the app's one container (S6) owns the workspace and its dirs as they are
    # binds only for this backup's own reading: nosuid, nodev, noexec
    quota = LoopQuota(root, QuotaLimits(bytes=0, inodes=0))
    out: dict[str, Held] = {}
    for row in convs:
        key = ConversationKey(app.agent, str(row["channel"]), str(row["chat_id"]))
        if not quota.image(app.agent, key.digest).exists():
            continue
        hold = functools.partial(quota.held, app.agent, key.digest)
        out[f"workspace/chats/{key.dir_name}"] = functools.partial(hold, reader_targets(app, key))
        ids = sessions.get(str(row["id"]), []) if key.channel == "api" else [""]
        for sid in ids:
            try:
                media = key.media_dir_name(sid)
            except ConversationError:
                continue
            out[f"workspace/media/{media}"] = functools.partial(
                hold, reader_targets(app, key, media)
            )
    return out


def _api_sessions(db: Database, agent: str) -> dict[str, list[str]]:
    sql = (
        "SELECT s.id, s.conversation_id FROM sessions s JOIN conversations c"
        " ON c.id = s.conversation_id WHERE c.agent = ? AND c.channel = 'api'"
    )
    out: dict[str, list[str]] = {}
    with db.read() as conn:
        for sid, conv in conn.execute(sql, (agent,)).fetchall():
            out.setdefault(str(conv), []).append(str(sid))
    return out


def _open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def backup_app(
    name: str,
    state_dir: Path,
    archive: Path,
    progress: Progress,
    limits: ArchiveLimits = DEFAULT_LIMITS,
) -> Path:
    """Write one tar.gz of the app's record, workspace and store rows; 0600, atomic."""
    app = InstalledApp.load(state_dir, name)
    record_dir = state_dir / "apps" / name
    archive = archive.expanduser().resolve()
    archive.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = archive.with_name(f".{archive.name}.{secrets.token_hex(4)}.partial")
    rows: dict[str, list[dict[str, Any]]] = {}
    sessions: dict[str, list[str]] = {}
    if (state_dir / DB_FILE).exists():
        db = Database(state_dir / DB_FILE)
        try:
            rows = _rows(db, app.agent)
            sessions = _api_sessions(db, app.agent)
        finally:
            db.close()
    holds = _quota_holds(state_dir, app, rows.get("conversations", []), sessions)
    meta = {
        "format": FORMAT,
        "app": app.name,
        "agent": app.agent,
        "version": app.version,
        "createdAt": time.time(),
        "conversations": len(rows.get("conversations", [])),
    }
    progress(f"backup of app {name} to {archive}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
            _add_bytes(tar, MANIFEST, json.dumps(meta, indent=2).encode())
            walker = _Walker(tar, progress, limits, holds)
            for arc, path in (("app", record_dir), ("workspace", app.workspace)):
                top = _open_dir(path)
                try:
                    walker.add_tree(top, arc)
                finally:
                    os.close(top)
            _add_bytes(tar, ROWS, json.dumps(rows).encode())
        if walker.unreadable:  # a backup without a conversation's memory is no backup
            raise AppError(
                name,
                f"{len(walker.unreadable)} conversation dir(s) could not be read from their "
                f"quota images, so no backup was written (and nothing was deleted): "
                f"{'; '.join(walker.unreadable[:3])}. Check `cellgate doctor` and the "
                "gateway's log, then try again",
            )
        partial.replace(archive)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    for what in walker.left_out:
        progress(f"left out: {what}")
        logger.warning("backup of %s: left out %s", name, what)
    progress(
        f"backup done: {walker.files} files, {walker.bytes // 1024} KB, "
        f"{meta['conversations']} conversations -> {archive}"
    )
    return archive


# -- restore ------------------------------------------------------------------------------


def _kind(m: tarfile.TarInfo) -> Any:
    if m.isreg():
        return "file"
    if m.isdir():
        return "dir"
    if m.issym():
        return "symlink"
    if m.islnk():
        return "hardlink"
    if m.ischr() or m.isblk():
        return "device"
    if m.isfifo():
        return "fifo"
    return "other"


def _mkdirs(base: Path, parts: list[str]) -> Path:
    """`mkdir -p` inside the staging dir, which holds no links (none are ever unpacked)."""
    cur = base
    for part in parts:
        cur = cur / part
        try:
            os.mkdir(cur, 0o755)
        except FileExistsError as exc:
            if not stat.S_ISDIR(os.lstat(cur).st_mode):
                raise AppError(
                    "restore", f"{cur} is in the archive as a file and a directory"
                ) from exc
    return cur


def _unpack(tar: tarfile.TarFile, staging: Path, limits: ArchiveLimits, progress: Progress) -> None:
    total = 0
    last = time.monotonic()
    for index, m in enumerate(_members(tar)):
        facts = MemberFacts(m.name, _kind(m), m.size if m.isreg() else 0, index, total)
        decision = member_allowed(facts, limits)
        if not decision.allowed:
            raise AppError("restore", f"archive refused: {decision.reason}")
        parts = [p for p in m.name.split("/") if p not in ("", ".")]
        if m.isdir():
            _mkdirs(staging, parts)
            continue
        parent = _mkdirs(staging, parts[:-1])
        src = tar.extractfile(m)
        if src is None:
            raise AppError("restore", f"archive refused: {m.name!r} has no data")
        mode = (m.mode & 0o755) | 0o600
        try:
            fd = os.open(
                parent / parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode
            )
        except FileExistsError as exc:
            raise AppError("restore", f"archive refused: {m.name!r} appears twice") from exc
        with os.fdopen(fd, "wb") as out:
            left = m.size
            while left > 0:
                chunk = src.read(min(_CHUNK, left))
                if not chunk:
                    raise AppError("restore", f"archive refused: {m.name!r} is truncated")
                out.write(chunk)
                left -= len(chunk)
        total += m.size
        if time.monotonic() - last >= 2.0:
            last = time.monotonic()
            progress(f"restore: {index + 1} members, {total // (1024 * 1024)} MB so far")


def _members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    while True:
        try:
            m = tar.next()
        except tarfile.TarError as exc:
            raise AppError("restore", f"not a readable archive: {exc}") from exc
        if m is None:
            return
        yield m


def _import_rows(state_dir: Path, rows: Mapping[str, Any], agent: str) -> int:
    db = Database(state_dir / DB_FILE)
    conversations = rows.get("conversations", [])
    try:
        with db.write() as conn:
            for c in conversations:
                if c.get("agent") != agent:
                    raise AppError("restore", "the store rows name another agent")
                conn.execute(
                    "INSERT OR IGNORE INTO conversations (id, agent, channel, chat_id, dir_name,"
                    " created_at, last_active_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (c["id"], c["agent"], c["channel"], c["chat_id"], c["dir_name"],
                     c["created_at"], c["last_active_at"]),
                )  # fmt: skip
            known = {str(c["id"]) for c in conversations}
            ids: dict[int, int] = {}
            for m in rows.get("messages", []):
                if m["conversation_id"] not in known:
                    continue
                # An answered turn comes back delivered (never sent twice); one caught
                # mid-turn comes back failed (never run again).
                state = {"delivered": "delivered", "replied": "delivered"}.get(m["state"], "failed")
                if m["state"] == "failed":
                    state = "failed"
                cur = conn.execute(
                    "INSERT OR IGNORE INTO messages (conversation_id, platform_message_id, sender,"
                    " text, attachments, received_at, state, attempts, error, updated_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
                    (m["conversation_id"], m["platform_message_id"], m["sender"], m["text"],
                     m["attachments"], m["received_at"], state, m["attempts"],
                     m["error"] if state != "failed" or m["state"] == "failed"
                     else "restored from a backup mid-turn",
                     m["updated_at"]),
                )  # fmt: skip
                row = cur.fetchone()
                if row is not None:
                    ids[int(m["id"])] = int(row[0])
            for r in rows.get("replies", []):
                new_id = ids.get(int(r["message_id"]))
                if new_id is None:
                    continue
                conn.execute(
                    "INSERT OR IGNORE INTO replies (message_id, conversation_id, outbound_key,"
                    " text, created_at, delivered_at) VALUES (?, ?, ?, ?, ?, ?)",
                    (new_id, r["conversation_id"], f"reply:{new_id}", r["text"], r["created_at"],
                     r["delivered_at"] or r["created_at"]),
                )  # fmt: skip
            for k in rows.get("api_chat_keys", []):
                if k["conversation_id"] in known:
                    conn.execute(
                        "INSERT OR IGNORE INTO api_chat_keys (conversation_id, key_ref, bound_at)"
                        " VALUES (?, ?, ?)",
                        (k["conversation_id"], k["key_ref"], k["bound_at"]),
                    )
            for j in rows.get("cron_jobs", []):
                if j.get("agent") == agent:
                    conn.execute(
                        "INSERT OR IGNORE INTO cron_jobs (id, agent, type, schedule, payload,"
                        " one_shot, enabled, created_at, last_run_at) VALUES (?,?,?,?,?,?,?,?,?)",
                        (j["id"], j["agent"], j["type"], j["schedule"], j["payload"],
                         j["one_shot"], j["enabled"], j["created_at"], j["last_run_at"]),
                    )  # fmt: skip
    except (sqlite3.Error, KeyError, TypeError, ValueError) as exc:
        raise AppError("restore", f"the archive's store rows are unusable: {exc}") from exc
    finally:
        db.close()
    return len(conversations)


def restore_app(
    archive: Path,
    config_path: Path,
    state_dir: Path,
    docker: Any,
    progress: Progress,
    build_args: Mapping[str, str] | None = None,
    limits: ArchiveLimits = DEFAULT_LIMITS,
) -> InstalledApp:
    """Bring an app back from `archive` into this state directory (fresh or not)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    staging = state_dir / f".restore-{secrets.token_hex(6)}"
    os.mkdir(staging, 0o700)
    try:
        progress(f"checking and unpacking {archive}")
        try:
            with tarfile.open(archive, mode="r:gz") as tar:
                _unpack(tar, staging, limits, progress)
        except (OSError, tarfile.TarError, EOFError) as exc:
            raise AppError("restore", f"not a readable archive {archive}: {exc}") from exc
        return _move_in(staging, config_path, state_dir, docker, progress, build_args)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _move_in(
    staging: Path,
    config_path: Path,
    state_dir: Path,
    docker: Any,
    progress: Progress,
    build_args: Mapping[str, str] | None,
) -> InstalledApp:
    try:
        meta = json.loads((staging / MANIFEST).read_text(encoding="utf-8"))
        name, agent = str(meta["app"]), str(meta["agent"])
        if meta.get("format") != FORMAT:
            raise AppError(name, f"backup format {meta.get('format')!r} is not {FORMAT}")
        record = json.loads((staging / "app" / "app.json").read_text(encoding="utf-8"))
        rows_file = staging / ROWS
        if rows_file.stat().st_size > MAX_ROWS_BYTES:
            raise AppError(name, f"{ROWS} is over {MAX_ROWS_BYTES} bytes")
        rows = json.loads(rows_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AppError("restore", f"the archive is not a usable cellgate backup: {exc}") from exc
    names = (name, agent, record.get("name"), record.get("agent"))
    if not all(isinstance(n, str) and re.fullmatch(AGENT_ID_RE, n) for n in names) or (
        record.get("name"), record.get("agent")) != (name, agent):  # fmt: skip
        raise AppError("restore", "archive refused: its app or agent name is not a plain name")
    if not isinstance(rows, dict):
        raise AppError(name, f"archive refused: {ROWS} is not an object")
    record_dir = state_dir / "apps" / name
    agent_root = state_dir / "agents" / agent
    if (record_dir / "app.json").exists():
        raise AppError(name, "is installed here; uninstall it first (`--purge` to drop its data)")
    if (agent_root / "workspace").exists():
        raise AppError(
            name, f"{agent_root / 'workspace'} exists; remove it or restore on a fresh state dir"
        )
    shutil.rmtree(record_dir, ignore_errors=True)
    record_dir.parent.mkdir(parents=True, exist_ok=True)
    (staging / "app").rename(record_dir)
    agent_root.mkdir(parents=True, exist_ok=True)
    (staging / "workspace").rename(agent_root / "workspace")
    app = InstalledApp.load(state_dir, name)
    manifest = installed_manifest(state_dir, name)
    owner = load_gateway_id(state_dir)
    ref, iid = app.image, app.image_id
    if not image_exists(docker, app.image_id):
        progress(f"image {app.image} is not on this engine: rebuilding it from the backup")
        ref, iid = build_or_check_image(record_dir / "release", manifest, docker, progress,
                                        build_args, owner=owner)  # fmt: skip
    elif app.image.startswith(BUILT_PREFIX) and app.image != own_tag(manifest, owner):
        # the image is here under the backed-up gateway's tag: tag it as this gateway's
        # own, so an update or uninstall here never removes that other gateway's tag (R1)
        ref = own_tag(manifest, owner)
        repo, _, tag = ref.rpartition(":")
        docker.api.tag(app.image_id, repo, tag)
        progress(f"tagged image {app.image_id[:19]} as {ref}")
    if (ref, iid) != (app.image, app.image_id):
        import dataclasses

        app = dataclasses.replace(app, image=ref, image_id=iid)
        env = read_record(state_dir, name).get("operator_environment", {})
        write_record(record_dir, app, manifest, operator_env=env if isinstance(env, dict) else {})
    count = _import_rows(state_dir, rows, agent)
    write_agent_entry(config_path, agent_entry(manifest))
    progress(f"restored app {name} {app.version}: agent {agent}, {count} conversations")
    logger.info("restored app %s from a backup (%d conversations)", name, count)
    return app
