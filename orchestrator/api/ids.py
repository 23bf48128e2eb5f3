"""Ids in request paths, checked before anything is looked up.

Every id is validated here and then resolved only through the store; a
malformed one is a 400 that says what is wrong. Checked: NUL and control
characters, `..` components, percent-encoded sequences left after the one
decoding the server does (`..%252f` arrives as `..%2f`), over-long values,
and each id's own shape. Nothing here touches the filesystem.
"""

from __future__ import annotations

import re

from cellgate.models import CHANNEL_RE, SESSION_RE
from orchestrator.api.errors import ApiError
from orchestrator.config import AGENT_ID_RE

__all__ = [
    "CHAT_PATTERN",
    "MAX_ID",
    "MAX_MEDIA_PATH",
    "MediaPath",
    "agent_id",
    "chat_ref",
    "key_id",
    "media_path",
    "session_id",
    "share_ref",
]

MAX_ID = 256
MAX_MEDIA_PATH = 1024
_MAX_COMPONENT = 255

_CONV_ID = re.compile(r"^[0-9a-f]{32}$")
_DIR_NAME = re.compile(r"^[a-z][a-z0-9]{0,15}-[A-Za-z0-9_-]{1,40}-[0-9a-f]{16}$")
CHAT_PATTERN = r"^([0-9a-f]{32}|[a-z][a-z0-9]{0,15}-[A-Za-z0-9_-]{1,40}-[0-9a-f]{16})$"
_SHARE_ID = re.compile(r"^sh_[0-9a-f]{16}$")
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{20,128}$")
_KEY_ID = re.compile(r"^key_[0-9a-f]{16}$")
_ENCODED = re.compile(r"%[0-9A-Fa-f]{2}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_AGENT = re.compile(AGENT_ID_RE)
_MEDIA_DIR = re.compile(
    r"^(api-[A-Za-z0-9_-]{1,64}|[a-z][a-z0-9]{0,15}-(h\.[0-9a-f]{16}|[A-Za-z0-9_-]{1,64}))$"
)


def _bad(kind: str, what: str) -> ApiError:
    return ApiError(400, f"bad_{kind}", what)


def _common(value: str, kind: str, limit: int = MAX_ID) -> None:
    if not value:
        raise _bad(kind, f"the {kind} id is empty")
    if "\x00" in value:
        raise _bad(kind, f"the {kind} id contains a NUL byte")
    if _CONTROL.search(value):
        raise _bad(kind, f"the {kind} id contains a control character")
    if len(value) > limit:
        raise _bad(kind, f"the {kind} id is {len(value)} characters long; at most {limit}")
    if ".." in value:
        raise _bad(kind, f"the {kind} id contains '..'; ids never do (path traversal refused)")
    if _ENCODED.search(value):
        raise _bad(
            kind,
            f"the {kind} id still holds a percent-encoded sequence after decoding "
            "(double encoding?); send the id itself",
        )
    if "/" in value or "\\" in value:
        raise _bad(kind, f"the {kind} id contains a path separator")


def agent_id(value: str) -> str:
    _common(value, "agent")
    if not _AGENT.fullmatch(value):
        raise _bad("agent", "an agent id is 1-40 lowercase letters, digits or '-', starting "
                   "with a letter or digit")  # fmt: skip
    return value


def chat_ref(value: str) -> str:
    """A conversation id (32 hex) or its directory name (`<channel>-<slug>-<hash>`)."""
    _common(value, "chat")
    if not (_CONV_ID.fullmatch(value) or _DIR_NAME.fullmatch(value)):
        raise _bad(
            "chat",
            "name a chat by its conversation id (32 hex characters) or its directory name "
            "(`<channel>-<chatId>-<hash>`), as the chat list shows them",
        )
    return value


def session_id(value: str) -> str:
    _common(value, "session")
    if not SESSION_RE.fullmatch(value):
        raise _bad("session", "a session id is 1-64 letters, digits, '_' or '-'")
    return value


def share_ref(value: str) -> str:
    """A share id (`sh_` + 16 hex) or a share token (URL-safe base64)."""
    _common(value, "share")
    if not (_SHARE_ID.fullmatch(value) or _TOKEN.fullmatch(value)):
        raise _bad("share", "a share is named by its id (`sh_...`) or by its token")
    return value


def share_token(value: str) -> str:
    _common(value, "share")
    if not _TOKEN.fullmatch(value):
        raise _bad("share", "a share token is 20-128 URL-safe characters (A-Z a-z 0-9 _ -)")
    return value


def key_id(value: str) -> str:
    _common(value, "key")
    if not _KEY_ID.fullmatch(value):
        raise _bad("key", "an API key id is `key_` and 16 hex characters, as `keys list` shows")
    return value


class MediaPath:
    """`<media dir name>/<file path inside it>`, lexically safe (no filesystem yet)."""

    __slots__ = ("dir_name", "file")

    def __init__(self, dir_name: str, file: str) -> None:
        self.dir_name = dir_name
        self.file = file

    @property
    def is_api_session(self) -> bool:
        return self.dir_name.startswith("api-")

    @property
    def channel(self) -> str:
        return self.dir_name.split("-", 1)[0]

    @property
    def rest(self) -> str:
        return self.dir_name.split("-", 1)[1]


def relative_file(value: str, kind: str = "media path") -> str:
    """A path relative to a media directory: plain components, no `..`, no encoding."""
    code = kind.replace(" ", "_")
    if not value:
        raise _bad(code, f"the {kind} is empty; name a file")
    if "\x00" in value:
        raise _bad(code, f"the {kind} contains a NUL byte")
    if _CONTROL.search(value):
        raise _bad(code, f"the {kind} contains a control character")
    if len(value) > MAX_MEDIA_PATH:
        raise _bad(code, f"the {kind} is {len(value)} characters long; at most {MAX_MEDIA_PATH}")
    if value.startswith("/"):
        raise _bad(code, f"the {kind} must be relative to the media directory, not absolute")
    if "\\" in value:
        raise _bad(code, f"the {kind} contains a backslash; use '/' between components")
    parts = value.split("/")
    for part in parts:
        if part in ("", "."):
            raise _bad(code, f"the {kind} has an empty or '.' component; write it plainly")
        if part == "..":
            raise _bad(code, f"the {kind} contains '..'; only files inside the media directory "
                       "can be read (path traversal refused)")  # fmt: skip
        if _ENCODED.search(part):
            raise _bad(code, f"the {kind} still holds a percent-encoded sequence after decoding "
                       "(double encoding?); send the path itself")  # fmt: skip
        if len(part.encode("utf-8", "surrogatepass")) > _MAX_COMPONENT:
            raise _bad(code, f"a component of the {kind} is longer than {_MAX_COMPONENT} bytes")
    return value


def media_path(value: str) -> MediaPath:
    """`GET /v1/agents/{id}/media/{path}`: the media directory name, then the file in it."""
    first, sep, rest = value.partition("/")
    if not sep or not rest:
        relative_file(value)  # the specific complaint, if there is one
        raise _bad("media_path", "a media path is `<media dir>/<file>`, e.g. "
                   "`api-<session>/photo.png` or `telegram-42/a.jpg`")  # fmt: skip
    relative_file(value)
    if not _MEDIA_DIR.fullmatch(first) or not CHANNEL_RE.fullmatch(first.split("-", 1)[0]):
        raise _bad("media_path", f"{first[:80]!r} is not a media directory name "
                   "(`api-<session>` or `<channel>-<chatId>`)")  # fmt: skip
    return MediaPath(first, rest)
