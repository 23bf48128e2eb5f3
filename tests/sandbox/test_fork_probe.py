"""R7: a command that started but could not fork makes the backend probe its sandbox;
a sandbox where the probe cannot fork either is removed (the next turn gets a fresh
one), and the command's own result is returned as it was. Backend-agnostic: a small
backend of our own whose `_exec` answers from a script."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from cellgate.errors import SandboxSpent
from sandbox.backends.base import (
    FORK_PROBE,
    ExecResult,
    ImageFacts,
    SandboxBackend,
    SandboxHandle,
    SandboxInfo,
)
from sandbox.spec import SandboxSpec
from sandbox.verify import ObservedContainer

HANDLE = SandboxHandle("cg-test-sandbox", "c0ffee", "hash")
FORK_FAILED = ExecResult(2, b"", b"sh: 1: Cannot fork\n")


class Scripted(SandboxBackend):
    """Each `_exec` answers the next scripted result (or raises it)."""

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

    async def _ensure(self, spec: SandboxSpec) -> SandboxHandle:
        raise NotImplementedError

    async def inspect(self, name: str) -> ObservedContainer:
        raise NotImplementedError

    async def list(self, labels: Mapping[str, str]) -> list[SandboxInfo]:
        raise NotImplementedError

    async def image_facts(self, image: str) -> ImageFacts:
        raise NotImplementedError

    async def probe(
        self,
        runtime: str | None,
        image: str,
        argv: Sequence[str],
        *,
        run_id: str,
        timeout: float,  # noqa: ASYNC109
    ) -> ExecResult:
        raise NotImplementedError


async def test_R7_a_sandbox_where_the_probe_cannot_fork_either_is_removed() -> None:
    backend = Scripted(FORK_FAILED, ExecResult(2, b"", b"sh: 1: Cannot fork\n"))
    result = await backend.exec(HANDLE, ["/bin/sh", "-c", "ls"])
    assert result == FORK_FAILED  # the command's own result stands
    assert backend.calls[1] == list(FORK_PROBE)
    assert backend.removed == [HANDLE.name]


@pytest.mark.parametrize(
    "failed",
    [
        FORK_FAILED,
        ExecResult(1, b"bash: fork: retry: Resource temporarily unavailable\n", b""),
        ExecResult(1, b"", b"BlockingIOError: [Errno 11] Resource temporarily unavailable\n"),
    ],
)
async def test_R7_a_sandbox_that_can_fork_again_is_kept(failed: ExecResult) -> None:
    backend = Scripted(failed, ExecResult(0, b"", b""))
    assert await backend.exec(HANDLE, ["/bin/sh", "-c", "x"]) == failed
    assert len(backend.calls) == 2 and backend.removed == []


async def test_R7_a_probe_that_could_not_start_leaves_the_removal_to_the_engine_path() -> None:
    """Nothing could start: the backend removed the sandbox itself (`SandboxSpent`)."""
    backend = Scripted(FORK_FAILED, SandboxSpent())
    assert await backend.exec(HANDLE, ["/bin/sh", "-c", "ls"]) == FORK_FAILED
    assert backend.removed == []


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
    assert len(backend.calls) == 1 and backend.removed == []


async def test_R7_a_host_process_is_never_probed_or_removed() -> None:
    backend = Scripted(FORK_FAILED, confined=False)
    assert await backend.exec(HANDLE, ["/bin/sh", "-c", "ls"]) == FORK_FAILED
    assert len(backend.calls) == 1 and backend.removed == []
