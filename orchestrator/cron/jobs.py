"""Creating, listing, pausing, resuming and deleting cron jobs, with the C1/C2 refusals.

The one place every way in goes through: the CLI (`cellgate cron ...`), the
admin API (`/v1/agents/{agent}/cron`) and the `cron_*` bridge tools. Each
decision is `policies.cron.create_cron`; a refusal is recorded in the audit
table and raised as `PolicyDenied(rule, reason)`. Synchronous (the store is);
async callers offload with `asyncio.to_thread`.

    jobs = CronJobs(store, facts, clock=time.time)
    job = jobs.create("shop-bot", JobRequest.prompt("good morning", "telegram", "42",
                                                    cron="0 9 * * *", timezone="Asia/Bangkok"))
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from cellgate.errors import NotFound, PolicyDenied, ScheduleError, StateConflict, UnknownAgent
from cellgate.models import ConversationKey
from orchestrator.config import AgentConfig
from orchestrator.cron.schedule import due_after, first_due, parse_schedule, stored
from orchestrator.store.models import CronJob, CronJobId, CronType
from orchestrator.store.views import CronStore
from policies.cron import JobType, create_cron

__all__ = [
    "MAX_JOBS_PER_AGENT",
    "MAX_PAYLOAD_CHARS",
    "AgentFacts",
    "AgentLookup",
    "CronJobs",
    "JobRequest",
    "facts_from_configs",
    "job_state",
    "job_view",
]

logger = logging.getLogger(__name__)

MAX_JOBS_PER_AGENT = 100
MAX_PAYLOAD_CHARS = 8_000
MAX_NAME_CHARS = 100
MAX_TIMEOUT_SECONDS = 3_600.0


@dataclass(frozen=True, slots=True)
class AgentFacts:
    """What C1/C2 need to know of an agent: isolated now (or when it started), an app's agent."""

    isolated: bool
    is_app: bool


AgentLookup = Callable[[str], AgentFacts | None]
"""Agent id -> its facts, or None for an agent that is not configured."""


def facts_from_configs(agents: Iterable[AgentConfig]) -> AgentLookup:
    """The facts of agents as the config file declares them (the CLI's view)."""
    table = {a.id: AgentFacts(a.isolate_memory, a.app is not None) for a in agents}
    return table.get


@dataclass(frozen=True, slots=True)
class JobRequest:
    """A new job as a caller asked for it; validated by `CronJobs.create`."""

    type: str
    payload: str
    cron: str | None = None
    every: str | int | None = None
    at: str | None = None
    timezone: str | None = None
    channel: str | None = None
    chat_id: str | None = None
    name: str = ""
    timeout_seconds: float = 60.0


def job_state(job: CronJob) -> str:
    """`active`, `paused`, or `used up` (a one-shot job that ran)."""
    if job.enabled:
        return "active"
    return "used up" if job.one_shot and job.runs > 0 else "paused"


def job_view(job: CronJob) -> dict[str, Any]:
    """A job as the API, the bridge and the CLI show it."""
    return {
        "id": job.id,
        "agent": job.agent,
        "name": job.name,
        "type": job.type.value,
        "schedule": {"kind": job.schedule_kind.value, "expr": job.schedule,
                     "timezone": job.timezone},
        "payload": job.payload,
        "channel": job.channel,
        "chat_id": job.chat_id,
        "state": job_state(job),
        "one_shot": job.one_shot,
        "next_run_at": job.next_run_at,
        "last_run_at": job.last_run_at,
        "runs": job.runs,
        "last_status": job.last_status,
        "timeout_seconds": job.timeout_seconds,
    }  # fmt: skip


class CronJobs:
    def __init__(
        self,
        store: CronStore,
        facts: AgentLookup,
        *,
        clock: Callable[[], float],
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.facts = facts
        self.clock = clock
        self.on_change = on_change or (lambda: None)

    def _agent(self, agent: str) -> AgentFacts:
        found = self.facts(agent)
        if found is None:
            raise UnknownAgent(agent)
        return found

    def _refuse(self, agent: str, rule: str, reason: str, via: str) -> PolicyDenied:
        """The refusal, audited here unless it came over the bridge (which audits its own)."""
        logger.info("cron job for %s refused by %s: %s", agent, rule, reason)
        if via != "bridge":
            self.store.record_refusal(
                rule=rule, action="cron_create", reason=reason, detail={"agent": agent, "via": via}
            )
        return PolicyDenied(rule, reason)

    def create(self, agent: str, req: JobRequest, *, via: str = "cli") -> CronJob:
        """C1/C2 first, then the fields; the job is stored with the time it is first due."""
        facts = self._agent(agent)
        if req.type not in ("prompt", "command"):
            raise ScheduleError(f"job type {req.type[:32]!r} is unknown: use 'prompt' or 'command'")
        job_type: JobType = "command" if req.type == "command" else "prompt"
        decision = create_cron(facts.isolated, facts.is_app, job_type)
        if not decision:
            raise self._refuse(agent, decision.rule, decision.reason, via)
        payload = req.payload.strip()
        if not payload or len(payload) > MAX_PAYLOAD_CHARS:
            what = "a prompt" if req.type == "prompt" else "a command"
            raise ScheduleError(f"the job needs {what} of 1 to {MAX_PAYLOAD_CHARS} characters")
        if "\0" in payload or len(req.name) > MAX_NAME_CHARS:
            raise ScheduleError(f"a NUL byte or a name over {MAX_NAME_CHARS} characters")
        channel = chat_id = None
        if req.type == "prompt":
            if not req.channel or not req.chat_id:
                raise ScheduleError(
                    "a prompt job runs a turn in a named conversation: give its channel and "
                    "chat id (e.g. channel 'telegram', chat id '123456')"
                )
            key = ConversationKey(agent, req.channel, req.chat_id)  # ConversationError if bad
            channel, chat_id = key.channel, key.chat_id
        if not 1 <= req.timeout_seconds <= MAX_TIMEOUT_SECONDS:
            raise ScheduleError(f"timeout must be 1 to {MAX_TIMEOUT_SECONDS:g} seconds")
        now = self.clock()
        schedule = parse_schedule(
            cron=req.cron, every=req.every, at=req.at, timezone=req.timezone, now=now
        )
        if self.store.count_cron_jobs(agent) >= MAX_JOBS_PER_AGENT:
            raise ScheduleError(
                f"agent {agent} already has {MAX_JOBS_PER_AGENT} cron jobs; delete one first"
            )
        job = self.store.create_cron_job(
            agent,
            CronType(req.type),
            schedule.expr,
            payload,
            one_shot=schedule.one_shot,
            name=req.name,
            schedule_kind=schedule.kind,
            timezone=schedule.timezone,
            channel=channel,
            chat_id=chat_id,
            timeout_seconds=req.timeout_seconds,
            next_run_at=first_due(schedule, now),
        )
        logger.info("cron job %s created for %s: %s", job.id, agent, schedule.describe())
        self.on_change()
        return job

    def list(self, agent: str | None = None) -> list[CronJob]:
        return self.store.cron_jobs(agent)

    def get(self, job_id: str, agent: str | None = None) -> CronJob:
        """The job, if it exists and (when `agent` is given) belongs to that agent."""
        job = self.store.get_cron_job(CronJobId(job_id))
        if job is None or (agent is not None and job.agent != agent):
            raise NotFound("cron job", job_id)
        return job

    def pause(self, job_id: str, agent: str | None = None) -> CronJob:
        job = self.store.update_cron_job(self.get(job_id, agent).id, enabled=False)
        self.on_change()
        return job

    def resume(self, job_id: str, agent: str | None = None) -> CronJob:
        """Enable a paused job; a one-shot job that ran is used up and stays so."""
        job = self.get(job_id, agent)
        if job.one_shot and job.runs > 0:
            raise StateConflict("cron job", job_id, "not used up", "used up (a one-shot ran)")
        nxt = None
        if not job.one_shot:  # runs missed while paused are not made up
            nxt = due_after(stored(job.schedule_kind, job.schedule, job.timezone), self.clock())
        job = self.store.update_cron_job(job.id, enabled=True, next_run_at=nxt)
        self.on_change()
        return job

    def delete(self, job_id: str, agent: str | None = None) -> bool:
        done = self.store.delete_cron_job(self.get(job_id, agent).id)
        self.on_change()
        return done
