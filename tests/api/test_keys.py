"""Keys in the store: `cellgate keys create | list | revoke`, and the host agent's MCP key (K2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cellgate.errors import PolicyDenied, StoreError
from orchestrator.cli import main
from orchestrator.config import write_config_document
from orchestrator.keys import create_operator_key, mint_host_agent_key
from orchestrator.store import Store
from orchestrator.store.db import DB_FILE
from policies.api_access import KeySpec, key_spec_ok_for_host_agent

AGENTS = ("shop-bot", "faq-bot")


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    agents = [{"id": a, "harness": {"type": "command", "argv": ["true"]}} for a in AGENTS]
    write_config_document(
        path, {"gateway": {"stateDir": str(tmp_path / "state")}, "agents": agents}
    )
    return path


def test_K2_keys_cli_create_list_revoke(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "keys",
            "create",
            "--config",
            str(config),
            "--name",
            "support",
            "--agent",
            "shop-bot",
            "--agent",
            "faq-bot",
            "--write",
        ]
    )
    assert code == 0
    out = capsys.readouterr()
    secret = out.out.strip()
    assert secret.startswith("cg_") and "shown only now" in out.err
    with Store.open(config.parent / "state") as store:
        key = store.lookup_key(secret)
        assert key is not None
        assert key.agents == ("faq-bot", "shop-bot") and key.write and not key.admin
    db = (config.parent / "state" / DB_FILE).read_bytes()
    assert secret.encode() not in db  # only a hash is stored

    assert main(["keys", "list", "--config", str(config)]) == 0
    listing = capsys.readouterr().out
    assert key.id in listing and "support" in listing and secret not in listing

    assert main(["keys", "revoke", key.id, "--config", str(config)]) == 0
    capsys.readouterr()
    with Store.open(config.parent / "state") as store:
        assert store.lookup_key(secret) is None
    assert main(["keys", "list", "--config", str(config)]) == 0
    assert key.id not in capsys.readouterr().out  # revoked keys only with --all
    assert main(["keys", "list", "--config", str(config), "--all"]) == 0
    assert key.id in capsys.readouterr().out
    assert main(["keys", "revoke", key.id, "--config", str(config)]) == 2  # already revoked


def test_K2_keys_cli_admin_all_agents(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            ["keys", "create", "--config", str(config), "--name", "ops", "--all-agents", "--admin"]
        )
        == 0
    )
    secret = capsys.readouterr().out.strip()
    with Store.open(config.parent / "state") as store:
        key = store.lookup_key(secret)
    assert key is not None and key.admin and key.agents == ("*",) and not key.write


def test_K2_keys_cli_refuses_bad_agents(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "create", "--config", str(config), "--name", "x", "--agent", "*"]) == 2
    assert "--all-agents" in capsys.readouterr().err
    assert main(["keys", "create", "--config", str(config), "--name", "x", "--agent", "../a"]) == 2
    assert "not an agent id" in capsys.readouterr().err
    # a typo would make a key that quietly reaches nothing
    assert (
        main(["keys", "create", "--config", str(config), "--name", "x", "--agent", "shop-bto"]) == 2
    )
    err = capsys.readouterr().err
    assert "no agent 'shop-bto'" in err and "faq-bot, shop-bot" in err
    with pytest.raises(SystemExit):  # --agent and --all-agents are exclusive
        main(
            [
                "keys",
                "create",
                "--config",
                str(config),
                "--name",
                "x",
                "--agent",
                "a",
                "--all-agents",
            ]
        )


@pytest.mark.parametrize(
    ("channels", "write"),
    [
        ([], False),
        (["telegram", "discord"], False),
        (["whatsapp"], True),
        (["line", "wechat"], True),
    ],
)
def test_K2_mint_host_agent_key_is_narrow(tmp_path: Path, channels: list[str], write: bool) -> None:
    with Store.open(tmp_path) as store:
        key, secret = mint_host_agent_key(store, "home-bot", channels)
        assert not key.admin and key.agents == ("home-bot",) and key.write is write
        assert store.lookup_key(secret) == key
        spec = KeySpec(admin=key.admin, agents=frozenset(key.agents), write=key.write)
        assert key_spec_ok_for_host_agent(spec, "home-bot", needs_write=write).allowed


@pytest.mark.parametrize("agent", ["*", "", "../x", "Home"])
def test_K2_mint_host_agent_key_refuses_wildcards_and_bad_ids(tmp_path: Path, agent: str) -> None:
    with Store.open(tmp_path) as store:
        with pytest.raises(PolicyDenied) as exc:
            mint_host_agent_key(store, agent, ["whatsapp"])
        assert exc.value.rule == "K2"
        assert store.list_keys() == []


def test_create_operator_key_needs_a_scope(tmp_path: Path) -> None:
    with Store.open(tmp_path) as store:
        with pytest.raises(StoreError):
            create_operator_key(store, "x", [])
        with pytest.raises(StoreError):
            create_operator_key(store, " ", ["a"])
