"""A sandbox whose mounts drifted is refused before anything runs in it (S4)."""

from __future__ import annotations

from typing import Any

import docker.errors
import pytest

from cellgate.models import ConversationKey
from sandbox.spec import sandbox_name
from tests.e2e.conftest import LiveGateway

pytestmark = pytest.mark.docker


def _recreate(live: LiveGateway, name: str, change: Any) -> None:
    """Replace the container by hand with the same name, labels and flags, changed by `change`."""
    old = live.docker.containers.get(name)
    attrs = old.attrs
    host = attrs["HostConfig"]
    mounts = [
        {"Type": "bind", "Source": m["Source"], "Target": m["Destination"], "ReadOnly": not m["RW"]}
        for m in attrs["Mounts"]
        if m["Type"] == "bind"
    ]
    mounts = change(mounts)
    old.remove(force=True)
    live.docker.api.create_container(
        image=attrs["Image"],
        command=attrs["Config"]["Cmd"],
        user=attrs["Config"]["User"],
        environment=attrs["Config"]["Env"],
        labels=attrs["Config"]["Labels"],
        name=name,
        working_dir=attrs["Config"]["WorkingDir"],
        host_config=live.docker.api.create_host_config(
            mounts=mounts,
            cap_drop=host["CapDrop"],
            security_opt=host["SecurityOpt"],
            read_only=host["ReadonlyRootfs"],
            tmpfs=host["Tmpfs"],
            network_mode=host["NetworkMode"],
            init=True,
            pids_limit=host["PidsLimit"],
            ipc_mode=host["IpcMode"],
        ),
    )
    live.docker.containers.get(name).start()


@pytest.mark.parametrize(
    ("chat", "change", "names"),
    [
        (
            "tamper-extra-bind",
            lambda live, ms: [
                *ms,
                {
                    "Type": "bind",
                    "Source": str(live.state_dir / "config.json"),
                    "Target": "/workspace/leak.json",
                    "ReadOnly": True,
                },
            ],
            "/workspace/leak.json",
        ),
        (
            "tamper-rw-persona",
            lambda live, ms: [
                {**m, "ReadOnly": False} if m["Target"] == "/workspace/AGENTS.md" else m for m in ms
            ],
            "/workspace/AGENTS.md is read-write",
        ),
        (
            "tamper-parent",
            lambda live, ms: [
                {**m, "Source": str(live.state_dir / "agents" / live.agent / "workspace" / "chats")}
                if m["Target"].startswith("/workspace/chats/")
                else m
                for m in ms
            ],
            "a parent of the planned",
        ),
    ],
)
def test_S4_drifted_sandbox_refuses_the_next_turn(
    live: LiveGateway, chat: str, change: Any, names: str
) -> None:
    assert "[exit 0]" in live.run(chat, "true")
    key = ConversationKey(live.agent, "api", chat)
    name = sandbox_name(live.app, key.digest, gateway=live.gateway.gateway_id)
    _recreate(live, name, lambda ms: change(live, ms))
    r = live.say(chat, "echo ran > $HOME/.claude/ran.txt; echo ran")
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "sandbox_drifted" and err["rule"] == "S4"
    assert str(live.state_dir) not in err["message"]  # R6: the caller gets a ref, not paths
    # the operator finds what differed, under that ref, in the audit table
    [audit] = [r for r in live.gateway.store.refusals() if r.detail.get("ref") == err["ref"]]
    assert names in audit.detail["message"] and name in audit.detail["message"]
    # Nothing ran: the command's trace is absent on the host.
    home = live.state_dir / "agents" / live.agent / "sandbox-homes"
    assert not list(home.glob("*/ran.txt"))
    # R5: the refused container is gone; the next turn recreates it to plan.
    with pytest.raises(docker.errors.NotFound):
        live.docker.containers.get(name)
    assert "ok-again" in live.run(chat, "echo ok-again")
