"""What counts as a secret: an environment entry (K1) or a memory write (M8)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from policies.base import Decision, allow, deny

_SECRET_NAME = re.compile(
    r"(TOKEN|SECRET|PASSW|PASSWD|PWD|API_?KEY|ACCESS_?KEY|PRIVATE|CREDENTIAL|AUTH|COOKIE|SESSION_?KEY"
    r"|_KEY$|^KEY$|DSN|DATABASE_URL|WEBHOOK)",
    re.IGNORECASE,
)
_GATEWAY_NAME = re.compile(r"^(GATEWAY_|CELLGATE_|DOCKER_|TELEGRAM_|DISCORD_|LINE_|SLACK_)")
_GATEWAY_ALLOWED = frozenset({"GATEWAY_ORIGIN_CHAT_ID", "GATEWAY_ORIGIN_CHANNEL"})

# Shapes of credentials that are recognisable by their value alone.
_SECRET_VALUE = re.compile(
    r"(-----BEGIN [A-Z ]*PRIVATE KEY-----"
    r"|\bsk-[A-Za-z0-9_-]{16,}"
    r"|\bsk-ant-[A-Za-z0-9_-]{16,}"
    r"|\bgh[pousr]_[A-Za-z0-9]{30,}"
    r"|\bgithub_pat_[A-Za-z0-9_]{30,}"
    r"|\bxox[abprs]-[A-Za-z0-9-]{10,}"
    r"|\bAKIA[0-9A-Z]{16}\b"
    r"|\bAIza[0-9A-Za-z_-]{35}"
    r"|\b\d{6,12}:[A-Za-z0-9_-]{30,}\b"  # Telegram bot token
    r"|\beyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}"  # JWT
    r"|\bcg_[A-Za-z0-9_-]{20,}"  # cellgate API keys
    r")"
)
_SECRET_ASSIGNMENT = re.compile(
    r"(?i)\b(password|passwd|pwd|secret|api[_-]?key|access[_-]?token|auth[_-]?token|token)"
    r"\s*[:=]\s*['\"]?[^\s'\"]{8,}"
)


def secret_in_text(text: str) -> str | None:
    """The kind of secret `text` seems to carry, or None."""
    m = _SECRET_VALUE.search(text)
    if m:
        return "a credential-shaped value"
    if _SECRET_ASSIGNMENT.search(text):
        return "a password or token assignment"
    return None


def env_entry(name: str, value: str) -> Decision:
    """K1: may this environment entry of the app container enter a sandbox?"""
    if name in _GATEWAY_ALLOWED:
        return allow("K1")
    if _GATEWAY_NAME.match(name):
        return deny("K1", f"{name} belongs to the gateway or a channel")
    if _SECRET_NAME.search(name):
        return deny("K1", f"{name} is named like a secret")
    if secret_in_text(value):
        return deny("K1", f"{name} holds a value shaped like a credential")
    return allow("K1")


def strip_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """The environment with every secret-looking entry removed (K1)."""
    return {k: v for k, v in env.items() if env_entry(k, v).allowed}
