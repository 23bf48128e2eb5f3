"""K1: the environment a sandbox inherits from the app container."""

from __future__ import annotations

import pytest

from policies.secrets import env_entry, strip_secrets


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("GATEWAY_ORIGIN_CHAT_ID", "42", True),
        ("GATEWAY_ORIGIN_CHANNEL", "telegram", True),
        ("GATEWAY_API_URL", "http://gw:8080", False),
        ("TELEGRAM_BOT_TOKEN", "x", False),
        ("DISCORD_TOKEN", "x", False),
        ("OPENAI_API_KEY", "x", False),
        ("DATABASE_URL", "sqlite:///x", False),
        ("APP_CONFIG", "postgres://u:pw1234@db/app", False),  # credentials in a URL
        ("NOTE", "sk_live_abcdefghijklmnop", False),
        ("LANG", "C.UTF-8", True),
        ("HOME", "/home/app", True),
        ("NODE_ENV", "production", True),
        ("PATH", "/usr/local/bin:/usr/bin:/bin", True),
        ("TZ", "Asia/Bangkok", True),
    ],
)
def test_K1_env_entry_table(name: str, value: str, allowed: bool) -> None:
    assert env_entry(name, value).allowed is allowed


def test_K1_strip_secrets_keeps_order_and_safe_entries() -> None:
    env = {"LANG": "C", "GATEWAY_API_URL": "http://x", "TZ": "UTC", "AWS_SECRET_ACCESS_KEY": "y"}
    assert strip_secrets(env) == {"LANG": "C", "TZ": "UTC"}
