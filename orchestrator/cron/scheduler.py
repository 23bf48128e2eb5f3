"""The scheduler: runs each due cron job once, through the same doors as everything else.

- A prompt job is a stored message in its named conversation, submitted
  through `Intake` (admission, the durable turn loop, delivery) with the
  platform id `cron:<job>:<due time>`: a crash between the submit and the
  bookkeeping submits the same id again, which the store accepts once (D1).
- A command job runs on the host (`cron.command`), one at a time per job, in
  a task of its own so a long command holds up no other job.
- Before every run `policies.cron.run_cron` decides (C1, C2). A refused job
  is not touched: its row stays exactly as stored, a one-shot job is not used
  up, and it runs (once) when a gateway starts with the mode turned off.
- A job due while the gateway was down is due at start, and runs once; its
  next time is the first one after that run (`schedule.due_after`).
- A one-shot job is used up (`mark_cron_run`) only once it ran.

`tick()` is one pass at the clock's `now`; tests call it with a fake clock.
`run_forever()` ticks whenever a job is due, woken early by `wake()` when a
job is created or resumed in this process, and at least every `poll` seconds
(a job added by `cellgate cron add` in another process).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from cellgate.errors import CellgateError, StateConflict
from orchestrator.cron.command import CommandResult, run_command
from orchestrator.cron.jobs import AgentLookup
from orchestrator.cron.schedule import due_after, stored
from orchestrator.store.models import CronJob, CronJobId, CronType, Message
from orchestrator.store.views import CronStore
from policies.cron import run_cron

__all__ = ["CronScheduler", "RunRecord", "Submit", "cron_message_id"]

logger = logging.getLogger(__name__)

POLL_SECONDS = 5.0
HOLD_SECONDS = 300.0
"""A job that may not run (C1/C2) or could not be submitted is not retried sooner."""
RETRY_SECONDS = 30.0
MAX_OUTPUT_CHARS = 16_000

Outcome = Literal["ran", "started", "skipped", "deferred"]


class Submit(Protocol):
    """`Intake.submit`: store a message and queue its turn."""

    def __call__(
        self,
        agent_id: str,
        channel: str,
        chat_id: str,
        text: str,
        *,
        message_id: str | None = None,
        sender: str = "",
    ) -> Awaitable[tuple[Message, bool]]: ...


@dataclass(frozen=True, slots=True)
class RunRecord:
    """What one tick did with one due job."""

    job: CronJobId
    outcome: Outcome
    rule: str | None = None
    detail: str = ""


def cron_message_id(job: CronJob) -> str:
    """The platform id of the message a prompt job's run submits (idempotent per due time)."""
    return f"cron:{job.id}:{int(job.next_run_at or 0)}"


class CronScheduler:
    def __init__(
        self,
        store: CronStore,
        facts: AgentLookup,
        submit: Submit,
        *,
        clock: Callable[[], float],
        workdir: Callable[[str], Path],
        poll: float = POLL_SECONDS,
    ) -> None:
        self.store = store
        self.facts = facts
        self.submit = submit
        self.clock = clock
        self.workdir = workdir
        self.poll = poll
        self._held: dict[CronJobId, float] = {}
        self._running: dict[CronJobId, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def wake(self) -> None:
        """Look at the jobs again now (one was created, paused or resumed); any thread."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    async def tick(self) -> list[RunRecord]:
        """Run every job due now, each once."""
        now = self.clock()
        due = await asyncio.to_thread(self.store.due_cron_jobs, now, 1000)
        self._held = {j: t for j, t in self._held.items() if t > now}
        records: list[RunRecord] = []
        for job in due:
            if job.id in self._held or job.id in self._running:
                continue
            records.append(await self._run(job, now))
        return records

    def _hold(self, job: CronJob, now: float, seconds: float) -> None:
        self._held[job.id] = now + seconds

    async def _run(self, job: CronJob, now: float) -> RunRecord:
        facts = self.facts(job.agent)
        if facts is None:
            self._hold(job, now, HOLD_SECONDS)
            logger.warning("cron job %s not run: agent %s is not configured", job.id, job.agent)
            return RunRecord(job.id, "deferred", None, f"agent {job.agent} is not configured")
        decision = run_cron(facts.isolated, is_app_agent=facts.is_app, job_type=job.type.value)
        if not decision:
            self._hold(job, now, HOLD_SECONDS)  # C1/C2: the row is not touched
            logger.info("cron job %s of %s not run (%s): %s", job.id, job.agent,
                        decision.rule, decision.reason)  # fmt: skip
            return RunRecord(job.id, "skipped", decision.rule, decision.reason)
        if job.type is CronType.COMMAND:
            self._running[job.id] = asyncio.create_task(self._command(job, now))
            return RunRecord(job.id, "started", decision.rule, job.payload[:80])
        return await self._prompt(job, now)

    def _next(self, job: CronJob, now: float) -> float | None:
        return due_after(stored(job.schedule_kind, job.schedule, job.timezone), now)

    async def _mark(self, job: CronJob, now: float, status: str) -> None:
        try:
            await asyncio.to_thread(
                self.store.mark_cron_run,
                job.id,
                next_run_at=self._next(job, now),
                status=status,
                due=job.next_run_at,
            )
        except StateConflict as exc:  # paused, deleted or run elsewhere meanwhile
            logger.info("cron job %s changed while it ran: %s", job.id, exc)

    async def _prompt(self, job: CronJob, now: float) -> RunRecord:
        assert job.channel is not None and job.chat_id is not None
        try:
            msg, created = await self.submit(
                job.agent,
                job.channel,
                job.chat_id,
                job.payload,
                message_id=cron_message_id(job),
                sender=f"cron:{job.id}",
            )
        except CellgateError as exc:  # throttled, agent unavailable, store: try again later
            self._hold(job, now, RETRY_SECONDS)
            logger.warning("cron job %s of %s not submitted: %s", job.id, job.agent, exc)
            return RunRecord(job.id, "deferred", getattr(exc, "rule", None), str(exc))
        status = f"message {msg.id} {'queued' if created else 'already queued'}"
        await self._mark(job, now, status)
        logger.info("cron job %s of %s ran: %s", job.id, job.agent, status)
        return RunRecord(job.id, "ran", "C1", status)

    async def _command(self, job: CronJob, now: float) -> None:
        try:
            result: CommandResult = await run_command(
                job.payload, cwd=self.workdir(job.agent), timeout_seconds=job.timeout_seconds
            )
            await self._mark(job, now, result.status)
            await asyncio.to_thread(
                self.store.record_cron_result,
                job.id,
                result.status,
                result.output[-MAX_OUTPUT_CHARS:],
            )
            logger.info("cron command job %s of %s: %s", job.id, job.agent, result.status)
        except (OSError, CellgateError) as exc:
            self._hold(job, self.clock(), RETRY_SECONDS)
            logger.error("cron command job %s of %s failed to run: %s", job.id, job.agent, exc)
        finally:
            self._running.pop(job.id, None)

    async def wait_commands(self) -> None:
        """Wait for the command jobs running now (tests; shutdown cancels them instead)."""
        tasks = list(self._running.values())
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run_forever(self) -> None:
        """Tick now (missed runs run once at start), then whenever a job is due."""
        self._loop = asyncio.get_running_loop()
        try:
            while True:
                self._wake.clear()
                await self.tick()
                nxt = await asyncio.to_thread(self.store.next_cron_due)
                now = self.clock()
                pause = self.poll if nxt is None or nxt <= now else min(self.poll, nxt - now)
                try:
                    async with asyncio.timeout(max(0.05, pause)):
                        await self._wake.wait()
                except TimeoutError:
                    pass
        finally:
            for task in list(self._running.values()):
                task.cancel()
            if self._running:
                await asyncio.gather(*self._running.values(), return_exceptions=True)
