"""Cron jobs of isolated agents and app agents (C1, C2).

- C1 an isolated agent gets no new cron job, and its existing jobs (even ones
  made before the mode was on) do not run; they stay stored unchanged, so a
  one-shot job is not used up.
- C2 `type: command` jobs run on the host, so every app agent is refused them.
"""

from __future__ import annotations

from typing import Literal

from policies.base import Decision, allow, deny

__all__ = ["JobType", "create_cron", "run_cron"]

JobType = Literal["prompt", "command"]


def create_cron(agent_isolated: bool, is_app_agent: bool, job_type: JobType) -> Decision:
    """C1/C2: may this agent get a new cron job of `job_type`?"""
    if agent_isolated:
        return deny(
            "C1",
            "cron jobs are off for an isolated agent: scheduled jobs and their prompts belong "
            "to the whole agent, not to one conversation",
        )
    if job_type not in ("prompt", "command"):
        return deny("C2", f"unknown cron job type {job_type!r}: use 'prompt' or 'command'")
    if job_type == "command" and is_app_agent:
        return deny(
            "C2",
            "type: command jobs run on the host and are refused for app agents; "
            "use a type: prompt job",
        )
    return allow("C1")


def run_cron(
    agent_isolated: bool, *, is_app_agent: bool = False, job_type: JobType = "prompt"
) -> Decision:
    """C1/C2: may a stored job run now? A refusal leaves the job exactly as stored."""
    if agent_isolated:
        return deny(
            "C1",
            "not run: the agent is in isolated memory mode; the job stays stored unchanged "
            "(a one-shot job is not used up) and runs again once the mode is off",
        )
    if job_type == "command" and is_app_agent:
        return deny(
            "C2",
            "not run: type: command jobs run on the host and are refused for app agents; "
            "the job stays stored unchanged",
        )
    return allow("C1")
