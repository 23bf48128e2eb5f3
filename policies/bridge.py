"""How much a sandbox may ask of its bridge: call rate (R4) and pending messages (R3).

A sandbox can call its bridge in a loop, between turns as well as during
them. Two pure decisions keep that from costing the gateway memory or time:

- R4 `take_call`: a token bucket per conversation socket. A call takes one
  token; tokens come back at `RateLimit.per_second` up to `RateLimit.burst`.
  A call with no token is answered `busy` before its request is even parsed.
- R3 `admit_pending`: the messages the bridge holds for a conversation until
  its turn takes them (the `api` channel's outbox, returned with the HTTP
  answer) are bounded in count and in bytes; the next is answered `busy`.

The defaults (`RateLimit()`, `PENDING_MAX_MESSAGES`, `PENDING_MAX_BYTES`) are
constants, not configuration: a turn's honest use (a few replies, a progress
note, a memory append) is far below them.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Decision, allow, deny

__all__ = [
    "PENDING_MAX_BYTES",
    "PENDING_MAX_MESSAGES",
    "Bucket",
    "PendingFacts",
    "RateLimit",
    "admit_pending",
    "take_call",
]

PENDING_MAX_MESSAGES = 20
PENDING_MAX_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class RateLimit:
    """Calls a conversation's bridge answers: `per_second` sustained, `burst` at once."""

    per_second: float = 10.0
    burst: int = 40


@dataclass(frozen=True, slots=True)
class Bucket:
    """The tokens left at time `at` (a monotonic clock the caller reads)."""

    tokens: float
    at: float


def take_call(bucket: Bucket | None, now: float, limit: RateLimit) -> tuple[Decision, Bucket]:
    """R4: whether one more call is answered now, and the bucket after it."""
    if bucket is None:
        tokens = float(limit.burst)
    else:
        elapsed = max(0.0, now - bucket.at)
        tokens = min(float(limit.burst), bucket.tokens + elapsed * limit.per_second)
    if tokens >= 1.0:
        return allow("R4"), Bucket(tokens - 1.0, now)
    wait = (1.0 - tokens) / limit.per_second if limit.per_second > 0 else float("inf")
    reason = (
        f"too many bridge calls: at most {limit.per_second:g} a second "
        f"(bursts of {limit.burst}); retry in {wait:.1f} s"
    )
    return deny("R4", reason), Bucket(tokens, now)


@dataclass(frozen=True, slots=True)
class PendingFacts:
    """What a conversation already has pending, and the size of the message to add."""

    count: int
    size: int
    adding: int
    max_count: int = PENDING_MAX_MESSAGES
    max_bytes: int = PENDING_MAX_BYTES


def admit_pending(f: PendingFacts) -> Decision:
    """R3: whether one more message may wait for this conversation's turn."""
    if f.count >= f.max_count:
        return deny(
            "R3",
            f"{f.count} messages already wait for this turn's answer (at most {f.max_count}); "
            "send fewer, longer messages, or put the rest in the final answer",
        )
    if f.size + f.adding > f.max_bytes:
        return deny(
            "R3",
            f"the messages waiting for this turn's answer would be {f.size + f.adding} bytes "
            f"(at most {f.max_bytes}); put the rest in the final answer",
        )
    return allow("R3")
