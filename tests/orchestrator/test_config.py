"""The config loader: strict booleans (L1), no --append-system-prompt-file (L2), clear errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from cellgate.errors import ConfigError
from orchestrator.config import load_config, parse_config


def write(tmp_path: Path, doc: object) -> Path:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(doc))
    return p


@pytest.mark.parametrize("field", ["isolateMemory", "disableArchive"])
@pytest.mark.parametrize("value", ["true", "yes", 1, 0, None, [], {}])
def test_L1_non_boolean_mode_skips_agent_with_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, field: str, value: object
) -> None:
    path = write(tmp_path, {"agents": [{"id": "good"}, {"id": "shop-bot", field: value}]})
    with caplog.at_level(logging.ERROR):
        cfg = load_config(path)
    assert [a.id for a in cfg.agents] == ["good"]
    assert len(cfg.skipped_agents) == 1
    reason = cfg.skipped_agents[0]
    assert str(path) in reason and "shop-bot" in reason and field in reason
    assert "true or false" in reason
    assert reason in caplog.text


@pytest.mark.parametrize("value", [True, False])
def test_L1_boolean_mode_is_kept(tmp_path: Path, value: bool) -> None:
    cfg = load_config(
        write(tmp_path, {"agents": [{"id": "a", "isolateMemory": value, "disableArchive": value}]})
    )
    assert cfg.agents[0].isolate_memory is value
    assert cfg.agents[0].disable_archive is value


@pytest.mark.parametrize(
    "flags",
    [["--append-system-prompt-file", "x.md"], ["--verbose", "--append-system-prompt-file=x.md"]],
)
def test_L2_append_system_prompt_file_is_refused(tmp_path: Path, flags: list[str]) -> None:
    cfg = load_config(write(tmp_path, {"agents": [{"id": "a", "claude": {"extraFlags": flags}}]}))
    assert cfg.agents == ()
    assert "--append-system-prompt" in cfg.skipped_agents[0]
    assert "AGENTS.md" in cfg.skipped_agents[0]


def test_L2_append_system_prompt_inline_is_fine(tmp_path: Path) -> None:
    doc = {"agents": [{"id": "a", "claude": {"extraFlags": ["--append-system-prompt", "hi"]}}]}
    assert load_config(write(tmp_path, doc)).agents[0].id == "a"


def test_malformed_json_names_file_and_position(tmp_path: Path) -> None:
    p = tmp_path / "config.json"
    p.write_text('{"gateway": {"listen": }')
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert str(p) in str(info.value) and "line 1" in str(info.value)


def test_bad_gateway_field_stops_start_with_field_path(tmp_path: Path) -> None:
    p = write(tmp_path, {"gateway": {"listen": {"port": "many"}}})
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert info.value.field == "gateway.listen.port"
    assert str(p) in str(info.value)


def test_unknown_gateway_key_is_an_error_not_ignored(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, {"gateway": {"sandboxIdleMinutez": 5}}))
    assert "sandboxIdleMinutez" in str(info.value)


def test_every_gateway_error_is_named_at_once(tmp_path: Path) -> None:
    """An operator fixes a config in one pass, not one field per start."""
    doc = {"gateway": {"listen": {"port": "eighty"}, "pol": {"size": 2}, "maxConcurrentTurns": 0}}
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, doc))
    text = str(info.value)
    assert info.value.field == "gateway.listen.port"
    assert "gateway.pol: unknown field (check its spelling)" in text
    assert "gateway.maxConcurrentTurns" in text and "gateway.listen.port" in text


def test_a_flood_of_errors_is_reported_bounded(tmp_path: Path) -> None:
    doc = {"gateway": {f"typo{i}": 1 for i in range(500)}}
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, doc))
    assert str(info.value).count("unknown field") == 10
    assert str(info.value).endswith("; and 490 more")


def test_duplicate_agent_ids_keep_the_first(tmp_path: Path) -> None:
    cfg = parse_config({"agents": [{"id": "a"}, {"id": "a", "isolateMemory": True}]}, "c.json")
    assert len(cfg.agents) == 1 and cfg.agents[0].isolate_memory is False
    assert "duplicate" in cfg.skipped_agents[0]


def test_relative_state_dir_is_relative_to_the_config_file(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, {"gateway": {"stateDir": "state"}}))
    assert cfg.gateway.state_dir == (tmp_path / "state").resolve()


def test_defaults_are_the_documented_ones(tmp_path: Path) -> None:
    gw = load_config(write(tmp_path, {})).gateway
    assert gw.sandbox_idle_minutes == 30
    assert gw.memory.memory_budget_chars == 8000 and gw.memory.user_budget_chars == 3000
    assert gw.memory.over_budget == "warn"
    assert gw.listen.host == "127.0.0.1"


def test_a_number_where_a_string_belongs_says_to_quote_it(tmp_path: Path) -> None:
    import yaml

    from orchestrator.apps import load_manifest

    (tmp_path / "agent").mkdir()
    svc = {"path": "./agent", "name": "vt-bot", "image": "x:1"}
    doc = {"name": "vt", "version": 1.10, "services": {"agent": svc}}
    (tmp_path / "app.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(
        ConfigError,
        match=r"version: must be a string, not the number 1\.1: put the value in quotes",
    ):
        load_manifest(tmp_path)
