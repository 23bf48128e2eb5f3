"""`cellgate doctor`: will this gateway start, and if not, why (O4).

    run_checks(config_path) -> list[Check]       each: name, status, detail, fix

Checks, in order: the engine (reachable, its version), the runtimes (runc,
runsc: a tiny hardened container runs `ls /` and `stat /` in each), the base
and app images, the config (every error, with the file and field path), the
state directory's and the config file's permissions, quota support for R2
(loop device + mkfs.ext4 + mount, or project quotas), the resident runner
(native, or the Python one when the native one is not built), channel tokens
(only where a config names some), and the time zone. A check that cannot run
because an earlier one failed is `skip`; a failing one says what to do.
`render_table` and `render_json` print them; any `fail` makes the exit status 1.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import docker
import docker.errors
from pydantic import ValidationError

from cellgate.errors import CellgateError, ConfigError
from sandbox.runner_client import NATIVE_NAME, native_runner

Status = Literal["ok", "warn", "fail", "skip"]

ENGINE_TIMEOUT = 10
CONTAINER_SECONDS = 60
LOCAL_BASE = "cellgate-base:bookworm"
DEFAULT_BASE = "python:3.12-slim"
DOCTOR_LABEL = "cellgate.doctor"
_CHECK_CMD = ["/bin/sh", "-c", "ls / >/dev/null && stat -c '%n %F' / && echo doctor-ok"]


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


@dataclass
class _Facts:
    """What earlier checks learned, for the later ones."""

    config_path: Path | None
    doc: dict[str, Any] | None = None
    cfg: Any = None  # GatewayConfig, when it loaded
    client: Any = None
    runtimes: dict[str, Any] | None = None
    base_image: str | None = None


# -- engine, runtimes, images ------------------------------------------------


def _engine(f: _Facts) -> Check:
    try:
        client = docker.from_env(timeout=ENGINE_TIMEOUT)
        client.ping()
        version = client.version()
        info = client.info()
    except (docker.errors.DockerException, OSError) as exc:
        host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        return Check(
            "engine",
            "fail",
            f"no Docker engine answers at {host}: {str(exc)[:200]}",
            "start the engine (`systemctl start docker`, or scripts/setup-engine.sh) "
            "or point DOCKER_HOST at a running one",
        )
    f.client = client
    f.runtimes = dict(info.get("Runtimes") or {})
    return Check(
        "engine",
        "ok",
        f"Docker {version.get('Version', '?')} (API {version.get('ApiVersion', '?')}), "
        f"default runtime {info.get('DefaultRuntime', '?')}",
    )


def _configured_base(f: _Facts) -> str | None:
    if f.cfg is not None and f.cfg.gateway.base_image:
        return str(f.cfg.gateway.base_image)
    return os.environ.get("CELLGATE_BASE_IMAGE") or None


def _image_present(client: Any, ref: str) -> bool:
    try:
        client.images.get(ref)
    except docker.errors.ImageNotFound:
        return False
    return True


def _base_image(f: _Facts) -> Check:
    if f.client is None:
        return Check("base image", "skip", "the engine is not reachable")
    wanted = _configured_base(f)
    candidates = [wanted] if wanted else [DEFAULT_BASE, LOCAL_BASE]
    for ref in candidates:
        if _image_present(f.client, ref):
            f.base_image = ref
            return Check("base image", "ok", f"{ref} is present")
    shown = " or ".join(candidates)
    fix = (
        f"build it under that name with `scripts/build-base-image.sh {wanted}`, "
        f"or `docker pull {wanted}` where a registry is reachable"
        if wanted
        else f"build {LOCAL_BASE} with scripts/build-base-image.sh, or `docker pull {DEFAULT_BASE}`"
    )
    return Check("base image", "fail", f"{shown} is not on this engine", fix)


def _app_images(f: _Facts) -> Check:
    from orchestrator.apps import InstalledApp

    if f.client is None:
        return Check("app images", "skip", "the engine is not reachable")
    if f.cfg is None:
        return Check("app images", "skip", "no valid config to read the apps from")
    apps = [a for a in f.cfg.agents if a.app]
    if not apps:
        return Check("app images", "ok", "no agent runs an app")
    missing: list[str] = []
    found: list[str] = []
    for agent in apps:
        try:
            app = InstalledApp.load(f.cfg.gateway.state_dir, agent.app)
        except CellgateError as exc:
            missing.append(f"agent {agent.id}: {exc}")
            continue
        if _image_present(f.client, app.image_id):
            found.append(f"{app.name} ({app.image})")
        else:
            missing.append(f"agent {agent.id}: image {app.image} ({app.image_id[:19]}) is missing")
    if missing:
        return Check(
            "app images",
            "fail",
            "; ".join(missing),
            "install the app again: `cellgate apps install DIR --config FILE`",
        )
    return Check("app images", "ok", "present: " + ", ".join(found))


def _run_probe(client: Any, image: str, runtime: str) -> tuple[int, str]:
    """Run the probe in a hardened container named with a random run id; always removed."""
    run_id = secrets.token_hex(6)
    container = client.containers.create(
        image,
        _CHECK_CMD,
        name=f"cellgate-doctor-{run_id}-{runtime}",
        labels={DOCTOR_LABEL: run_id},
        runtime=runtime,
        user="65534:65534",
        cap_drop=["ALL"],
        security_opt=["no-new-privileges:true"],
        read_only=True,
        network_mode="none",
        pids_limit=32,
        mem_limit="64m",
        log_config={"type": "json-file", "config": {"max-size": "64k"}},
    )
    try:
        container.start()
        status = container.wait(timeout=CONTAINER_SECONDS)
        logs = container.logs(stdout=True, stderr=True)[-2000:].decode("utf-8", "replace")
        return int(status.get("StatusCode", -1)), logs
    finally:
        container.remove(force=True)


def _runtime(f: _Facts, runtime: str) -> Check:
    name = f"runtime {runtime}"
    if f.client is None or f.runtimes is None:
        return Check(name, "skip", "the engine is not reachable")
    configured = f.cfg.gateway.runtime if f.cfg is not None else None
    needed = runtime == "runc" or configured == runtime
    if runtime not in f.runtimes:
        fix = (
            "install gVisor (scripts/setup-engine.sh) and register `runsc` in daemon.json"
            if runtime == "runsc"
            else f"register `{runtime}` in /etc/docker/daemon.json and restart the engine, "
            "or set gateway.runtime to one the engine has"
        )
        return Check(name, "fail" if needed else "warn", "not registered with the engine", fix)
    if f.base_image is None:
        return Check(name, "skip", "no base image to run a probe in")
    try:
        code, out = _run_probe(f.client, f.base_image, runtime)
    except (docker.errors.DockerException, OSError) as exc:
        code, out = -1, str(exc)[:300]
    if code == 0 and "doctor-ok" in out:
        return Check(name, "ok", f"a hardened container ran `ls /` and `stat /` (exit {code})")
    return Check(
        name,
        "fail" if needed else "warn",
        f"the probe container failed (exit {code}): {out.strip()[-300:]}",
        f"check the engine log (`journalctl -u docker`) and `docker run --rm --runtime "
        f"{runtime} {f.base_image} true`",
    )


# -- config --------------------------------------------------------------------


def _messages(exc: ValidationError, prefix: str) -> Iterator[str]:
    """As `cellgate serve` words them (at most `MAX_REPORTED_ERRORS` per section)."""
    from orchestrator.config import validation_errors

    for loc, msg in validation_errors(exc):
        path = f"{prefix}.{loc}" if prefix and loc else (prefix or loc or "(top level)")
        yield f"{path}: {msg}"


def config_errors(doc: dict[str, Any]) -> list[str]:
    """Every problem in a config document, each with its field path."""
    from orchestrator.config import AgentConfig, GatewayConfig

    rest = {k: v for k, v in doc.items() if k != "agents"}
    errors: list[str] = []
    try:
        GatewayConfig.model_validate(rest)
    except ValidationError as exc:
        errors += _messages(exc, "")
    raw_agents = doc.get("agents", [])
    if not isinstance(raw_agents, list):
        return [*errors, "agents: must be a list of agent objects"]
    seen: set[str] = set()
    for i, raw in enumerate(raw_agents):
        try:
            agent = AgentConfig.model_validate(raw)
        except ValidationError as exc:
            errors += _messages(exc, f"agents[{i}]")
            continue
        if agent.id in seen:
            errors.append(f"agents[{i}].id: duplicate agent id {agent.id!r}")
        seen.add(agent.id)
    return errors


def _config(f: _Facts) -> Check:
    from orchestrator.config import load_config, read_config_document

    if f.config_path is None:
        return Check("config", "skip", "no --config given")
    try:
        f.doc = read_config_document(f.config_path)
    except ConfigError as exc:
        return Check("config", "fail", str(exc), "fix the file (it must be a JSON object)")
    errors = config_errors(f.doc)
    # serve refuses to start on an error outside `agents[]`, and skips a bad agent entry
    if [e for e in errors if not e.startswith("agents[")]:
        return Check(
            "config",
            "fail",
            f"{f.config_path}: {len(errors)} error(s): " + "; ".join(errors),
            "fix each field named (README, section Configuration)",
        )
    try:
        f.cfg = load_config(f.config_path, quiet=True)
    except ConfigError as exc:
        return Check("config", "fail", str(exc), "fix the field named")
    agents = ", ".join(a.id for a in f.cfg.agents) or "none"
    if errors:
        return Check(
            "config",
            "warn",
            f"{f.config_path}: the gateway starts with agents: {agents}; it skips "
            f"{len(f.cfg.skipped_agents)} agent entry(ies): " + "; ".join(errors),
            "fix each field named (README, section Configuration); an app agent's "
            "isolateMemory and disableArchive are rewritten from its app.yaml at start (L3)",
        )
    return Check("config", "ok", f"{f.config_path}: valid; agents: {agents}")


# -- permissions, quota, channels, time zone -----------------------------------------


def _mode_problem(path: Path, st: os.stat_result, allowed: int) -> str | None:
    mode = stat.S_IMODE(st.st_mode)
    if mode & ~allowed:
        return f"{path} is mode {mode:04o} (at most {allowed:04o})"
    if st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
    return None


def _permissions(f: _Facts) -> Check:
    if f.config_path is None:
        return Check("permissions", "skip", "no --config given")
    problems: list[str] = []
    fixes: list[str] = []
    try:
        cst = f.config_path.stat()
    except OSError as exc:
        return Check("permissions", "fail", f"{f.config_path}: {exc.strerror}", "create it")
    problem = _mode_problem(f.config_path, cst, 0o600)
    if problem:
        problems.append(problem)
        fixes.append(f"chmod 600 {f.config_path}")
    if f.cfg is not None:
        state = Path(f.cfg.gateway.state_dir)
        try:
            sst = state.stat()
        except FileNotFoundError:
            sst = None  # created at first start, 0700
        if sst is not None:
            if not stat.S_ISDIR(sst.st_mode):
                problems.append(f"{state} is not a directory")
                fixes.append(f"move it away; the gateway creates {state}")
            else:
                problem = _mode_problem(state, sst, 0o755)
                if problem:
                    problems.append(problem)
                    fixes.append(f"chmod 700 {state}")
                elif not os.access(state, os.W_OK | os.X_OK):
                    problems.append(f"{state} is not writable by this user")
                    fixes.append(f"chown {os.geteuid()} {state}")
            db = state / "state.db"
            if db.exists():
                problem = _mode_problem(db, db.stat(), 0o600)
                if problem:
                    problems.append(problem)
                    fixes.append(f"chmod 600 {db}")
    if problems:
        return Check("permissions", "fail", "; ".join(problems), "; ".join(fixes))
    return Check("permissions", "ok", f"{f.config_path} is 0600 and the state directory is ours")


def _runner(f: _Facts) -> Check:
    """Which resident runner (F2) the gateway starts in its sandboxes."""
    if f.cfg is not None and not f.cfg.gateway.resident_runner:
        return Check("resident runner", "skip", "off (gateway.residentRunner): turns use exec")
    if native_runner() is not None:
        return Check("resident runner", "ok", f"native ({NATIVE_NAME})")
    return Check(
        "resident runner",
        "warn",
        "the native runner is not built: each sandbox starts a Python runner (slower first "
        "turns; images without python3 run every turn by exec)",
        "run scripts/build-runner.sh (it needs a C compiler and a static libc), then restart",
    )


def _try(cmd: list[str]) -> str | None:
    """None when the command succeeds, else why not."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{cmd[0]}: {exc}"
    if r.returncode != 0:
        return f"{' '.join(cmd[:2])}: {(r.stderr or r.stdout).strip()[:200]}"
    return None


def _loop_quota(work: Path) -> str | None:
    """Make, mount and unmount a 16 MB ext4 image on a loop device; None when all worked."""
    for tool in ("mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not Path("/dev/loop-control").exists():
        return "no /dev/loop-control (no loop devices)"
    image, mnt = work / "probe.ext4", work / "mnt"
    mnt.mkdir()
    with image.open("wb") as fh:
        fh.truncate(16 * 1024 * 1024)
    why = _try(["mkfs.ext4", "-q", "-F", "-N", "64", str(image)])
    if why:
        return why
    why = _try(["mount", "-o", "loop,nosuid,nodev,noexec", str(image), str(mnt)])
    if why:
        return why
    return _try(["umount", str(mnt)])


def _project_quota(path: Path) -> bool:
    if shutil.which("findmnt") is None:
        return False
    r = subprocess.run(
        ["findmnt", "-no", "OPTIONS", "--target", str(path)],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    return "prjquota" in r.stdout or "pquota" in r.stdout


def _quota(f: _Facts) -> Check:
    target = Path(f.cfg.gateway.state_dir) if f.cfg is not None else Path(tempfile.gettempdir())
    while not target.exists() and target != target.parent:
        target = target.parent
    works: list[str] = []
    if _project_quota(target):
        works.append(f"project quotas on the file system of {target}")
    with tempfile.TemporaryDirectory(prefix="cellgate-doctor-") as tmp:
        why = _loop_quota(Path(tmp))
    if why is None:
        works.append("loop-mounted ext4 images (loop device, mkfs.ext4, mount)")
    if works:
        return Check("quota (R2)", "ok", "works: " + "; ".join(works))
    if f.cfg is not None and f.cfg.gateway.quota == "off":
        return Check(
            "quota (R2)",
            "warn",
            f'gateway.quota is "off" (loop images fail here: {why}): one conversation can '
            "fill the state directory's disk",
            'run the gateway on a host where loop images work, and remove the "off"',
        )
    return Check(
        "quota (R2)",
        "fail",
        f"no way to cap a conversation's disk: loop images fail ({why}); no project quotas",
        "run the gateway as root with loop devices (apt-get install e2fsprogs mount), or "
        "mount the state directory's file system with prjquota",
    )


def _secret_name(field: str) -> bool:
    """A field that holds (or, ending in `Env`, names the variable of) a channel credential."""
    low = field.lower()
    return any(word in low for word in ("token", "secret", "apikey", "password"))


def _channel_entries(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    def visit(node: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
        if isinstance(node, dict):
            for k, v in node.items():
                here = f"{path}.{k}" if path else str(k)
                if k == "channels" and isinstance(v, dict):
                    for name, entry in v.items():
                        if isinstance(entry, dict):
                            yield f"{here}.{name}", entry
                elif k == "channels" and isinstance(v, list):
                    for i, entry in enumerate(v):
                        if isinstance(entry, dict):
                            yield f"{here}[{i}]", entry
                else:
                    yield from visit(v, here)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                yield from visit(v, f"{path}[{i}]")

    yield from visit(doc, "")


def _channels(f: _Facts) -> Check:
    if f.doc is None:
        return Check("channel tokens", "skip", "no config to read channels from")
    missing: list[str] = []
    present: list[str] = []
    for where, entry in _channel_entries(f.doc):
        for key, value in entry.items():
            if key.endswith("Env") and isinstance(value, str) and _secret_name(key[:-3]):
                (present if os.environ.get(value) else missing).append(f"{where}.{key} -> ${value}")
            elif _secret_name(key):
                (present if isinstance(value, str) and value else missing).append(f"{where}.{key}")
    if not missing and not present:
        return Check("channel tokens", "skip", "no channel with a token is configured")
    if missing:
        return Check(
            "channel tokens",
            "fail",
            "missing: " + ", ".join(missing),
            "set each named environment variable (or field) for the gateway's process",
        )
    return Check("channel tokens", "ok", "present: " + ", ".join(present))


def _time_zone(_: _Facts) -> Check:
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    tz = os.environ.get("TZ")
    if tz:
        try:
            ZoneInfo(tz.lstrip(":"))
        except (ZoneInfoNotFoundError, ValueError):
            return Check(
                "time zone",
                "fail",
                f"TZ={tz!r} is not a known zone",
                "set TZ to a name such as UTC or Europe/Berlin (apt-get install tzdata)",
            )
        return Check("time zone", "ok", f"TZ={tz}")
    local = Path("/etc/localtime")
    if local.exists():
        target = os.path.realpath(local)
        name = target.split("zoneinfo/", 1)[1] if "zoneinfo/" in target else target
        return Check("time zone", "ok", f"/etc/localtime: {name}")
    return Check("time zone", "warn", "no TZ and no /etc/localtime: times are UTC", "set TZ")


def run_checks(config_path: Path | None) -> list[Check]:
    f = _Facts(config_path)
    out = [_config(f), _engine(f)]
    out.append(_base_image(f))
    configured = f.cfg.gateway.runtime if f.cfg is not None else None
    for runtime in dict.fromkeys(["runc", "runsc", *([configured] if configured else [])]):
        out.append(_runtime(f, runtime))  # the configured one too: the gateway runs it
    out.append(_app_images(f))
    out += [_permissions(f), _quota(f), _runner(f), _channels(f), _time_zone(f)]
    if f.client is not None:
        f.client.close()
    return out


def failed(checks: list[Check]) -> bool:
    return any(c.status == "fail" for c in checks)


def render_json(checks: list[Check]) -> str:
    return json.dumps({"ok": not failed(checks), "checks": [asdict(c) for c in checks]}, indent=2)


_MARK = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def render_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'STATUS':6}  {'CHECK':{width}}  DETAIL"]
    for c in checks:
        lines.append(f"{_MARK[c.status]:6}  {c.name:{width}}  {c.detail}")
        if c.fix and c.status in ("fail", "warn"):
            lines.append(f"{'':6}  {'':{width}}  fix: {c.fix}")
    bad = sum(c.status == "fail" for c in checks)
    lines.append(f"{bad} check(s) failed" if bad else "all checks passed")
    return "\n".join(lines)
