"""The `shell` harness (H2): the message is a shell command run inside the sandbox.

For tests and demos: the reply is the command's output and its exit status.
"""

from __future__ import annotations

import uuid

from orchestrator.harnesses.base import ExecDetail, Harness, SessionContext, TurnRequest, TurnResult

MAX_REPLY_CHARS = 16_000


class ShellHarness(Harness):
    def __init__(self, timeout_seconds: float = 60.0) -> None:
        self.timeout_seconds = timeout_seconds

    async def ensure_session(self, ctx: SessionContext) -> str:
        return ctx.session_key

    async def dispatch(self, ctx: SessionContext, request: TurnRequest) -> TurnResult:
        turn_id = uuid.uuid4().hex
        result = await ctx.backend.exec(
            ctx.sandbox,
            ["/bin/sh", "-c", request.prompt],
            env=ctx.env,
            timeout=self.timeout_seconds,
            workdir=ctx.workdir,
        )
        out = (result.stdout + result.stderr).decode("utf-8", "replace")
        if len(out) > MAX_REPLY_CHARS:
            out = out[:MAX_REPLY_CHARS] + "\n[output truncated]"
        status = "timed out" if result.timed_out else f"exit {result.exit_code}"
        reply = f"{out}{'' if not out or out.endswith(chr(10)) else chr(10)}[{status}]"
        return TurnResult(
            ok=not result.timed_out,
            reply=reply,
            turn_id=turn_id,
            detail=ExecDetail(exit_code=result.exit_code, timed_out=result.timed_out),
        )

    async def reset_session(self, ctx: SessionContext) -> None:
        """A shell session keeps no state between turns: nothing to forget."""
