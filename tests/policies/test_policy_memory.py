"""M6, M7, M8, A2: where a memory write goes, what it may carry, and budget banners."""

from __future__ import annotations

import pytest

from policies.memory import (
    archive_index,
    budget_banner,
    memory_content,
    memory_file_for,
    memory_target,
)


@pytest.mark.parametrize(
    ("target", "file"),
    [
        (None, "MEMORY.md"),
        ("", "MEMORY.md"),
        ("MEMORY.md", "MEMORY.md"),
        ("USER.md", "USER.md"),
        ("memory/topic.md", None),
        ("memory/family-7.md", None),
        ("Memory/topic.md", None),
        ("memory.md", None),  # names are exact
        ("user.md", None),
        ("./MEMORY.md", None),
        (" MEMORY.md", None),
        ("MEMORY.md ", None),
        ("/workspace/chats/telegram-42-abc/MEMORY.md", None),
        ("../MEMORY.md", None),
        ("../../chats/other/MEMORY.md", None),
        ("chats/telegram-43-x/MEMORY.md", None),
        ("AGENTS.md", None),
        ("SOUL.md", None),
        ("MEMORY.md\0", None),
        ("~/MEMORY.md", None),
        ("..\\MEMORY.md", None),
    ],
)
def test_M6_memory_target_table(target: str | None, file: str | None) -> None:
    d = memory_target(target)
    assert d.rule == "M6"
    assert d.allowed is (file is not None), d.reason
    assert memory_file_for(target) == file
    if file is None:
        assert "'MEMORY.md'" in d.reason or "use 'USER.md'" in d.reason


def test_M6_topic_notes_refused_because_never_injected_or_searchable() -> None:
    d = memory_target("memory/recipes.md")
    assert "never be injected or searchable" in d.reason


def test_M6_wrong_case_suggests_exact_name() -> None:
    assert "'USER.md'" in memory_target("user.md").reason


SECRETS = [
    "-----BEGIN RSA PRIVATE KEY-----\nMIIEow...",
    "-----BEGIN OPENSSH PRIVATE KEY-----",
    "-----BEGIN PGP PRIVATE KEY BLOCK-----",
    "key sk-ant-api03-abcdefghijklmnopqrstuvwx",
    "openai sk-proj-abcdefghijklmnop1234",
    "stripe sk_live_51HabcdefGHIJKLmnop",
    "restricted rk_test_abcdefghij12345",
    "ghp_abcdefghijklmnopqrstuvwxyz0123456789",
    "glpat-abcdefghij0123456789",
    "xoxb-1234567890-abcdefghij",
    "https://hooks.slack.com/services/T0000/B0000/XXXXXXXXXXXX",
    "AKIAIOSFODNN7EXAMPLE",
    "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "AIzaSyA1234567890abcdefghijklmnopqrstuv",
    "hf_abcdefghijklmnopqrstuvwxyzABCDEFGH",
    "123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw0",
    "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "connect with postgres://admin:s3cretpw@db.example.com/app",
    "Authorization: Basic dXNlcjpwYXNzd29yZA==",
    "use header Bearer abcdef0123456789abcdef0123",
    "password=hunter22",
    "DB_PASSWORD=correcthorse",
    'config: {"api_key": "a1b2c3d4e5f6g7h8"}',
    "apiKey: 9f8e7d6c5b4a",
    "my password is hunter2",
    "the wifi password: Tr0ub4dor&3",
    "STRIPE_KEY=Zx81kLmQ9pRt7vWy2",
    "token: 8a7b6c5d4e3f2a1b",
    "db: password=hunter22",  # an earlier `name: value` must not hide the secret
    "secret_key = 'django-insecure-abc123'",
    "He said the password is Bangkok2024!",
]

PROSE = [
    "my password manager is great",
    "the token economy of the game",
    "see https://docs.python.org/3/library/re.html for details",
    "https://example.com:8080/path?page=2",
    "Password: remember to rotate it monthly",
    "the password is required on every login",
    "the session token is expired, so the user logs in again",
    "the API key is in the vault",
    "User prefers replies in Thai; lives in Chiang Mai.",
    "commit da39a3ee5e6b4b0d3255bfef95601890afd80709 fixed the bug",
    "meeting at 10:30, keep it short",
    "sort_key=created_at in the export",
    "the user asks: is the basic internationalization done?",
    "he plays sk-8 boarding",
    "password=<your-password> goes in the config template",
    "API_KEY=${API_KEY}",
    "The user's name is Somchai and his password is long.",
    "Token: the user prefers short answers",
    "primary key: user_id",
    "secret: don't tell anyone about the party",
    "pass: 2 tickets for Friday",
    "Authorization: the manager approved it",
    "Authorization: the approvals are pending",
    "Password reset link: https://example.com/reset",
]


@pytest.mark.parametrize("text", SECRETS)
def test_M8_memory_content_refuses_secrets(text: str) -> None:
    d = memory_content(text)
    assert (d.allowed, d.rule) == (False, "M8")
    assert "nothing secret" in d.reason


@pytest.mark.parametrize("text", PROSE)
def test_M8_memory_content_allows_prose(text: str) -> None:
    d = memory_content(text)
    assert d.allowed, d.reason


def test_M8_reason_never_echoes_the_secret() -> None:
    d = memory_content("password=hunter22")
    assert "hunter22" not in d.reason


@pytest.mark.parametrize(
    ("kind", "chars", "budget", "severity", "expect"),
    [
        ("memory", 8000, 8000, "warn", None),  # at budget is within
        ("memory", 7999, 8000, "warn", None),
        ("memory", 8001, 8000, "warn", "⚠️"),
        ("memory", 9000, 8000, "error", "🛑"),
        ("user", 3001, 3000, "warn", "⚠️"),
        ("user", 3001, 3000, "error", "🛑"),
        ("memory", 10**6, 0, "error", None),  # 0 disables the budget
        ("user", 10**6, 0, "warn", None),
        ("memory", 9000, 8000, "loud", "⚠️"),  # unknown severity falls back to warn
        ("memory", 9000, 8000, "", "⚠️"),
        ("memory", 9000, 8000, "ERROR", "⚠️"),  # severity is matched exactly
    ],
)
def test_M7_budget_banner_table(
    kind: str, chars: int, budget: int, severity: str, expect: str | None
) -> None:
    banner = budget_banner(kind, chars, budget, severity)  # type: ignore[arg-type]
    if expect is None:
        assert banner is None
        return
    assert banner is not None
    assert banner.startswith(expect)
    assert ("MEMORY.md" if kind == "memory" else "USER.md") in banner
    assert f"{budget:,}" in banner and f"{chars:,}" in banner
    other = "🛑" if expect == "⚠️" else "⚠️"
    assert other not in banner


def test_M7_error_banner_is_stronger_than_warn() -> None:
    warn = budget_banner("memory", 9000, 8000, "warn")
    error = budget_banner("memory", 9000, 8000, "error")
    assert warn is not None and error is not None
    assert "OVER BUDGET" in error and "OVER BUDGET" not in warn
    assert "Before adding anything else" in error


def test_M7_unknown_kind_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown memory file kind"):
        budget_banner("soul", 1, 0, "warn")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("isolated", "disabled", "allowed", "rule"),
    [
        (False, False, True, "A1"),
        (False, True, False, "A2"),
        (True, False, False, "T2"),
        (True, True, False, "T2"),
    ],
)
def test_A2_archive_index_table(isolated: bool, disabled: bool, allowed: bool, rule: str) -> None:
    d = archive_index(isolated, disabled)
    assert (d.allowed, d.rule) == (allowed, rule)
