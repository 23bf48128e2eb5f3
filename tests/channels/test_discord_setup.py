"""Discord configuration: token sources, Discord's own URLs by default, the hub (W1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cellgate.errors import ConfigError
from channels.discord import DISCORD_API_BASE, DISCORD_GATEWAY, DiscordChannel
from orchestrator.channel_hub import build_channels
from orchestrator.config import parse_config
from orchestrator.store import Store


def _config(tmp_path: Path, discord: dict[str, object]) -> dict[str, object]:
    return {
        "gateway": {"stateDir": str(tmp_path / "state")},
        "agents": [{"id": "bot", "channels": {"discord": discord}}],
    }


@pytest.mark.parametrize(
    ("discord", "why"),
    [
        ({}, "tokenEnv"),
        ({"tokenEnv": "A", "tokenFile": "/x"}, "exactly one"),
        ({"tokenEnv": "A", "token": "abc"}, "token"),  # never a token in the file
        ({"tokenEnv": "A", "gatewayUrl": "http://x/"}, "gatewayUrl"),
        ({"tokenEnv": "A", "apiBaseUrl": "discord.com"}, "apiBaseUrl"),
        ({"tokenEnv": "A", "requireMention": "yes"}, "requireMention"),
    ],
)
def test_W1_a_bad_discord_entry_skips_the_agent_with_the_field(
    tmp_path: Path, discord: dict[str, object], why: str
) -> None:
    cfg = parse_config(_config(tmp_path, discord), "cfg.json")
    assert cfg.agents == ()
    assert "channels.discord" in cfg.skipped_agents[0] and why in cfg.skipped_agents[0]


def test_W1_discords_own_urls_by_default_and_the_token_from_a_file(tmp_path: Path) -> None:
    token_file = tmp_path / "dc.token"
    token_file.write_text("file.token.value\n")
    store = Store.open(tmp_path / "state")
    try:
        cfg = parse_config(_config(tmp_path, {"tokenFile": str(token_file)}), "cfg.json")
        [channel] = build_channels(cfg, store).values()
        assert isinstance(channel, DiscordChannel)
        assert channel.options.api_base_url == DISCORD_API_BASE == "https://discord.com/api/v10"
        assert channel.options.gateway_url == DISCORD_GATEWAY == "wss://gateway.discord.gg/"
        assert channel.options.token.get_secret_value() == "file.token.value"
        assert "file.token" not in repr(channel) and "file.token" not in repr(channel.options)
    finally:
        store.close()


def test_W1_a_missing_token_variable_names_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CG_DC_TOKEN", raising=False)
    store = Store.open(tmp_path / "state")
    try:
        cfg = parse_config(_config(tmp_path, {"tokenEnv": "CG_DC_TOKEN"}), "cfg.json")
        with pytest.raises(ConfigError) as err:
            build_channels(cfg, store)
        assert err.value.field == "agents[bot].channels.discord.tokenEnv"
    finally:
        store.close()
