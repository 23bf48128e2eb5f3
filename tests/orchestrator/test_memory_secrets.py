"""M8 beyond the tool: a secret in USER.md / MEMORY.md never reaches the composed CLAUDE.md.

A sandbox can write its memory files with its own shell, past
`task_memory_append`'s check. When a session is composed, each line that
seems to carry a key, token, password or private key is left out, a banner
says why, and each is told to the audit reporter; the file is not rewritten.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cellgate.errors import UnsafePath
from cellgate.models import ConversationKey
from orchestrator.config import MemorySettings
from orchestrator.conversations import conversation_paths, ensure_conversation
from orchestrator.memory import compose_claude_md
from policies.memory import SecretLine, secret_banner, secret_lines

STRIPE = "sk_live_" + "4eC39HqLyjWDarjtT1zdp7dc"
GITHUB = "ghp_" + "A" * 36
PEM = (
    "-----BEGIN OPENSSH PRIVATE KEY-----\n"
    "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n"
    "QyNTUxOQAAACBvZ2VudGxlbWFua2V5MDEyMzQ1Njc4OWFiY2RlZmdoaWprbG1ub3AAAAA\n"
    "-----END OPENSSH PRIVATE KEY-----\n"
)
MEMORY = (
    "# Facts\n"
    "- Bob likes green tea\n"
    f"- the shop key is {STRIPE}\n"
    "- db_password = hunter2hunter2\n"
    "- Bob's password manager is great\n"
    f"{PEM}"
    "- ships to Osaka\n"
)


def test_M8_secret_lines_drops_keys_tokens_passwords_and_a_whole_private_key() -> None:
    kept, dropped = secret_lines(MEMORY)
    assert kept == (
        "# Facts\n- Bob likes green tea\n- Bob's password manager is great\n- ships to Osaka\n"
    )
    assert [d.line for d in dropped] == [3, 4, 6, 7, 8, 9]
    assert dropped[0] == SecretLine(3, "a Stripe secret key")
    assert {d.kind for d in dropped[2:]} == {"a private key"}


def test_M8_an_unterminated_private_key_is_left_out_to_the_end() -> None:
    kept, dropped = secret_lines("a\n-----BEGIN RSA PRIVATE KEY-----\nMIIEow\nb\n")
    assert kept == "a\n" and [d.line for d in dropped] == [2, 3, 4]


def test_M8_clean_text_is_kept_whole_and_has_no_banner() -> None:
    text = "likes tea\nthe token economy is a topic\ncommit 3f2a9c1d8e7b6a5f4e3d2c1b0a9f8e7d\n"
    assert secret_lines(text) == (text, ())
    assert secret_banner("MEMORY.md", ()) is None


def test_M8_banner_names_lines_and_kinds_never_the_value() -> None:
    _, dropped = secret_lines(MEMORY)
    banner = secret_banner("MEMORY.md", dropped)
    assert banner is not None and "M8" in banner and "line 3, 4, 6" in banner
    assert "a Stripe secret key" in banner and STRIPE not in banner


@pytest.mark.parametrize("isolated", [True, False], ids=["isolated", "shared"])
def test_M8_composed_memory_leaves_secret_lines_out_and_reports_them(
    tmp_path: Path, isolated: bool
) -> None:
    ws = tmp_path / "workspace"
    ws.mkdir()
    (tmp_path / "agent").mkdir()
    key = ConversationKey("shop-bot", "telegram", "42")
    paths = conversation_paths(tmp_path / "agent", ws, key, "s1")
    ensure_conversation(paths, None, None)
    where = paths.chat_dir if isolated else ws
    (where / "MEMORY.md").write_text(MEMORY)
    (where / "USER.md").write_text(f"Bob\ngithub: {GITHUB}\n")
    seen: list[UnsafePath] = []
    text = compose_claude_md(
        ws, paths.chat_dir, MemorySettings(), isolated, False, secret_report=seen.append
    )
    for secret in (STRIPE, GITHUB, "hunter2hunter2", "b3BlbnNzaC1rZXkt", "PRIVATE KEY-----"):
        assert secret not in text
    assert "Bob likes green tea" in text and "ships to Osaka" in text
    assert text.count("(M8)") == 2  # a banner above each file that lost a line
    prefix = f"chats/{key.dir_name}/" if isolated else ""
    assert [e.rel for e in seen] == [f"{prefix}USER.md:2"] + [
        f"{prefix}MEMORY.md:{n}" for n in (3, 4, 6, 7, 8, 9)
    ]
    assert all(e.kind == "secret" and STRIPE not in e.reason for e in seen)
    assert (where / "MEMORY.md").read_text() == MEMORY  # the file is not rewritten
