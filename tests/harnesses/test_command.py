"""The command harness (H1, H2, T3, D3) on a real sandbox, with fake `claude` / `codex` CLIs.

The fakes answer with facts about how they were run (argv, prompt source,
environment, the session's earlier prompts), in the real output formats.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from orchestrator.harnesses.base import ExecDetail, TurnRequest, TurnResult
from orchestrator.harnesses.command import CommandHarness, CommandTemplate
from orchestrator.harnesses.templates import CLAUDE_MCP_FLAGS, CODEX_MCP_FLAGS
from sandbox.backends.docker import DockerBackend
from tests.harnesses.conftest import Sandboxed

pytestmark = pytest.mark.docker

HOSTILE = "--dangerously-skip-permissions $(touch /tmp/pwned) `touch /tmp/pwned2`; {session_id}"


def exec_detail(result: TurnResult) -> ExecDetail:
    assert isinstance(result.detail, ExecDetail), result
    return result.detail


def facts(result: TurnResult) -> dict[str, Any]:
    assert result.ok, result
    doc = json.loads(result.reply)
    assert isinstance(doc, dict)
    return doc


async def test_H2_T3_claude_preset_runs_in_sandbox_with_auto_memory_off(
    sandboxes: Callable[[str], Sandboxed], backend: DockerBackend
) -> None:
    sb = sandboxes("claude-1")
    ctx = sb.ctx(backend)
    harness = CommandHarness.preset("claude")
    assert await harness.ensure_session(ctx) == ""
    first = await harness.dispatch(ctx, TurnRequest("hello there"))
    f1 = facts(first)
    assert f1["tool"] == "claude"
    assert f1["argv"] == ["-p", "--output-format", "json", *CLAUDE_MCP_FLAGS]
    assert (f1["prompt"], f1["prompt_source"]) == ("hello there", "stdin")
    assert f1["auto_memory_off"] == "1"  # T3
    assert f1["uid"] == 10001 and f1["cwd"] == "/workspace"
    sid = first.harness_session_id
    assert isinstance(sid, str) and sid
    assert await harness.ensure_session(ctx) == sid

    second = await harness.dispatch(ctx, TurnRequest("and again"))
    f2 = facts(second)
    assert f2["argv"] == ["-p", "--output-format", "json", "--resume", sid, *CLAUDE_MCP_FLAGS]
    assert f2["history"] == ["hello there", "and again"]
    assert second.harness_session_id == sid and exec_detail(second).resumed is True


async def test_H2_hostile_prompt_is_data_never_a_flag_or_shell(
    sandboxes: Callable[[str], Sandboxed], backend: DockerBackend
) -> None:
    sb = sandboxes("claude-hostile")
    harness = CommandHarness.preset("claude")
    f = facts(await harness.dispatch(sb.ctx(backend), TurnRequest(HOSTILE)))
    assert f["prompt"] == HOSTILE
    assert f["argv"] == ["-p", "--output-format", "json", *CLAUDE_MCP_FLAGS]
    assert sb.sh("ls /tmp/pwned /tmp/pwned2 2>&1")[0] != 0


async def test_D3_restarted_gateway_resumes_from_saved_session_id(
    sandboxes: Callable[[str], Sandboxed], backend: DockerBackend
) -> None:
    sb = sandboxes("claude-restart")
    before = await CommandHarness.preset("claude").dispatch(
        sb.ctx(backend), TurnRequest("remember 7")
    )
    sid = before.harness_session_id
    fresh = CommandHarness.preset("claude")  # a new process knows nothing
    after = await fresh.dispatch(sb.ctx(backend), TurnRequest("what number?", resume_id=sid))
    assert facts(after)["history"] == ["remember 7", "what number?"]
    assert after.harness_session_id == sid


async def test_D3_unknown_or_hostile_saved_session_starts_cold(
    sandboxes: Callable[[str], Sandboxed], backend: DockerBackend
) -> None:
    sb = sandboxes("claude-stale")
    harness = CommandHarness.preset("claude")
    gone = await harness.dispatch(sb.ctx(backend), TurnRequest("hi", resume_id="no-such-session"))
    assert facts(gone)["history"] == ["hi"]
    assert exec_detail(gone).resume_failed is True
    assert gone.harness_session_id not in (None, "no-such-session")

    hostile = CommandHarness.preset("claude")
    res = await hostile.dispatch(
        sb.ctx(backend), TurnRequest("hi", resume_id="--dangerously-skip-permissions")
    )
    assert facts(res)["argv"] == ["-p", "--output-format", "json", *CLAUDE_MCP_FLAGS]


async def test_H1_reset_session_starts_cold_even_with_a_saved_id(
    sandboxes: Callable[[str], Sandboxed], backend: DockerBackend
) -> None:
    sb = sandboxes("claude-reset")
    ctx = sb.ctx(backend)
    harness = CommandHarness.preset("claude")
    sid = (await harness.dispatch(ctx, TurnRequest("one"))).harness_session_id
    await harness.reset_session(ctx)
    assert await harness.ensure_session(ctx) == ""
    res = await harness.dispatch(ctx, TurnRequest("two", resume_id=sid))
    assert facts(res)["history"] == ["two"]
    assert res.harness_session_id != sid


async def test_H2_claude_error_result_is_not_ok(
    sandboxes: Callable[[str], Sandboxed], backend: DockerBackend
) -> None:
    sb = sandboxes("claude-fail")
    res = await CommandHarness.preset("claude").dispatch(sb.ctx(backend), TurnRequest("fail"))
    assert not res.ok and exec_detail(res).exit_code == 1
    assert "error_during_execution" in res.reply


async def test_H2_extra_flags_follow_the_executable(
    sandboxes: Callable[[str], Sandboxed], backend: DockerBackend
) -> None:
    sb = sandboxes("claude-flags")
    harness = CommandHarness.preset("claude", extra_flags=("--model", "haiku"))
    f = facts(await harness.dispatch(sb.ctx(backend), TurnRequest("x")))
    assert f["argv"] == ["--model", "haiku", "-p", "--output-format", "json", *CLAUDE_MCP_FLAGS]


async def test_H2_codex_preset_parses_thread_and_last_agent_message(
    sandboxes: Callable[[str], Sandboxed], backend: DockerBackend
) -> None:
    sb = sandboxes("codex-1")
    ctx = sb.ctx(backend)
    harness = CommandHarness.preset("codex")
    first = await harness.dispatch(ctx, TurnRequest("-n hello"))
    f1 = facts(first)
    assert f1["tool"] == "codex" and f1["prompt"] == "-n hello"
    assert f1["prompt_source"] == "stdin" and f1["auto_memory_off"] == "1"
    tid = first.harness_session_id
    assert tid.startswith("th_")
    second = await harness.dispatch(ctx, TurnRequest("next"))
    f2 = facts(second)
    assert f2["argv"] == [
        "exec", "--json", "--skip-git-repo-check", *CODEX_MCP_FLAGS, "resume", tid, "-"
    ]  # fmt: skip
    assert f2["history"] == ["-n hello", "next"]

    failed = await harness.dispatch(ctx, TurnRequest("fail"))
    assert not failed.ok and "model overloaded" in failed.reply


async def test_H2_custom_template_with_placeholders_in_argv(
    sandboxes: Callable[[str], Sandboxed], backend: DockerBackend
) -> None:
    sb = sandboxes("custom")
    template = CommandTemplate(
        argv=("/bin/echo", "asked: {prompt}", "session={session_id}"),
        output="text",
    )
    res = await CommandHarness(template).dispatch(
        sb.ctx(backend), TurnRequest("$(id) {session_id}")
    )
    assert res.ok
    assert res.reply == "asked: $(id) {session_id} session=\n"


async def test_H2_timeout_is_reported_not_raised(
    sandboxes: Callable[[str], Sandboxed], backend: DockerBackend
) -> None:
    sb = sandboxes("claude-slow")
    harness = CommandHarness.preset("claude", timeout_seconds=1)
    res = await harness.dispatch(sb.ctx(backend), TurnRequest("sleep:20"))
    assert not res.ok and exec_detail(res).timed_out is True
    assert "timed out" in res.reply
