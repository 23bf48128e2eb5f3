"""Every error cellgate raises on purpose has one root.

    CellgateError
    ├── ConfigError(path, field, reason)        a config file or app.yaml is wrong
    ├── AppError(app, reason)                   an app cannot be installed or found
    ├── ConversationError(reason)               a chat id or channel name is unusable
    ├── UnknownAgent(agent)                     no such agent is configured
    ├── AgentUnavailable(agent, reason)         the agent exists but cannot take turns
    ├── TurnTimeout(seconds)                    a turn ran past its time limit
    ├── Throttled(rule, reason, retry_after)    admission refused a message (R4)
    ├── SandboxesBusy(reason)                   no sandbox may start now (R4)
    ├── PolicyDenied(rule, reason)              a policy refused an action
    ├── ScheduleError(reason)                   a cron job's schedule or fields are unusable
    ├── BridgeError(code, reason)               a bridge tool call was malformed or failed
    ├── UnsafePath(rel, kind, reason)           a path a sandbox can write is not a plain
    │                                           file or directory (link, FIFO, ...); not used
    ├── SandboxError                            anything about a sandbox container
    │   ├── EngineUnavailable(reason)           no Docker engine answers
    │   ├── ImageError(image, reason)           an image is missing or failed to build
    │   ├── MountVerificationFailed(container, violations)
    │   │                                       a container's mounts are wider than its plan
    │   ├── ExecFailed(reason, exit_code, stderr)
    │   │                                       a command could not be run in a sandbox
    │   └── QuotaError(reason)                  no disk quota for a conversation (R2)
    └── StoreError(reason)                      the state database failed or refused
        ├── StoreFull(reason)                   its disk is full; nothing was written
        ├── NotFound(kind, key)                 no row with that id
        └── StateConflict(kind, key, expected, actual)
                                                a guarded update found another state

Errors carry data; a message says what is wrong, where, and how to fix it.
`new_ref()` names one failure for a stranger and the log alike (R6).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence


def new_ref() -> str:
    """A reference id a stranger can quote and an operator can find in the log (R6):
    `r-` and 12 hex characters."""
    return "r-" + secrets.token_hex(6)


class CellgateError(Exception):
    """Root of every error cellgate raises on purpose.

    `public` is what a stranger in a chat may be shown of it; None means only
    "something went wrong" and a reference id (R6).
    """

    public: str | None = None


class ConfigError(CellgateError):
    def __init__(self, path: str, field: str, reason: str) -> None:
        self.path = path
        self.field = field
        self.reason = reason
        where = f"{path}: {field}" if field else path
        super().__init__(f"{where}: {reason}")


class AppError(CellgateError):
    def __init__(self, app: str, reason: str) -> None:
        self.app = app
        self.reason = reason
        super().__init__(f"app {app!r}: {reason}")


class ConversationError(CellgateError):
    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class UnknownAgent(CellgateError):
    def __init__(self, agent: str) -> None:
        self.agent = agent
        super().__init__(f"no agent {agent!r} is configured")


class AgentUnavailable(CellgateError):
    def __init__(self, agent: str, reason: str) -> None:
        self.agent = agent
        self.reason = reason
        super().__init__(f"agent {agent!r} cannot take turns: {reason}")


class TurnTimeout(CellgateError):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        super().__init__(f"the turn did not finish within {seconds:g} s")


class Throttled(CellgateError):
    """Admission refused a message: rate, queue bound (R4). Nothing was stored."""

    public = "too many messages right now; please wait a little and send again"

    def __init__(self, rule: str, reason: str, retry_after: float | None = None) -> None:
        self.rule = rule
        self.reason = reason
        self.retry_after = retry_after
        super().__init__(f"refused by {rule}: {reason}")


class SandboxesBusy(CellgateError):
    """Every sandbox this gateway may run is busy; the turn was not started (R4)."""

    rule = "R4"
    public = "the bot is busy with other chats right now; please try again in a minute"

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"refused by R4: {reason}")


class PolicyDenied(CellgateError):
    def __init__(self, rule: str, reason: str) -> None:
        self.rule = rule
        self.reason = reason
        super().__init__(f"refused by {rule}: {reason}")


class ScheduleError(CellgateError):
    """A cron job's schedule (expression, interval, time, time zone) or a field is unusable."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class SandboxError(CellgateError):
    """Anything about a sandbox container."""


class SandboxSpent(SandboxError):
    """The runtime could not start a process in a sandbox (its pids are exhausted, its
    gVisor sentry is wedged). Nothing ran; the sandbox was removed, so a retry gets a
    fresh one."""

    def __init__(self) -> None:
        super().__init__("the sandbox could not start a process; it was replaced")


class EngineUnavailable(SandboxError):
    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(
            f"no Docker engine is reachable ({reason}); start one, e.g. "
            "`sudo bash scripts/setup-engine.sh`, or set DOCKER_HOST"
        )


class ImageError(SandboxError):
    def __init__(self, image: str, reason: str) -> None:
        self.image = image
        self.reason = reason
        super().__init__(f"image {image!r}: {reason}")


class MountVerificationFailed(SandboxError):
    def __init__(self, container: str, violations: Sequence[str]) -> None:
        self.container = container
        self.violations = tuple(violations)
        listed = "; ".join(self.violations)
        super().__init__(
            f"refusing to run in {container}: it differs from its plan (S4, R5): {listed}. "
            "Nothing was run; the sandbox was removed and the next turn recreates it to plan"
        )


class ExecFailed(SandboxError):
    def __init__(self, reason: str, exit_code: int | None = None, stderr: str = "") -> None:
        self.reason = reason
        self.exit_code = exit_code
        self.stderr = stderr
        super().__init__(reason)


class QuotaError(SandboxError):
    """A conversation's writable storage cannot get its hard quota (R2); nothing runs."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"no disk quota for this conversation's storage (R2): {reason}")


class StoreError(CellgateError):
    """The state database failed, or refused an operation that would break its invariants."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class StoreFull(StoreError):
    """The state disk is full: the write did not happen, and may be tried again (R7)."""

    public = "the service is out of storage right now; please send it again later"


class NotFound(StoreError):
    def __init__(self, kind: str, key: object) -> None:
        self.kind = kind
        self.key = key
        super().__init__(f"no {kind} {key!r} in the state database")


class StateConflict(StoreError):
    """A guarded update (`UPDATE ... WHERE state = ?`) found the row in another state."""

    def __init__(self, kind: str, key: object, expected: str, actual: str) -> None:
        self.kind = kind
        self.key = key
        self.expected = expected
        self.actual = actual
        super().__init__(f"{kind} {key!r} is {actual}, not {expected}; nothing was changed")


class BridgeError(CellgateError):
    """A tool call over the bridge could not be carried out (not a policy refusal).

    `code` is what the caller sees: `bad_request`, `unknown_tool`, `not_found`,
    `too_large`, `busy`, `timeout`, `delivery_failed`, `conflict`, `no_session`,
    `internal`.
    """

    def __init__(self, code: str, reason: str) -> None:
        self.code = code
        self.reason = reason
        super().__init__(f"{code}: {reason}")


class UnsafePath(CellgateError):
    """A path under a directory a sandbox can write was refused and left untouched.

    `rel` is the path relative to that directory (never a host path); `kind`
    is what was found or why: `symlink`, `fifo`, `socket`, `device`, `dir`,
    `regular` (where a directory was needed), `hardlink`, `swapped`,
    `too_large`, `sparse`, `escape` (absolute, `..`, NUL, empty).
    """

    def __init__(self, rel: str, kind: str, reason: str) -> None:
        self.rel = rel
        self.kind = kind
        self.reason = reason
        super().__init__(f"{rel!r} {reason}")
