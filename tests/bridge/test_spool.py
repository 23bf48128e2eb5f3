"""send_file's spool: one bounded copy per send, removed after delivery, sparse refused (R3, P5)."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from cellgate.errors import BridgeError, PolicyDenied
from orchestrator.bridge.spool import Spool
from orchestrator.safefs import SafeDir, SafeFile
from tests.bridge.conftest import World


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def _spool_bytes(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in _files(root))


def _sparse(path: Path, size: int) -> None:
    with open(path, "wb") as fh:
        fh.truncate(size)


@pytest.fixture
def media(tmp_path: Path) -> Path:
    d = tmp_path / "media"
    d.mkdir()
    (d / "a.bin").write_bytes(b"A" * 1000)
    return d


def _open(media: Path, name: str, max_size: int = 1 << 20) -> SafeFile:
    with SafeDir.open(media) as d:
        return d.open_file(name, max_size=max_size, check_size=False)


def test_R3_flood_gets_busy_not_disk(media: Path, tmp_path: Path) -> None:
    """covers: R3 - copies in flight are bounded per conversation in count and bytes."""
    spool = Spool(tmp_path / "spool", max_files=2, max_bytes=2500)
    held = []
    for _ in range(2):
        with _open(media, "a.bin") as f:
            held.append(spool.put("conv-a", f))
    with _open(media, "a.bin") as f, pytest.raises(BridgeError) as info:
        spool.put("conv-a", f)
    assert info.value.code == "busy"
    with _open(media, "a.bin") as f:  # another conversation is not held up
        other = spool.put("conv-b", f)
    assert spool.in_flight("conv-a") == (2, 2000)
    (media / "b.bin").write_bytes(b"B" * 600)
    held[0].remove()
    with _open(media, "b.bin") as f:
        held.append(spool.put("conv-a", f))  # 1000 + 600 <= 2500
    with _open(media, "a.bin") as f, pytest.raises(BridgeError):
        spool.put("conv-a", f)  # count bound reached again
    for s in [*held, other]:
        s.remove()
    assert spool.in_flight("conv-a") == (0, 0)
    assert _files(tmp_path / "spool") == [], "every copy removed"


def test_R3_bytes_bound(media: Path, tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", max_files=10, max_bytes=1500)
    with _open(media, "a.bin") as f:
        first = spool.put("c", f)
    with _open(media, "a.bin") as f, pytest.raises(BridgeError, match="busy"):
        spool.put("c", f)
    first.remove()
    assert _files(tmp_path / "spool") == []


def test_P5_R3_sparse_and_oversize_refused_before_copying(media: Path, tmp_path: Path) -> None:
    """covers: P5, R3 - a sparse file costs the host nothing: refused before a byte is copied."""
    _sparse(media / "sparse.bin", 40 << 20)
    spool = Spool(tmp_path / "spool")
    with _open(media, "sparse.bin", max_size=50 << 20) as f, pytest.raises(PolicyDenied) as info:
        spool.put("c", f)
    assert info.value.rule == "P5" and "sparse" in info.value.reason
    with _open(media, "a.bin", max_size=10) as f, pytest.raises(PolicyDenied) as info:
        spool.put("c", f)
    assert "over the limit" in info.value.reason
    assert _files(tmp_path / "spool") == []
    assert spool.in_flight("c") == (0, 0)


async def test_R3_a_cancelled_send_leaves_no_copy(media: Path, tmp_path: Path) -> None:
    """covers: R3 - the turn ends (the task is cancelled) while the copy runs: nothing stays."""
    spool = Spool(tmp_path / "spool")
    opened = threading.Event()
    go_on = threading.Event()

    def opener() -> SafeFile:
        opened.set()
        go_on.wait(5)
        return _open(media, "a.bin")

    task = asyncio.create_task(spool.copy("c", opener))
    await asyncio.to_thread(opened.wait, 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    go_on.set()
    for _ in range(100):
        await asyncio.sleep(0.02)
        if spool.in_flight("c") == (0, 0) and not _files(tmp_path / "spool"):
            break
    assert spool.in_flight("c") == (0, 0)
    assert _files(tmp_path / "spool") == []


async def test_R3_send_file_flood_leaves_the_spool_empty(world: World) -> None:
    """covers: R3 - 30 sends of a 2 MB file: one copy each, each removed once delivered."""
    a = await world.open("42")
    data = os.urandom(2 << 20)
    (a.media / "big.bin").write_bytes(data)
    spool_root = world.root / "spool"
    peak = 0
    for i in range(30):
        result = await a.ok("send_file", {"path": "big.bin", "caption": f"n{i}"})
        assert result["size"] == len(data)
        peak = max(peak, _spool_bytes(spool_root))
    assert world.outbox.file_bytes == [data] * 30
    assert _files(spool_root) == [], "no copy outlives its delivery"
    assert peak == 0


async def test_P5_send_file_refuses_a_sparse_file(world: World) -> None:
    """covers: P5, R3 - a sparse file (1 TB, or 40 MB under the cap) is never copied."""
    a = await world.open("42")
    _sparse(a.media / "huge", 1 << 40)
    _sparse(a.media / "holes", 40 << 20)
    err = await a.refused("send_file", {"path": "huge"}, "P5")
    assert "over the limit" in err["message"], err
    err = await a.refused("send_file", {"path": "holes"}, "P5")
    assert "sparse" in err["message"], err
    assert world.outbox.sent == []
    assert _files(world.root / "spool") == []
    assert len(world.store.refusals(a.scope.conversation_id)) == 2
