"""`/dashboard`: one server-rendered page for admin keys (O3).

A browser cannot send a Bearer header from its address bar, so the page has a
login form: the admin key is posted once, checked, and answered with a random
session cookie (HttpOnly, SameSite=Strict, Secure over HTTPS); the key itself
never travels in a URL or a cookie. Each request authenticates the key again
(a revoked key ends its sessions). Sessions live in memory, bounded, for
`SESSION_SECONDS`.

The page: agents and apps; chats by recent activity; live sandboxes with
their spec hash and a live check of their container (S4); recent turns and
failures; recent refusals with their rule. Jinja2 escapes everything shown.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape

from cellgate.errors import CellgateError
from orchestrator.api.auth import Principal, authenticate
from orchestrator.api.context import ApiContext, context
from orchestrator.api.errors import ApiError

__all__ = ["router"]

COOKIE = "cellgate_dashboard"
SESSION_SECONDS = 12 * 3600
SESSIONS_MAX = 256
FORM_MAX = 4096
ROWS = 50

router = APIRouter(tags=["dashboard"], include_in_schema=False)
Ctx = Annotated[ApiContext, Depends(context)]

_env = Environment(
    loader=PackageLoader("orchestrator.api", "templates"),
    autoescape=select_autoescape(["html"]),
)


@dataclass(frozen=True, slots=True)
class _Session:
    secret: str
    expires: float


class _Sessions:
    """Session token -> the admin key it was opened with; bounded, expiring."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, _Session] = OrderedDict()

    def open(self, secret: str) -> str:
        token = secrets.token_urlsafe(32)
        self._items[token] = _Session(secret, time.monotonic() + SESSION_SECONDS)
        while len(self._items) > SESSIONS_MAX:
            self._items.popitem(last=False)
        return token

    def secret(self, token: str | None) -> str | None:
        s = self._items.get(token or "")
        if s is None or s.expires < time.monotonic():
            self._items.pop(token or "", None)
            return None
        return s.secret

    def close(self, token: str | None) -> None:
        self._items.pop(token or "", None)


def _sessions(request: Request) -> _Sessions:
    state = request.app.state
    if not hasattr(state, "dashboard_sessions"):
        state.dashboard_sessions = _Sessions()
    sessions: _Sessions = state.dashboard_sessions
    return sessions


def _admin(ctx: ApiContext, secret: str | None) -> Principal | None:
    if not secret:
        return None
    try:
        who = authenticate(ctx, secret)
    except ApiError:
        return None
    return who if who.admin else None


def _login_page(status: int, error: str = "") -> HTMLResponse:
    html = _env.get_template("login.html").render(error=error)
    return HTMLResponse(html, status_code=status, headers=_NO_STORE)


_NO_STORE = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
    "form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard(request: Request, ctx: Ctx) -> Response:
    who = _admin(ctx, _sessions(request).secret(request.cookies.get(COOKIE)))
    if who is None:
        return _login_page(401)
    view = await _gather(ctx)
    html = _env.get_template("dashboard.html").render(who=who.name, now=time.time(), **view)
    return HTMLResponse(html, headers=_NO_STORE)


@router.post("/dashboard/login")
async def login(request: Request, ctx: Ctx) -> Response:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > FORM_MAX:
            return _login_page(413, "that form is too large")
    fields = parse_qs(body.decode("utf-8", "replace"), max_num_fields=4)
    secret = (fields.get("key") or [""])[0].strip()
    if _admin(ctx, secret) is None:
        return _login_page(401, "that is not an admin key (K2)")
    token = _sessions(request).open(secret)
    out = RedirectResponse("/dashboard", status_code=303)
    out.set_cookie(
        COOKIE,
        token,
        max_age=SESSION_SECONDS,
        path="/dashboard",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return out


@router.post("/dashboard/logout")
async def logout(request: Request) -> Response:
    _sessions(request).close(request.cookies.get(COOKIE))
    out = RedirectResponse("/dashboard", status_code=303)
    out.delete_cookie(COOKIE, path="/dashboard")
    return out


# -- what the page shows ---------------------------------------------------------


@contextlib.contextmanager
def _ro(path: Path) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2)
    conn.row_factory = sqlite3.Row
    try:
        yield conn
    finally:
        conn.close()


def _rows(path: Path) -> dict[str, list[dict[str, Any]]]:
    with _ro(path) as db:
        turns = db.execute(
            "SELECT t.id, t.started_at, t.finished_at, t.ok, c.agent, c.channel, c.chat_id,"
            " m.state AS message_state, m.error"
            " FROM turns t JOIN sessions s ON s.id = t.session_id"
            " JOIN conversations c ON c.id = s.conversation_id"
            " LEFT JOIN messages m ON m.id = t.message_id ORDER BY t.id DESC LIMIT ?",
            (ROWS,),
        ).fetchall()
        chats = db.execute(
            "SELECT c.id, c.agent, c.channel, c.chat_id, c.last_active_at,"
            " (SELECT count(*) FROM messages m WHERE m.conversation_id = c.id) AS messages"
            " FROM conversations c ORDER BY c.last_active_at DESC LIMIT ?",
            (ROWS,),
        ).fetchall()
        refusals = db.execute(
            "SELECT r.at, r.rule, r.action, r.reason, c.agent, c.chat_id FROM refusals r"
            " LEFT JOIN conversations c ON c.id = r.conversation_id ORDER BY r.id DESC LIMIT ?",
            (ROWS,),
        ).fetchall()
        sandboxes = db.execute(
            "SELECT b.name, b.agent, b.app, b.spec_hash, b.state, b.last_used_at, c.channel,"
            " c.chat_id FROM sandboxes b JOIN conversations c ON c.id = b.conversation_id"
            " ORDER BY b.last_used_at DESC LIMIT ?",
            (ROWS,),
        ).fetchall()
    return {
        "turns": [dict(r) for r in turns],
        "chats": [dict(r) for r in chats],
        "refusals": [dict(r) for r in refusals],
        "sandboxes": [dict(r) for r in sandboxes],
    }


async def _check(ctx: ApiContext, sandbox: dict[str, Any]) -> str:
    """S4, live: the container exists, carries its recorded spec hash, and is hardened."""
    from sandbox.spec import LABEL_SPEC_HASH

    try:
        seen = await ctx.gateway.backend.inspect(sandbox["name"])
    except CellgateError as exc:
        return f"not checked: {exc}"[:200]
    problems = []
    if seen.labels.get(LABEL_SPEC_HASH) != sandbox["spec_hash"]:
        problems.append("spec hash differs")
    if seen.privileged or seen.cap_add:
        problems.append("privileges added")
    if not seen.readonly_rootfs:
        problems.append("root file system writable")
    if "ALL" not in seen.cap_drop:
        problems.append("capabilities kept")
    return "verified" if not problems else "FAILED: " + ", ".join(problems)


async def _gather(ctx: ApiContext) -> dict[str, Any]:
    rows = await asyncio.to_thread(_rows, ctx.store.path)
    checks = await asyncio.gather(*(_check(ctx, sb) for sb in rows["sandboxes"]))
    for sb, state in zip(rows["sandboxes"], checks, strict=True):
        sb["verification"] = state
    for chat in rows["chats"]:
        chat["isolated"] = ctx.isolated(chat["agent"])
    agents = []
    for agent_id in sorted(ctx.gateway.agents):
        rt = ctx.gateway.agents[agent_id]
        agents.append(
            {
                "id": agent_id,
                "harness": rt.config.harness.type,
                "app": f"{rt.app.name} {rt.app.version}" if rt.app else (rt.config.app or "-"),
                "image": rt.app.image if rt.app else "-",
                "isolated": ctx.isolated(agent_id),
                "ready": rt.app is not None or rt.config.app is None,
            }
        )
    return {"agents": agents, **rows}


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


_env.filters["when"] = _when
