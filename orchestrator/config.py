"""The gateway config file (JSON, as the seed's `config.json`), validated once at load.

A malformed file, or a bad `gateway` section, stops start-up with the file and
the field path. A bad entry in `agents[]` is skipped with a logged reason that
names the file, the agent and the field (L1, L2); the other agents still load.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from cellgate.errors import ConfigError
from orchestrator.harnesses.templates import CommandTemplate

logger = logging.getLogger(__name__)

AGENT_ID_RE = r"^[a-z0-9][a-z0-9-]{0,39}$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Listen(_Model):
    host: str = "127.0.0.1"
    port: int = Field(8787, ge=0, le=65535)


class Limits(_Model):
    pids: int = Field(128, ge=16, le=65536)
    memory_mb: int = Field(512, alias="memoryMb", ge=32, le=65536)
    cpus: float = Field(1.0, gt=0, le=64)
    # R2: one conversation's chat dir, media and home share one image this big.
    disk_mb: int = Field(256, alias="diskMb", ge=8, le=1_048_576)
    disk_inodes: int = Field(20_000, alias="diskInodes", ge=128, le=100_000_000)
    # Writable dirs are mounted noexec unless this is true.
    writable_exec: StrictBool = Field(False, alias="writableExec")
    # R4: live sandboxes per gateway; unset: as many as fit in 80% of host memory.
    max_sandboxes: int | None = Field(None, alias="maxSandboxes", ge=1, le=100_000)

    @model_validator(mode="after")
    def _inodes_fit(self) -> Limits:
        if self.disk_inodes * 256 * 2 > self.disk_mb * 1024 * 1024:
            raise ValueError(
                f"diskInodes {self.disk_inodes} do not fit in diskMb {self.disk_mb} "
                "(each inode takes 256 bytes; keep them under half the disk)"
            )
        return self


class Admission(_Model):
    """R4: how fast a stranger may send, how much may wait, how much one sender may run."""

    sender_per_minute: float = Field(20, alias="senderPerMinute", gt=0)
    chat_per_minute: float = Field(30, alias="chatPerMinute", gt=0)
    burst: float = Field(10, ge=1)
    max_queued_per_chat: int = Field(10, alias="maxQueuedPerChat", ge=1, le=10_000)
    # concurrent turns one sender may hold; unset: half of maxConcurrentTurns (at least 1)
    turns_per_sender: int | None = Field(None, alias="turnsPerSender", ge=1)
    retry_after: float = Field(30, alias="retryAfterSeconds", gt=0)


class PoolSettings(_Model):
    """F1: hardened sandboxes started ahead per app, handed to new conversations.

    `size` are kept ready per app (0 turns the pool off); `max` bounds the
    pooled sandboxes of one app, ready or starting. Both live inside
    `limits.maxSandboxes` (R4)."""

    size: int = Field(2, ge=0, le=1024)  # small by default; 0 turns it off (README: Warm pool)
    max: int = Field(8, ge=0, le=1024)

    @model_validator(mode="after")
    def _size_fits(self) -> PoolSettings:
        if self.size > self.max:
            raise ValueError(f"pool size {self.size} is above its max {self.max}")
        return self


class MemorySettings(_Model):
    memory_budget_chars: int = Field(8000, alias="memoryBudgetChars", ge=0)
    user_budget_chars: int = Field(3000, alias="userBudgetChars", ge=0)
    over_budget: str = Field("warn", alias="overBudget")

    @field_validator("over_budget")
    @classmethod
    def _unknown_falls_back(cls, v: str) -> str:
        """The seed's rule: an unknown severity is `warn`; said once, so a typo is seen."""
        if v in ("warn", "error"):
            return v
        logger.warning("memory.overBudget %r is neither 'warn' nor 'error'; using 'warn'", v[:40])
        return "warn"


class GatewaySettings(_Model):
    state_dir: Path = Field(Path("~/.cellgate"), alias="stateDir")
    listen: Listen = Listen()
    sandbox_idle_minutes: float = Field(30, alias="sandboxIdleMinutes", gt=0)
    runtime: str | None = None
    limits: Limits = Limits()
    memory: MemorySettings = MemorySettings()
    admission: Admission = Admission()
    pool: PoolSettings = PoolSettings()
    # F2: turns run through a small process resident in the sandbox (exec when it is not there)
    resident_runner: StrictBool = Field(True, alias="residentRunner")  # F2; false: exec per turn
    turn_timeout_seconds: float = Field(120, alias="turnTimeoutSeconds", gt=0)
    max_concurrent_turns: int = Field(8, alias="maxConcurrentTurns", ge=1, le=1024)
    base_image: str | None = Field(None, alias="baseImage")
    # R2: "required" refuses sandboxed agents when no disk quota works here;
    # "off" serves them without one, with a warning at every start.
    quota: Literal["required", "off"] = "required"


class ShellHarness(_Model):
    """Runs the message text with `/bin/sh -c` in the sandbox; replies with its output (H2)."""

    type: Literal["shell"]
    timeout_seconds: float = Field(60, alias="timeoutSeconds", gt=0)


class CommandHarness(_Model):
    """A CLI agent run per turn in the sandbox: a preset (claude, codex) or a template (H2).

    Placeholders `{prompt}` and `{session_id}`; without `{prompt}` the message
    goes to stdin. `output` says how to read the reply and session id.
    """

    type: Literal["command"]
    preset: Literal["claude", "codex"] | None = None
    argv: tuple[str, ...] | None = Field(None, min_length=1)
    resume_argv: tuple[str, ...] | None = Field(None, alias="resumeArgv", min_length=1)
    output: Literal["text", "claude-json", "codex-jsonl"] | None = None
    timeout_seconds: float = Field(300, alias="timeoutSeconds", gt=0)

    @model_validator(mode="after")
    def _usable(self) -> CommandHarness:
        if self.preset is None and self.argv is None:
            raise ValueError("give a `preset` (claude or codex) or the command's `argv`")
        if self.preset is None:
            assert self.argv is not None
            CommandTemplate(self.argv, self.resume_argv, self.output or "text")
        return self


class OpenAIHarness(_Model):
    """A model behind an OpenAI-compatible API; its loop runs in the gateway, tools in the
    sandbox; the key (`apiKey`, or the gateway variable named by `apiKeyEnv`) stays here."""

    type: Literal["openai"]
    base_url: str = Field(alias="baseUrl", pattern=r"^https?://[^\s]+$")
    model: str = Field(min_length=1)
    api_key: SecretStr | None = Field(None, alias="apiKey")
    api_key_env: str | None = Field(None, alias="apiKeyEnv", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    max_steps: int = Field(8, alias="maxSteps", ge=1, le=64)
    request_timeout_seconds: float = Field(60, alias="requestTimeoutSeconds", gt=0)
    tool_timeout_seconds: float = Field(60, alias="toolTimeoutSeconds", gt=0)
    bridge_tools: StrictBool = Field(True, alias="bridgeTools")
    temperature: float | None = Field(None, ge=0, le=2)
    max_history_messages: int = Field(200, alias="maxHistoryMessages", ge=2)

    @model_validator(mode="after")
    def _one_key_source(self) -> OpenAIHarness:
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("give `apiKey` or `apiKeyEnv`, not both (prefer apiKeyEnv)")
        return self


HarnessConfig = Annotated[
    ShellHarness | CommandHarness | OpenAIHarness, Field(discriminator="type")
]


class ClaudeSettings(_Model):
    extra_flags: tuple[str, ...] = Field((), alias="extraFlags")

    @field_validator("extra_flags")
    @classmethod
    def _no_append_file(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(
            f == "--append-system-prompt-file" or f.startswith("--append-system-prompt-file=")
            for f in v
        ):
            raise ValueError(
                "--append-system-prompt-file would replace the conversation's memory (Claude "
                "Code keeps only the last such flag); use --append-system-prompt or move the "
                "text into AGENTS.md (L2)"
            )
        return v


class HeartbeatSettings(_Model):
    """A periodic turn in every live session, or in `__heartbeat__` when none is live (M4)."""

    every_minutes: float = Field(alias="everyMinutes", gt=0)
    prompt: str = Field(
        "Heartbeat: check HEARTBEAT.md and this conversation's memory; act only if something "
        "is due.",
        min_length=1,
        max_length=10_000,
    )


class TelegramSettings(_Model):
    """A Telegram bot for one agent (W1). The token is read from the gateway's environment
    (`tokenEnv`) or a file (`tokenFile`), never from the config file, never logged."""

    token_env: str | None = Field(None, alias="tokenEnv", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    token_file: Path | None = Field(None, alias="tokenFile")
    mode: Literal["webhook", "polling"] = "polling"
    # webhook mode: the public HTTPS URL Telegram posts to (it reaches this gateway's
    # /v1/telegram/<agent>/webhook); the secret token is generated and kept in the
    # state directory when not given.
    webhook_url: str | None = Field(None, alias="webhookUrl", pattern=r"^https?://[^\s]+$")
    secret_token: SecretStr | None = Field(None, alias="secretToken")
    # the Bot API server (a local Bot API server, or a stand-in); default: Telegram's own
    base_url: str | None = Field(None, alias="baseUrl", pattern=r"^https?://[^\s]+$")
    base_file_url: str | None = Field(None, alias="baseFileUrl", pattern=r"^https?://[^\s]+$")
    max_download_bytes: int = Field(
        20 * 1024 * 1024, alias="maxDownloadBytes", ge=1, le=2 * 1024 * 1024 * 1024
    )
    poll_timeout_seconds: int = Field(25, alias="pollTimeoutSeconds", ge=0, le=50)

    @field_validator("secret_token")
    @classmethod
    def _secret_shape(cls, v: SecretStr | None) -> SecretStr | None:
        # what the Bot API accepts for secret_token: 1-256 of A-Z a-z 0-9 _ -
        if v is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,256}", v.get_secret_value()):
            raise ValueError("secretToken must be 1-256 characters of A-Z, a-z, 0-9, _ and -")
        return v

    @model_validator(mode="after")
    def _usable(self) -> TelegramSettings:
        if (self.token_env is None) == (self.token_file is None):
            raise ValueError("give the bot token's `tokenEnv` or `tokenFile` (exactly one)")
        if self.mode == "webhook" and self.webhook_url is None:
            raise ValueError("mode `webhook` needs `webhookUrl` (the public HTTPS URL)")
        return self


class LineSettings(_Model):
    """A LINE official account for one agent (W1). The channel secret and the channel
    access token are read from the gateway's environment (`...Env`) or a file
    (`...File`), never from the config file, never logged."""

    channel_secret_env: str | None = Field(
        None, alias="channelSecretEnv", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$"
    )
    channel_secret_file: Path | None = Field(None, alias="channelSecretFile")
    access_token_env: str | None = Field(
        None, alias="accessTokenEnv", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$"
    )
    access_token_file: Path | None = Field(None, alias="accessTokenFile")
    # the Messaging API and its content (data) API; default: LINE's own (or a stand-in)
    api_base_url: str = Field(
        "https://api.line.me", alias="apiBaseUrl", pattern=r"^https?://[^\s]+$"
    )
    data_api_base_url: str = Field(
        "https://api-data.line.me", alias="dataApiBaseUrl", pattern=r"^https?://[^\s]+$"
    )
    # this gateway's public HTTPS base URL: LINE posts to <publicUrl>/v1/line/<agent>/webhook
    # and fetches line_image pictures from <publicUrl>/v1/line/<agent>/images/...
    public_url: str | None = Field(None, alias="publicUrl", pattern=r"^https?://[^\s]+$")
    max_download_bytes: int = Field(
        20 * 1024 * 1024, alias="maxDownloadBytes", ge=1, le=2 * 1024 * 1024 * 1024
    )
    image_url_seconds: int = Field(86400, alias="imageUrlSeconds", ge=60, le=30 * 86400)
    reply_token_seconds: float = Field(50.0, alias="replyTokenSeconds", ge=0, le=600)

    @model_validator(mode="after")
    def _usable(self) -> LineSettings:
        if (self.channel_secret_env is None) == (self.channel_secret_file is None):
            raise ValueError("give the channel secret's `channelSecretEnv` or "
                             "`channelSecretFile` (exactly one)")  # fmt: skip
        if (self.access_token_env is None) == (self.access_token_file is None):
            raise ValueError("give the channel access token's `accessTokenEnv` or "
                             "`accessTokenFile` (exactly one)")  # fmt: skip
        return self


class DiscordSettings(_Model):
    """A Discord bot for one agent (W1): the gateway websocket and REST. The token is read
    from the gateway's environment (`tokenEnv`) or a file (`tokenFile`), never logged."""

    token_env: str | None = Field(None, alias="tokenEnv", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    token_file: Path | None = Field(None, alias="tokenFile")
    # Discord's own by default; a stand-in (or a proxy) for tests and `cellgate serve`
    api_base_url: str = Field(
        "https://discord.com/api/v10", alias="apiBaseUrl", pattern=r"^https?://[^\s]+$"
    )
    gateway_url: str = Field(
        "wss://gateway.discord.gg/", alias="gatewayUrl", pattern=r"^wss?://[^\s]+$"
    )
    # in guild channels answer only messages that mention the bot (DMs are always answered)
    require_mention: StrictBool = Field(False, alias="requireMention")
    max_download_bytes: int = Field(
        25 * 1024 * 1024, alias="maxDownloadBytes", ge=1, le=512 * 1024 * 1024
    )

    @model_validator(mode="after")
    def _usable(self) -> DiscordSettings:
        if (self.token_env is None) == (self.token_file is None):
            raise ValueError("give the bot token's `tokenEnv` or `tokenFile` (exactly one)")
        return self


class ChannelSettings(_Model):
    telegram: TelegramSettings | None = None
    line: LineSettings | None = None
    discord: DiscordSettings | None = None


class AgentConfig(_Model):
    id: str = Field(pattern=AGENT_ID_RE)
    isolate_memory: StrictBool = Field(False, alias="isolateMemory")
    disable_archive: StrictBool = Field(False, alias="disableArchive")
    app: str | None = Field(None, pattern=AGENT_ID_RE)
    workspace: Path | None = None
    harness: HarnessConfig = ShellHarness(type="shell")
    claude: ClaudeSettings = ClaudeSettings()
    heartbeat: HeartbeatSettings | None = None
    channels: ChannelSettings = ChannelSettings()


class ApiKeyConfig(_Model):
    """A key written in the config file: for first runs; `cellgate keys create` is the way."""

    name: str
    key: SecretStr = Field(min_length=16)
    agents: tuple[str, ...] = ("*",)
    admin: StrictBool = False
    write: StrictBool = True


class GatewayConfig(_Model):
    gateway: GatewaySettings = GatewaySettings()
    api_keys: tuple[ApiKeyConfig, ...] = Field((), alias="apiKeys")
    agents: tuple[AgentConfig, ...] = ()
    skipped_agents: tuple[str, ...] = Field((), exclude=True)

    def agent(self, agent_id: str) -> AgentConfig | None:
        return next((a for a in self.agents if a.id == agent_id), None)


def _field_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


MAX_REPORTED_ERRORS = 10


def validation_errors(exc: ValidationError) -> list[tuple[str, str]]:
    """Each problem (at most `MAX_REPORTED_ERRORS`) as its field path and what is wrong."""
    out: list[tuple[str, str]] = []
    for err in exc.errors()[:MAX_REPORTED_ERRORS]:
        msg = err["msg"]
        if err["type"] == "bool_type":
            msg = f"must be true or false (got {err['input']!r})"
        elif err["type"] == "extra_forbidden":
            msg = "unknown field (check its spelling)"
        elif err["type"] == "string_type" and type(err["input"]) in (int, float):
            # YAML and JSON read 1 and 1.10 as numbers (1.10 becomes 1.1)
            msg = (
                f"must be a string, not the number {err['input']}: "
                "put the value in quotes, as you wrote it"
            )
        out.append((_field_path(tuple(err["loc"])), msg))
    return out


def every_validation_error(exc: ValidationError) -> tuple[str, str]:
    """The first problem's field, and every problem's message (an operator fixes all at once)."""
    (field, msg), *more = validation_errors(exc)
    if more:
        msg += "; and " + "; ".join(f"{f}: {m}" for f, m in more)
    unsaid = exc.error_count() - MAX_REPORTED_ERRORS
    if unsaid > 0:
        msg += f"; and {unsaid} more"
    return field, msg


def read_config_document(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(str(path), "", "file not found; create it or pass --config") from exc
    except OSError as exc:
        raise ConfigError(str(path), "", f"cannot read: {exc.strerror}") from exc
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            str(path), f"line {exc.lineno} column {exc.colno}", f"not valid JSON: {exc.msg}"
        ) from exc
    if not isinstance(doc, dict):
        raise ConfigError(str(path), "", "the top level must be a JSON object")
    return doc


def parse_config(doc: dict[str, Any], source: str, *, quiet: bool = False) -> GatewayConfig:
    """Validate a config document; skip bad agents with a logged reason."""
    raw_agents = doc.get("agents", [])
    if not isinstance(raw_agents, list):
        raise ConfigError(source, "agents", "must be a list of agent objects")
    rest = {k: v for k, v in doc.items() if k != "agents"}
    try:
        base = GatewayConfig.model_validate(rest)
    except ValidationError as exc:
        field, msg = every_validation_error(exc)
        raise ConfigError(source, field, msg) from exc
    agents: list[AgentConfig] = []
    skipped: list[str] = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_agents):
        name = raw.get("id", f"#{i}") if isinstance(raw, dict) else f"#{i}"
        try:
            agent = AgentConfig.model_validate(raw)
        except ValidationError as exc:
            field, msg = every_validation_error(exc)
            reason = f"{source}: agents[{i}] ({name}): {field}: {msg}; agent skipped"
            if not quiet:
                logger.error("%s", reason)
            skipped.append(reason)
            continue
        if agent.id in seen:
            reason = f"{source}: agents[{i}] ({name}): id: duplicate agent id; agent skipped"
            if not quiet:
                logger.error("%s", reason)
            skipped.append(reason)
            continue
        seen.add(agent.id)
        agents.append(agent)
    return base.model_copy(update={"agents": tuple(agents), "skipped_agents": tuple(skipped)})


def load_config(path: Path, *, quiet: bool = False) -> GatewayConfig:
    """The config at `path`; a bad agent entry is skipped and logged (kept in
    `skipped_agents` only, when `quiet`)."""
    cfg = parse_config(read_config_document(path), str(path), quiet=quiet)
    state = cfg.gateway.state_dir.expanduser()
    if not state.is_absolute():
        state = (path.parent / state).resolve()
    gw = cfg.gateway.model_copy(update={"state_dir": state})
    return cfg.model_copy(update={"gateway": gw})


def write_config_document(path: Path, doc: dict[str, Any]) -> None:
    """Write atomically: a crash never leaves half a config. The file holds secrets: a new
    one is 0600 and a rewrite keeps the mode it had (O4)."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = 0o600
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        os.fchmod(fh.fileno(), mode)
        fh.write(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)


def is_valid_agent_id(value: str) -> bool:
    return re.fullmatch(AGENT_ID_RE, value) is not None
