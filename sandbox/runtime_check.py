"""Does a container runtime run ordinary tools? The smoke check before serving (S2).

An old gVisor on a new kernel starts containers whose `ls` and `stat` fail
(statx: "Invalid argument"); an agent in such a sandbox is useless, and an
isolation check run there passes by accident. So, once at start, the gateway
runs `PROBE_STEPS` in a throwaway hardened container of each runtime it uses
(`SandboxBackend.probe`) and refuses to serve an agent whose runtime fails.

`judge` is pure: it reads the probe's exit status and output and says which
step failed and how to fix it. `check_runtime` runs the probe and judges it.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from cellgate.errors import EngineUnavailable, SandboxError
from sandbox.backends.base import ExecResult, SandboxBackend

logger = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)

PROBE_TIMEOUT = 60.0
PROBE_MARK = "cellgate-runtime-probe"
MIN_GVISOR = "0.0~20240729"
DETAIL_CAP = 300


@dataclass(frozen=True, slots=True)
class ProbeStep:
    """One ordinary thing an agent's tools do; `expect` must be a line of its output."""

    command: str
    expect: str


PROBE_STEPS: tuple[ProbeStep, ...] = (
    ProbeStep("ls /", "etc"),
    ProbeStep("stat -c %n /etc/hostname", "/etc/hostname"),
    ProbeStep(
        f"echo {PROBE_MARK} > /tmp/{PROBE_MARK} && cat /tmp/{PROBE_MARK} && rm /tmp/{PROBE_MARK}",
        PROBE_MARK,
    ),
)
_STEP = "@@cellgate-step"
_DONE = "@@cellgate-done"


def probe_script(steps: tuple[ProbeStep, ...] = PROBE_STEPS) -> list[str]:
    """argv for `sh`: run each step, print its index, exit status and output; stop at a failure."""
    lines = [
        'step() { out=$(sh -c "$2" 2>&1); rc=$?; '
        f'printf \'{_STEP} %s %s\\n%s\\n\' "$1" "$rc" "$out"; '
        '[ "$rc" -eq 0 ] || exit 3; }'
    ]
    for i, s in enumerate(steps):
        lines.append(f"step {i} {_shell_quote(s.command)}")
    lines.append(f"echo {_DONE}")
    return ["sh", "-c", "\n".join(lines)]


def _shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


@dataclass(frozen=True, slots=True)
class RuntimeVerdict:
    """Whether `runtime` runs ordinary tools; if not, what failed and how to fix it."""

    runtime: str | None
    ok: bool
    failed: str = ""
    detail: str = ""

    @property
    def label(self) -> str:
        return self.runtime or "default"

    @property
    def message(self) -> str:
        """For the operator's log: what failed, what it said, how to fix it."""
        if self.ok:
            return f"runtime {self.label}: ls, stat and a tmpfs write work"
        return f"runtime {self.label}: {self.failed}: {self.detail}; {fix_hint(self.runtime)}"

    @property
    def summary(self) -> str:
        """For an API caller (R6): what failed and how to fix it, without the engine's words."""
        if self.ok:
            return self.message
        return (
            f"runtime {self.label} failed the start check ({self.failed}; details in the "
            f"gateway log); {fix_hint(self.runtime)}"
        )


def fix_hint(runtime: str | None) -> str:
    if runtime == "runsc":
        return (
            f"run scripts/setup-engine.sh to install a working runsc (gVisor {MIN_GVISOR} "
            "or newer) and register it, then restart the gateway"
        )
    if runtime:
        return (
            f"check the runtime {runtime!r} registered with the engine (`docker info`, "
            "/etc/docker/daemon.json) or set gateway.runtime to one that works"
        )
    return "check the Docker engine's default runtime (`docker info`)"


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= DETAIL_CAP else text[:DETAIL_CAP] + "..."


def judge(
    runtime: str | None, result: ExecResult, steps: tuple[ProbeStep, ...] = PROBE_STEPS
) -> RuntimeVerdict:
    """Read the probe's output: every step ran, printed what it must, and the container exited 0."""
    out = result.stdout.decode(errors="replace")
    err = result.stderr.decode(errors="replace")
    if result.timed_out:
        return RuntimeVerdict(runtime, False, "the probe container", "did not finish in time")
    ran: dict[int, tuple[int, list[str]]] = {}
    current: list[str] | None = None
    for line in out.splitlines():
        head = line.split()
        if len(head) == 3 and head[0] == _STEP and head[1].isdigit() and head[2].isdigit():
            current = []
            ran[int(head[1])] = (int(head[2]), current)
        elif current is not None and line != _DONE:
            current.append(line)
    for i, step in enumerate(steps):
        if i not in ran:
            why = f"never ran (the container exited {result.exit_code}"
            why += f": {_clip(err or out)})" if (err or out).strip() else ")"
            return RuntimeVerdict(runtime, False, f"`{step.command}`", why)
        rc, lines = ran[i]
        said = _clip("\n".join(lines)) or "no output"
        if rc == 127:
            return RuntimeVerdict(
                runtime, False, f"`{step.command}`", f"the image has no such command ({said})"
            )
        if rc != 0:
            return RuntimeVerdict(runtime, False, f"`{step.command}` failed (exit {rc})", said)
        if step.expect not in (x.strip() for x in lines):
            return RuntimeVerdict(
                runtime, False, f"`{step.command}`", f"printed {said!r}, not {step.expect!r}"
            )
    if _DONE not in out.splitlines() or result.exit_code != 0:
        return RuntimeVerdict(
            runtime, False, "the probe container", f"exited {result.exit_code} after its steps"
        )
    return RuntimeVerdict(runtime, True)


def engine_refused(runtime: str | None, exc: SandboxError) -> RuntimeVerdict:
    """The engine could not even run the probe container (an unknown runtime, a missing image)."""
    text = str(exc)
    if "nknown runtime" in text or "invalid runtime" in text:
        return RuntimeVerdict(runtime, False, "the engine does not know it", _clip(text))
    return RuntimeVerdict(runtime, False, "the engine could not run a container", _clip(text))


async def check_runtime(
    backend: SandboxBackend,
    runtime: str | None,
    image: str,
    *,
    timeout: float = PROBE_TIMEOUT,  # noqa: ASYNC109 - the engine bounds the wait
) -> RuntimeVerdict:
    """Run the probe once in a throwaway container (its own run id, removed after); judge it.

    EngineUnavailable propagates: no engine is not the runtime's fault.
    """
    run_id = secrets.token_hex(6)
    try:
        result = await backend.probe(runtime, image, probe_script(), run_id=run_id, timeout=timeout)
    except EngineUnavailable:
        raise
    except SandboxError as exc:
        return engine_refused(runtime, exc)
    return judge(runtime, result)


async def check_runtimes(
    backend: SandboxBackend, wanted: Mapping[K, tuple[str | None, str]]
) -> dict[K, RuntimeVerdict]:
    """Each distinct (runtime, image) once; every key gets its pair's verdict.

    With no engine answering nothing is judged (an empty answer, and a warning):
    the turns will say that the engine is down, which is not the runtime's fault.
    """
    done: dict[tuple[str | None, str], RuntimeVerdict] = {}
    out: dict[K, RuntimeVerdict] = {}
    for key, pair in wanted.items():
        if pair not in done:
            try:
                done[pair] = await check_runtime(backend, *pair)
            except EngineUnavailable as exc:
                logger.warning("runtime check skipped: %s", exc)
                return {}
            level = logging.INFO if done[pair].ok else logging.ERROR
            logger.log(level, "%s (image %s)", done[pair].message, pair[1])
        out[key] = done[pair]
    return out


__all__ = [
    "PROBE_STEPS",
    "ProbeStep",
    "RuntimeVerdict",
    "check_runtime",
    "check_runtimes",
    "fix_hint",
    "judge",
    "probe_script",
]
