"""`/v1/agents/{agent}/cron`: an agent's cron jobs, for admin keys (C1, C2).

The same operations as `cellgate cron add | list | pause | resume | delete`
and the `cron_*` bridge tools, through `cron.CronJobs`: creating a job for an
isolated agent answers 403 with rule C1, a command job for an app's agent
403 with rule C2; both are recorded in the audit table.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path
from pydantic import BaseModel, ConfigDict, Field

from cellgate.errors import ScheduleError
from orchestrator.api.auth import CallerKey, require
from orchestrator.api.context import ApiContext, context
from orchestrator.api.errors import ApiError
from orchestrator.api.ids import agent_id
from orchestrator.cron.jobs import MAX_PAYLOAD_CHARS, CronJobs, JobRequest, job_view

__all__ = ["router"]

router = APIRouter(tags=["cron"])

Ctx = Annotated[ApiContext, Depends(context)]
AgentPath = Annotated[str, Path(description="The agent id.", json_schema_extra={
    "pattern": r"^[a-z0-9][a-z0-9-]{0,39}$"})]  # fmt: skip
JobPath = Annotated[str, Path(description="The job id.", json_schema_extra={
    "pattern": r"^cron_[0-9a-f]{16}$"})]  # fmt: skip


class CronIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["prompt", "command"] = "prompt"
    prompt: str | None = Field(None, max_length=MAX_PAYLOAD_CHARS)
    command: str | None = Field(None, max_length=MAX_PAYLOAD_CHARS)
    cron: str | None = Field(None, max_length=200)
    every: int | None = Field(None, ge=1)
    at: str | None = Field(None, max_length=64)
    timezone: str | None = Field(None, max_length=64)
    channel: str | None = Field(None, max_length=16)
    chat_id: str | None = Field(None, max_length=512)
    name: str = Field("", max_length=100)
    timeout_seconds: float = Field(60.0, ge=1, le=3600)


def _jobs(ctx: ApiContext) -> CronJobs:
    jobs: CronJobs = ctx.gateway.cron_jobs
    return jobs


def _job_id(value: str) -> str:
    if not value.startswith("cron_") or len(value) != 21 or not value[5:].isalnum():
        raise ApiError(400, "bad_job", "a cron job id is 'cron_' and 16 hex digits")
    return value


async def _call(fn: Any, *args: Any, **kw: Any) -> Any:
    try:
        return await asyncio.to_thread(fn, *args, **kw)
    except ScheduleError as exc:
        raise ApiError(400, "bad_schedule", exc.reason) from exc


@router.get("/v1/agents/{agent}/cron")
async def list_jobs(agent: AgentPath, who: CallerKey, ctx: Ctx) -> list[dict[str, Any]]:
    agent_id(agent)
    require(ctx, who, agent, "admin")
    return [job_view(j) for j in await _call(_jobs(ctx).list, agent)]


@router.post("/v1/agents/{agent}/cron", status_code=201)
async def create_job(agent: AgentPath, body: CronIn, who: CallerKey, ctx: Ctx) -> dict[str, Any]:
    agent_id(agent)
    require(ctx, who, agent, "admin", is_write=True)
    payload = body.command if body.type == "command" else body.prompt
    req = JobRequest(
        type=body.type,
        payload=payload or "",
        cron=body.cron,
        every=body.every,
        at=body.at,
        timezone=body.timezone,
        channel=body.channel,
        chat_id=body.chat_id,
        name=body.name,
        timeout_seconds=body.timeout_seconds,
    )
    return job_view(await _call(_jobs(ctx).create, agent, req, via="api"))


@router.post("/v1/agents/{agent}/cron/{job}/pause")
async def pause_job(agent: AgentPath, job: JobPath, who: CallerKey, ctx: Ctx) -> dict[str, Any]:
    agent_id(agent)
    require(ctx, who, agent, "admin", is_write=True)
    return job_view(await _call(_jobs(ctx).pause, _job_id(job), agent))


@router.post("/v1/agents/{agent}/cron/{job}/resume")
async def resume_job(agent: AgentPath, job: JobPath, who: CallerKey, ctx: Ctx) -> dict[str, Any]:
    agent_id(agent)
    require(ctx, who, agent, "admin", is_write=True)
    return job_view(await _call(_jobs(ctx).resume, _job_id(job), agent))


@router.delete("/v1/agents/{agent}/cron/{job}")
async def delete_job(agent: AgentPath, job: JobPath, who: CallerKey, ctx: Ctx) -> dict[str, Any]:
    agent_id(agent)
    require(ctx, who, agent, "admin", is_write=True)
    await _call(_jobs(ctx).delete, _job_id(job), agent)
    return {"deleted": job}
