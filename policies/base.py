"""The one shape every policy returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of a policy: allowed or not, the SPEC rule id, and why."""

    allowed: bool
    rule: str
    reason: str

    def __bool__(self) -> bool:
        return self.allowed


def allow(rule: str, reason: str = "allowed") -> Decision:
    return Decision(True, rule, reason)


def deny(rule: str, reason: str) -> Decision:
    return Decision(False, rule, reason)
