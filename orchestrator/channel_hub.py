"""Channels of every agent: built from config, keyed by (agent, channel), fed into intake.

- `build_channels(config, store)`: one adapter per configured agent channel
  (W1). The token is read here from the gateway's environment or a file,
  as a `SecretStr`; a missing token stops start-up with the config field.
  A webhook's secret token, when not configured, is generated once and kept
  in `<state>/telegram/<agent>.secret` (0600).
- `ChannelInbox`: what a channel calls with each normalised inbound message.
  It records the message's attachments in the chat's ledger (P3), hands the
  message to `Intake` (admission, then stored idempotently: W3, D1), shows a
  typing indicator while its turn runs (W4), and handles `/reset` (this
  chat's session only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from pydantic import SecretStr

from cellgate.errors import CellgateError, ConfigError, QuotaError, StateConflict, Throttled
from cellgate.models import ConversationKey, InboundMessage, OutboundMessage
from channels.base import Channel, ChannelFailed, ChatBlocked
from channels.discord import DiscordChannel, DiscordOptions
from channels.line import LineChannel, LineOptions
from channels.telegram import RESET_TEXT, TYPING_EVERY, TelegramChannel, TelegramOptions
from orchestrator.agents import Agents
from orchestrator.config import DiscordSettings, GatewayConfig, LineSettings, TelegramSettings
from orchestrator.intake import Intake
from orchestrator.sandboxes import memory_held
from orchestrator.store import ConversationId, MessageId, MessageState, Store, conversation_id
from orchestrator.transcripts import save_session_id
from orchestrator.turns import TurnLoop

__all__ = ["ChannelInbox", "ChannelKey", "attachment_notes", "build_channels"]

logger = logging.getLogger(__name__)

ChannelKey = tuple[str, str]  # (agent, channel)
_WAITING = (MessageState.ACCEPTED, MessageState.RUNNING)
MAX_PENDING_RESETS = 4096  # chats whose `/reset` waits for their running turn
_DOWNLOAD_TOOLS = {"line": "line_download_content"}  # W6: LINE content by message id
_REF_NAMES = {"line": "message_id", "discord": "url"}  # P4: a Discord CDN URL


def _read_token(
    agent: str, cfg: TelegramSettings | DiscordSettings, source: str, channel: str = "telegram"
) -> SecretStr:
    field = f"agents[{agent}].channels.{channel}"
    if cfg.token_env is not None:
        value = os.environ.get(cfg.token_env, "").strip()
        if not value:
            raise ConfigError(
                source,
                f"{field}.tokenEnv",
                f"the environment variable {cfg.token_env} is not set in the gateway's "
                "environment; export the bot token there",
            )
        return SecretStr(value)
    assert cfg.token_file is not None
    try:
        value = cfg.token_file.expanduser().read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(
            source, f"{field}.tokenFile", f"cannot read {cfg.token_file}: {exc.strerror}"
        ) from exc
    if not value:
        raise ConfigError(source, f"{field}.tokenFile", f"{cfg.token_file} is empty")
    return SecretStr(value)


def webhook_secret(state_dir: Path, agent: str) -> SecretStr:
    """The generated webhook secret of an agent, created once (0600) and kept."""
    folder = state_dir / "telegram"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / f"{agent}.secret"
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(48))
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        return SecretStr(f.read().strip())


def read_secret(source: str, field: str, env: str | None, file: Path | None) -> SecretStr:
    """A credential from the gateway's environment variable `env` or the file `file` (W1)."""
    if env is not None:
        value = os.environ.get(env, "").strip()
        if not value:
            raise ConfigError(
                source,
                f"{field}Env",
                f"the environment variable {env} is not set in the gateway's environment",
            )
        return SecretStr(value)
    assert file is not None
    try:
        value = file.expanduser().read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(source, f"{field}File", f"cannot read {file}: {exc.strerror}") from exc
    if not value:
        raise ConfigError(source, f"{field}File", f"{file} is empty")
    return SecretStr(value)


def _line_channel(agent: str, cfg: LineSettings, store: Store, source: str) -> LineChannel:
    field = f"agents[{agent}].channels.line"
    options = LineOptions(
        agent=agent,
        channel_secret=read_secret(
            source, f"{field}.channelSecret", cfg.channel_secret_env, cfg.channel_secret_file
        ),
        access_token=read_secret(
            source, f"{field}.accessToken", cfg.access_token_env, cfg.access_token_file
        ),
        api_base_url=cfg.api_base_url,
        data_api_base_url=cfg.data_api_base_url,
        public_url=cfg.public_url,
        max_download_bytes=cfg.max_download_bytes,
        image_url_seconds=cfg.image_url_seconds,
        reply_token_seconds=cfg.reply_token_seconds,
    )
    return LineChannel(options, store)


def build_channels(
    config: GatewayConfig, store: Store, source: str = "config"
) -> dict[ChannelKey, Channel]:
    channels: dict[ChannelKey, Channel] = {}
    state_dir = config.gateway.state_dir
    for agent in config.agents:
        if agent.channels.line is not None:
            channels[(agent.id, "line")] = _line_channel(
                agent.id, agent.channels.line, store, source
            )
        dc = agent.channels.discord
        if dc is not None:
            channels[(agent.id, "discord")] = DiscordChannel(
                DiscordOptions(
                    agent=agent.id,
                    token=_read_token(agent.id, dc, source, "discord"),
                    api_base_url=dc.api_base_url,
                    gateway_url=dc.gateway_url,
                    require_mention=dc.require_mention,
                    max_download_bytes=dc.max_download_bytes,
                ),
                store,
            )
        tg = agent.channels.telegram
        if tg is None:
            continue
        secret = tg.secret_token
        if tg.mode == "webhook" and secret is None:
            secret = webhook_secret(state_dir, agent.id)
        options = TelegramOptions(
            agent=agent.id,
            token=_read_token(agent.id, tg, source),
            mode=tg.mode,
            webhook_url=tg.webhook_url,
            secret_token=secret,
            base_url=tg.base_url,
            base_file_url=tg.base_file_url,
            max_download_bytes=tg.max_download_bytes,
            poll_timeout=tg.poll_timeout_seconds,
        )
        channels[(agent.id, "telegram")] = TelegramChannel(options, store)
    return channels


def attachment_notes(message: InboundMessage) -> str:
    """The message text, with each attachment named on a `#` line the harness can act on."""
    lines = [message.text] if message.text else []
    for a in message.attachments:
        name = f" name={a.name!r}" if a.name else ""
        size = f" size={a.size}" if a.size is not None else ""
        tool = _DOWNLOAD_TOOLS.get(message.channel, f"{message.channel}_download_attachment")
        ref = _REF_NAMES.get(message.channel, "file_id")
        lines.append(f"# attachment: {a.kind} {ref}={a.ref}{name}{size} (fetch it with {tool})")
    return "\n".join(lines)


class ChannelInbox:
    """The handler every channel's `start` gets: normalised messages into the gateway."""

    def __init__(
        self,
        agents: Agents,
        store: Store,
        intake: Intake,
        loop: TurnLoop,
        channels: Mapping[ChannelKey, Channel],
        *,
        typing_limit: float = 600.0,
    ) -> None:
        self.agents = agents
        self.store = store
        self.intake = intake
        self.loop = loop
        self.channels = channels
        self.typing_limit = typing_limit
        self._typing: set[asyncio.Task[None]] = set()
        self._resets: dict[ConversationId, asyncio.Task[None]] = {}  # one waiting per chat

    async def __call__(self, message: InboundMessage) -> None:
        if message.command == "reset":
            await self.start_reset(message)
            return
        msg, created = await self.intake.submit(  # admitted first: a refused one stores nothing
            message.agent,
            message.channel,
            message.chat_id,
            attachment_notes(message),
            message_id=message.message_id,
            sender=message.sender,
            files=[(a.ref, message.channel) for a in message.attachments],
        )
        if created:
            self._show_typing(message, msg.id)

    def _show_typing(self, message: InboundMessage, msg_id: int) -> None:
        channel = self.channels.get((message.agent, message.channel))
        if channel is None:
            return
        task = asyncio.create_task(self._typing_while_waiting(channel, message.chat_id, msg_id))
        self._typing.add(task)
        task.add_done_callback(self._typing.discard)

    async def _typing_while_waiting(self, channel: Channel, chat_id: str, msg_id: int) -> None:
        """W4: a typing action every few seconds while the message waits or runs (bounded)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.typing_limit
        while loop.time() < deadline:
            msg = await asyncio.to_thread(self.store.get_message, MessageId(msg_id))
            if msg is None or msg.state not in _WAITING:
                return
            with contextlib.suppress(ChannelFailed, ChatBlocked):
                await channel.typing(chat_id)
            await asyncio.sleep(TYPING_EVERY)

    async def start_reset(self, message: InboundMessage) -> None:
        """`/reset`: admitted at once (a flood is refused, R4); the reset itself waits for
        the chat's running turn in a task of its own, so the channel's other chats are
        never held up behind it. A second `/reset` while one waits joins it."""
        key = ConversationKey(message.agent, message.channel, message.chat_id)

        async def none_pending() -> int:
            return 0

        await self.intake.gate.admit(  # before anything is stored (R4)
            key.agent, key.channel, key.chat_id, message.sender, conversation_id(key), none_pending
        )
        conv = await asyncio.to_thread(self.store.upsert_conversation, key)
        if conv.id in self._resets:
            return
        if len(self._resets) >= MAX_PENDING_RESETS:
            raise Throttled("R4", f"{MAX_PENDING_RESETS} resets are waiting already", 5.0)
        task = asyncio.create_task(self._reset_logged(message, key, conv.id))
        self._resets[conv.id] = task
        conv_id = conv.id

        def done(_: asyncio.Task[None]) -> None:
            self._resets.pop(conv_id, None)

        task.add_done_callback(done)

    async def _reset_logged(
        self, message: InboundMessage, key: ConversationKey, conv: ConversationId
    ) -> None:
        try:
            await self.reset(message, key, conv)
        except CellgateError as exc:
            logger.warning("reset of %s: %s", conv, exc)

    async def reset(
        self, message: InboundMessage, key: ConversationKey, conv_id: ConversationId
    ) -> None:
        """End this chat's session (after its running turn); its next message starts cold.
        No other chat's."""
        async with self.loop.conversation_lock(conv_id):
            for session in await asyncio.to_thread(self.store.live_sessions, conversation=conv_id):
                with contextlib.suppress(StateConflict):
                    await asyncio.to_thread(self.store.end_session, session.id)
            rt = self.agents.get(key.agent)
            if rt is not None and rt.workspace is not None:
                chat_dir = rt.workspace / "chats" / key.dir_name

                def forget() -> None:  # in its quota image (R2), mounted or not
                    with memory_held(rt.sandboxes, key):
                        save_session_id(chat_dir, "", None)

                try:
                    await asyncio.to_thread(forget)
                except (OSError, QuotaError) as exc:
                    logger.warning("reset of %s could not clear the session id: %s", conv_id, exc)
        channel = self.channels.get((key.agent, key.channel))
        if channel is not None:
            await channel.send(
                OutboundMessage(
                    channel=key.channel,
                    chat_id=key.chat_id,
                    outbound_key=f"cmd:{conv_id}:{message.message_id}",
                    text=RESET_TEXT,
                )
            )
        logger.info("session reset by the chat", extra={"conversation": conv_id})

    async def close(self) -> None:
        tasks = [*self._typing, *self._resets.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
