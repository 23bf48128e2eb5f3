"""R7: a command that started but could not fork makes the backend probe its sandbox;
a sandbox where every probe cannot fork either is removed by its container id once the
turn is over (the next turn gets a fresh one), and the command's own result is
returned as it was. Backend-agnostic: a small backend of our own whose `_exec`
answers from a script."""

from __future__ import annotations

import pytest

from cellgate.errors import SandboxSpent
from sandbox.backends import base
from sandbox.backends.base import FORK_PROBE, PROBES, ExecResult, SandboxHandle, SandboxNotFound
from tests.fakes.no_engine import NoEngineBackend

HANDLE = SandboxHandle("cg-test-sandbox", "c0ffee", "hash")
FORK_FAILED = ExecResult(2, b"", b"sh: 1: Cannot fork\n")


class Scripted(NoEngineBackend):
    """Each `_exec` answers the next scripted result (or raises it); `remove` is recorded;
    anything else needs an engine this backend does not have."""

    def __init__(self, *answers: ExecResult | Exception, confined: bool = True) -> None:
        self.answers = list(answers)
        self.calls: list[list[str]] = []
        self.removed: list[str] = []
        self.confined = confined  # type: ignore[misc]

    async def _exec(
        self,
        handle: SandboxHandle,
        argv: list[str],
        env: dict[str, str],
        stdin: bytes | None,
        timeout: float,  # noqa: ASYNC109
        workdir: str | None,
    ) -> ExecResult:
        self.calls.append(argv)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def remove(self, name: str) -> None:
        self.removed.append(name)


@pytest.fixture(autouse=True)
def no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "PROBE_PAUSE", 0.0)


async def test_R7_a_sandbox_where_every_probe_cannot_fork_is_removed_once_its_turn_ends() -> None:
    backend = Scripted(FORK_FAILED, *[FORK_FAILED] * PROBES)
    result = await backend.exec(HANDLE, ["/bin/sh", "-c", "ls"])
    assert result == FORK_FAILED  # the command's own result stands
    assert backend.calls[1:] == [list(FORK_PROBE)] * PROBES
    assert backend.removed == []  # not in the middle of the turn: a harness may exec again
    assert await backend.retire_if_spent(HANDLE)
    assert backend.removed == [HANDLE.container_id]  # by id: never a namesake made since
    assert not await backend.retire_if_spent(HANDLE)  # once
    assert backend.removed == [HANDLE.container_id]


@pytest.mark.parametrize(
    "failed",
    [
        FORK_FAILED,
        ExecResult(1, b"bash: fork: retry: Resource temporarily unavailable\n", b""),
        ExecResult(1, b"", b"BlockingIOError: [Errno 11] Resource temporarily unavailable\n"),
    ],
)
async def test_R7_a_sandbox_that_can_fork_again_is_kept(failed: ExecResult) -> None:
    backend = Scripted(failed, FORK_FAILED, ExecResult(0, b"", b""))  # busy a moment
    assert await backend.exec(HANDLE, ["/bin/sh", "-c", "x"]) == failed
    assert len(backend.calls) == 3
    assert not await backend.retire_if_spent(HANDLE) and backend.removed == []


@pytest.mark.parametrize(
    "probe",
    [
        ExecResult(124, b"", b"", timed_out=True),  # slow is not spent
        ExecResult(1, b"", b"sh: true: not found\n"),  # failed, but not a fork
        SandboxSpent(),  # nothing could start: the engine path removed it already
        SandboxNotFound("cg-test-sandbox"),
    ],
    ids=["timed-out", "other-failure", "spent", "gone"],
)
async def test_R7_a_probe_that_proves_nothing_keeps_the_sandbox(
    probe: ExecResult | Exception,
) -> None:
    backend = Scripted(FORK_FAILED, probe)
    assert await backend.exec(HANDLE, ["/bin/sh", "-c", "ls"]) == FORK_FAILED
    assert len(backend.calls) == 2
    assert not await backend.retire_if_spent(HANDLE) and backend.removed == []


@pytest.mark.parametrize(
    "result",
    [
        ExecResult(0, b"sh: 1: Cannot fork\n", b""),  # said, but the command succeeded
        ExecResult(1, b"", b"no such file\n"),  # failed, but not a fork
        ExecResult(124, b"", b"Cannot fork\n", timed_out=True),
    ],
)
async def test_R7_no_probe_without_a_failed_fork(result: ExecResult) -> None:
    backend = Scripted(result)
    assert await backend.exec(HANDLE, ["/bin/sh", "-c", "x"]) == result
    assert len(backend.calls) == 1


async def test_R7_a_host_process_is_never_probed_or_removed() -> None:
    backend = Scripted(FORK_FAILED, confined=False)
    assert await backend.exec(HANDLE, ["/bin/sh", "-c", "ls"]) == FORK_FAILED
    assert len(backend.calls) == 1
    assert not await backend.retire_if_spent(HANDLE) and backend.removed == []


async def test_R7_a_resident_backend_judges_a_command_once_not_once_per_layer() -> None:
    """No runner serves the sandbox: the command goes to the engine's exec hook, and only
    the outer backend judges it (probes are not doubled by the layer beneath)."""
    from orchestrator.resident import ResidentBackend

    inner = Scripted(FORK_FAILED, *[FORK_FAILED] * PROBES)
    resident = ResidentBackend(inner, native=False)  # type: ignore[arg-type]
    try:
        assert await resident.exec(HANDLE, ["/bin/sh", "-c", "ls"]) == FORK_FAILED
        assert len(inner.calls) == 1 + PROBES
        assert await resident.retire_if_spent(HANDLE)
        assert inner.removed == [HANDLE.container_id]
        assert not await inner.retire_if_spent(HANDLE)
    finally:
        await resident.close()
