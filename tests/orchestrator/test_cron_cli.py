"""`cellgate cron add | list | pause | resume | delete` (C1, C2) on a real state database."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config import write_config_document
from orchestrator.store import Store


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    write_config_document(
        path,
        {
            "gateway": {"stateDir": str(tmp_path / "state")},
            "agents": [
                {"id": "shop", "app": "shopapp", "isolateMemory": True},
                {"id": "family", "app": "famapp"},
                {"id": "ops"},
            ],
        },
    )
    return path


def cron(config: Path, *args: str) -> int:
    return main(["cron", args[0], "--config", str(config), *args[1:]])


def test_cron_cli_add_list_pause_resume_delete(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cron(config, "add", "--agent", "family", "--cron", "0 7 * * *", "--tz",
                "Asia/Bangkok", "--prompt", "good morning", "--channel", "telegram",
                "--chat", "-1001") == 0  # fmt: skip
    assert "created cron job cron_" in capsys.readouterr().out
    assert cron(config, "list", "--json") == 0
    [job] = json.loads(capsys.readouterr().out)
    assert (job["agent"], job["chat_id"], job["state"]) == ("family", "-1001", "active")
    assert cron(config, "list") == 0
    assert "0 7 * * * Asia/Bangkok" in capsys.readouterr().out
    assert cron(config, "pause", job["id"]) == 0
    assert "paused" in capsys.readouterr().out
    assert cron(config, "resume", job["id"]) == 0
    assert cron(config, "delete", job["id"]) == 0
    assert cron(config, "delete", job["id"]) == 2  # gone: a clear error, exit 2


def test_C1_C2_cron_cli_refusals_name_the_rule(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cron(config, "add", "--agent", "shop", "--every", "3600", "--prompt", "hi",
                "--channel", "api", "--chat", "c1") == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "refused by C1" in err and "isolated" in err
    assert cron(config, "add", "--agent", "family", "--every", "3600", "--command", "id") == 2
    assert "refused by C2" in capsys.readouterr().err
    assert cron(config, "add", "--agent", "ops", "--every", "3600", "--command", "id") == 0
    with Store.open(config.parent / "state") as store:
        assert [(j.agent, j.type.value) for j in store.cron_jobs()] == [("ops", "command")]
        assert {r.rule for r in store.refusals()} == {"C1", "C2"}
