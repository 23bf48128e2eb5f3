"""R2: a hostile stranger's `dd` and file flood, from inside real sandboxes, stop at the quota.

A gateway of its own (app `q<run id>`, diskMb 16, diskInodes 2000) over real HTTP
on a real engine; every container carries the run id's app label and is removed
after, then every quota mount under the test's tmp dir is unmounted.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cellgate.models import ConversationKey
from sandbox.backends.docker import DockerBackend
from sandbox.quota import release_all
from tests.e2e.conftest import CONFIG_KEY, LiveGateway, install_test_app, remove_app_containers
from tests.support.served import served_gateway

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(os.geteuid() != 0, reason="loop mounts need root"),
]

DISK_MB = 16
INODES = 2000
MB = 1024 * 1024


@pytest.fixture(scope="module")
def quota_live(
    tmp_path_factory: pytest.TempPathFactory, docker_client: Any, base_image: str
) -> Iterator[LiveGateway]:
    app = f"q{secrets.token_hex(4)}"
    tmp = tmp_path_factory.mktemp(app)
    try:
        config_path = install_test_app(
            tmp,
            docker_client,
            base_image,
            app,
            {"limits": {"pids": 64, "diskMb": DISK_MB, "diskInodes": INODES}},
        )
        with served_gateway(config_path, DockerBackend.from_env) as (url, gw):
            yield LiveGateway(
                url, CONFIG_KEY, config_path.parent, app, f"{app}-bot", docker_client, gw, "runc"
            )
    finally:
        remove_app_containers(docker_client, app)
        release_all(tmp)


def chat_dir(live: LiveGateway, chat: str) -> str:
    return "/workspace/chats/" + ConversationKey(live.agent, "api", chat).dir_name


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_r2_dd_stops_at_the_quota_and_the_host_and_neighbours_are_unaffected(
    quota_live: LiveGateway,
) -> None:
    live = quota_live
    live.run("victim", f"cd {chat_dir(live, 'victim')}; echo ready > note.txt; echo ok")
    before = free_bytes(live.state_dir)
    start = time.monotonic()
    reply = live.run(
        "dd",
        f"cd {chat_dir(live, 'dd')}; dd if=/dev/zero of=big bs=1M count={2 * DISK_MB} 2>&1; "
        "echo rc=$?; stat -c size=%s big; "
        "for d in /workspace/media/*/ $HOME/.claude; do "
        "  dd if=/dev/zero of=$d/more bs=64k count=32 2>/dev/null || echo refused-in-$d; done",
    )
    took = time.monotonic() - start
    after = free_bytes(live.state_dir)
    assert "No space left on device" in reply, reply
    assert "rc=1" in reply
    size = int(re.search(r"size=(\d+)", reply).group(1))  # type: ignore[union-attr]
    assert 8 * MB < size < DISK_MB * MB, reply
    assert reply.count("refused-in-") == 2, reply  # media and home share the one budget
    drop = before - after
    assert drop <= DISK_MB * MB + 48 * MB, drop
    images = list((live.state_dir / "quota" / live.agent).glob("*.img"))
    assert images and all(p.stat().st_blocks * 512 <= DISK_MB * MB for p in images)
    other = live.run(
        "victim",
        f"cd {chat_dir(live, 'victim')}; dd if=/dev/zero of=ok bs=1M count=4 2>&1; echo rc=$?; "
        "cat note.txt",
    )
    assert "rc=0" in other and "ready" in other, other
    print(
        f"\nR2 figures: dd wrote {size} bytes before ENOSPC in {took:.1f}s (turn); "
        f"host free before {before}, after {after}, drop {drop} bytes"
    )


def test_r2_an_inode_flood_stops_at_the_inode_limit_and_the_chat_recovers(
    quota_live: LiveGateway,
) -> None:
    live = quota_live
    home = (
        live.state_dir
        / "agents"
        / live.agent
        / "sandbox-homes"
        / ConversationKey(live.agent, "api", "flood").dir_name
    )
    # The flooding turn itself may end in an error: the gateway cannot record it.
    live.say(
        "flood",
        "cd $HOME/.claude; i=0; while [ $i -lt 20000 ] && : > f$i 2>/dev/null; "
        "do i=$((i+1)); done; echo made=$i",
    )
    made = sum(1 for n in os.listdir(home) if n.startswith("f"))
    assert INODES * 0.8 < made < INODES * 1.6, made
    assert os.statvfs(home).f_ffree == 0
    # The gateway's spare inodes let the next turn run, and it can clean up.
    reply = live.run("flood", "cd $HOME/.claude; rm -f f*; : > after && echo cleaned")
    assert "cleaned" in reply, reply
    assert not any(n.startswith("f") for n in os.listdir(home))
    print(f"\nR2 figures: the inode flood made {made} files (diskInodes {INODES})")


def test_r2_writable_mounts_are_nosuid_nodev_noexec_in_the_sandbox(
    quota_live: LiveGateway,
) -> None:
    live = quota_live
    reply = live.run(
        "opts",
        "grep -E ' (/workspace/chats|/workspace/media|/home/agent/.claude)' /proc/self/mounts; "
        f"cp /bin/true {chat_dir(live, 'opts')}/t && {chat_dir(live, 'opts')}/t; echo exec=$?",
    )
    lines = [x for x in reply.splitlines() if x.startswith("/dev/")]
    assert len(lines) == 3, reply
    for line in lines:
        opts = set(line.split()[3].split(","))
        assert {"rw", "nosuid", "nodev", "noexec"} <= opts, line
    assert "exec=126" in reply, reply


def test_r2_after_an_unmount_the_next_turn_mounts_again_and_finds_its_data(
    quota_live: LiveGateway,
) -> None:
    live = quota_live
    cd = f"cd {chat_dir(live, 'reboot')}; "
    live.run("reboot", cd + "echo kept-across > MEMORY.md; echo ok")
    host_chat = live.state_dir / "agents" / live.agent / "workspace" / chat_dir(live, "reboot")[11:]
    assert (host_chat / "MEMORY.md").read_text().strip() == "kept-across"
    release_all(live.state_dir)  # a reboot, as far as the host's mounts go
    assert not (host_chat / "MEMORY.md").exists()
    reply = live.run("reboot", cd + "cat MEMORY.md; echo x > w && echo wrote")
    assert "kept-across" in reply and "wrote" in reply, reply
    assert (host_chat / "MEMORY.md").read_text().strip() == "kept-across"
