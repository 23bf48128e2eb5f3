"""Where `send_file` puts the checked copy it hands to the outbox, bounded (P5, R3).

The spool is a gateway-only directory (`<state_dir>/bridge-spool`, never
mounted into a sandbox). Each send makes at most one copy, from the
descriptor `safefiles.open_media_file` checked, and the copy is removed as
soon as the delivery returns, fails or is cancelled (the turn ended), so a
copy outlives no send. A sparse file or one over its cap is refused before a
byte is copied (`safefs.SafeFile.copy_into`).

Copies in flight are bounded per conversation, in bytes and in count, and
for the whole gateway in bytes: a flood of sends gets `BridgeError("busy")`,
not disk. Each gateway process spools into its own subdirectory; what a
crashed process left behind is swept once it is an hour old.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from cellgate.errors import BridgeError, UnsafePath
from orchestrator.bridge.safefiles import refused_file
from orchestrator.safefs import SafeDir, SafeFile

__all__ = ["Spool", "SpooledFile"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_FILES = 4
"""Copies one conversation may have in flight at once."""
DEFAULT_MAX_BYTES = 128 * 1024 * 1024
"""Bytes one conversation may have in flight at once."""
DEFAULT_MAX_TOTAL_BYTES = 1024 * 1024 * 1024
"""Bytes the whole gateway may have in flight at once."""
STALE_SECONDS = 3600.0


@dataclass(slots=True)
class SpooledFile:
    """One copy in the spool; `remove()` (or leaving `with`) deletes it and frees its share."""

    path: Path
    name: str
    size: int
    _spool: Spool
    _conversation: str
    _token: str
    _reserved: int
    _removed: bool = False

    def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        self._spool._release(self._conversation, self._token, self._reserved)

    def __enter__(self) -> SpooledFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()


class Spool:
    """The bounded spool of one gateway process; thread-safe (copies run in threads)."""

    def __init__(
        self,
        directory: Path,
        *,
        max_files: int = DEFAULT_MAX_FILES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    ) -> None:
        self.directory = directory
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.max_total_bytes = max_total_bytes
        self._own = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._lock = threading.Lock()
        self._files: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        self._total = 0
        self._swept = False

    @property
    def own_dir(self) -> Path:
        return self.directory / self._own

    def in_flight(self, conversation: str) -> tuple[int, int]:
        """(copies, bytes) of `conversation` in the spool now."""
        with self._lock:
            return self._files.get(conversation, 0), self._bytes.get(conversation, 0)

    def _reserve(self, conversation: str, size: int) -> None:
        with self._lock:
            files = self._files.get(conversation, 0)
            used = self._bytes.get(conversation, 0)
            if files >= self.max_files or used + size > self.max_bytes:
                raise BridgeError(
                    "busy",
                    f"this conversation already has {files} file(s), {used} bytes, being sent; "
                    "wait for them to be delivered and send again",
                )
            if self._total + size > self.max_total_bytes:
                raise BridgeError("busy", "the gateway is sending many files; send again shortly")
            self._files[conversation] = files + 1
            self._bytes[conversation] = used + size
            self._total += size

    def _release(self, conversation: str, token: str, size: int) -> None:
        try:
            with SafeDir.trusted(self.own_dir) as own:
                with contextlib.suppress(FileNotFoundError), own.subdir(token) as d:
                    for name in os.listdir(d.fd):
                        d.remove(name)
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(token, dir_fd=own.fd)
        except FileNotFoundError:
            pass  # nothing was spooled yet
        except OSError as exc:  # the copy stays; log it, the count is freed regardless
            logger.warning("a spooled copy could not be removed: %s", exc.strerror)
        finally:
            with self._lock:
                left = self._files.get(conversation, 0) - 1
                if left > 0:
                    self._files[conversation] = left
                    self._bytes[conversation] -= size
                else:
                    self._files.pop(conversation, None)
                    self._bytes.pop(conversation, None)
                self._total -= size

    def _sweep(self) -> None:
        """Remove what crashed gateway processes left (their subdirectories, an hour old)."""
        if self._swept:
            return
        self._swept = True
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.directory):
                if entry.name == self._own:
                    continue
                with contextlib.suppress(OSError):
                    if time.time() - entry.stat(follow_symlinks=False).st_mtime > STALE_SECONDS:
                        if entry.is_dir(follow_symlinks=False):
                            shutil.rmtree(entry.path, ignore_errors=True)
                        else:
                            os.unlink(entry.path)

    async def copy(self, conversation: str, opener: Callable[[], SafeFile]) -> SpooledFile:
        """Open (`opener`, in a thread) and `put` one file; a cancelled caller leaves no copy."""

        def run() -> SpooledFile:
            with opener() as f:
                return self.put(conversation, f)

        task = asyncio.ensure_future(asyncio.to_thread(run))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(_remove_result)
            raise

    def put(self, conversation: str, f: SafeFile) -> SpooledFile:
        """Copy the checked file `f` into the spool once; the caller removes it after delivery.

        Raises `BridgeError("busy")` over a bound, `PolicyDenied` (P5) for a
        sparse file or one over its cap, both before a byte is copied.
        """
        if f.sparse or f.size > f.max_size:
            raise refused_file(_unsafe(f))
        self._sweep()
        self._reserve(conversation, f.size)
        token = secrets.token_hex(8)
        try:
            os.makedirs(self.own_dir, mode=0o700, exist_ok=True)
            own = SafeDir.trusted(self.own_dir)
            with own, own.subdir(token, create=True, mode=0o700) as d:
                try:
                    size = f.copy_into(d, f.name)
                except UnsafePath as exc:
                    raise refused_file(exc) from exc
        except BaseException:
            self._release(conversation, token, f.size)
            raise
        path = self.own_dir / token / f.name
        return SpooledFile(path, f.name, size, self, conversation, token, f.size)


def _remove_result(task: asyncio.Future[SpooledFile]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().remove()


def _unsafe(f: SafeFile) -> UnsafePath:
    if f.sparse:
        return UnsafePath(
            f.rel,
            "sparse",
            f"is sparse ({f.size} bytes, {f.allocated} on disk); write it out in full",
        )
    return UnsafePath(f.rel, "too_large", f"is {f.size} bytes, over the limit of {f.max_size}")
