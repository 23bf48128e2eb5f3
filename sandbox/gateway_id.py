"""This gateway's id: made once in the state directory, then read back (R1).

Every container a gateway creates carries its id as a label and in its name, so
two gateways on one engine (even serving apps of the same name) never share,
list, reconcile or reap each other's sandboxes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from pathlib import Path

from cellgate.errors import CellgateError

GATEWAY_ID_FILE = "gateway-id"
_VALID = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
_MAX_READ = 128


class GatewayIdError(CellgateError):
    """The state directory's gateway id cannot be read or is not a valid id."""


def valid_gateway_id(value: str) -> bool:
    """Lower-case letters, digits, `_.-`; 1 to 63 characters (label- and name-safe)."""
    return _VALID.fullmatch(value) is not None


def new_gateway_id() -> str:
    return f"g{secrets.token_hex(8)}"


def _read(path: Path) -> str:
    """The id in `path`: no symlink followed, a regular file only, a bounded read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise GatewayIdError(f"{path} is not a regular file")
        raw = os.read(fd, _MAX_READ + 1)
    finally:
        os.close(fd)
    value = raw.decode("ascii", "replace").strip()
    if len(raw) > _MAX_READ or not valid_gateway_id(value):
        raise GatewayIdError(f"{path} does not hold a valid gateway id; remove it to make one")
    return value


def _create(path: Path, value: str) -> None:
    """Write `value` to a private temp file and link it into place; no-op if one exists."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, f"{value}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic: fails when another process made the id first
    except FileExistsError:
        pass
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def load_gateway_id(state_dir: Path) -> str:
    """The gateway id of `state_dir`, created on first use; always what the file holds."""
    path = state_dir / GATEWAY_ID_FILE
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise GatewayIdError(f"{path} is a symlink; refusing to follow it") from exc
        raise GatewayIdError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        _create(path, new_gateway_id())
        return _read(path)
    except OSError as exc:
        raise GatewayIdError(f"cannot create {path}: {exc.strerror or exc}") from exc


def write_gateway_id(state_dir: Path, value: str) -> None:
    """Set the id of a fresh state directory (tests, migration); refuses to replace one."""
    if not valid_gateway_id(value):
        raise GatewayIdError(f"{value!r} is not a valid gateway id")
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / GATEWAY_ID_FILE
    _create(path, value)
    if _read(path) != value:
        raise GatewayIdError(f"{path} already holds another gateway id")
