"""What counts as a secret: an environment entry (K1) or a memory write (M8).

Two kinds of evidence:

- a value whose shape alone gives it away (a PEM private key, `sk_live_…`,
  `ghp_…`, a Telegram bot token, a JWT, credentials inside a URL);
- a secret-named assignment (`DB_PASSWORD=…`, `"api_key": "…"`,
  `my password is hunter2`) whose value looks like a credential rather than a
  word of prose, so "my password manager is great" or "the token economy" pass.

Bare high-entropy strings without a name are not refused: a git commit hash
or a file checksum is a normal thing to remember.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from policies.base import Decision, allow, deny

__all__ = ["env_entry", "secret_in_text", "strip_secrets"]

_SECRET_NAME = re.compile(
    r"(TOKEN|SECRET|PASSW|PASSWD|PWD|API_?KEY|ACCESS_?KEY|PRIVATE|CREDENTIAL|AUTH|COOKIE|SESSION_?KEY"
    r"|_KEY$|^KEY$|DSN|DATABASE_URL|WEBHOOK)",
    re.IGNORECASE,
)
_GATEWAY_NAME = re.compile(r"^(GATEWAY_|CELLGATE_|DOCKER_|TELEGRAM_|DISCORD_|LINE_|SLACK_)")
_GATEWAY_ALLOWED = frozenset({"GATEWAY_ORIGIN_CHAT_ID", "GATEWAY_ORIGIN_CHANNEL"})

# Shapes of credentials that are recognisable by their value alone, with the
# kind named in a refusal (never the value itself).
_SECRET_SHAPES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("a private key", re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----")),
    ("an Anthropic or OpenAI API key", re.compile(r"\bsk-(?:ant-|proj-)?[A-Za-z0-9_-]{16,}")),
    ("a Stripe secret key", re.compile(r"\b[sr]k_(?:live|test)_[A-Za-z0-9]{10,}")),
    ("a GitHub token", re.compile(r"\bgh[pousr]_[A-Za-z0-9]{30,}|\bgithub_pat_[A-Za-z0-9_]{30,}")),
    ("a GitLab token", re.compile(r"\bglpat-[A-Za-z0-9_-]{20,}")),
    (
        "a Slack token",
        re.compile(r"\bxox[abeoprs]-[A-Za-z0-9-]{10,}|\bxapp-[0-9]-[A-Za-z0-9-]{10,}"),
    ),
    (
        "a Slack or Discord webhook URL",
        re.compile(
            r"hooks\.slack\.com/services/T[A-Za-z0-9]+/B[A-Za-z0-9]+/[A-Za-z0-9]+"
            r"|discord(?:app)?\.com/api/webhooks/\d+/[A-Za-z0-9_-]{20,}"
        ),
    ),
    ("an AWS access key id", re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b")),
    ("a Google API key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}")),
    ("a Google OAuth token", re.compile(r"\bya29\.[A-Za-z0-9_-]{20,}")),
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}")),
    ("an npm token", re.compile(r"\bnpm_[A-Za-z0-9]{36}\b")),
    ("a SendGrid API key", re.compile(r"\bSG\.[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,}")),
    ("a Telegram bot token", re.compile(r"\b\d{6,12}:[A-Za-z0-9_-]{30,}\b")),
    (
        "a Discord bot token",
        re.compile(r"\b[MNO][A-Za-z0-9_-]{23,27}\.[A-Za-z0-9_-]{6}\.[A-Za-z0-9_-]{27,40}\b"),
    ),
    ("a JSON web token", re.compile(r"\beyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[\w-]{10,}")),
    ("a cellgate API key", re.compile(r"\bcg_[A-Za-z0-9_-]{20,}")),
    ("a bearer token", re.compile(r"\bBearer\s+(?=\S*\d)[A-Za-z0-9._~+/=-]{20,}")),
    (
        "an Authorization header",
        re.compile(r"(?i)\bauthorization:\s*(?:basic|bearer|token|digest)\s+\S{8,}"),
    ),
    (
        "a password inside a URL",
        re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s/:@]+:[^\s/@]{3,}@[^\s/@]+", re.IGNORECASE),
    ),
)

# `name <sep> value`: `=` and `:` (also in JSON/YAML, quoted) or prose `is`/`was`.
_ASSIGNMENT = re.compile(
    r"(?<![A-Za-z0-9_.-])(?P<name>[A-Za-z][A-Za-z0-9_.-]*)['\"]?"
    r"(?P<sep>\s*[:=]\s*|\s+(?:is|was)\s+(?:now\s+)?)"
    r"(?=['\"]?(?P<value>[^\s'\"`]+))"  # a lookahead: the value may hold the next name
)
_NAME_PARTS = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")
_STRONG_PARTS = frozenset(
    {"password", "passwd", "passphrase", "pwd", "pass", "secret", "token", "apikey", "credential"}
)
_KEY_QUALIFIERS = frozenset({"api", "access", "secret", "private", "signing", "encryption"})
_PLAIN_WORD = re.compile(r"[A-Za-z][a-z]*(?:-[a-z]+)*")
_PLACEHOLDER = re.compile(
    r"<[^>]*>?|\$\{?[A-Za-z_][A-Za-z0-9_]*\}?|\*+|x+|\.+|(?:none|null|nil|true|false|redacted)",
    re.IGNORECASE,
)


def _name_strength(name: str) -> str | None:
    """'strong' for password/token/secret names, 'key' for a bare `*_key`, else None."""
    parts = [p.lower() for p in _NAME_PARTS.findall(name)]
    for i, part in enumerate(parts):
        if part in _STRONG_PARTS or part == "passwords":
            return "strong"
        if part == "key" and i > 0 and parts[i - 1] in _KEY_QUALIFIERS:
            return "strong"
    if parts and parts[-1] in {"key", "keys"}:
        return "key"
    return None


def _classes(value: str) -> int:
    return sum(
        (
            any(c.islower() for c in value),
            any(c.isupper() for c in value),
            any(c.isdigit() for c in value),
            any(not c.isalnum() for c in value),
        )
    )


def _credential_like(value: str, sep: str, strength: str) -> bool:
    value = value.rstrip(".,;:!?)]}")
    if len(value) < 6 or _PLACEHOLDER.fullmatch(value):
        return False
    if strength == "key":
        # `sort_key=created_at` is code, not a secret: ask for key-like randomness.
        return len(value) >= 16 and _classes(value) >= 2 and not _PLAIN_WORD.fullmatch(value)
    if "=" in sep:
        return True
    # `password: remember to rotate it`, `the token is expired`: prose.
    return not _PLAIN_WORD.fullmatch(value)


def secret_in_text(text: str) -> str | None:
    """The kind of secret `text` seems to carry ("a Stripe secret key", ...), or None."""
    for kind, shape in _SECRET_SHAPES:
        if shape.search(text):
            return kind
    for m in _ASSIGNMENT.finditer(text):
        strength = _name_strength(m["name"])
        if strength and _credential_like(m["value"], m["sep"], strength):
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
