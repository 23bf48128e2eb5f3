"""C1, C2, L5, L6, A3."""

from __future__ import annotations

import pytest

from policies.cron import JobType, create_cron, run_cron
from policies.lifecycle import (
    apply_dreaming_proposal,
    dreaming_allowed,
    restart_needed,
    skill_learning_allowed,
)
from policies.persona import persona_write


@pytest.mark.parametrize(
    ("isolated", "app", "job", "allowed", "rule"),
    [
        (True, True, "prompt", False, "C1"),
        (True, False, "prompt", False, "C1"),
        (True, True, "command", False, "C1"),
        (True, False, "command", False, "C1"),
        (False, True, "command", False, "C2"),
        (False, True, "prompt", True, "C1"),
        (False, False, "command", True, "C1"),  # host agents may run host commands
        (False, False, "prompt", True, "C1"),
        (False, False, "shell", False, "C2"),
    ],
)
def test_C1_C2_create_cron_table(
    isolated: bool, app: bool, job: JobType, allowed: bool, rule: str
) -> None:
    d = create_cron(isolated, app, job)
    assert (d.allowed, d.rule) == (allowed, rule)


@pytest.mark.parametrize(
    ("isolated", "app", "job", "allowed", "rule"),
    [
        (True, False, "prompt", False, "C1"),
        (True, True, "command", False, "C1"),
        (False, True, "command", False, "C2"),
        (False, True, "prompt", True, "C1"),
        (False, False, "command", True, "C1"),
    ],
)
def test_C1_C2_run_cron_table(
    isolated: bool, app: bool, job: JobType, allowed: bool, rule: str
) -> None:
    d = run_cron(isolated, is_app_agent=app, job_type=job)
    assert (d.allowed, d.rule) == (allowed, rule)


def test_C1_run_refusal_says_job_kept_and_one_shot_not_used_up() -> None:
    d = run_cron(True)
    assert not d.allowed
    assert "stored unchanged" in d.reason and "one-shot job is not used up" in d.reason


@pytest.mark.parametrize(
    ("path", "isolated", "allowed"),
    [
        ("AGENTS.md", False, False),
        ("SOUL.md", False, False),
        ("IDENTITY.md", False, False),
        ("./SOUL.md", False, False),
        ("soul.md", False, False),  # case-insensitive filesystems
        ("//IDENTITY.md", False, False),  # absolute
        ("/workspace/AGENTS.md", True, False),
        ("x/../AGENTS.md", True, False),
        ("", True, False),
        ("AGENTS.md\0", True, False),
        ("CLAUDE.md", True, False),
        ("HEARTBEAT.md", True, False),
        ("CLAUDE.md", False, True),
        ("HEARTBEAT.md", False, True),
        ("chats/telegram-42-abc/MEMORY.md", True, True),
        ("chats/telegram-42-abc/AGENTS.md", True, True),  # not the persona file
        ("notes/SOUL.md", False, True),
        ("AGENTS.md.bak", True, True),
    ],
)
def test_L6_persona_write_table(path: str, isolated: bool, allowed: bool) -> None:
    d = persona_write(path, isolated=isolated)
    assert (d.allowed, d.rule) == (allowed, "L6"), d.reason


def test_L6_refusal_tells_agent_to_decline() -> None:
    assert "decline" in persona_write("SOUL.md", isolated=True).reason


@pytest.mark.parametrize(
    ("started", "config", "busy", "restart", "changed"),
    [
        ((False, False), (False, False), 0, False, False),
        ((True, True), (True, True), 3, False, False),
        ((False, False), (True, False), 0, True, True),
        ((False, False), (True, False), 1, False, True),  # waits for the busy session
        ((True, False), (False, False), 0, True, True),
        ((False, False), (False, True), 0, True, True),  # disableArchive counts too
        ((False, True), (False, False), 2, False, True),
        ((True, True), (False, False), 0, True, True),
    ],
)
def test_L5_restart_needed_table(
    started: tuple[bool, bool],
    config: tuple[bool, bool],
    busy: int,
    restart: bool,
    changed: bool,
) -> None:
    d = restart_needed(started[0], started[1], config[0], config[1], busy)
    assert (d.allowed, d.changed, d.rule) == (restart, changed, "L5")
    if changed and not restart:
        assert f"{busy} busy" in d.reason


def test_L5_negative_busy_count_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="negative"):
        restart_needed(False, False, True, False, -1)


@pytest.mark.parametrize(
    ("isolated", "before", "status"),
    [
        (True, True, 409),
        (True, False, 409),
        (False, True, 200),
        (False, False, 200),
    ],
)
def test_A3_apply_dreaming_proposal_table(isolated: bool, before: bool, status: int) -> None:
    d = apply_dreaming_proposal(isolated, before)
    assert (d.status, d.allowed, d.rule) == (status, status == 200, "A3")
    if isolated and before:
        assert "before isolated memory mode" in d.reason


@pytest.mark.parametrize("isolated", [True, False])
def test_A3_no_dreaming_or_skill_learning_when_isolated(isolated: bool) -> None:
    assert dreaming_allowed(isolated).allowed is not isolated
    assert skill_learning_allowed(isolated).allowed is not isolated
