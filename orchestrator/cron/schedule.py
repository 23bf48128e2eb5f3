"""When a cron job runs: a cron expression in a time zone, an interval, or once at a time.

Pure functions of their inputs and `now` (no clock read here), so a table of
cases with a fixed `now` is a complete test. Cron expressions are read by
croniter (five fields; seconds are refused: a job runs at most once a
minute), time zones by `zoneinfo`.

    s = parse_schedule(cron="0 9 * * 1-5", timezone="Europe/Berlin", now=now)
    s = parse_schedule(every="3600", now=now)         # seconds, at least 60
    s = parse_schedule(at="2026-12-24T18:00", timezone="Europe/Berlin", now=now)
    s = parse_schedule(at="+15m", now=now)            # relative, stored as a UTC time
    first = first_due(s, now)                         # when it is due first
    later = due_after(s, now)                         # after a run at `now`; None: used up
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter

from cellgate.errors import ScheduleError
from orchestrator.store.models import ScheduleKind

__all__ = [
    "MAX_INTERVAL_SECONDS",
    "MIN_INTERVAL_SECONDS",
    "Schedule",
    "due_after",
    "first_due",
    "parse_schedule",
]

MIN_INTERVAL_SECONDS = 60
MAX_INTERVAL_SECONDS = 366 * 24 * 3600
_RELATIVE = re.compile(r"^\+(\d{1,7})([smhd])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_MAX_EXPR = 200


@dataclass(frozen=True, slots=True)
class Schedule:
    """A validated schedule as it is stored: `kind`, `expr` (the text of `schedule`), `timezone`."""

    kind: ScheduleKind
    expr: str
    timezone: str = "UTC"

    @property
    def one_shot(self) -> bool:
        return self.kind is ScheduleKind.AT

    def describe(self) -> str:
        if self.kind is ScheduleKind.CRON:
            return f"cron {self.expr!r} ({self.timezone})"
        if self.kind is ScheduleKind.EVERY:
            return f"every {self.expr} s"
        return f"once at {self.expr}"


def _zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        raise ScheduleError(
            f"unknown time zone {name[:64]!r}: use an IANA name such as 'Europe/Berlin' or 'UTC'"
        ) from exc


def _cron(expr: str, timezone: str, now: float) -> Schedule:
    expr = " ".join(expr.split())
    if len(expr) > _MAX_EXPR or len(expr.split(" ")) != 5:
        raise ScheduleError(
            f"cron expression {expr[:64]!r} must have five fields "
            "(minute hour day-of-month month day-of-week), e.g. '0 9 * * 1-5'"
        )
    try:
        valid = croniter.is_valid(expr)
    except (ValueError, TypeError, KeyError):
        valid = False
    if not valid:
        raise ScheduleError(f"cron expression {expr!r} is not valid, e.g. '*/15 * * * *'")
    schedule = Schedule(ScheduleKind.CRON, expr, timezone)
    try:
        _next_cron(schedule, now)
    except ScheduleError:
        raise
    except (CroniterError, ValueError, OverflowError) as exc:
        raise ScheduleError(f"cron expression {expr!r} never runs (e.g. 31 February)") from exc
    return schedule


def _every(text: str) -> Schedule:
    try:
        seconds = int(text.strip())
    except ValueError as exc:
        raise ScheduleError(f"interval {text[:32]!r} must be a whole number of seconds") from exc
    if not MIN_INTERVAL_SECONDS <= seconds <= MAX_INTERVAL_SECONDS:
        raise ScheduleError(
            f"interval {seconds} s is out of range: use {MIN_INTERVAL_SECONDS} to "
            f"{MAX_INTERVAL_SECONDS} seconds"
        )
    return Schedule(ScheduleKind.EVERY, str(seconds))


def _at(text: str, timezone: str, now: float) -> Schedule:
    text = text.strip()
    rel = _RELATIVE.match(text)
    if rel is not None:
        when = now + int(rel.group(1)) * _UNIT[rel.group(2)]
    else:
        try:
            parsed = datetime.fromisoformat(text[:64])
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=_zone(timezone))
            when = parsed.timestamp()
        except (ValueError, OverflowError, OSError) as exc:
            raise ScheduleError(
                f"time {text[:64]!r} is not ISO 8601 (e.g. '2026-12-24T18:00' in the job's "
                "time zone, '2026-12-24T17:00:00+00:00') or relative ('+15m', '+2h')"
            ) from exc
    if when > now + MAX_INTERVAL_SECONDS:
        raise ScheduleError(f"time {text[:64]!r} is more than a year ahead")
    if when < now - 86400:
        raise ScheduleError(f"time {text[:64]!r} is more than a day in the past")
    iso = datetime.fromtimestamp(when, UTC).isoformat(timespec="seconds")
    return Schedule(ScheduleKind.AT, iso, "UTC")


def parse_schedule(
    *,
    cron: str | None = None,
    every: str | int | None = None,
    at: str | None = None,
    timezone: str | None = None,
    now: float,
) -> Schedule:
    """Exactly one of `cron`, `every` (seconds) or `at`; `timezone` reads `cron` and a bare `at`."""
    given = [k for k, v in (("cron", cron), ("every", every), ("at", at)) if v not in (None, "")]
    if len(given) != 1:
        raise ScheduleError(
            "give exactly one schedule: 'cron' (with an optional 'timezone'), 'every' "
            f"(seconds) or 'at' (a time); got {', '.join(given) or 'none'}"
        )
    tz = timezone or "UTC"
    if cron:
        return _cron(cron, tz, now)
    if every not in (None, ""):
        return _every(str(every))
    assert at is not None
    return _at(at, tz, now)


def stored(kind: ScheduleKind, expr: str, timezone: str) -> Schedule:
    """The schedule of a stored row (validated when it was created)."""
    return Schedule(kind, expr, timezone)


def _next_cron(s: Schedule, after: float) -> float:
    start = datetime.fromtimestamp(after, _zone(s.timezone))
    return float(croniter(s.expr, start).get_next(float))


def first_due(s: Schedule, now: float) -> float:
    """When a job created at `now` is first due."""
    if s.kind is ScheduleKind.CRON:
        return _next_cron(s, now)
    if s.kind is ScheduleKind.EVERY:
        return now + int(s.expr)
    return datetime.fromisoformat(s.expr).timestamp()


def due_after(s: Schedule, now: float) -> float | None:
    """When a job that ran at `now` is due next (always after `now`); None for a one-shot job.

    Runs missed while the gateway was down are not made up one by one: the
    job ran once, and its next time is the first one after `now`.
    """
    if s.kind is ScheduleKind.CRON:
        return _next_cron(s, now)
    if s.kind is ScheduleKind.EVERY:
        return now + int(s.expr)
    return None


def utc_text(when: float | None) -> str:
    """`2026-12-03 14:00:00 UTC`, or `-`."""
    if when is None:
        return "-"
    return (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(seconds=when)).strftime(
        "%Y-%m-%d %H:%M:%S UTC"
    )
