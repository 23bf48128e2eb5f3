"""A hostile shell in chat A's sandbox, driven through the HTTP endpoint and the shell harness.

Every claim is checked from inside a sandbox, not by reading our own config back.
Every "cannot see" is preceded, in the same sandbox and the same turn, by a
positive control (`control`): the shell lists, stats and reads its own chat
directory, media and home. A sandbox whose `ls` or `stat` is broken (an old
gVisor: statx fails) then fails the test instead of passing it by accident.
"""

from __future__ import annotations

import concurrent.futures
import re

import pytest

from cellgate.models import ConversationKey
from tests.e2e.conftest import (
    APP_PUBLIC_ENV,
    APP_SECRETS,
    CANARIES,
    CANARY_NEEDLE,
    CONFIG_KEY,
    LiveGateway,
)

pytestmark = pytest.mark.docker

A, B = "alice", "bob"
MARK = "alice-private-marker-7f3a"


def dir_of(live: LiveGateway, chat: str) -> str:
    return ConversationKey(live.agent, "api", chat).dir_name


CONTROL_OK = "control-ok-5d1e"
CONTROL_FAILED = "control-FAILED"


def control(live: LiveGateway, chat: str) -> str:
    """Shell that lists, stats and reads what `chat` owns; prints CONTROL_OK only if all worked."""
    own = f"/workspace/chats/{dir_of(live, chat)}"
    return (
        f"ls -la {own} /workspace/media/ $HOME && "
        f"stat -c 'stat-ok %F %n' {own} {own}/MEMORY.md $HOME && "
        f"for d in /workspace/media/*/; do stat -c 'stat-ok %F %n' $d; done && "
        f"find {own} -maxdepth 1 -name USER.md && "
        f"cat {own}/MEMORY.md {own}/USER.md >/dev/null && "
        # split with "" so that a listing of this command line (/proc) does not count
        f'echo {CONTROL_OK[:8]}""{CONTROL_OK[8:]} || '
        f'echo {CONTROL_FAILED[:8]}""{CONTROL_FAILED[8:]}; '
    )


def assert_control(live: LiveGateway, chat: str, reply: str) -> None:
    """The positive control ran and saw what it must: a listing of its own files, real stats."""
    own = f"/workspace/chats/{dir_of(live, chat)}"
    assert CONTROL_OK in reply, f"the positive control failed in chat {chat}:\n{reply}"
    assert CONTROL_FAILED not in reply
    assert re.search(r"^[-rwx]{10}.* MEMORY\.md$", reply, re.M), reply  # ls -la of its dir
    assert re.search(r"^[-rwx]{10}.* USER\.md$", reply, re.M), reply
    assert f"stat-ok directory {own}\n" in reply
    assert re.search(rf"^stat-ok regular (empty )?file {re.escape(own)}/MEMORY\.md$", reply, re.M)
    assert re.search(r"^stat-ok directory /workspace/media/api-[^/]+/$", reply, re.M), reply
    assert f"{own}/USER.md\n" in reply  # find


@pytest.fixture(scope="module")
def seeded(live: LiveGateway) -> LiveGateway:
    """Chat A leaves traces everywhere it can write: memory, media, home, /tmp, a process."""
    reply = live.run(
        A,
        f"set -e; cd /workspace/chats/{dir_of(live, A)}; echo {MARK} >> MEMORY.md; "
        f"echo {MARK} > USER.md; echo {MARK} >> notes.txt; "
        f"for d in /workspace/media/*/; do echo {MARK} > $d/photo.txt; done; "
        f"echo {MARK} > $HOME/.claude/a.json; "
        f"echo {MARK} > /tmp/a.txt; (nohup sleep 600 >/dev/null 2>&1 &); echo done",
    )
    assert "done" in reply and "[exit 0]" in reply
    return live


def test_M1_S3_chat_sees_only_its_own_conversation(seeded: LiveGateway) -> None:
    reply = seeded.run(
        B,
        control(seeded, B) + "ls -la /workspace/chats /workspace/media; "
        "echo /workspace/chats/* /workspace/media/*",
    )
    assert_control(seeded, B, reply)
    listed = reply.split(CONTROL_OK, 1)[1]
    assert listed.count(dir_of(seeded, B)) == 2  # ls and the glob both see its own
    assert dir_of(seeded, A) not in listed
    media = re.findall(r"/workspace/media/(api-[0-9a-f]+)", listed)
    assert len(media) == 1 and listed.count(media[0]) == 2  # its own media dir, once each


def test_S2_S3_tools_work_in_own_paths(seeded: LiveGateway) -> None:
    """The probe itself: ls, stat, find and python3 file I/O work in the chat's own paths."""
    own = f"/workspace/chats/{dir_of(seeded, B)}"
    reply = seeded.run(
        B,
        control(seeded, B) + f"echo tools > {own}/t.txt && ls -la {own}/t.txt && "
        f"stat -c '%s %F' {own}/t.txt && find {own} -name t.txt && "
        f"python3 -c \"import os; p='{own}/py.txt'; open(p,'w').write('py-io'); "
        f"print(open(p).read(), sorted(os.listdir('{own}')))\"",
    )
    assert_control(seeded, B, reply)
    assert "6 regular file" in reply and f"{own}/t.txt\n" in reply
    assert "py-io [" in reply and "'t.txt'" in reply and "'MEMORY.md'" in reply


def test_S3_M1_chat_b_finds_nothing_of_chat_a(seeded: LiveGateway) -> None:
    own = f"/workspace/chats/{dir_of(seeded, B)}"
    theirs = f"/workspace/chats/{dir_of(seeded, A)}"
    reply = seeded.run(
        B,
        control(seeded, B) + f"echo bob-own-marker-2c9 > {own}/bob.txt; "
        f"grep -rl -e {MARK} -e bob-own-marker-2c9 / --exclude-dir=proc --exclude-dir=sys "
        f"2>/dev/null; cat {theirs}/MEMORY.md 2>&1; stat {theirs} 2>&1; ls {theirs} 2>&1; "
        "echo checked",
    )
    assert_control(seeded, B, reply)
    assert f"{own}/bob.txt\n" in reply  # grep does search: it finds chat B's own marker
    assert MARK not in reply
    assert reply.count("No such file or directory") == 3
    assert "checked" in reply


def test_M3_new_chat_starts_with_empty_memory_not_root_memory(seeded: LiveGateway) -> None:
    d = dir_of(seeded, B)
    reply = seeded.run(
        B,
        f"wc -c < /workspace/chats/{d}/MEMORY.md; wc -c < /workspace/chats/{d}/USER.md;"
        f" {control(seeded, B)}"
        " for f in MEMORY.md USER.md; do test -e /workspace/$f || echo absent; done",
    )
    assert_control(seeded, B, reply)
    assert re.search(r"^0\n0\n", reply)
    assert "Operator note" not in reply
    assert reply.count("absent") == 2


def test_S2_chat_b_sees_none_of_chat_a_processes(seeded: LiveGateway) -> None:
    mine = seeded.run(A, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '")
    assert "sleep 600" in mine
    theirs = seeded.run(
        B, control(seeded, B) + "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '"
    )
    assert_control(seeded, B, theirs)
    assert "cat /proc/" in theirs  # it does read its own processes' command lines
    assert "sleep 600" not in theirs


def test_S2_own_tmp_and_home(seeded: LiveGateway) -> None:
    reply = seeded.run(
        B,
        control(seeded, B) + "touch /tmp/b-own.txt $HOME/.claude/b-own.json && echo w-ok; "
        "ls -A /tmp $HOME/.claude; echo $HOME",
    )
    assert_control(seeded, B, reply)
    assert "b-own.txt" in reply and "b-own.json" in reply  # the listings do list
    assert "a.txt" not in reply and "a.json" not in reply
    assert "/home/agent" in reply and "w-ok" in reply


@pytest.mark.parametrize(
    "target",
    [
        "/workspace/AGENTS.md",
        "/workspace/SOUL.md",
        "/workspace/IDENTITY.md",
        "/workspace/skills/hello/SKILL.md",
        "/workspace/skills/new.md",
        "/workspace/.claude/settings.json",
        "/workspace/.claude/skills/greet/SKILL.md",
        "/workspace/new-root-file.md",
        "/workspace/chats/new-dir/x",
        "/etc/passwd",
        "/usr/bin/evil",
        "/run/cellgate/x",
    ],
)
def test_S2_S3_L6_read_only_paths_cannot_be_written(seeded: LiveGateway, target: str) -> None:
    own = f"/workspace/chats/{dir_of(seeded, A)}"
    reply = seeded.run(
        A,
        f"echo fine >> {own}/notes.txt && echo OWN-WROTE; "
        f"echo pwned >> {target} && echo WROTE || echo refused",
    )
    assert "OWN-WROTE" in reply  # writing works where it should, in the same turn
    assert "refused" in reply and "\nWROTE" not in reply


def test_L6_persona_unchanged_on_host(seeded: LiveGateway) -> None:
    ws = seeded.state_dir / "agents" / seeded.agent / "workspace"
    assert "pwned" not in (ws / "AGENTS.md").read_text()
    assert not (ws / "new-root-file.md").exists()


def test_K1_no_secret_in_environment_or_files(seeded: LiveGateway) -> None:
    reply = seeded.run(
        A,
        control(seeded, A) + "echo needle-own-9b1 > /tmp/own-needle.txt; "
        "env; echo ---; tr '\\0' '\\n' < /proc/1/environ; echo ---; "
        f"grep -rIil -e {CANARY_NEEDLE} -e {CONFIG_KEY[:12]} -e needle-own-9b1 / "
        "--exclude-dir=proc --exclude-dir=sys "
        "2>/dev/null; echo end",
    )
    assert_control(seeded, A, reply)
    assert "/tmp/own-needle.txt\n" in reply  # the search does find what is there
    assert CANARY_NEEDLE not in reply.lower().replace(f"-e {CANARY_NEEDLE}", "")
    for value in [*CANARIES.values(), *APP_SECRETS.values(), CONFIG_KEY]:
        assert value not in reply
    for name in [*CANARIES, *APP_SECRETS]:
        assert f"{name}=" not in reply
    assert "GATEWAY_API_URL" not in reply
    # The app's ordinary settings do reach it: the filter is not "drop everything".
    assert f"APP_MODE={APP_PUBLIC_ENV['APP_MODE']}" in reply
    assert f"GATEWAY_ORIGIN_CHAT_ID={A}" in reply
    assert "CLAUDE_CODE_DISABLE_AUTO_MEMORY=1" in reply


def test_S2_no_capabilities_no_new_privileges_not_root(seeded: LiveGateway) -> None:
    reply = seeded.run(A, "grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs)' /proc/self/status; id -u")
    assert re.search(r"CapEff:\s+0+\n", reply)
    assert re.search(r"CapPrm:\s+0+\n", reply)
    if seeded.runtime == "runc":  # gVisor's /proc has no NoNewPrivs line: prctl says it
        assert re.search(r"NoNewPrivs:\s+1", reply)
    nnp = seeded.run(
        A, "python3 -c 'import ctypes; print(ctypes.CDLL(None).prctl(39, 0, 0, 0, 0))'"
    )
    assert nnp.startswith("1\n")  # PR_GET_NO_NEW_PRIVS
    uid = reply.split("\n")[-2].strip()
    assert uid.isdigit() and uid != "0"


def test_S2_no_docker_socket(seeded: LiveGateway) -> None:
    reply = seeded.run(
        A,
        control(seeded, A)
        + "for s in /var/run/docker.sock /run/docker.sock; do test -e $s || echo absent; done; "
        "find / -name '*.sock' -not -path '/proc/*' 2>/dev/null; echo end",
    )
    assert_control(seeded, A, reply)
    assert "\n/run/cellgate/bridge.sock\n" in reply  # find does find sockets: its bridge
    assert reply.count("absent") == 2
    assert "docker.sock" not in reply.replace("/var/run/docker.sock", "").replace(
        "/run/docker.sock", ""
    )


PY_SYSCALLS = (
    "python3 - <<'PY'\n"
    "import ctypes, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "os.makedirs('/tmp/m', exist_ok=True)\n"
    "r = libc.mount(b'none', b'/tmp/m', b'tmpfs', 0, None)\n"
    "print('mount', r, os.strerror(ctypes.get_errno()))\n"
    "for name, flag in (('user', 0x10000000), ('mnt', 0x00020000), ('net', 0x40000000)):\n"
    "    r = libc.unshare(flag)\n"
    "    print('unshare', name, r, os.strerror(ctypes.get_errno()))\n"
    "PY"
)


def test_S2_cannot_mount_or_unshare(seeded: LiveGateway) -> None:
    reply = seeded.run(A, PY_SYSCALLS)
    assert "mount -1" in reply
    if seeded.runtime == "runsc":
        # gVisor's own kernel grants namespaces that live inside its Sentry; they reach
        # nothing on the host. Under runc every unshare must fail.
        return
    for ns in ("user", "mnt", "net"):
        assert f"unshare {ns} -1" in reply


def test_S2_no_network(seeded: LiveGateway) -> None:
    reply = seeded.run(A, "cat /proc/net/dev | tail -n +3 | cut -d: -f1")
    assert [line.strip() for line in reply.splitlines()[:-1]] == ["lo"]


def test_S2_pids_limit_stops_a_fork_bomb_without_hurting_chat_b(seeded: LiveGateway) -> None:
    bomb = (
        "python3 - <<'PY'\n"
        "import os, time\n"
        "pids, err = [], None\n"
        "for _ in range(300):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError as e:\n"
        "        err = e.errno\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "print('forked', len(pids), 'errno', err)\n"
        "for p in pids:\n"
        "    os.kill(p, 9)\n"
        "    os.waitpid(p, 0)\n"
        "print('survived')\n"
        "PY"
    )
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fut_a = pool.submit(seeded.say, A, bomb)
        fut_b = pool.submit(seeded.say, B, "echo b-is-fine")
        ra, rb = fut_a.result(), fut_b.result()
    assert rb.status_code == 200 and "b-is-fine" in rb.json()["reply"]
    assert ra.status_code == 200, ra.text
    reply = ra.json()["reply"]
    assert "survived" in reply
    forked, errno = re.findall(r"^forked (\d+) errno (\S+)$", reply, re.M)[0]
    assert errno == "11" and 10 < int(forked) < 64  # EAGAIN: the limit (64) held
    assert "b-is-fine" in seeded.run(B, "echo b-is-fine")
