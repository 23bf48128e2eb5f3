"""Admission (R4): whether a stranger's message is taken, and whether a sandbox may start.

Pure decisions over facts the caller gathered: a token bucket's state and the
time, a conversation's queue length, the count of live sandboxes and which of
them are idle. No clock is read here; `now` is a fact like any other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from policies.base import Decision, allow, deny

__all__ = [
    "Bucket",
    "SandboxRoom",
    "queue_room",
    "sandbox_room",
    "take_token",
    "token_wait",
]


@dataclass(frozen=True, slots=True)
class Bucket:
    """A token bucket: `tokens` left at time `at`."""

    tokens: float
    at: float


def take_token(
    bucket: Bucket | None, now: float, *, per_minute: float, burst: float, what: str
) -> tuple[Decision, Bucket]:
    """R4: one message against a rate; `what` names who sends ("you are sending").

    The bucket refills at `per_minute / 60` tokens a second up to `burst`;
    a message takes one token, or is refused with the wait until the next.
    """
    rate = per_minute / 60.0
    if bucket is None:
        tokens = burst
    else:
        tokens = min(burst, bucket.tokens + max(0.0, now - bucket.at) * rate)
    if tokens >= 1.0:
        return allow("R4", f"{what} is within its rate"), Bucket(tokens - 1.0, now)
    after = Bucket(tokens, now)
    wait = math.ceil(token_wait(after, per_minute))
    return (
        deny("R4", f"{what} more than {per_minute:g} messages a minute; wait {wait} s"),
        after,
    )


def token_wait(bucket: Bucket, per_minute: float) -> float:
    """Seconds from `bucket.at` until it holds a token again (what a refusal tells to wait)."""
    rate = per_minute / 60.0
    return max(0.0, (1.0 - bucket.tokens) / rate) if rate > 0 else float("inf")


def queue_room(pending: int, max_queued: int) -> Decision:
    """R4: a conversation holds at most `max_queued` unanswered messages."""
    if pending >= max_queued:
        return deny(
            "R4",
            f"this chat already has {pending} messages waiting (at most {max_queued}); "
            "wait for the answers before sending more",
        )
    return allow("R4", "the chat's queue has room")


@dataclass(frozen=True, slots=True)
class SandboxRoom:
    """May a new sandbox start, and which idle one to evict first for it."""

    decision: Decision
    evict: str | None = None


def sandbox_room(live: int, max_sandboxes: int, idle_oldest_first: Sequence[str]) -> SandboxRoom:
    """R4: at most `max_sandboxes` live; an idle one is evicted for a newcomer, never a busy one."""
    if live < max_sandboxes:
        return SandboxRoom(allow("R4", f"{live} of {max_sandboxes} sandboxes are live"))
    if idle_oldest_first:
        return SandboxRoom(
            allow("R4", f"all {max_sandboxes} sandboxes are live; the longest idle one makes room"),
            evict=idle_oldest_first[0],
        )
    return SandboxRoom(
        deny("R4", f"all {max_sandboxes} sandboxes are busy; the newcomer waits for a free one")
    )
