#!/usr/bin/env python3
"""Stand-ins for the `claude` and `codex` CLIs, installed in a test image as both names.

They speak the real output formats (`claude -p --output-format json`, one
result object; `codex exec --json`, JSONL events), keep sessions under
`$HOME/.claude/fake-<tool>/` so resuming works across runs, and answer with a
JSON document of facts about how they were started: argv, where the prompt
came from, the environment, the session's earlier prompts.

Prompts with a meaning: `sleep:N` sleeps N seconds; `fail` reports an error;
`mcp:tools` starts every MCP server the CLI was given (claude `--mcp-config`
JSON or file, `--strict-mcp-config`; codex `-c mcp_servers.<name>.command=` and
`.args=`) over stdio, as the real CLIs do, and reports the tools each lists.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path


def _store(tool: str) -> Path:
    path = Path(os.environ.get("HOME", "/tmp")) / ".claude" / f"fake-{tool}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _mcp_tools(servers: dict[str, dict[str, object]]) -> dict[str, object]:
    """initialize, notifications/initialized, tools/list with each server, as a CLI does."""
    import subprocess

    out: dict[str, object] = {}
    for name, spec in servers.items():
        argv = [str(spec.get("command", ""))] + [str(a) for a in spec.get("args", []) or []]  # type: ignore[union-attr]
        requests = [
            {"jsonrpc": "2.0", "id": 1, "method": "initialize",
             "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                        "clientInfo": {"name": "fake-cli", "version": "0"}}},
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            {"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}},
        ]  # fmt: skip
        feed = "".join(json.dumps(r) + "\n" for r in requests)
        done = subprocess.run(argv, input=feed, capture_output=True, text=True, timeout=60)
        names: list[str] = []
        for line in done.stdout.splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if doc.get("id") == 2:
                names = [t["name"] for t in doc.get("result", {}).get("tools", [])]
        out[name] = names if names else {"error": done.stderr[-500:]}
    return out


MCP: dict[str, object] = {"servers": {}, "strict": False}


def _facts(tool: str, argv: list[str], prompt: str, source: str, history: list[str]) -> str:
    mcp = dict(MCP)
    if prompt == "mcp:tools":
        mcp["tools"] = _mcp_tools(MCP["servers"])  # type: ignore[arg-type]
    return json.dumps(
        {
            "mcp": mcp,
            "tool": tool,
            "argv": argv,
            "prompt": prompt,
            "prompt_source": source,
            "turn": len(history),
            "history": history,
            "auto_memory_off": os.environ.get("CLAUDE_CODE_DISABLE_AUTO_MEMORY"),
            "env_keys": sorted(os.environ),
            "cwd": os.getcwd(),
            "uid": os.getuid(),
        }
    )


def _prompt(positional: list[str]) -> tuple[str, str]:
    if positional and positional[-1] != "-":
        return positional[-1], "argv"
    return sys.stdin.read(), "stdin"


def _behave(prompt: str) -> None:
    if prompt.startswith("sleep:"):
        time.sleep(float(prompt.split(":", 1)[1]))


def claude(argv: list[str]) -> int:
    resume = None
    positional: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("--resume", "-r", "--output-format", "--session-id", "--mcp-config"):
            if a in ("--resume", "-r"):
                resume = argv[i + 1]
            if a == "--mcp-config":
                raw = argv[i + 1]
                doc = json.loads(raw if raw.lstrip().startswith("{") else Path(raw).read_text())
                MCP["servers"] = doc.get("mcpServers", {})
            i += 2
            continue
        if a == "--strict-mcp-config":
            MCP["strict"] = True
        if not a.startswith("-"):
            positional.append(a)
        i += 1
    prompt, source = _prompt(positional)
    store = _store("claude")
    if resume is not None:
        f = store / f"{resume}.json"
        if not f.is_file():
            print(f"No conversation found with session ID: {resume}", file=sys.stderr)
            return 1
        sid, history = resume, json.loads(f.read_text())
    else:
        sid, history = str(uuid.uuid4()), []
    history.append(prompt)
    (store / f"{sid}.json").write_text(json.dumps(history))
    _behave(prompt)
    failed = prompt == "fail"
    print(
        json.dumps(
            {
                "type": "result",
                "subtype": "error_during_execution" if failed else "success",
                "is_error": failed,
                "duration_ms": 12,
                "num_turns": 1,
                "result": "" if failed else _facts("claude", argv, prompt, source, history),
                "session_id": sid,
                "total_cost_usd": 0.0,
                "usage": {"input_tokens": 1, "output_tokens": 1},
            }
        )
    )
    return 1 if failed else 0


def codex(argv: list[str]) -> int:
    if not argv or argv[0] != "exec":
        print("usage: codex exec [--json] [resume ID] PROMPT", file=sys.stderr)
        return 2
    rest: list[str] = []
    servers: dict[str, dict[str, object]] = {}
    args = iter(argv[1:])
    for a in args:
        if a == "-c":
            key, _, value = next(args).partition("=")
            parts = key.split(".")
            if len(parts) == 3 and parts[0] == "mcp_servers":
                servers.setdefault(parts[1], {})[parts[2]] = json.loads(value)
        elif not a.startswith("--"):
            rest.append(a)
    MCP["servers"] = servers
    resume = None
    if rest and rest[0] == "resume":
        resume, rest = rest[1], rest[2:]
    prompt, source = _prompt(rest)
    store = _store("codex")
    if resume is not None:
        f = store / f"{resume}.json"
        if not f.is_file():
            print(json.dumps({"type": "error", "message": f"no rollout found for {resume}"}))
            return 1
        tid, history = resume, json.loads(f.read_text())
    else:
        tid, history = f"th_{uuid.uuid4().hex[:12]}", []
    history.append(prompt)
    (store / f"{tid}.json").write_text(json.dumps(history))
    _behave(prompt)
    events: list[dict[str, object]] = [
        {"type": "thread.started", "thread_id": tid},
        {"type": "turn.started"},
        {"type": "item.completed", "item": {"id": "item_0", "type": "reasoning", "text": "hm"}},
    ]
    if prompt == "fail":
        events.append({"type": "turn.failed", "error": {"message": "model overloaded"}})
    else:
        events += [
            {
                "type": "item.completed",
                "item": {"id": "item_1", "type": "agent_message", "text": "draft"},
            },
            {
                "type": "item.completed",
                "item": {
                    "id": "item_2",
                    "type": "agent_message",
                    "text": _facts("codex", argv, prompt, source, history),
                },
            },
            {"type": "turn.completed", "usage": {"input_tokens": 1, "output_tokens": 1}},
        ]
    for ev in events:
        print(json.dumps(ev))
    return 1 if prompt == "fail" else 0


if __name__ == "__main__":
    tool = os.path.basename(sys.argv[0])
    sys.exit(codex(sys.argv[1:]) if tool == "codex" else claude(sys.argv[1:]))
