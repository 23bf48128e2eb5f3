"""F3: a conversation's sandbox host side runs in the host worker, a process of its own.

Each test starts its own worker (named with this run's id, so `ps` shows whose it
is) and closes it. No engine and no quota image are needed: the host side of a
conversation without a quota still makes its dirs and plans its mounts, and a pool
claim's failures are the binder's and the engine's (claims of real pooled sandboxes
through the worker: tests/e2e/test_pool.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cellgate.errors import ConversationError, EngineUnavailable, SandboxError
from cellgate.models import ConversationKey
from orchestrator.conversations import ConversationPaths, conversation_paths
from orchestrator.host_side import HostJob, host_side
from orchestrator.host_worker import MAX_FRAME, Broken, HostWorker, recv_frame
from sandbox.backends.base import SandboxHandle
from sandbox.backends.docker_pool import ClaimJob, claim_side
from sandbox.backends.engine_http import EngineHTTP, EngineRef
from sandbox.latebind import Slot
from sandbox.mountplan import MountPlan
from sandbox.spec import SandboxSpec
from tests.support.run_id import RUN_ID

OWNER = (os.getuid(), os.getgid())


@pytest.fixture
def worker() -> Iterator[HostWorker]:
    w = HostWorker(RUN_ID, reply_timeout=10, retry_after=0.2)
    yield w
    w.close()


def _paths(tmp_path: Path, chat: str) -> tuple[ConversationPaths, Path]:
    workspace, agent_root = tmp_path / "ws", tmp_path / "agent"
    for d in (workspace, agent_root):
        d.mkdir(exist_ok=True)
    (workspace / "SOUL.md").write_text("soul\n")
    key = ConversationKey("bot", "telegram", chat)
    return conversation_paths(agent_root, workspace, key, f"s-{chat}"), agent_root


def _job(paths: ConversationPaths, root: Path) -> HostJob:
    return HostJob("bot", "d" * 16, paths, root, OWNER)


async def _run(w: HostWorker, paths: ConversationPaths, root: Path) -> object:
    return await w.host_side(None, _job(paths, root))


def _until(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_F3_M3_S3_the_worker_makes_the_dirs_and_plans_as_the_gateway_would(
    worker: HostWorker, tmp_path: Path
) -> None:
    """The same plan as `host_side` run here (dev/inode of the same dirs and files), from a
    process that is not this one, which is named with its owner's run id."""
    paths, root = _paths(tmp_path, "a")
    plan = await _run(worker, paths, root)
    assert worker.pid is not None and worker.pid != os.getpid()
    cmdline = Path(f"/proc/{worker.pid}/cmdline").read_bytes().split(b"\0")
    assert b"orchestrator.host_worker" in cmdline and RUN_ID.encode() in cmdline
    for d in (paths.chat_dir, paths.media_dir, paths.home_dir, paths.bridge_dir):
        assert d.is_dir() and not d.is_symlink()
    assert (paths.chat_dir / "MEMORY.md").read_text() == ""
    assert plan == host_side(None, _job(paths, root), quick=True)


async def test_F3_R3_the_workers_log_records_are_logged_by_the_gateway(
    worker: HostWorker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A planted USER.md link is left out in the worker; its warning reaches this process's
    logger of the same name, marked with the worker's pid."""
    paths, root = _paths(tmp_path, "b")
    paths.chat_dir.mkdir(parents=True)
    (paths.chat_dir / "USER.md").symlink_to("/etc/shadow")
    with caplog.at_level(logging.INFO):
        await _run(worker, paths, root)
    mine = [r for r in caplog.records if "USER.md" in r.getMessage()]
    assert mine, [r.getMessage() for r in caplog.records]
    assert {r.process for r in mine} == {worker.pid}
    assert mine[0].levelno >= logging.WARNING
    assert (paths.chat_dir / "USER.md").is_symlink()  # left as it was


async def test_F3_an_error_in_the_worker_is_raised_here_as_the_same_exception(
    worker: HostWorker, tmp_path: Path
) -> None:
    paths, root = _paths(tmp_path, "c")
    (paths.workspace / "chats").symlink_to(tmp_path)  # a planted link on the way
    with pytest.raises(ConversationError) as here:
        host_side(None, _job(paths, root), quick=True)
    with pytest.raises(ConversationError) as there:
        await _run(worker, paths, root)
    assert worker.pid is not None  # it answered: the error was the host side's
    assert str(there.value) == str(here.value)
    assert there.value.reason == here.value.reason
    assert not list(tmp_path.glob("*/MEMORY.md"))


async def test_F3_a_dead_worker_is_done_without_and_replaced_after_the_wait(
    worker: HostWorker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths, root = _paths(tmp_path, "d")
    want = await _run(worker, paths, root)
    first = worker.pid
    assert first is not None
    with caplog.at_level(logging.WARNING):
        os.kill(first, signal.SIGKILL)
        _until(lambda: worker.pid is None)  # its reader saw it go
        assert await _run(worker, paths, root) == want  # done here meanwhile: nothing lost
    assert worker.pid is None
    assert not _alive(first)  # reaped
    assert any("host worker (F3)" in r.getMessage() for r in caplog.records)
    time.sleep(0.3)  # its retry_after
    assert await _run(worker, paths, root) == want
    assert worker.pid is not None and worker.pid != first


async def test_F3_a_hung_worker_is_killed_after_the_reply_timeout(tmp_path: Path) -> None:
    w = HostWorker(RUN_ID, reply_timeout=0.5, retry_after=60)
    try:
        paths, root = _paths(tmp_path, "e")
        want = await _run(w, paths, root)
        hung = w.pid
        assert hung is not None
        os.kill(hung, signal.SIGSTOP)
        assert await _run(w, paths, root) == want
        assert not _alive(hung)  # killed and reaped
        assert w.pid is None  # and not started again before retry_after
    finally:
        w.close()


async def test_F3_the_worker_ends_when_the_gateway_closes_it(
    worker: HostWorker, tmp_path: Path
) -> None:
    paths, root = _paths(tmp_path, "f")
    await _run(worker, paths, root)
    pid = worker.pid
    assert pid is not None
    worker.close()
    assert not _alive(pid)


async def test_K1_the_worker_gets_none_of_the_gateways_secrets(
    worker: HostWorker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", "123:secret-of-the-gateway")
    paths, root = _paths(tmp_path, "g")
    await _run(worker, paths, root)
    assert worker.pid is not None
    environ = Path(f"/proc/{worker.pid}/environ").read_bytes()
    assert b"secret-of-the-gateway" not in environ
    assert b"TELEGRAM_BOT_TOKEN" not in environ


async def test_F3_requests_in_flight_at_once_each_get_their_own_answer(
    worker: HostWorker, tmp_path: Path
) -> None:
    """Sent without waiting for the one before: 24 conversations' host sides at once, each
    caller answered with its own conversation's plan (its own dirs' inodes)."""
    convs = [_paths(tmp_path, f"many-{i}") for i in range(24)]
    plans = await asyncio.gather(*(_run(worker, p, r) for p, r in convs))
    for (paths, _), plan in zip(convs, plans, strict=True):
        assert isinstance(plan, MountPlan)
        chat = os.stat(paths.chat_dir)
        [mount] = [m for m in plan.mounts if m.source == str(paths.chat_dir)]
        assert (mount.dev, mount.ino) == (chat.st_dev, chat.st_ino)


def test_F3_a_frame_too_big_or_cut_short_is_a_broken_worker_not_a_read_of_it() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("!I", MAX_FRAME + 1))
        with pytest.raises(Broken, match="frame"):
            recv_frame(b)
        a.sendall(struct.pack("!I", 100) + b"short")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(Broken, match="closed"):
            recv_frame(b)


# -- claims (F1, F3) ---------------------------------------------------------------


def _claim_job(tmp_path: Path, engine: EngineRef | None) -> ClaimJob:
    """A claim of an empty plan into an empty slot, inspected from `engine`: what the
    worker does with it is the binder's and the engine's, no pooled sandbox needed."""
    slot = Slot(tmp_path / "slots" / "s1")
    slot.root.mkdir(parents=True)
    spec = SandboxSpec(
        name=f"cgtest-{RUN_ID}-nosuch", image="img", image_id="sha256:1", user="1000:1000",
        env={}, networks=(), plan=MountPlan(()), app="app", agent="app-bot",
        conversation="c1", gateway="gw",
    )  # fmt: skip
    handle = SandboxHandle(spec.name, f"cgtest-{RUN_ID}-nosuch", "h")
    return ClaimJob(tmp_path, slot, spec, handle, MountPlan(()), engine)


async def test_F3_a_claim_in_the_worker_raises_what_it_raises_here(
    worker: HostWorker, tmp_path: Path
) -> None:
    """The worker binds and inspects as the gateway would: an engine it cannot reach is
    the same `EngineUnavailable` here and there, answered by the worker's process."""
    job = _claim_job(tmp_path, EngineRef(str(tmp_path / "no-engine.sock"), "1.41", 5.0))
    lookup = EngineHTTP.from_ref(job.engine).inspect  # type: ignore[arg-type]
    with pytest.raises(EngineUnavailable) as here:
        claim_side(job, lookup)

    async def not_here(job: ClaimJob) -> list[str]:
        raise AssertionError("done in the gateway's process")

    with pytest.raises(EngineUnavailable) as there:
        await worker.claim(job, not_here)
    assert worker.pid is not None  # it answered
    assert type(there.value) is type(here.value)
    assert str(there.value) == str(here.value)


async def test_F3_a_claim_is_done_here_when_no_worker_runs_never_twice(
    tmp_path: Path,
) -> None:
    """No worker to send it to (or no engine it can reach): the claim is done in this
    process. A worker that stops answering once it has the claim: the claim fails (its
    slot may be half bound), and is not done again here."""
    done_here: list[ClaimJob] = []

    async def here(job: ClaimJob) -> list[str]:
        done_here.append(job)
        return []

    w = HostWorker(RUN_ID, reply_timeout=0.5, retry_after=60)
    try:
        job = _claim_job(tmp_path, EngineRef(str(tmp_path / "no-engine.sock"), "1.41", 5.0))
        assert await w.claim(dataclasses.replace(job, engine=None), here) == []
        assert len(done_here) == 1 and w.pid is None  # not even started for it
        paths, root = _paths(tmp_path, "claim")
        await _run(w, paths, root)
        hung = w.pid
        assert hung is not None
        os.kill(hung, signal.SIGSTOP)
        with pytest.raises(SandboxError, match="during a claim"):
            await w.claim(job, here)
        assert len(done_here) == 1
        assert not _alive(hung)
        assert await w.claim(job, here) == []  # down for retry_after: done here
        assert len(done_here) == 2 and w.pid is None
    finally:
        w.close()
