"""policies.bridge: the bridge's call rate (R4) and pending-message bound (R3), as tables."""

from __future__ import annotations

import pytest

from policies.bridge import (
    PENDING_MAX_BYTES,
    PENDING_MAX_MESSAGES,
    Bucket,
    PendingFacts,
    RateLimit,
    admit_pending,
    take_call,
)

LIMIT = RateLimit(per_second=2.0, burst=3)


@pytest.mark.parametrize(
    ("bucket", "now", "allowed", "tokens_after"),
    [
        (None, 100.0, True, 2.0),  # a new bucket starts full
        (Bucket(0.0, 100.0), 100.0, False, 0.0),  # empty
        (Bucket(0.0, 100.0), 100.4, False, 0.8),  # not yet one token back
        (Bucket(0.0, 100.0), 100.5, True, 0.0),  # one token back after 1 / per_second
        (Bucket(0.0, 100.0), 200.0, True, 2.0),  # refills up to the burst, never beyond
        (Bucket(1.0, 100.0), 99.0, True, 0.0),  # a clock step back gives nothing
    ],
)
def test_R4_token_bucket(
    bucket: Bucket | None, now: float, allowed: bool, tokens_after: float
) -> None:
    decision, after = take_call(bucket, now, LIMIT)
    assert decision.allowed is allowed and decision.rule == "R4"
    assert after.tokens == pytest.approx(tokens_after) and after.at == now


def test_R4_a_flood_gets_burst_plus_rate_times_time() -> None:
    bucket = None
    allowed = 0
    for i in range(10_000):  # 10,000 calls over 10 s
        decision, bucket = take_call(bucket, i / 1000, RateLimit(per_second=10, burst=40))
        allowed += decision.allowed
    assert 40 + 99 <= allowed <= 40 + 100
    refused, _ = take_call(Bucket(0.5, 5.0), 5.0, RateLimit(per_second=10, burst=40))
    assert not refused
    assert "at most 10 a second" in refused.reason and "retry in 0.1 s" in refused.reason


@pytest.mark.parametrize(
    ("count", "size", "adding", "allowed", "says"),
    [
        (0, 0, 10, True, ""),
        (PENDING_MAX_MESSAGES - 1, 0, 10, True, ""),
        (PENDING_MAX_MESSAGES, 0, 10, False, f"at most {PENDING_MAX_MESSAGES}"),
        (0, PENDING_MAX_BYTES - 10, 10, True, ""),
        (0, PENDING_MAX_BYTES - 10, 11, False, f"at most {PENDING_MAX_BYTES}"),
        (0, 0, PENDING_MAX_BYTES + 1, False, f"at most {PENDING_MAX_BYTES}"),
    ],
)
def test_R3_pending_messages_are_bounded(
    count: int, size: int, adding: int, allowed: bool, says: str
) -> None:
    decision = admit_pending(PendingFacts(count, size, adding))
    assert decision.allowed is allowed and decision.rule == "R3"
    assert says in decision.reason
