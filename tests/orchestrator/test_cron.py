"""Cron jobs (C1, C2): schedules, the job service and the scheduler, over a real store.

No sleeps for time: the store, the job service and the scheduler share an
injected fake clock; the scheduler is driven by `tick()`. The scheduler's
`submit` is the store's own `accept_message` (what `Intake.submit` does after
admission), so a run is a stored message a chat would get a turn for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from cellgate.errors import (
    ConversationError,
    NotFound,
    PolicyDenied,
    ScheduleError,
    StateConflict,
    Throttled,
    UnknownAgent,
)
from cellgate.models import ConversationKey
from orchestrator.cron import (
    AgentFacts,
    CronJobs,
    CronScheduler,
    JobRequest,
    due_after,
    first_due,
    parse_schedule,
)
from orchestrator.cron.command import run_command
from orchestrator.store import CronType, Message, ScheduleKind, Store


class Clock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


T0 = ts("2026-12-03T12:00:00+00:00")


# -- schedules ------------------------------------------------------------------------


def test_cron_expression_in_a_time_zone() -> None:
    s = parse_schedule(cron="0 9 * * *", timezone="Asia/Bangkok", now=T0)
    first = first_due(s, T0)  # 12:00 UTC is 19:00 in Bangkok: next 09:00 is tomorrow
    assert datetime.fromtimestamp(first, ZoneInfo("Asia/Bangkok")).isoformat() == (
        "2026-12-04T09:00:00+07:00"
    )
    assert due_after(s, first) == first + 86400


def test_cron_across_a_dst_change_keeps_the_wall_clock_time() -> None:
    s = parse_schedule(cron="30 8 * * *", timezone="Europe/Berlin", now=T0)
    before = ts("2027-03-26T12:00:00+00:00")  # in the night to 28 March: CET -> CEST
    a = first_due(s, before)
    b = due_after(s, a)
    assert b is not None
    berlin = ZoneInfo("Europe/Berlin")
    assert datetime.fromtimestamp(a, berlin).strftime("%H:%M %z") == "08:30 +0100"
    assert datetime.fromtimestamp(b, berlin).strftime("%H:%M %z") == "08:30 +0200"
    assert b - a == 23 * 3600


def test_interval_and_once_at() -> None:
    every = parse_schedule(every="3600", now=T0)
    assert (first_due(every, T0), due_after(every, T0 + 10)) == (T0 + 3600, T0 + 3610)
    at = parse_schedule(at="2026-12-24T18:00", timezone="Europe/Berlin", now=T0)
    assert at.one_shot and at.kind is ScheduleKind.AT
    assert first_due(at, T0) == ts("2026-12-24T17:00:00+00:00")
    assert due_after(at, T0) is None  # a one-shot job is not due again
    rel = parse_schedule(at="+15m", now=T0)
    assert first_due(rel, T0) == T0 + 900


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"cron": "0 9 * * *", "every": "60"},
        {"cron": "not a cron"},
        {"cron": "* * * * * *"},  # seconds: refused, a job runs at most once a minute
        {"cron": "0 9 * * *", "timezone": "Mars/Olympus"},
        {"every": "5"},
        {"every": "sixty"},
        {"at": "tomorrow-ish"},
        {"at": "2030-01-01T00:00:00+00:00"},  # more than a year ahead
        {"at": "0001-01-01T00:00:00+14:00"},
        {"cron": "0 0 31 2 *"},  # never runs
        {"cron": "0 9 * * *", "timezone": "../../etc/passwd"},
    ],
)
def test_unusable_schedules_say_why(kwargs: dict[str, str]) -> None:
    with pytest.raises(ScheduleError) as err:
        parse_schedule(now=T0, **kwargs)
    assert err.value.reason


# -- the job service: C1, C2 ------------------------------------------------------------

FACTS = {
    "iso": AgentFacts(isolated=True, is_app=True),
    "open": AgentFacts(isolated=False, is_app=True),
    "host": AgentFacts(isolated=False, is_app=False),
    "hostiso": AgentFacts(isolated=True, is_app=False),
}


@pytest.fixture
def clock() -> Clock:
    return Clock(T0)


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[Store]:
    with Store.open(tmp_path, clock=clock) as s:
        yield s


@pytest.fixture
def jobs(store: Store, clock: Clock) -> CronJobs:
    return CronJobs(store, FACTS.get, clock=clock)


def prompt(**kw: str) -> JobRequest:
    fields: dict[str, str] = {"cron": "0 9 * * *", "channel": "telegram", "chat_id": "42"}
    fields.update(kw)
    return JobRequest("prompt", "good morning", **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("agent", ["iso", "hostiso"])
def test_C1_creating_a_job_for_an_isolated_agent_is_refused_and_audited(
    jobs: CronJobs, store: Store, agent: str
) -> None:
    with pytest.raises(PolicyDenied) as err:
        jobs.create(agent, prompt(), via="api")
    assert err.value.rule == "C1"
    assert "isolated" in err.value.reason and "whole agent" in err.value.reason
    assert store.cron_jobs() == []
    audit = store.refusals()
    assert [(r.rule, r.action, r.detail["agent"]) for r in audit] == [("C1", "cron_create", agent)]


@pytest.mark.parametrize("agent", ["open", "iso"])
def test_C2_command_jobs_are_refused_for_every_app_agent(jobs: CronJobs, agent: str) -> None:
    with pytest.raises(PolicyDenied) as err:
        jobs.create(agent, JobRequest("command", "date", every="3600"))
    assert err.value.rule == ("C1" if agent == "iso" else "C2")
    if agent == "open":
        assert "host" in err.value.reason and "type: prompt" in err.value.reason


def test_host_agent_may_have_command_jobs_and_prompt_jobs(jobs: CronJobs, store: Store) -> None:
    cmd = jobs.create("host", JobRequest("command", "date", every="3600", timeout_seconds=5))
    assert (cmd.type, cmd.next_run_at, cmd.timeout_seconds) == (CronType.COMMAND, T0 + 3600, 5)
    job = jobs.create("open", prompt(name="morning"))
    assert (job.channel, job.chat_id, job.name, job.one_shot) == (
        "telegram",
        "42",
        "morning",
        False,
    )
    assert [j.id for j in jobs.list("open")] == [job.id]


def test_job_fields_are_checked(jobs: CronJobs) -> None:
    with pytest.raises(UnknownAgent):
        jobs.create("nobody", prompt())
    with pytest.raises(ScheduleError, match="channel and chat id"):
        jobs.create("open", JobRequest("prompt", "hi", every="60"))
    with pytest.raises(ConversationError):
        jobs.create("open", prompt(channel="Bad Channel"))
    with pytest.raises(ScheduleError, match="unknown"):
        jobs.create("open", JobRequest("shell", "hi", every="60"))
    with pytest.raises(ScheduleError, match="characters"):
        jobs.create("open", JobRequest("prompt", " ", every="60", channel="api", chat_id="c"))


def test_pause_resume_delete_only_the_agents_own_jobs(jobs: CronJobs, clock: Clock) -> None:
    job = jobs.create("open", prompt(every="3600", cron=""))
    with pytest.raises(NotFound):
        jobs.pause(job.id, agent="host")  # another agent's job is not found
    assert not jobs.pause(job.id, agent="open").enabled
    clock.advance(10 * 3600)
    resumed = jobs.resume(job.id)
    assert resumed.enabled and resumed.next_run_at == clock.now + 3600  # no burst of missed runs
    assert jobs.delete(job.id, agent="open") is True
    with pytest.raises(NotFound):
        jobs.get(job.id)


def test_per_agent_job_cap(jobs: CronJobs, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("orchestrator.cron.jobs.MAX_JOBS_PER_AGENT", 2)
    jobs.create("open", prompt())
    jobs.create("open", prompt())
    with pytest.raises(ScheduleError, match="already has 2"):
        jobs.create("open", prompt())


# -- the scheduler ----------------------------------------------------------------------


class World:
    """A scheduler whose submit stores the message as intake would, and counts runs."""

    def __init__(self, store: Store, clock: Clock, tmp: Path) -> None:
        self.store = store
        self.clock = clock
        self.facts = dict(FACTS)
        self.throttle = False
        self.jobs = CronJobs(store, self.facts.get, clock=clock)
        self.scheduler = self.new_scheduler()
        self.tmp = tmp

    def new_scheduler(self) -> CronScheduler:
        return CronScheduler(
            self.store,
            self.facts.get,
            self.submit,
            clock=self.clock,
            workdir=lambda agent: self.tmp / agent,
        )

    async def submit(
        self,
        agent_id: str,
        channel: str,
        chat_id: str,
        text: str,
        *,
        message_id: str | None = None,
        sender: str = "",
    ) -> tuple[Message, bool]:
        if self.throttle:
            raise Throttled("R4", "too many messages", 30)
        conv = self.store.upsert_conversation(ConversationKey(agent_id, channel, chat_id))
        assert message_id is not None
        return self.store.accept_message(conv.id, message_id, sender=sender, text=text)

    def messages(self, agent: str, chat: str = "42") -> list[Message]:
        conv = self.store.upsert_conversation(ConversationKey(agent, "telegram", chat))
        return self.store.pending_for_conversation(conv.id)


@pytest.fixture
def world(store: Store, clock: Clock, tmp_path: Path) -> World:
    return World(store, clock, tmp_path)


async def test_a_prompt_job_runs_its_turn_in_its_conversation_on_schedule(world: World) -> None:
    job = world.jobs.create("open", prompt(every="3600", cron=""))
    assert await world.scheduler.tick() == []  # not due yet
    world.clock.advance(3600)
    [run] = await world.scheduler.tick()
    assert (run.job, run.outcome) == (job.id, "ran")
    [msg] = world.messages("open")
    assert (msg.text, msg.sender) == ("good morning", f"cron:{job.id}")
    after = world.store.get_cron_job(job.id)
    assert after is not None
    assert (after.runs, after.last_run_at, after.next_run_at) == (1, T0 + 3600, T0 + 7200)
    assert await world.scheduler.tick() == []  # ran once for this due time


async def test_a_missed_run_runs_once_at_start(world: World) -> None:
    job = world.jobs.create("open", prompt(every="3600", cron=""))
    world.clock.advance(10 * 3600 + 5)  # the gateway was down for ten due times
    fresh = world.new_scheduler()  # a gateway start
    [run] = await fresh.tick()
    assert run.outcome == "ran"
    assert len(world.messages("open")) == 1
    after = world.store.get_cron_job(job.id)
    assert after is not None and after.next_run_at == world.clock.now + 3600
    assert await fresh.tick() == []


async def test_one_shot_is_used_up_only_when_it_ran(world: World) -> None:
    job = world.jobs.create("open", prompt(at="+10m", cron=""))
    world.clock.advance(600)
    world.throttle = True  # admission refused it: it did not run
    [run] = await world.scheduler.tick()
    assert run.outcome == "deferred"
    kept = world.store.get_cron_job(job.id)
    assert kept is not None and kept.enabled and kept.runs == 0
    world.throttle = False
    world.clock.advance(31)
    [run] = await world.scheduler.tick()
    assert run.outcome == "ran"
    used = world.store.get_cron_job(job.id)
    assert used is not None
    assert (used.enabled, used.runs, used.next_run_at) == (False, 1, None)
    with pytest.raises(StateConflict):
        world.jobs.resume(job.id)  # a used-up one-shot stays used up


async def test_C1_an_isolated_agents_jobs_stay_stored_unchanged_and_run_when_the_mode_is_off(
    world: World,
) -> None:
    # created while the agent was not isolated
    one = world.jobs.create("open", prompt(at="+5m", cron=""))
    rec = world.jobs.create("open", prompt(every="600", cron="", chat_id="43"))
    world.facts["open"] = AgentFacts(isolated=True, is_app=True)  # the mode is turned on
    world.clock.advance(3600)
    before = world.store.cron_jobs("open")
    for scheduler in (world.scheduler, world.new_scheduler()):  # and across a restart
        runs = await scheduler.tick()
        assert {(r.job, r.outcome, r.rule) for r in runs} == {
            (one.id, "skipped", "C1"),
            (rec.id, "skipped", "C1"),
        }
    assert world.store.cron_jobs("open") == before  # every column as it was
    assert world.messages("open") == [] and world.messages("open", "43") == []
    world.facts["open"] = AgentFacts(isolated=False, is_app=True)  # the mode is turned off
    runs = await world.new_scheduler().tick()
    assert {(r.job, r.outcome) for r in runs} == {(one.id, "ran"), (rec.id, "ran")}
    assert len(world.messages("open")) == 1 and len(world.messages("open", "43")) == 1
    used = world.store.get_cron_job(one.id)
    assert used is not None and not used.enabled


async def test_C2_a_stored_command_job_of_an_app_agent_does_not_run(world: World) -> None:
    job = world.jobs.create("host", JobRequest("command", "touch ran", every="60"))
    world.facts["host"] = AgentFacts(isolated=False, is_app=True)  # now an app's agent
    world.clock.advance(60)
    [run] = await world.scheduler.tick()
    assert (run.outcome, run.rule) == ("skipped", "C2")
    await world.scheduler.wait_commands()
    assert not (world.tmp / "host" / "ran").exists()
    assert world.store.get_cron_job(job.id) == job


async def test_a_command_job_runs_on_the_host_with_a_timeout_and_an_output_cap(
    world: World,
) -> None:
    job = world.jobs.create(
        "host", JobRequest("command", "yes cron | head -c 200000; echo done", every="60")
    )
    world.clock.advance(60)
    [run] = await world.scheduler.tick()
    assert run.outcome == "started"
    assert await world.scheduler.tick() == []  # running: not started twice
    await world.scheduler.wait_commands()
    done = world.store.get_cron_job(job.id)
    assert done is not None and done.runs == 1 and done.last_status == "exit 0"
    assert done.last_output is not None and len(done.last_output) <= 16_000
    assert "[output truncated" in done.last_output


async def test_a_command_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    marker = tmp_path / "late"
    started = asyncio.get_running_loop().time()
    result = await run_command(
        f"(sleep 3; touch {marker}) & sleep 30", cwd=tmp_path, timeout_seconds=0.5
    )
    assert result.timed_out and result.status == "timed out"
    assert asyncio.get_running_loop().time() - started < 5
    await asyncio.sleep(3.5)  # the backgrounded child was killed with its group
    assert not marker.exists()


async def test_a_command_does_not_see_the_gateways_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", "canary-token")
    result = await run_command("env", cwd=tmp_path, timeout_seconds=5)
    assert result.exit_code == 0 and "canary-token" not in result.output


async def test_a_job_of_an_unknown_agent_is_left_alone(world: World, store: Store) -> None:
    job = store.create_cron_job(
        "gone", CronType.PROMPT, "60", "hi", schedule_kind=ScheduleKind.EVERY,
        channel="api", chat_id="c", next_run_at=T0,
    )  # fmt: skip
    [run] = await world.scheduler.tick()
    assert run.outcome == "deferred"
    assert store.get_cron_job(job.id) == job


def test_utc_sanity() -> None:
    assert datetime.fromtimestamp(T0, UTC).hour == 12
