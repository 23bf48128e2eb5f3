"""The standard tools through a real socket and the real client (P1 P5 P6 M6 M8 T1 T2 T4)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from cellgate.models import OutboundKind
from orchestrator.store import SessionId
from tests.bridge.conftest import World

SOURCE_DIR = Path(__file__).resolve().parents[2] / "sandbox" / "client"

# -- P1: reply, react, edit only into the chat the socket serves ---------------------


async def test_P1_reply_without_chat_id_goes_to_origin(world: World) -> None:
    a = await world.open("42")
    result = await a.ok("reply", {"text": "hello"})
    [msg] = world.outbox.sent
    assert (msg.channel, msg.chat_id, msg.kind, msg.text) == ("telegram", "42", "reply", "hello")
    assert result == {"message_id": "m1", "chat_id": "42"}
    assert msg.outbound_key.startswith("bridge:")


async def test_P1_reply_with_own_chat_id_is_allowed_int_or_str(world: World) -> None:
    a = await world.open("-100123")
    await a.ok("reply", {"text": "x", "chat_id": "-100123"})
    await a.ok("reply", {"text": "y", "chat_id": -100123})
    assert [m.chat_id for m in world.outbox.sent] == ["-100123", "-100123"]


async def test_P1_reply_to_another_chat_refused_and_recorded(world: World) -> None:
    a = await world.open("42")
    await world.open("77")
    err = await a.refused("reply", {"text": "psst", "chat_id": "77"}, "P1")
    assert "'77' is not the chat this session serves" in err["message"]
    assert world.outbox.sent == []
    [refusal] = world.store.refusals(a.scope.conversation_id)
    assert (refusal.rule, refusal.action, refusal.session_id) == ("P1", "reply", a.scope.session_id)


async def test_P1_exact_compare_no_numeric_normalisation(world: World) -> None:
    a = await world.open("-100123")
    await a.refused("reply", {"text": "x", "chat_id": "123"}, "P1")
    await a.refused("react", {"emoji": "👍", "message_id": "5", "chat_id": "-100123 "}, "P1")


async def test_P1_react_and_edit_refused_elsewhere_allowed_at_home(world: World) -> None:
    a = await world.open("42")
    await a.refused("react", {"emoji": "👍", "message_id": "9", "chat_id": "7"}, "P1")
    await a.refused("edit", {"text": "x", "message_id": "9", "chat_id": "7"}, "P1")
    await a.ok("react", {"emoji": "👍", "message_id": "9"})
    await a.ok("edit", {"text": "fixed", "message_id": "9"})
    kinds = [(m.kind, m.target_message_id) for m in world.outbox.sent]
    assert kinds == [(OutboundKind.REACT, "9"), (OutboundKind.EDIT, "9")]


async def test_P1_unknown_origin_refuses_everything(world: World) -> None:
    a = await world.open("42", origin_chat_id=None)
    await a.refused("reply", {"text": "x"}, "P1")
    await a.refused("reply", {"text": "x", "chat_id": "42"}, "P1")
    await a.refused("narrate", {"text": "x"}, "P1")
    (a.media / "f.txt").write_bytes(b"f")
    await a.refused("send_file", {"path": "f.txt"}, "P1")
    assert world.outbox.sent == []


async def test_P1_scope_comes_from_the_socket_not_the_arguments(world: World) -> None:
    """Arguments naming another conversation, session or directory change nothing."""
    a = await world.open("42")
    b = await world.open("77")
    await a.ok(
        "reply",
        {"text": "x"} | {"chat": "77", "session_id": b.scope.session_id},
    )
    await b.ok("reply", {"text": "y"})
    assert [(s.key.chat_id, m.chat_id) for s, m in world.outbox.messages] == [
        ("42", "42"),
        ("77", "77"),
    ]


async def test_P1_retried_call_is_delivered_once(world: World) -> None:
    from sandbox.client import cellgate_tool

    a = await world.open("42")
    for _ in range(3):
        doc = await asyncio.to_thread(
            cellgate_tool.call, "reply", {"text": "once"}, path=str(a.socket), call_id="c-1"
        )
        assert doc["ok"]
    assert len(world.outbox.sent) == 1


# -- P5: files --------------------------------------------------------------------


async def test_P5_send_file_delivers_a_checked_copy(world: World) -> None:
    a = await world.open("42")
    (a.media / "pic.png").write_bytes(b"\x89PNG-data")
    result = await a.ok("send_file", {"path": f"{a.scope.media_dir_in_sandbox}/pic.png",
                                      "caption": "look"})  # fmt: skip
    [msg] = world.outbox.sent
    assert msg.kind is OutboundKind.FILE
    assert (msg.text, msg.file_name, result["size"]) == ("look", "pic.png", 9)
    assert world.outbox.file_bytes == [b"\x89PNG-data"]
    assert msg.file_path is not None
    assert not msg.file_path.startswith(str(world.workspace)), "the copy is outside every mount"
    assert [m & 0o077 for m in world.outbox.file_modes] == [0], "only the gateway reads the copy"
    assert not os.path.exists(msg.file_path), "R3: the copy is removed once delivered"


async def test_P5_send_file_refusals(world: World) -> None:
    a = await world.open("42")
    b = await world.open("77")
    (b.media / "b-secret.txt").write_bytes(b"B-ONLY")
    (a.media / "to-b").symlink_to(b.media / "b-secret.txt")
    os.link(b.media / "b-secret.txt", a.media / "hard")
    os.mkfifo(a.media / "fifo")
    for path, needle in [
        ("../x", "'..'"),
        ("/etc/passwd", "outside"),
        (f"{b.scope.media_dir_in_sandbox}/b-secret.txt", "outside"),
        ("to-b", "symbolic link"),
        ("hard", "hard link"),
        ("fifo", "named pipe"),
        ("nope.txt", "does not exist"),
    ]:
        err = await a.refused("send_file", {"path": path}, "P5")
        assert needle in err["message"], (path, err)
    assert world.outbox.sent == []
    assert len(world.store.refusals(a.scope.conversation_id)) == 7


async def test_P5_share_file_checks_the_path_and_stores_a_share(world: World) -> None:
    a = await world.open("42")
    (a.media / "doc.pdf").write_bytes(b"%PDF")
    (a.media / "out").symlink_to("/etc/passwd")
    await a.refused("share_file", {"path": "out"}, "P5")
    made = await a.ok("share_file", {"path": "doc.pdf"})
    share = world.store.get_share_by_token(made["token"])
    assert share is not None
    assert (share.id, share.path, share.session_id) == (made["share_id"], "doc.pdf",
                                                        a.scope.session_id)  # fmt: skip


# -- P6: revoke only your own share ------------------------------------------------


async def test_P6_another_sessions_share_is_not_revocable(world: World) -> None:
    a = await world.open("42")
    b = await world.open("77")
    (b.media / "b.txt").write_bytes(b"b")
    made = await b.ok("share_file", {"path": "b.txt"})
    await a.refused("revoke_share", {"share": made["token"]}, "P6")
    await a.refused("revoke_share", {"share": made["share_id"]}, "P6")
    assert world.store.get_share_by_token(made["token"]) is not None, "still active"
    done = await b.ok("revoke_share", {"share": made["share_id"]})
    assert done == {"share_id": made["share_id"], "revoked": True}
    assert world.store.get_share_by_token(made["token"]) is None
    again = await b.call("revoke_share", {"share": made["token"]})
    assert again["error"]["code"] == "conflict"


async def test_P6_a_new_session_of_the_same_chat_cannot_revoke_the_old_share(
    world: World,
) -> None:
    a = await world.open("42")
    (a.media / "a.txt").write_bytes(b"a")
    made = await a.ok("share_file", {"path": "a.txt"})
    conv = world.store.upsert_conversation(a.key)
    world.store.open_session(conv.id, "shell", session_id=SessionId("s-newer"))
    a2 = await world.open("42", session_id="s-newer")
    assert a2.socket == a.socket, "same conversation, same socket, new scope"
    await a2.refused("revoke_share", {"share": made["share_id"]}, "P6")


async def test_P6_unknown_share_is_not_found(world: World) -> None:
    a = await world.open("42")
    doc = await a.call("revoke_share", {"share": "sh_0000000000000000"})
    assert doc["error"]["code"] == "not_found"


# -- M6/M8: memory -----------------------------------------------------------------


async def test_M6_memory_append_writes_this_conversations_files(world: World) -> None:
    a = await world.open("42")
    b = await world.open("77")
    await a.ok("task_memory_append", {"text": "likes green tea"})
    await a.ok("task_memory_append", {"text": "name: Ada", "target": "USER.md"})
    assert (a.chat_dir / "MEMORY.md").read_text() == "likes green tea\n"
    assert (a.chat_dir / "USER.md").read_text() == "name: Ada\n"
    assert (b.chat_dir / "MEMORY.md").read_text() == ""


async def test_M6_memory_append_refuses_other_targets(world: World) -> None:
    a = await world.open("42")
    for target in ["memory/topic.md", "../telegram-77/MEMORY.md", "/workspace/MEMORY.md",
                   "memory.md", "SOUL.md", f"{a.chat_dir}/MEMORY.md"]:  # fmt: skip
        await a.refused("task_memory_append", {"text": "x", "target": target}, "M6")
    assert (a.chat_dir / "MEMORY.md").read_text() == ""
    assert not (a.chat_dir / "memory").exists()


async def test_M6_planted_memory_symlink_is_not_followed(world: World) -> None:
    a = await world.open("42")
    b = await world.open("77")
    (b.chat_dir / "MEMORY.md").write_text("B's memory\n")
    (a.chat_dir / "MEMORY.md").unlink()
    (a.chat_dir / "MEMORY.md").symlink_to(b.chat_dir / "MEMORY.md")
    err = await a.refused("task_memory_append", {"text": "overwrite"}, "M6")
    assert "not followed" in err["message"]
    assert (b.chat_dir / "MEMORY.md").read_text() == "B's memory\n"


async def test_M8_memory_with_a_secret_is_refused(world: World) -> None:
    a = await world.open("42")
    err = await a.refused(
        "task_memory_append", {"text": "the key is sk-live0123456789abcdefABCDEF0123"}, "M8"
    )
    assert "secret" in err["message"]
    await a.refused(
        "task_memory_append", {"text": "-----BEGIN OPENSSH PRIVATE KEY-----\nabc"}, "M8"
    )
    assert (a.chat_dir / "MEMORY.md").read_text() == ""


# -- T4: narrate -------------------------------------------------------------------


async def test_T4_narrate_goes_into_the_tasks_own_conversation(world: World) -> None:
    a = await world.open("42")
    b = await world.open("77")
    await a.ok("narrate", {"text": "working on it"})
    await a.refused("narrate", {"text": "x", "conversation": b.scope.conversation_id}, "T4")
    [msg] = world.outbox.sent
    assert (msg.chat_id, msg.kind, msg.extra) == ("42", OutboundKind.REPLY, {"narrate": "1"})


# -- T1/T2: list_tools and tool gating ---------------------------------------------


async def test_T1_list_tools_names_what_the_scope_may_call(world: World) -> None:
    a = await world.open("42")
    tools = (await a.ok("list_tools"))["tools"]
    names = [t["name"] for t in tools]
    assert names == ["reply", "react", "edit", "send_file", "share_file", "revoke_share",
                     "task_memory_append", "narrate", "list_tools"]  # fmt: skip
    reply = next(t for t in tools if t["name"] == "reply")
    assert reply["input_schema"]["required"] == ["text"]


async def test_T1_a_channel_module_tool_loads_only_for_its_channel(world: World) -> None:
    from orchestrator.bridge import ToolCall

    async def download(call: ToolCall) -> dict[str, object]:
        return {"file_id": call.args.get("file_id"), "chat": call.scope.key.chat_id}

    world.handlers.register("telegram_download_attachment", download, module="telegram")
    world.handlers.register("browser_open", download, module="browser")
    tg = await world.open("42", "telegram")
    dc = await world.open("900", "discord")
    listed = [t["name"] for t in (await tg.ok("list_tools"))["tools"]]
    assert "telegram_download_attachment" in listed
    got = await tg.ok("telegram_download_attachment", {"file_id": "F"})
    assert got == {"file_id": "F", "chat": "42"}
    await dc.refused("telegram_download_attachment", {"file_id": "F"}, "T1")
    await tg.refused("browser_open", {}, "T1")
    assert "browser_open" not in json.dumps(await tg.ok("list_tools"))


async def test_T1_T2_F3_each_kind_of_scope_keeps_its_own_offer_until_a_tool_is_added(
    world: World,
) -> None:
    """The offer is worked out once per (channel, isolated, archive) (F3: not per turn);
    a scope of another kind gets its own, and a tool registered later is offered at once."""
    from orchestrator.bridge import ToolCall

    async def anything(call: ToolCall) -> dict[str, object]:
        return {}

    tg = await world.open("42", "telegram")
    shared = await world.open("43", "telegram", isolated=False)
    first = [t.name for t in world.handlers.definitions(tg.scope)]
    assert world.handlers.offered(tg.scope) is world.handlers.offered(tg.scope)
    world.handlers.register("cron_create", anything)  # T2: only a shared agent's
    world.handlers.register("telegram_pin", anything, module="telegram")
    world.handlers.register("discord_pin", anything, module="discord")
    after = [t.name for t in world.handlers.definitions(tg.scope)]
    assert after == [*first, "telegram_pin"]
    assert "cron_create" in [t.name for t in world.handlers.definitions(shared.scope)]
    names = [t["name"] for t in (await tg.ok("list_tools"))["tools"]]
    assert "telegram_pin" in names and "discord_pin" not in names
    await tg.refused("discord_pin", {}, "T1")
    await tg.refused("cron_create", {}, "T2")


async def test_T2_tools_not_offered_to_an_isolated_agent(world: World) -> None:
    from orchestrator.bridge import ToolCall

    async def anything(call: ToolCall) -> dict[str, object]:
        return {}

    world.handlers.register("cron_create", anything)
    world.handlers.register("memory_search", anything)
    a = await world.open("42")
    await a.refused("cron_create", {}, "T2")
    await a.refused("memory_search", {}, "T2")
    names = [t["name"] for t in (await a.ok("list_tools"))["tools"]]
    assert "cron_create" not in names and "memory_search" not in names


# -- outboxes, registry and client install -------------------------------------------


async def test_P2_a_thread_the_session_opened_itself_is_allowed(world: World) -> None:
    from orchestrator.bridge import ToolCall

    async def create_thread(call: ToolCall) -> dict[str, object]:
        thread = f"thread-{len(call.state.own_threads) + 1}"
        call.state.own_threads.add(thread)
        return {"chat_id": thread}

    world.handlers.register("discord_create_thread", create_thread, module="discord")
    a = await world.open("chan-1", "discord")
    made = await a.ok("discord_create_thread", {})
    await a.ok("reply", {"text": "in my thread", "chat_id": made["chat_id"]})
    await a.refused("reply", {"text": "x", "chat_id": "thread-of-someone-else"}, "P1")
    assert [m.chat_id for m in world.outbox.sent] == ["thread-1"]


async def test_P1_channel_outbox_routes_by_channel_and_sends_a_key_once() -> None:
    from cellgate.errors import BridgeError
    from cellgate.models import ConversationKey, DeliveryReceipt, OutboundMessage
    from channels.base import Channel, InboundHandler
    from orchestrator.bridge import BridgeScope, ChannelOutbox, PendingOutbox
    from orchestrator.conversations import conversation_paths

    class Recording(Channel):
        name = "telegram"

        def __init__(self) -> None:
            self.sent: list[OutboundMessage] = []

        async def start(self, on_message: InboundHandler) -> None: ...

        async def stop(self) -> None: ...

        async def send(self, message: OutboundMessage) -> DeliveryReceipt:
            self.sent.append(message)
            return DeliveryReceipt(f"tg-{len(self.sent)}")

    key = ConversationKey("bot", "telegram", "42")
    paths = conversation_paths(Path("/a"), Path("/a/workspace"), key, "s1")
    scope = BridgeScope.for_conversation(key, "s1", paths)
    tg = Recording()
    other_agent = Recording()
    outbox = ChannelOutbox({("bot", "telegram"): tg, ("other", "telegram"): other_agent})
    msg = OutboundMessage(channel="telegram", chat_id="42", outbound_key="bridge:k1", text="hi")
    assert (await outbox.deliver(scope, msg)).platform_message_id == "tg-1"
    assert (await outbox.deliver(scope, msg)).platform_message_id == "tg-1"
    assert len(tg.sent) == 1
    assert other_agent.sent == [], "routed by the conversation's agent, not only the channel"
    try:
        await outbox.deliver(scope, OutboundMessage("line", "42", "bridge:k2"))
    except BridgeError as exc:
        assert exc.code == "delivery_failed"
    else:
        raise AssertionError("an unknown channel must fail")
    pending = PendingOutbox()
    await pending.deliver(scope, msg)
    await pending.deliver(scope, msg)
    assert pending.take(scope.conversation_id) == [msg]
    assert pending.take(scope.conversation_id) == []


async def test_install_client_puts_two_executables_in_the_bridge_dir(world: World) -> None:
    a = await world.open("42")
    for name in ("cellgate-tool", "cellgate-mcp"):
        st = os.stat(a.socket.parent / name)
        assert st.st_mode & 0o777 == 0o755
    source = SOURCE_DIR / "cellgate_mcp.py"
    assert (a.socket.parent / "cellgate-mcp").read_bytes() == source.read_bytes()
    assert sorted(os.listdir(a.socket.parent)) == ["bridge.sock", "cellgate-mcp", "cellgate-tool"]


def test_T1_registering_a_name_twice_is_an_error(world: World) -> None:
    import pytest

    from orchestrator.bridge import ToolCall

    async def h(call: ToolCall) -> dict[str, object]:
        return {}

    with pytest.raises(ValueError, match="already registered"):
        world.handlers.register("reply", h)
