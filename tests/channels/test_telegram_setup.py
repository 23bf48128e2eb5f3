"""Telegram configuration and the download writer, without an engine (W1, W6)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cellgate.errors import ConfigError
from orchestrator.bridge.telegram_tools import write_new_media_file
from orchestrator.channel_hub import build_channels, webhook_secret
from orchestrator.config import parse_config
from orchestrator.store import Store


def _config(tmp_path: Path, telegram: dict[str, object]) -> dict[str, object]:
    return {
        "gateway": {"stateDir": str(tmp_path / "state")},
        "agents": [{"id": "bot", "channels": {"telegram": telegram}}],
    }


@pytest.mark.parametrize(
    ("telegram", "why"),
    [
        ({}, "tokenEnv"),
        ({"tokenEnv": "A", "tokenFile": "/x"}, "exactly one"),
        ({"tokenEnv": "A", "mode": "webhook"}, "webhookUrl"),
        ({"tokenEnv": "A", "mode": "sometimes"}, "mode"),
        ({"tokenEnv": "A", "secretToken": "has spaces"}, "secretToken"),
        ({"tokenEnv": "A", "token": "123:abc"}, "token"),  # never a token in the file
    ],
)
def test_W1_a_bad_telegram_entry_skips_the_agent_with_the_field(
    tmp_path: Path, telegram: dict[str, object], why: str
) -> None:
    cfg = parse_config(_config(tmp_path, telegram), "cfg.json")
    assert cfg.agents == ()
    assert "channels.telegram" in cfg.skipped_agents[0] and why in cfg.skipped_agents[0]


def test_W1_token_from_env_or_file_never_in_repr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store.open(tmp_path / "state")
    try:
        cfg = parse_config(_config(tmp_path, {"tokenEnv": "CG_T_TOKEN"}), "cfg.json")
        monkeypatch.delenv("CG_T_TOKEN", raising=False)
        with pytest.raises(ConfigError) as exc:
            build_channels(cfg, store)
        assert "tokenEnv" in str(exc.value) and "CG_T_TOKEN" in str(exc.value)
        monkeypatch.setenv("CG_T_TOKEN", "999:envTokenValue")
        [channel] = build_channels(cfg, store).values()
        assert "envTokenValue" not in repr(channel)
        token_file = tmp_path / "token"
        token_file.write_text("999:fileTokenValue\n")
        cfg = parse_config(_config(tmp_path, {"tokenFile": str(token_file)}), "cfg.json")
        [channel] = build_channels(cfg, store).values()
        assert "fileTokenValue" not in repr(channel)
        missing = parse_config(_config(tmp_path, {"tokenFile": str(tmp_path / "no")}), "c")
        with pytest.raises(ConfigError, match="tokenFile"):
            build_channels(missing, store)
    finally:
        store.close()


def test_W2_the_generated_webhook_secret_is_made_once_and_private(tmp_path: Path) -> None:
    first = webhook_secret(tmp_path, "bot").get_secret_value()
    again = webhook_secret(tmp_path, "bot").get_secret_value()
    assert first == again and len(first) >= 48
    assert os.stat(tmp_path / "telegram" / "bot.secret").st_mode & 0o777 == 0o600
    assert webhook_secret(tmp_path, "other").get_secret_value() != first


def test_W6_a_download_never_writes_through_what_the_sandbox_planted(tmp_path: Path) -> None:
    media = tmp_path / "media"
    media.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("host file")
    (media / "x.txt").symlink_to(outside)
    os.mkfifo(media / "x-1.txt")
    name = write_new_media_file(media, "x.txt", b"downloaded")
    assert name == "x-2.txt"
    assert (media / "x-2.txt").read_bytes() == b"downloaded"
    assert outside.read_text() == "host file"
    link = tmp_path / "linked-media"
    link.symlink_to(media)
    with pytest.raises(OSError):
        write_new_media_file(link, "y.txt", b"no")
