"""A decision that also names the HTTP status the admin API answers with (K2-K4, A3)."""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Decision

__all__ = ["AccessDecision", "granted", "refused", "status_for"]


@dataclass(frozen=True, slots=True)
class AccessDecision(Decision):
    """A `Decision` plus the HTTP status to answer with (200 when allowed)."""

    status: int = 200


def granted(rule: str, reason: str = "allowed") -> AccessDecision:
    return AccessDecision(True, rule, reason, 200)


def refused(rule: str, reason: str, status: int) -> AccessDecision:
    if not 400 <= status <= 499:
        raise ValueError(f"a refusal answers with a 4xx status, not {status}")
    return AccessDecision(False, rule, reason, status)


def status_for(decision: Decision) -> int:
    """The HTTP status for any decision: its own for an `AccessDecision`, else 200 or 403."""
    if isinstance(decision, AccessDecision):
        return decision.status
    return 200 if decision.allowed else 403
