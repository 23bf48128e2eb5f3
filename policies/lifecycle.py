"""When an agent restarts for a mode change, and dreaming under isolation (L5, A3).

- L5 a running agent keeps the isolateMemory/disableArchive mode it started
  with; when the configured mode differs, it is restarted once none of its
  sessions is busy (no gateway restart).
- A3 no nightly dreaming or skill learning for an isolated agent; applying a
  dreaming proposal (necessarily made before the mode was on) answers 409.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Decision, allow, deny
from policies.status import AccessDecision, granted, refused

__all__ = [
    "RestartDecision",
    "apply_dreaming_proposal",
    "dreaming_allowed",
    "restart_needed",
    "skill_learning_allowed",
]


@dataclass(frozen=True, slots=True)
class RestartDecision(Decision):
    """`allowed` means restart now; `changed` means the mode differs (restart is due)."""

    changed: bool = False


def restart_needed(
    started_isolated: bool,
    started_archive_disabled: bool,
    config_isolated: bool,
    config_archive_disabled: bool,
    busy_sessions: int,
) -> RestartDecision:
    """L5: restart the agent now? Only when its mode changed and no session is busy."""
    if busy_sessions < 0:
        raise ValueError(f"busy_sessions cannot be negative, got {busy_sessions}")
    changes = []
    if started_isolated != config_isolated:
        changes.append(
            f"isolateMemory {str(started_isolated).lower()} → {str(config_isolated).lower()}"
        )
    if started_archive_disabled != config_archive_disabled:
        changes.append(
            f"disableArchive {str(started_archive_disabled).lower()} → "
            f"{str(config_archive_disabled).lower()}"
        )
    if not changes:
        return RestartDecision(False, "L5", "the agent runs with its configured mode", False)
    what = ", ".join(changes)
    if busy_sessions:
        return RestartDecision(
            False,
            "L5",
            f"{what}: restart waits until the agent's {busy_sessions} busy session(s) finish; "
            "the agent keeps its current mode until then",
            True,
        )
    return RestartDecision(True, "L5", f"{what}: restarting the agent, no session is busy", True)


def apply_dreaming_proposal(
    agent_isolated: bool, proposal_made_before_isolation: bool
) -> AccessDecision:
    """A3: may a dreaming proposal be applied? Refused with 409 for an isolated agent."""
    if agent_isolated:
        when = (
            "it was made before isolated memory mode was turned on and "
            if proposal_made_before_isolation
            else ""
        )
        return refused(
            "A3",
            f"the proposal is not applied: {when}dreaming merges every conversation's memory, "
            "which an isolated agent does not allow; it stays pending until the mode is off",
            409,
        )
    return granted("A3")


def dreaming_allowed(agent_isolated: bool) -> Decision:
    """A3: may nightly dreaming run for this agent?"""
    if agent_isolated:
        return deny(
            "A3",
            "no nightly dreaming for an isolated agent: it would merge every conversation's "
            "transcripts into one memory",
        )
    return allow("A3")


def skill_learning_allowed(agent_isolated: bool) -> Decision:
    """A3: may skill learning run for this agent?"""
    if agent_isolated:
        return deny(
            "A3",
            "no skill learning for an isolated agent: a skill learned in one conversation "
            "would be offered to all of them",
        )
    return allow("A3")
