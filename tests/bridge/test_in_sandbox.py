"""The bridge from inside real sandboxes: `python3 /run/cellgate/cellgate-tool` (P1 P5 P6 M6 M8).

Each test gets fresh chats, so fresh directories and a fresh sandbox per chat.
The attacker is the sandbox: it writes its own media and chat directories,
and plants symlinks whose targets are host paths, since the gateway (root, on
the host) is the one that would resolve them.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import textwrap

import pytest

from cellgate.models import OutboundKind
from orchestrator.bridge import BridgeLimits
from policies.bridge import RateLimit
from tests.bridge.conftest import SandboxWorld, chat_id_for

pytestmark = pytest.mark.docker


def _refused_by(result_stderr: bytes, rule: str) -> bool:
    return f"refused by {rule}".encode() in result_stderr


async def test_P1_in_sandbox_reply_goes_to_origin_and_other_chats_are_refused(
    sandboxed: SandboxWorld,
) -> None:
    a = await sandboxed.open(chat_id_for("p1a"))
    b = await sandboxed.open(chat_id_for("p1b"))
    home = await a.tool("reply", {"text": "hi"})
    assert home.exit_code == 0, home.stderr
    assert json.loads(home.stdout)["chat_id"] == a.chat.key.chat_id
    other = await a.tool("reply", {"text": "psst", "chat_id": b.chat.key.chat_id})
    assert other.exit_code == 1
    assert _refused_by(other.stderr, "P1"), other.stderr
    # whatever the environment claims, the socket decides
    spoof = await a.sh(
        f"GATEWAY_ORIGIN_CHAT_ID={b.chat.key.chat_id} python3 /run/cellgate/cellgate-tool "
        'reply \'{"text": "spoofed"}\''
    )
    assert spoof.exit_code == 0
    assert [(m.chat_id, m.text) for m in sandboxed.outbox.sent] == [
        (a.chat.key.chat_id, "hi"),
        (a.chat.key.chat_id, "spoofed"),
    ]
    [refusal] = sandboxed.world.store.refusals(a.chat.scope.conversation_id)
    assert (refusal.rule, refusal.action) == ("P1", "reply")


async def test_P1_each_sandbox_sees_only_its_own_socket(sandboxed: SandboxWorld) -> None:
    a = await sandboxed.open(chat_id_for("own"))
    listing = await a.sh("ls -la /run/cellgate; test -w /run/cellgate && echo WRITABLE; true")
    assert b"bridge.sock" in listing.stdout
    assert b"cellgate-tool" in listing.stdout and b"cellgate-mcp" in listing.stdout
    assert b"WRITABLE" not in listing.stdout
    planted = await a.sh("rm -f /run/cellgate/bridge.sock; ln -s /x /run/cellgate/y")
    assert planted.exit_code != 0, "the bridge directory is read-only in the sandbox"


async def test_P5_in_sandbox_sends_outside_the_media_dir_are_refused(
    sandboxed: SandboxWorld,
) -> None:
    a = await sandboxed.open(chat_id_for("p5a"))
    b = await sandboxed.open(chat_id_for("p5b"))
    b_file = b.chat.media / "b-private.txt"
    b_file.write_text("B-PRIVATE-MEDIA")  # planted on the host, in chat B's media
    try:
        os.link(b_file, a.chat.media / "hard-b")  # a host-made hard link into A's media
        cross_linked = True
    except OSError as exc:  # R2: each conversation is its own filesystem, no link can cross
        assert exc.errno == errno.EXDEV, exc
        cross_linked = False
    setup = await a.sh(
        textwrap.dedent(f"""\
        set -e
        cd {a.media}
        echo public > ok.txt
        ln -s {b_file} to-b
        ln -s /etc/passwd to-passwd
        mkfifo fifo
        echo same > orig && ln orig hard-same
        # across bind mounts the kernel says EXDEV; if it ever allows it, it is refused
        ln {a.chat_dir}/MEMORY.md hard-chat 2>/dev/null && echo CROSS-LINKED || echo EXDEV
        """)
    )
    assert setup.exit_code == 0, setup.stderr
    cases = {
        "../x": "'..'",
        f"{a.media}/../{b.chat.scope.paths.media_dir.name}/b-private.txt": "'..'",
        "/etc/passwd": "outside",
        f"{b.media}/b-private.txt": "outside",
        "to-b": "symbolic link",
        "to-passwd": "symbolic link",
        "fifo": "named pipe",
        "hard-same": "hard link",
    }
    if cross_linked:
        cases["hard-b"] = "hard link"
    if b"CROSS-LINKED" in setup.stdout:
        cases["hard-chat"] = "hard link"
    for path, needle in cases.items():
        r = await a.tool("send_file", {"path": path})
        assert r.exit_code == 1, (path, r.stdout)
        assert _refused_by(r.stderr, "P5") and needle.encode() in r.stderr, (path, r.stderr)
    sent = await a.tool("send_file", {"path": f"{a.media}/ok.txt", "caption": "here"})
    assert sent.exit_code == 0, sent.stderr
    assert sandboxed.outbox.file_bytes == [b"public\n"]
    [msg] = sandboxed.outbox.sent
    assert (msg.kind, msg.chat_id, msg.file_name) == (
        OutboundKind.FILE,
        a.chat.key.chat_id,
        "ok.txt",
    )


async def test_P5_in_sandbox_symlink_swap_race_never_leaks(sandboxed: SandboxWorld) -> None:
    """A loop in the sandbox flips `x` between a file and a symlink to a host secret; 250 sends."""
    # 250 sends as fast as they go: above the R4 rate (tested in test_bounds), on purpose
    sandboxed.world.server.limits = BridgeLimits(rate=RateLimit(per_second=1e6, burst=10**6))
    a = await sandboxed.open(chat_id_for("race"))
    b = await sandboxed.open(chat_id_for("victim"))
    marker = f"HOST-SECRET-{secrets.token_hex(8)}"
    secret = b.chat.chat_dir / "MEMORY.md"  # another conversation's memory, a host-only path
    secret.write_text(f"{marker}\n")
    sends = 250
    script = textwrap.dedent(f"""\
        cd {a.media}
        echo PUBLIC > x
        ( while :; do
            ln -sfn {secret} .l && mv -Tf .l x
            echo PUBLIC > .f && mv -Tf .f x
          done ) &
        FLIPPER=$!
        python3 - <<'PY'
        import importlib.machinery, json, collections
        tool = importlib.machinery.SourceFileLoader(
            "cellgate_tool", "/run/cellgate/cellgate-tool").load_module()
        seen = collections.Counter()
        for i in range({sends}):
            doc = tool.call("send_file", {{"path": "x"}})
            seen["ok" if doc["ok"] else doc["error"].get("rule") or doc["error"]["code"]] += 1
        print(json.dumps(seen))
        PY
        kill $FLIPPER
        """)
    r = await a.sh(script, limit=300)
    assert r.exit_code == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert sum(seen.values()) == sends
    assert set(seen) <= {"ok", "P5"}, seen
    assert seen.get("P5", 0) > 0, f"the swap was never caught mid-flight: {seen}"
    assert seen.get("ok", 0) > 0, f"no send went through: {seen}"
    assert len(sandboxed.outbox.file_bytes) == seen["ok"]
    for data in sandboxed.outbox.file_bytes:
        assert marker.encode() not in data
        assert data in (b"PUBLIC\n", b"")
    assert secret.read_text() == f"{marker}\n"


async def test_M6_M8_in_sandbox_memory_writes(sandboxed: SandboxWorld) -> None:
    a = await sandboxed.open(chat_id_for("mem"))
    ok = await a.tool("task_memory_append", {"text": "prefers short answers"})
    assert ok.exit_code == 0, ok.stderr
    topic = await a.tool("task_memory_append", {"text": "x", "target": "memory/x.md"})
    assert topic.exit_code == 1 and _refused_by(topic.stderr, "M6"), topic.stderr
    key = "sk-ant-api03-" + "A" * 40
    planted = await a.tool("task_memory_append", {"text": f"my key is {key}"})
    assert planted.exit_code == 1 and _refused_by(planted.stderr, "M8"), planted.stderr
    seen = await a.sh(f"cat {a.chat_dir}/MEMORY.md")
    assert seen.stdout == b"prefers short answers\n"


async def test_M6_in_sandbox_planted_memory_symlink_is_not_followed(
    sandboxed: SandboxWorld,
) -> None:
    a = await sandboxed.open(chat_id_for("memlink"))
    b = await sandboxed.open(chat_id_for("memvictim"))
    victim = b.chat.chat_dir / "MEMORY.md"
    victim.write_text("B's memory\n")
    plant = await a.sh(f"cd {a.chat_dir} && rm MEMORY.md && ln -s {victim} MEMORY.md")
    assert plant.exit_code == 0, plant.stderr
    r = await a.tool("task_memory_append", {"text": "written through a link"})
    assert r.exit_code == 1 and _refused_by(r.stderr, "M6"), r.stderr
    assert b"not followed" in r.stderr
    assert victim.read_text() == "B's memory\n"
    dangling = a.chat.chat_dir / "USER.md"
    target = sandboxed.world.root / "created-through-a-link"
    await a.sh(f"cd {a.chat_dir} && rm -f USER.md && ln -s {target} USER.md")
    r = await a.tool("task_memory_append", {"text": "x", "target": "USER.md"})
    assert r.exit_code == 1 and _refused_by(r.stderr, "M6")
    assert not target.exists() and dangling.is_symlink()


async def test_P6_in_sandbox_another_sessions_share_is_not_revocable(
    sandboxed: SandboxWorld,
) -> None:
    a = await sandboxed.open(chat_id_for("p6a"))
    b = await sandboxed.open(chat_id_for("p6b"))
    await b.sh(f"echo shared > {b.media}/s.txt")
    made = await b.tool("share_file", {"path": "s.txt"})
    assert made.exit_code == 0, made.stderr
    share = json.loads(made.stdout)
    for ref in (share["token"], share["share_id"]):
        r = await a.tool("revoke_share", {"share": ref})
        assert r.exit_code == 1 and _refused_by(r.stderr, "P6"), r.stderr
    assert sandboxed.world.store.get_share_by_token(share["token"]) is not None
    own = await b.tool("revoke_share", {"share": share["share_id"]})
    assert own.exit_code == 0, own.stderr
    assert sandboxed.world.store.get_share_by_token(share["token"]) is None


async def test_T1_in_sandbox_mcp_stdlib_server_speaks_the_stdio_protocol(
    sandboxed: SandboxWorld,
) -> None:
    """The image has no `mcp` package: cellgate-mcp falls back to its stdlib server."""
    a = await sandboxed.open(chat_id_for("mcp"))
    requests = [
        {"jsonrpc": "2.0", "id": 1, "method": "initialize",
         "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                    "clientInfo": {"name": "t", "version": "0"}}},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
        {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
         "params": {"name": "reply", "arguments": {"text": "via mcp"}}},
        {"jsonrpc": "2.0", "id": 4, "method": "tools/call",
         "params": {"name": "reply", "arguments": {"text": "x", "chat_id": "elsewhere"}}},
        {"jsonrpc": "2.0", "id": 5, "method": "resources/list"},
    ]  # fmt: skip
    stdin = "".join(json.dumps(r) + "\n" for r in requests).encode()
    probe = await a.backend.exec(a.handle, ["python3", "-c", "import mcp"], timeout=30)
    assert probe.exit_code != 0, "this test needs an image without the mcp SDK"
    r = await a.backend.exec(a.handle, ["python3", "/run/cellgate/cellgate-mcp"], stdin=stdin,
                             timeout=60)  # fmt: skip
    assert r.exit_code == 0, r.stderr
    answers = {m["id"]: m for m in map(json.loads, r.stdout.decode().splitlines())}
    assert sorted(answers) == [1, 2, 3, 4, 5], "the notification gets no answer"
    assert answers[1]["result"]["protocolVersion"] == "2025-06-18"
    assert answers[1]["result"]["capabilities"] == {"tools": {"listChanged": False}}
    names = [t["name"] for t in answers[2]["result"]["tools"]]
    assert "reply" in names and "task_memory_append" in names
    assert answers[2]["result"]["tools"][0]["inputSchema"]["required"] == ["text"]
    assert answers[3]["result"]["isError"] is False
    assert answers[4]["result"]["isError"] is True
    assert "refused by P1" in answers[4]["result"]["content"][0]["text"]
    assert answers[5]["error"]["code"] == -32601
    assert [m.text for m in sandboxed.outbox.sent] == ["via mcp"]
