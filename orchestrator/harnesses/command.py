"""The generic command harness (H2): a CLI agent run once per turn inside the sandbox.

A turn runs a command template with `ctx.backend.exec`, in the session's
environment (`ctx.env`, which carries `CLAUDE_CODE_DISABLE_AUTO_MEMORY=1`, T3)
and working directory. Two placeholders exist, each replaced inside an argv
element, in one pass: `{prompt}` (the message) and `{session_id}` (the harness
session to resume). Nothing goes through a shell. A template without
`{prompt}` gets the message on stdin, which is what the presets do, so a
message that starts with `-` can never be read as a flag.

Presets:
- `claude`: `claude -p --output-format json [--resume <sid>]`, prompt on
  stdin; the reply is `result` and the session is `session_id` of its JSON.
- `codex`: `codex exec --json --skip-git-repo-check [resume <sid>] -`; the
  session is the `thread_id` of `thread.started` and the reply the last
  `agent_message` item of its JSONL.

The session id comes back from code running in the sandbox, so it is read
only from the top level of the output and used only if it looks like an id
(no leading `-`, no spaces). Resuming: `dispatch` takes a saved id from
`TurnRequest.resume_id` when this process knows none for the conversation
(D3), and reports the id in `TurnResult.harness_session_id`. A resume that
fails is retried once from cold.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cellgate.errors import new_ref
from orchestrator import config
from orchestrator.bounded import LruMap
from orchestrator.harnesses.base import ExecDetail, Harness, SessionContext, TurnRequest, TurnResult
from orchestrator.harnesses.templates import (
    PLACEHOLDER,
    PRESETS,
    CommandTemplate,
    OutputFormat,
)

__all__ = [
    "MAX_REPLY_CHARS",
    "PRESETS",
    "CommandHarness",
    "CommandTemplate",
    "OutputFormat",
    "ParsedOutput",
    "expand",
    "parse_output",
    "valid_session_id",
]

logger = logging.getLogger(__name__)

# Sessions this process remembers (a cache: the id and history are saved per chat, D3).
SESSION_CACHE_MAX = 1024

MAX_REPLY_CHARS = 16_000
_SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def valid_session_id(value: object) -> str | None:
    """`value` if it is a plausible harness session id, else None."""
    return value if isinstance(value, str) and _SESSION_ID.fullmatch(value) else None


def expand(argv: Sequence[str], prompt: str, session_id: str) -> list[str]:
    """Replace `{prompt}` and `{session_id}` in each element, in one pass (no re-expansion)."""
    values = {"prompt": prompt.replace("\0", ""), "session_id": session_id}
    return [PLACEHOLDER.sub(lambda m: values[m.group(1)], part) for part in argv]


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    ok: bool
    reply: str
    session_id: str | None


def _cap(text: str) -> str:
    if len(text) > MAX_REPLY_CHARS:
        return text[:MAX_REPLY_CHARS] + "\n[output truncated]"
    return text


def _json_objects(text: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out


def _parse_claude(stdout: str) -> ParsedOutput:
    doc: object
    try:
        doc = json.loads(stdout)
    except ValueError:
        results = [d for d in _json_objects(stdout) if d.get("type") == "result"]
        doc = results[-1] if results else None
    if not isinstance(doc, dict):
        return ParsedOutput(False, "the agent's output was not the JSON claude prints", None)
    sid = valid_session_id(doc.get("session_id"))
    result = doc.get("result")
    reply = result if isinstance(result, str) else ""
    failed = doc.get("is_error") is True or (
        isinstance(doc.get("subtype"), str) and str(doc.get("subtype")).startswith("error")
    )
    if failed and not reply:
        reply = f"the agent stopped: {doc.get('subtype', 'error')}"
    return ParsedOutput(not failed and isinstance(result, str), reply, sid)


def _parse_codex(stdout: str) -> ParsedOutput:
    sid: str | None = None
    reply: str | None = None
    error: str | None = None
    for ev in _json_objects(stdout):
        kind = ev.get("type")
        if kind == "thread.started":
            sid = valid_session_id(ev.get("thread_id")) or sid
        elif kind == "item.completed" and isinstance(ev.get("item"), dict):
            item = ev["item"]
            item_type = item.get("type", item.get("item_type"))
            if item_type in ("agent_message", "assistant_message") and isinstance(
                item.get("text"), str
            ):
                reply = item["text"]
        elif kind == "turn.failed":
            err = ev.get("error")
            msg = err.get("message") if isinstance(err, dict) else None
            error = msg if isinstance(msg, str) else "the turn failed"
        elif kind == "error" and isinstance(ev.get("message"), str):
            error = ev["message"]
    if error is not None:
        return ParsedOutput(False, f"the agent failed: {error}", sid)
    if reply is None:
        return ParsedOutput(False, "the agent's output held no agent message", sid)
    return ParsedOutput(True, reply, sid)


def parse_output(fmt: OutputFormat, stdout: bytes) -> ParsedOutput:
    """Read a turn's reply and session id from the command's standard output."""
    text = stdout.decode("utf-8", "replace")
    if fmt == "claude-json":
        parsed = _parse_claude(text)
    elif fmt == "codex-jsonl":
        parsed = _parse_codex(text)
    else:
        parsed = ParsedOutput(True, text, None)
    return ParsedOutput(parsed.ok, _cap(parsed.reply), parsed.session_id)


class CommandHarness(Harness):
    """Runs `template` in the sandbox once per turn; resumes the conversation's session."""

    def __init__(self, template: CommandTemplate, *, timeout_seconds: float = 300.0) -> None:
        self.template = template
        self.timeout_seconds = timeout_seconds
        self._sessions: LruMap[Any, str] = LruMap(SESSION_CACHE_MAX)
        self._reset: set[Any] = set()

    @classmethod
    def preset(
        cls,
        name: str,
        *,
        extra_flags: Sequence[str] = (),
        argv: Sequence[str] | None = None,
        resume_argv: Sequence[str] | None = None,
        timeout_seconds: float = 300.0,
    ) -> CommandHarness:
        """A preset, with `extra_flags` after its first word (e.g. `claude.extraFlags`)."""
        base = PRESETS[name]
        first = tuple(argv) if argv is not None else base.argv
        again = tuple(resume_argv) if resume_argv is not None else base.resume_argv
        flags = tuple(extra_flags)
        template = CommandTemplate(
            argv=(first[0], *flags, *first[1:]),
            resume_argv=(again[0], *flags, *again[1:]) if again else None,
            output=base.output,
        )
        return cls(template, timeout_seconds=timeout_seconds)

    @classmethod
    def from_config(
        cls, cfg: config.CommandHarness, *, claude_flags: Sequence[str] = ()
    ) -> CommandHarness:
        """From `agents[].harness`; `claude_flags` (`claude.extraFlags`) go to the claude preset."""
        if cfg.preset is not None:
            return cls.preset(
                cfg.preset,
                extra_flags=claude_flags if cfg.preset == "claude" else (),
                argv=cfg.argv,
                resume_argv=cfg.resume_argv,
                timeout_seconds=cfg.timeout_seconds,
            )
        if cfg.argv is None:
            raise ValueError("a command harness needs a preset or argv")
        template = CommandTemplate(cfg.argv, cfg.resume_argv, cfg.output or "text")
        return cls(template, timeout_seconds=cfg.timeout_seconds)

    def _key(self, ctx: SessionContext) -> Any:
        return (ctx.conversation, ctx.session_key)

    async def ensure_session(self, ctx: SessionContext) -> str:
        """The harness session id this process knows for the conversation, or "" if none yet."""
        return self._sessions.get(self._key(ctx)) or ""

    async def _run(
        self, ctx: SessionContext, message: str, session_id: str | None
    ) -> tuple[ParsedOutput, int, bool, bytes]:
        resume = session_id is not None and self.template.resume_argv is not None
        argv = self.template.resume_argv if resume else self.template.argv
        assert argv is not None
        on_stdin = self.template.prompt_on_stdin(resume)
        result = await ctx.backend.exec(
            ctx.sandbox,
            expand(argv, "" if on_stdin else message, session_id or ""),
            env=ctx.env,
            stdin=message.encode("utf-8") if on_stdin else None,
            timeout=self.timeout_seconds,
            workdir=ctx.workdir,
        )
        if result.timed_out:
            parsed = ParsedOutput(False, "", None)
        else:
            parsed = parse_output(self.template.output, result.stdout)
            if result.exit_code != 0:
                parsed = ParsedOutput(False, parsed.reply, parsed.session_id)
        return parsed, result.exit_code, result.timed_out, result.stderr

    async def dispatch(self, ctx: SessionContext, request: TurnRequest) -> TurnResult:
        turn_id = uuid.uuid4().hex
        message = request.prompt
        key = self._key(ctx)
        saved = None if key in self._reset else valid_session_id(request.resume_id)
        prior = self._sessions.get(key) or saved
        parsed, code, timed_out, stderr = await self._run(ctx, message, prior)
        resumed = prior is not None and self.template.resume_argv is not None
        retried = False
        if resumed and not parsed.ok and not timed_out:
            logger.info(
                "resuming harness session failed (exit %s); starting cold",
                code,
                extra={"conversation": ctx.conversation.digest},
            )
            self._sessions.pop(key)
            parsed, code, timed_out, stderr = await self._run(ctx, message, None)
            resumed, retried = False, True
        sid = parsed.session_id or (prior if resumed else None)
        if sid is not None:
            self._sessions.put(key, sid)
            self._reset.discard(key)
        reply = parsed.reply
        # a host command's failure output (stdout too) may name host paths: log only
        if not parsed.ok and (timed_out or not reply.strip() or not ctx.backend.confined):
            reply = self._failure_reply(ctx, code, timed_out, stderr, parsed.reply)
        return TurnResult(
            ok=parsed.ok,
            reply=reply,
            turn_id=turn_id,
            harness_session_id=self._sessions.get(key),
            detail=ExecDetail(
                exit_code=code, timed_out=timed_out, resumed=resumed, resume_failed=retried
            ),
        )

    def _failure_reply(
        self, ctx: SessionContext, code: int, timed_out: bool, stderr: bytes, stdout: str = ""
    ) -> str:
        """R6: a failed turn's reply names the failure and a reference the log holds.

        A sandboxed command's own error output is shown with it (the conversation's
        own sandbox printed it); a host agent's output, either stream, is only logged
        (it may name host paths).
        """
        ref = new_ref()
        tail = stderr.decode("utf-8", "replace").strip()[-2000:]
        what = (
            f"timed out after {self.timeout_seconds:g} s"
            if timed_out
            else f"the agent command failed (exit {code})"
        )
        out = stdout.strip()[-2000:]
        logger.warning(
            "turn %s (ref %s): %s%s%s",
            "timed out" if timed_out else "failed",
            ref,
            what,
            f"; its output ends: {out}" if out else "",
            f"; its error output ends: {tail}" if tail else "",
            extra={"conversation": ctx.conversation.digest, "ref": ref},
        )
        shown = f": {tail}" if tail and ctx.backend.confined and not timed_out else ""
        return f"[{what}{shown}] (ref {ref})"

    async def reset_session(self, ctx: SessionContext) -> None:
        """Forget the session id; the next turn starts a new session (it ignores `resume_id`)."""
        self._sessions.pop(self._key(ctx))
        self._reset.add(self._key(ctx))
