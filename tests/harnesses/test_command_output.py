"""Reading CLI output and expanding templates (H2): table-driven, no sandbox needed.

The output comes from code running in the sandbox, so a session id is taken
only from the top level and only when it looks like one.
"""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter, ValidationError

from orchestrator.config import AgentConfig, HarnessConfig
from orchestrator.harnesses.command import (
    PRESETS,
    CommandTemplate,
    ParsedOutput,
    expand,
    parse_output,
    valid_session_id,
)

SID = "4f1c2d9e-8a7b-4c3d-9e8f-0a1b2c3d4e5f"


def claude(**doc: object) -> bytes:
    return json.dumps({"type": "result", "subtype": "success", "is_error": False, **doc}).encode()


def jsonl(*events: dict[str, object]) -> bytes:
    return "\n".join(json.dumps(e) for e in events).encode()


CLAUDE_CASES = [
    pytest.param(claude(result="hi", session_id=SID), ParsedOutput(True, "hi", SID), id="plain"),
    pytest.param(
        b"warning: something\n" + claude(result="hi", session_id=SID),
        ParsedOutput(True, "hi", SID),
        id="noise-before-the-result-line",
    ),
    pytest.param(
        claude(result='{"session_id": "evil"}', session_id="--resume-me"),
        ParsedOutput(True, '{"session_id": "evil"}', None),
        id="flag-like-id-refused-nested-id-ignored",
    ),
    pytest.param(
        claude(result="", session_id=SID, is_error=True, subtype="error_max_turns"),
        ParsedOutput(False, "the agent stopped: error_max_turns", SID),
        id="error-keeps-session",
    ),
    pytest.param(
        b"not json",
        ParsedOutput(False, "the agent's output was not the JSON claude prints", None),
        id="garbage",
    ),
    pytest.param(claude(session_id=SID), ParsedOutput(False, "", SID), id="no-result"),
]


@pytest.mark.parametrize(("stdout", "expected"), CLAUDE_CASES)
def test_H2_claude_json_output(stdout: bytes, expected: ParsedOutput) -> None:
    assert parse_output("claude-json", stdout) == expected


CODEX_CASES = [
    pytest.param(
        jsonl(
            {"type": "thread.started", "thread_id": "th_1"},
            {"type": "item.completed", "item": {"type": "agent_message", "text": "first"}},
            {"type": "item.completed", "item": {"type": "command_execution", "command": "ls"}},
            {"type": "item.completed", "item": {"type": "agent_message", "text": "last"}},
            {"type": "turn.completed"},
        ),
        ParsedOutput(True, "last", "th_1"),
        id="last-agent-message",
    ),
    pytest.param(
        jsonl(
            {"type": "thread.started", "thread_id": "th_2"},
            {"type": "item.completed", "item": {"item_type": "assistant_message", "text": "old"}},
        ),
        ParsedOutput(True, "old", "th_2"),
        id="older-item-type-field",
    ),
    pytest.param(
        jsonl(
            {"type": "thread.started", "thread_id": "th_3"},
            {"type": "turn.failed", "error": {"message": "rate limited"}},
        ),
        ParsedOutput(False, "the agent failed: rate limited", "th_3"),
        id="turn-failed",
    ),
    pytest.param(
        jsonl({"type": "thread.started", "thread_id": "a b"}, {"type": "turn.completed"}),
        ParsedOutput(False, "the agent's output held no agent message", None),
        id="bad-id-no-message",
    ),
]


@pytest.mark.parametrize(("stdout", "expected"), CODEX_CASES)
def test_H2_codex_jsonl_output(stdout: bytes, expected: ParsedOutput) -> None:
    assert parse_output("codex-jsonl", stdout) == expected


def test_H2_text_output_is_capped() -> None:
    out = parse_output("text", b"x" * 20_000)
    assert out.ok and out.reply.endswith("[output truncated]") and len(out.reply) < 16_100


@pytest.mark.parametrize(
    ("value", "ok"),
    [(SID, True), ("th_abc", True), ("-x", False), ("", False), ("a/b", False), (7, False)],
)
def test_valid_session_id(value: object, ok: bool) -> None:
    assert (valid_session_id(value) is not None) is ok


def test_H2_expand_is_one_pass_and_never_re_expands() -> None:
    argv = ("run", "{prompt}", "--id={session_id}", "{{literal}}")
    assert expand(argv, "say {session_id}\0", "abc") == [
        "run",
        "say {session_id}",
        "--id=abc",
        "{{literal}}",
    ]


def test_H2_presets_send_the_prompt_on_stdin() -> None:
    for template in PRESETS.values():
        assert template.prompt_on_stdin(resume=False) and template.prompt_on_stdin(resume=True)


@pytest.mark.parametrize(
    ("argv", "resume", "match"),
    [
        ((), None, "argv is empty"),
        (("x", "{promt}"), None, "unknown placeholder"),
        (("x",), ("x", "--resume"), "must contain {session_id}"),
    ],
)
def test_H2_bad_templates_are_refused(
    argv: tuple[str, ...], resume: tuple[str, ...] | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        CommandTemplate(argv, resume)


HARNESS = TypeAdapter(HarnessConfig)


@pytest.mark.parametrize(
    "doc",
    [
        {"type": "command", "preset": "claude"},
        {"type": "command", "preset": "codex", "timeoutSeconds": 30},
        {"type": "command", "argv": ["my-agent", "{prompt}"], "output": "text"},
        {"type": "openai", "baseUrl": "http://127.0.0.1:9/v1", "model": "m", "apiKeyEnv": "K"},
        {"type": "shell"},
    ],
)
def test_H2_harness_configs_load(doc: dict[str, object]) -> None:
    assert HARNESS.validate_python(doc).type == doc["type"]


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"type": "command"}, "preset"),
        ({"type": "command", "argv": ["x", "{nope}"]}, "unknown placeholder"),
        ({"type": "command", "preset": "gemini"}, "preset"),
        (
            {
                "type": "openai",
                "baseUrl": "http://h/v1",
                "model": "m",
                "apiKey": "k",
                "apiKeyEnv": "K",
            },
            "not both",
        ),
        ({"type": "openai", "baseUrl": "ftp://h", "model": "m"}, "baseUrl"),
        ({"type": "openai", "baseUrl": "http://h", "model": "m", "maxSteps": 0}, "maxSteps"),
        ({"type": "telepathy"}, "type"),
    ],
)
def test_H2_bad_harness_configs_say_why(doc: dict[str, object], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        HARNESS.validate_python(doc)


def test_K1_openai_key_is_a_secret_in_config() -> None:
    agent = AgentConfig.model_validate(
        {
            "id": "bot",
            "harness": {
                "type": "openai",
                "baseUrl": "http://h/v1",
                "model": "m",
                "apiKey": "sk-x1",
            },
        }
    )
    assert "sk-x1" not in repr(agent) and "sk-x1" not in agent.model_dump_json()


def test_H2_build_harness_makes_each_configured_harness() -> None:
    from orchestrator.bridge.catalogue import BUILTIN_TOOLS
    from orchestrator.gateway import build_harness
    from orchestrator.harnesses.base import TurnRequest
    from orchestrator.harnesses.command import CommandHarness
    from orchestrator.harnesses.openai import SANDBOX_TOOLS, OpenAIHarness
    from orchestrator.harnesses.shell import ShellHarness

    def agent(harness: dict[str, object], **kw: object) -> AgentConfig:
        return AgentConfig.model_validate({"id": "bot", "harness": harness, **kw})

    claude_h = build_harness(
        agent({"type": "command", "preset": "claude"}, claude={"extraFlags": ["--model", "x"]})
    )
    assert isinstance(claude_h, CommandHarness)
    assert claude_h.template.argv[:3] == ("claude", "--model", "x")
    codex_h = build_harness(
        agent({"type": "command", "preset": "codex"}, claude={"extraFlags": ["--model", "x"]})
    )
    assert isinstance(codex_h, CommandHarness) and "--model" not in codex_h.template.argv
    ai_h = build_harness(
        agent({"type": "openai", "baseUrl": "http://127.0.0.1:9/v1", "model": "m", "maxSteps": 3})
    )
    assert isinstance(ai_h, OpenAIHarness) and ai_h.max_steps == 3
    turn = TurnRequest("hi", tools=BUILTIN_TOOLS)
    assert ai_h.tools_for(turn) == (*SANDBOX_TOOLS, *BUILTIN_TOOLS)
    quiet = build_harness(
        agent({"type": "openai", "baseUrl": "http://h/v1", "model": "m", "bridgeTools": False})
    )
    assert isinstance(quiet, OpenAIHarness) and quiet.tools_for(turn) == SANDBOX_TOOLS
    assert isinstance(build_harness(agent({"type": "shell"})), ShellHarness)
