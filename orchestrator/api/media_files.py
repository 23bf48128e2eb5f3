"""Media directories, resolved through the store, and files opened inside them (K3, K4, P5).

A media path is `<media dir>/<file>`: `api-<session>/...` for an API session,
`<channel>-<chatId>/...` (or `<channel>-h.<hash>/...`) for a channel chat
(`ConversationKey.media_dir_name`). The directory is found only through the
store (a session row, a conversation row); the file is opened by
`orchestrator.bridge.safefiles` (P5 over `orchestrator.safefs`'s `O_NOFOLLOW`
walk), decided by `policies.paths` on facts from the open descriptor, and
served from that same descriptor, read in bounded chunks. The conversation's
quota image is held on its directories while a file is opened (R2: after a
reboot, or once its sandbox is gone, it is not mounted until needed).
"""

from __future__ import annotations

import contextlib
import logging
import mimetypes
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi.responses import StreamingResponse

from cellgate.errors import CellgateError, PolicyDenied, QuotaError, UnsafePath
from cellgate.models import ConversationKey
from orchestrator.api.context import ApiContext
from orchestrator.api.errors import ApiError
from orchestrator.api.ids import MediaPath, relative_file
from orchestrator.bridge.safefiles import SafeFile, open_media_file
from orchestrator.safefs import SafeDir
from orchestrator.sandboxes import memory_held
from orchestrator.store import Conversation, Session, SessionId, conversation_id
from policies.api_access import MediaOwner
from policies.paths import normalize_request

__all__ = [
    "MAX_SERVE_BYTES",
    "MediaDir",
    "file_response",
    "image_type",
    "media_dir_of_path",
    "media_dir_of_session",
    "open_in",
    "open_stored",
]

logger = logging.getLogger(__name__)

MAX_SERVE_BYTES = 1024 * 1024 * 1024
_CHUNK = 256 * 1024
_INLINE = ("image/", "audio/", "video/")
_IMAGE_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


@dataclass(frozen=True, slots=True)
class MediaDir:
    """One conversation's (or API session's) media directory on the host."""

    name: str
    host: Path
    conversation: Conversation
    session: Session | None
    held: Callable[[], AbstractContextManager[object]] = field(
        default=contextlib.nullcontext, compare=False
    )  # R2: its conversation's quota image on `host`, while a file is opened

    @property
    def owner(self) -> MediaOwner:
        return "api_session" if self.name.startswith("api-") else "channel_chat"


def owner_of(mp: MediaPath) -> MediaOwner:
    """Whose directory a path names, from its shape alone (before any lookup)."""
    return "api_session" if mp.is_api_session else "channel_chat"


def _not_found(what: str) -> ApiError:
    return ApiError(404, "not_found", what)


def media_dir_of_session(ctx: ApiContext, session: Session) -> MediaDir:
    conv = ctx.store.get_conversation(session.conversation_id)
    if conv is None:  # a foreign key holds this; say so rather than guess
        raise _not_found(f"session {session.id}'s conversation is not in the state database")
    key = ConversationKey(conv.agent, conv.channel, conv.chat_id)
    name = key.media_dir_name(session.id)
    host = ctx.workspace(conv.agent) / "media" / name
    return MediaDir(name, host, conv, session, _holder(ctx, key, name))


def _holder(
    ctx: ApiContext, key: ConversationKey, name: str
) -> Callable[[], AbstractContextManager[object]]:
    rt = ctx.gateway.agents.get(key.agent)
    sandboxes = None if rt is None else rt.sandboxes
    return lambda: memory_held(sandboxes, key, name)


def media_dir_of_path(ctx: ApiContext, agent: str, mp: MediaPath) -> MediaDir:
    """The media directory a path names, if the store knows it for `agent`; else 404."""
    missing = _not_found(f"agent {agent!r} has no media directory {mp.dir_name!r}")
    if mp.is_api_session:
        session = ctx.store.get_session(SessionId(mp.rest))
        if session is None or session.agent != agent:
            raise missing
        found = media_dir_of_session(ctx, session)
        if found.name != mp.dir_name:  # a channel chat's session has no api- directory
            raise missing
        return found
    conv: Conversation | None = None
    if mp.rest.startswith("h."):
        digest = mp.rest[2:]
        for c in ctx.store.conversations(agent):
            if (
                c.channel == mp.channel
                and ConversationKey(agent, c.channel, c.chat_id).digest == digest
            ):
                conv = c
                break
    else:
        conv = ctx.store.get_conversation(
            conversation_id(ConversationKey(agent, mp.channel, mp.rest))
        )
    if conv is None or conv.agent != agent or conv.channel == "api":
        raise missing
    key = ConversationKey(conv.agent, conv.channel, conv.chat_id)
    if key.media_dir_name("") != mp.dir_name:
        raise missing
    host = ctx.workspace(agent) / "media" / mp.dir_name
    return MediaDir(mp.dir_name, host, conv, None, _holder(ctx, key, mp.dir_name))


def _exists_nofollow(media: MediaDir, rel: str) -> bool:
    """Is there anything at `rel` in the media directory (links not followed)?

    A link or non-directory on the way counts as something there: the answer
    is then a P5 refusal (403), whatever the link points at, so nothing
    outside the directory can be probed by 403 against 404.
    """
    norm = normalize_request(rel, _in_sandbox(media))
    if not isinstance(norm, str):
        return True
    try:
        with SafeDir.open(media.host, rel="") as d:
            return d.lstat(norm) is not None
    except UnsafePath:
        return True
    except OSError:
        return False


def _in_sandbox(media: MediaDir) -> str:
    return f"/workspace/media/{media.name}"


def open_in(media: MediaDir, rel: str, *, max_size: int = MAX_SERVE_BYTES) -> SafeFile:
    """P5: open `rel` (relative, checked here: 400) inside the media directory; 403 P5 / 404."""
    relative_file(rel, "file path")
    return open_stored(media, rel, max_size=max_size)


def open_stored(media: MediaDir, rel: str, *, max_size: int = MAX_SERVE_BYTES) -> SafeFile:
    """P5: open a path the store holds (relative, or as the sandbox wrote it) in `media`."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(media.held())
        except (QuotaError, OSError) as exc:
            logger.error("media directory %s: %s", media.name, exc)
            raise ApiError(503, "media_unavailable", f"media directory {media.name!r} cannot "
                           "be reached now; try again later") from exc  # fmt: skip
        return _open_stored(media, rel, max_size)


def _open_stored(media: MediaDir, rel: str, max_size: int) -> SafeFile:
    try:
        SafeDir.open(media.host, rel="").close()
    except FileNotFoundError:
        raise _not_found(f"media directory {media.name!r} holds no files yet") from None
    except (UnsafePath, OSError) as exc:
        raise ApiError(403, "forbidden", f"media directory {media.name!r} is not a plain "
                       "directory; nothing is served", "P5") from exc  # fmt: skip
    try:
        return open_media_file(media.host, rel, _in_sandbox(media), max_size=max_size)
    except PolicyDenied as exc:
        if not _exists_nofollow(media, rel):
            raise _not_found(f"{rel!r} does not exist in media directory {media.name!r}") from exc
        raise ApiError(403, "forbidden", exc.reason, exc.rule) from exc
    except CellgateError as exc:
        raise ApiError(
            500, "internal", f"{rel!r} in {media.name!r} could not be opened: {exc}"
        ) from exc


def image_type(f: SafeFile) -> str | None:
    """The image type by magic bytes (PNG, JPEG, GIF, WebP), or None."""
    head = f.pread(16, 0)
    for magic, mime in _IMAGE_MAGIC:
        if head.startswith(magic):
            return mime
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return None


def _chunks(f: SafeFile) -> Iterator[bytes]:
    try:
        offset = 0
        while offset < f.size:
            chunk = f.pread(min(_CHUNK, f.size - offset), offset)
            if not chunk:
                break
            offset += len(chunk)
            yield chunk
    finally:
        f.close()


def file_response(f: SafeFile) -> StreamingResponse:
    """Stream the checked descriptor; never a path. Active content is not rendered inline."""
    mime = image_type(f) or mimetypes.guess_type(f.name)[0] or "application/octet-stream"
    disposition = "inline" if mime.startswith(_INLINE) else "attachment"
    ascii_name = f.name.encode("ascii", "replace").decode().replace('"', "_").replace("?", "_")
    headers = {
        "Content-Disposition": f'{disposition}; filename="{ascii_name}"',
        "X-Content-Type-Options": "nosniff",
        "Content-Security-Policy": "sandbox; default-src 'none'",
        "Cache-Control": "private, no-store",
    }
    return StreamingResponse(_chunks(f), media_type=mime, headers=headers)
