"""The `cron_*` bridge tools (C1, C2): an agent schedules prompts into its own conversation.

Offered only to a non-isolated agent (`policies.tools`, T2: for an isolated
one they are neither listed nor callable). Every job goes through
`cron.CronJobs`, which asks `policies.cron` with the agent's facts as the
gateway knows them now: a session that started before isolation was turned
on is still refused (C1), and a command job of an app agent is refused (C2).
A job created here runs its prompt in the calling conversation only (P1: a
session never reaches another chat); only the operator (CLI, admin API)
names another. An agent sees and changes its own jobs only.
"""

from __future__ import annotations

import asyncio
from typing import Any

from cellgate.errors import BridgeError, ConversationError, NotFound, ScheduleError, StateConflict
from orchestrator.bridge.catalogue import CRON_TOOLS
from orchestrator.bridge.tools import Handler, JSONObject, ToolCall, ToolHandlers
from orchestrator.cron.jobs import MAX_PAYLOAD_CHARS, CronJobs, JobRequest, job_view

__all__ = ["CronTools"]


class CronTools:
    def __init__(self, jobs: CronJobs) -> None:
        self.jobs = jobs

    def install(self, handlers: ToolHandlers) -> ToolHandlers:
        own: dict[str, Handler] = {
            "cron_create": self.cron_create,
            "cron_list": self.cron_list,
            "cron_pause": self.cron_pause,
            "cron_resume": self.cron_resume,
            "cron_delete": self.cron_delete,
        }
        for definition in CRON_TOOLS:
            handlers.add(definition, own[definition.name])
        return handlers

    async def _do(self, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args, **kw)
        except (ScheduleError, ConversationError) as exc:
            raise BridgeError("bad_request", str(exc)) from exc
        except NotFound as exc:
            raise BridgeError("not_found", "no such cron job of this agent") from exc
        except StateConflict as exc:
            raise BridgeError("conflict", str(exc)) from exc

    async def cron_create(self, call: ToolCall) -> JSONObject:
        scope = call.scope
        if not scope.origin_chat_id:
            raise BridgeError("bad_request", "this session serves no chat to schedule into")
        kind = call.text("type", required=False, limit=16) or "prompt"
        text = call.text("prompt", required=False, limit=MAX_PAYLOAD_CHARS)
        text = text or call.required("command", limit=MAX_PAYLOAD_CHARS)
        req = JobRequest(
            type=kind,
            payload=text,
            cron=call.text("cron", required=False, limit=200),
            every=call.text("every", required=False, limit=32),
            at=call.text("at", required=False, limit=64),
            timezone=call.text("timezone", required=False, limit=64),
            channel=scope.channel,
            chat_id=scope.origin_chat_id,
            name=call.text("name", required=False, limit=100) or "",
        )
        job = await self._do(self.jobs.create, scope.key.agent, req, via="bridge")
        return {"job": job_view(job)}

    async def cron_list(self, call: ToolCall) -> JSONObject:
        jobs = await self._do(self.jobs.list, call.scope.key.agent)
        return {"jobs": [job_view(j) for j in jobs]}

    def _id(self, call: ToolCall) -> str:
        return call.required("job_id", limit=64)

    async def cron_pause(self, call: ToolCall) -> JSONObject:
        job = await self._do(self.jobs.pause, self._id(call), call.scope.key.agent)
        return {"job": job_view(job)}

    async def cron_resume(self, call: ToolCall) -> JSONObject:
        job = await self._do(self.jobs.resume, self._id(call), call.scope.key.agent)
        return {"job": job_view(job)}

    async def cron_delete(self, call: ToolCall) -> JSONObject:
        job_id = self._id(call)
        await self._do(self.jobs.delete, job_id, call.scope.key.agent)
        return {"deleted": job_id}
