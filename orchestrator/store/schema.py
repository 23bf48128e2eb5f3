"""The schema, as a list of migrations; `PRAGMA user_version` is how many have run.

Append a new tuple to change the schema; never edit one that has shipped.
Each migration is a tuple of single statements, run inside one
`BEGIN IMMEDIATE` transaction together with the version bump, so two
processes opening a fresh file cannot both apply it.
"""

from __future__ import annotations

_V1 = (
    """
    CREATE TABLE conversations (
        id             TEXT PRIMARY KEY,
        agent          TEXT NOT NULL,
        channel        TEXT NOT NULL,
        chat_id        TEXT NOT NULL,
        dir_name       TEXT NOT NULL,
        created_at     REAL NOT NULL,
        last_active_at REAL NOT NULL,
        UNIQUE (agent, channel, chat_id)
    ) STRICT
    """,
    """
    CREATE TABLE messages (
        id                  INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id     TEXT NOT NULL REFERENCES conversations (id),
        platform_message_id TEXT NOT NULL,
        sender              TEXT NOT NULL,
        text                TEXT NOT NULL,
        attachments         TEXT NOT NULL DEFAULT '[]',
        received_at         REAL NOT NULL,
        state               TEXT NOT NULL CHECK (state IN
                              ('accepted', 'running', 'replied', 'delivered', 'failed')),
        attempts            INTEGER NOT NULL DEFAULT 0,
        error               TEXT,
        updated_at          REAL NOT NULL,
        UNIQUE (conversation_id, platform_message_id)
    ) STRICT
    """,
    "CREATE INDEX messages_pending ON messages (state, id)",
    """
    CREATE TABLE replies (
        id              INTEGER PRIMARY KEY AUTOINCREMENT,
        message_id      INTEGER NOT NULL UNIQUE REFERENCES messages (id),
        conversation_id TEXT NOT NULL REFERENCES conversations (id),
        outbound_key    TEXT NOT NULL UNIQUE,
        text            TEXT NOT NULL,
        created_at      REAL NOT NULL,
        delivered_at    REAL
    ) STRICT
    """,
    """
    CREATE TABLE sessions (
        id                 TEXT PRIMARY KEY,
        conversation_id    TEXT NOT NULL REFERENCES conversations (id),
        harness            TEXT NOT NULL,
        harness_session_id TEXT,
        state              TEXT NOT NULL CHECK (state IN ('live', 'ended')),
        started_at         REAL NOT NULL,
        last_active_at     REAL NOT NULL,
        ended_at           REAL
    ) STRICT
    """,
    "CREATE INDEX sessions_by_conversation ON sessions (conversation_id, state)",
    """
    CREATE TABLE turns (
        id              INTEGER PRIMARY KEY AUTOINCREMENT,
        session_id      TEXT NOT NULL REFERENCES sessions (id),
        message_id      INTEGER REFERENCES messages (id),
        harness_turn_id TEXT,
        ok              INTEGER CHECK (ok IN (0, 1)),
        started_at      REAL NOT NULL,
        finished_at     REAL
    ) STRICT
    """,
    "CREATE INDEX turns_open ON turns (session_id) WHERE finished_at IS NULL",
    """
    CREATE TABLE sandboxes (
        name            TEXT PRIMARY KEY,
        conversation_id TEXT NOT NULL REFERENCES conversations (id),
        app             TEXT NOT NULL,
        agent           TEXT NOT NULL,
        spec_hash       TEXT NOT NULL,
        state           TEXT NOT NULL CHECK (state IN ('created', 'running', 'stopped')),
        created_at      REAL NOT NULL,
        last_used_at    REAL NOT NULL
    ) STRICT
    """,
    """
    CREATE TABLE shares (
        id              TEXT PRIMARY KEY,
        token_sha256    TEXT NOT NULL UNIQUE,
        session_id      TEXT NOT NULL REFERENCES sessions (id),
        conversation_id TEXT NOT NULL REFERENCES conversations (id),
        path            TEXT NOT NULL,
        created_at      REAL NOT NULL,
        revoked_at      REAL,
        revoked_by      TEXT
    ) STRICT
    """,
    """
    CREATE TABLE attachments (
        seq             INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id TEXT NOT NULL REFERENCES conversations (id),
        platform        TEXT NOT NULL,
        file_id         TEXT NOT NULL,
        delivered_at    REAL NOT NULL,
        UNIQUE (conversation_id, platform, file_id)
    ) STRICT
    """,
    """
    CREATE TABLE cron_jobs (
        id          TEXT PRIMARY KEY,
        agent       TEXT NOT NULL,
        type        TEXT NOT NULL CHECK (type IN ('prompt', 'command')),
        schedule    TEXT NOT NULL,
        payload     TEXT NOT NULL,
        one_shot    INTEGER NOT NULL CHECK (one_shot IN (0, 1)),
        enabled     INTEGER NOT NULL CHECK (enabled IN (0, 1)),
        created_at  REAL NOT NULL,
        last_run_at REAL
    ) STRICT
    """,
    """
    CREATE TABLE api_keys (
        id           TEXT PRIMARY KEY,
        name         TEXT NOT NULL,
        key_sha256   TEXT NOT NULL UNIQUE,
        prefix       TEXT NOT NULL,
        agents       TEXT NOT NULL,
        admin        INTEGER NOT NULL CHECK (admin IN (0, 1)),
        write        INTEGER NOT NULL CHECK (write IN (0, 1)),
        created_at   REAL NOT NULL,
        last_used_at REAL,
        revoked_at   REAL
    ) STRICT
    """,
    # No foreign keys on purpose: a refusal must be recorded even when the
    # conversation or session it names is unknown to the store.
    """
    CREATE TABLE refusals (
        id              INTEGER PRIMARY KEY AUTOINCREMENT,
        at              REAL NOT NULL,
        conversation_id TEXT,
        session_id      TEXT,
        rule            TEXT NOT NULL,
        action          TEXT NOT NULL,
        reason          TEXT NOT NULL,
        detail          TEXT NOT NULL DEFAULT '{}'
    ) STRICT
    """,
    "CREATE INDEX refusals_by_conversation ON refusals (conversation_id, id)",
)

# Channels (W3, W4): where a poller stopped, what was posted under which outbound
# key (one row per part of a split reply), and chats that blocked the bot.
_V_CHANNELS = (
    """
    CREATE TABLE channel_cursors (
        agent      TEXT NOT NULL,
        channel    TEXT NOT NULL,
        cursor     INTEGER NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (agent, channel)
    ) STRICT
    """,
    """
    CREATE TABLE outbound_parts (
        outbound_key        TEXT NOT NULL,
        part                INTEGER NOT NULL,
        agent               TEXT NOT NULL,
        channel             TEXT NOT NULL,
        chat_id             TEXT NOT NULL,
        platform_message_id TEXT NOT NULL,
        sent_at             REAL NOT NULL,
        PRIMARY KEY (outbound_key, part)
    ) STRICT
    """,
    "CREATE INDEX outbound_parts_by_chat"
    " ON outbound_parts (agent, channel, chat_id, platform_message_id)",
    """
    CREATE TABLE blocked_chats (
        agent      TEXT NOT NULL,
        channel    TEXT NOT NULL,
        chat_id    TEXT NOT NULL,
        reason     TEXT NOT NULL,
        blocked_at REAL NOT NULL,
        PRIMARY KEY (agent, channel, chat_id)
    ) STRICT
    """,
)

# K4, P6: an API chat, and so every session in it (its media `api-<session>`,
# its shares), is bound to the API key that started it. `key_ref` is a store
# key's id or `config:<name>` for a key of the config file. No foreign key:
# the binding is made when the first message is sent, before the gateway has
# accepted it (and so before the conversation row may exist). An API chat
# started before this table has no row: only an admin key reaches it.
_V_API_KEYS = (
    """
    CREATE TABLE api_chat_keys (
        conversation_id TEXT PRIMARY KEY,
        key_ref         TEXT NOT NULL,
        bound_at        REAL NOT NULL
    ) STRICT
    """,
)

# P2 (Discord): the threads a session opened itself with discord_create_thread; the
# only threads besides its own chat it may post into. Kept per session, so a reset
# (a new session) does not inherit them.
_V_DISCORD_THREADS = (
    """
    CREATE TABLE own_threads (
        session_id      TEXT NOT NULL,
        thread_id       TEXT NOT NULL,
        conversation_id TEXT NOT NULL,
        parent_chat_id  TEXT NOT NULL,
        created_at      REAL NOT NULL,
        PRIMARY KEY (session_id, thread_id)
    ) STRICT
    """,
)

# C1, C2: cron jobs as the scheduler runs them. `schedule_kind` says how
# `schedule` reads (a cron expression in `timezone`, an interval in seconds, or
# one ISO 8601 time); a prompt job's turn runs in the conversation
# (`channel`, `chat_id`); `next_run_at` is when it is due next, kept across
# restarts so a run missed while the gateway was down runs once at start.
# A job the scheduler may not run (C1) keeps every column as it was.
_V_CRON = (
    "ALTER TABLE cron_jobs ADD COLUMN name TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE cron_jobs ADD COLUMN schedule_kind TEXT NOT NULL DEFAULT 'cron'"
    " CHECK (schedule_kind IN ('cron', 'every', 'at'))",
    "ALTER TABLE cron_jobs ADD COLUMN timezone TEXT NOT NULL DEFAULT 'UTC'",
    "ALTER TABLE cron_jobs ADD COLUMN channel TEXT",
    "ALTER TABLE cron_jobs ADD COLUMN chat_id TEXT",
    "ALTER TABLE cron_jobs ADD COLUMN timeout_seconds REAL NOT NULL DEFAULT 60",
    "ALTER TABLE cron_jobs ADD COLUMN next_run_at REAL",
    "ALTER TABLE cron_jobs ADD COLUMN runs INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE cron_jobs ADD COLUMN last_status TEXT",
    "ALTER TABLE cron_jobs ADD COLUMN last_output TEXT",
    "CREATE INDEX cron_jobs_due ON cron_jobs (enabled, next_run_at)",
)

# A conversation's turn queue, read at every admission check and every turn: its
# pending messages only (a partial index stays as small as the queues). Without it the
# lookup walked the conversation's whole history, and a chat of years (or a stranger's
# flood of answered messages) made every message of every chat wait on the turn lane.
# The WHERE must stay the very `state IN (...)` term the store's queue queries use.
_V_QUEUE = (
    "CREATE INDEX messages_queue ON messages (conversation_id, id)"
    " WHERE state IN ('accepted','running','replied')",
)

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    _V1,
    _V_CHANNELS,
    _V_API_KEYS,
    _V_DISCORD_THREADS,
    _V_CRON,
    _V_QUEUE,
)
SCHEMA_VERSION = len(MIGRATIONS)
