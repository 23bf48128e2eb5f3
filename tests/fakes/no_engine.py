"""A sandbox backend with no engine behind it, for API tests that never run a turn.

Listing finds nothing (so the gateway's recovery scan has nothing to remove);
anything that would need a container says, like a real engine that is down,
that none answers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cellgate.errors import EngineUnavailable
from sandbox.backends.base import ExecResult, ImageFacts, SandboxBackend, SandboxHandle, SandboxInfo
from sandbox.spec import SandboxSpec
from sandbox.verify import ObservedContainer

_WHY = "this test gateway has no engine"


class NoEngineBackend(SandboxBackend):
    async def _ensure(self, spec: SandboxSpec) -> SandboxHandle:
        raise EngineUnavailable(_WHY)

    async def _exec(
        self,
        handle: SandboxHandle,
        argv: list[str],
        env: dict[str, str],
        stdin: bytes | None,
        timeout: float,  # noqa: ASYNC109
        workdir: str | None,
    ) -> ExecResult:
        raise EngineUnavailable(_WHY)

    async def inspect(self, name: str) -> ObservedContainer:
        raise EngineUnavailable(_WHY)

    async def remove(self, name: str) -> None:
        raise EngineUnavailable(_WHY)

    async def list(self, labels: Mapping[str, str]) -> list[SandboxInfo]:
        return []

    async def image_facts(self, image: str) -> ImageFacts:
        raise EngineUnavailable(_WHY)

    async def probe(
        self,
        runtime: str | None,
        image: str,
        argv: Sequence[str],
        *,
        run_id: str,
        timeout: float,  # noqa: ASYNC109
    ) -> ExecResult:
        raise EngineUnavailable(_WHY)
