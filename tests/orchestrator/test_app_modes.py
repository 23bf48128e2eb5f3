"""L3: app agents' isolateMemory/disableArchive follow app.yaml at every start (no engine)."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.app_modes import apply_declarations, prepare_config
from orchestrator.apps import InstalledApp, load_manifest, write_record
from orchestrator.config import write_config_document


def _installed(
    state: Path, name: str, agent: dict[str, Any], *, state_word: str = "running"
) -> None:
    """An app record as install writes it, for an app whose image is a reference."""
    src = state.parent / f"src-{name}"
    (src / "agent").mkdir(parents=True)
    svc = {"path": "./agent", "name": f"{name}-bot", "image": "x:1", **agent}
    doc = {"name": name, "version": "1", "services": {"agent": svc}}
    (src / "app.yaml").write_text(yaml.safe_dump(doc))
    manifest = load_manifest(src)
    declared = manifest.services.agent
    root = state / "agents" / declared.name
    app = InstalledApp(name=name, version="1", agent=declared.name, image="x:1",
                       image_id="sha256:0", user=None, environment={}, networks=(),
                       isolate_memory=declared.isolate_memory,
                       disable_archive=declared.disable_archive, workspace=root / "workspace",
                       agent_root=root, state=state_word)  # fmt: skip
    write_record(state / "apps" / name, app, manifest)


def _config(state: Path, agents: list[dict[str, Any]]) -> Path:
    path = state / "config.json"
    write_config_document(path, {"gateway": {"stateDir": str(state)}, "agents": agents})
    return path


def _agent(path: Path, agent: str) -> dict[str, Any]:
    entry: dict[str, Any] = next(
        a for a in json.loads(path.read_text())["agents"] if a["id"] == agent
    )
    return entry


def test_L3_hand_edit_reset_at_start_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    _installed(state, "shop", {"isolate_memory": True, "disable_archive": True})
    path = _config(state, [{"id": "shop-bot", "app": "shop", "isolateMemory": False,
                            "disableArchive": True}])  # fmt: skip
    os.chmod(path, 0o600)
    with caplog.at_level(logging.WARNING, logger="orchestrator.app_modes"):
        cfg = prepare_config(path)
    agent = cfg.agent("shop-bot")
    assert agent is not None and agent.isolate_memory is True
    assert _agent(path, "shop-bot")["isolateMemory"] is True
    assert any(
        "shop-bot" in r.getMessage() and "isolateMemory was False" in r.getMessage()
        and "reset to true" in r.getMessage() for r in caplog.records
    )  # fmt: skip
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # a config rewrite keeps 0600


def test_L3_a_non_boolean_hand_edit_is_reset_not_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    _installed(state, "shop", {"isolate_memory": True})
    path = _config(state, [{"id": "shop-bot", "app": "shop", "isolateMemory": "yes"}])
    with caplog.at_level(logging.ERROR):
        cfg = prepare_config(path)
    agent = cfg.agent("shop-bot")
    assert agent is not None and agent.isolate_memory is True and not cfg.skipped_agents
    # the log does not say it was skipped before the reset made it valid
    assert not [r for r in caplog.records if "skipped" in r.getMessage()]


def test_L3_release_without_the_line_turns_the_mode_off(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _installed(state, "shop", {})  # app.yaml has no isolate_memory / disable_archive
    path = _config(state, [{"id": "shop-bot", "app": "shop", "isolateMemory": True,
                            "disableArchive": True}])  # fmt: skip
    resets = apply_declarations(path, state)
    assert {r.field for r in resets} == {"isolateMemory", "disableArchive"}
    entry = _agent(path, "shop-bot")
    assert entry["isolateMemory"] is False and entry["disableArchive"] is False


def test_L3_a_stopped_apps_agent_keeps_its_entry_until_a_start_finds_it_running(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    _installed(state, "shop", {"isolate_memory": True}, state_word="stopped")
    _installed(state, "cafe", {"isolate_memory": True})
    path = _config(state, [
        {"id": "shop-bot", "app": "shop", "isolateMemory": False},
        {"id": "cafe-bot", "app": "cafe", "isolateMemory": False},
        {"id": "host-bot", "isolateMemory": False},
    ])  # fmt: skip
    before = path.read_text()
    resets = apply_declarations(path, state)
    assert [(r.agent, r.field) for r in resets] == [("cafe-bot", "isolateMemory")]
    assert _agent(path, "shop-bot")["isolateMemory"] is False  # stopped: untouched
    assert _agent(path, "host-bot")["isolateMemory"] is False  # host agent: not an app's
    assert before != path.read_text()
    # The app runs again: the next start resets it.
    record = state / "apps" / "shop" / "app.json"
    doc = json.loads(record.read_text())
    doc["state"] = "running"
    record.write_text(json.dumps(doc))
    assert [r.agent for r in apply_declarations(path, state)] == ["shop-bot"]
    assert _agent(path, "shop-bot")["isolateMemory"] is True


def test_L3_nothing_to_reset_leaves_the_file_alone(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _installed(state, "shop", {"isolate_memory": True})
    path = _config(state, [{"id": "shop-bot", "app": "shop", "isolateMemory": True}])
    mtime = path.stat().st_mtime_ns
    assert apply_declarations(path, state) == []
    assert path.stat().st_mtime_ns == mtime
