"""`cellgate`: serve, demo, doctor, apps (install, update, backup, ...), keys, cron."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cellgate.errors import CellgateError

if TYPE_CHECKING:
    from orchestrator.store import Store


def _state_default() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "cellgate-demo"


async def _serve(
    config_path: Path, port: int | None = None, banner: str | None = None, host: str | None = None
) -> int:
    import uvicorn

    from orchestrator.api import create_app
    from orchestrator.app_modes import prepare_config
    from orchestrator.gateway import Gateway
    from orchestrator.open_files import raise_open_files
    from sandbox.backends.docker import DockerBackend

    raise_open_files()  # R3: the sandboxes' bridges must not take every descriptor
    cfg = prepare_config(config_path)  # L3: app declarations written first
    for reason in cfg.skipped_agents:
        print(f"warning: {reason}", file=sys.stderr)
    gateway = Gateway(cfg, DockerBackend.from_env(), config_path=config_path)
    listen = cfg.gateway.listen
    server = _graceful_server()(
        uvicorn.Config(
            create_app(gateway),
            host=listen.host if host is None else host,
            port=listen.port if port is None else port,
            log_level="warning",
            lifespan="off",
        )
    )
    await gateway.start()  # D2: the recovery scan runs before the first request
    gateway.start_background()  # the reaper and heartbeats, supervised
    if banner:
        print(banner, flush=True)
    try:
        await server.serve()
    finally:
        await gateway.close()
    return 0


def _graceful_server() -> type[Any]:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM/SIGINT once it has stopped serving, which would end
        the process before the gateway closes: its warm pools drained (F1), its bridge
        sockets and runners closed. The signal is kept here; `_serve` returns after
        `Gateway.close`."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                try:
                    yield
                finally:
                    captured = getattr(self, "_captured_signals", None)
                    if isinstance(captured, list):
                        captured.clear()

    return GracefulServer


def _cmd_serve(args: argparse.Namespace) -> int:
    return asyncio.run(_serve(Path(args.config), args.port, host=args.host))


def _cmd_demo(args: argparse.Namespace) -> int:
    from orchestrator.demo import curl_examples, prepare_state, run_tour

    state = Path(args.state_dir).expanduser().resolve()
    print(f"cellgate demo: state directory {state}", file=sys.stderr)
    config_path, key = prepare_state(state, args.base_image)
    if args.once:
        return asyncio.run(run_tour(config_path))
    banner = (
        f"cellgate is serving the demo app on http://127.0.0.1:{args.port}\n"
        f"{curl_examples('127.0.0.1', args.port, key)}\n"
        "(Ctrl-C stops it; sandboxes are reaped after 30 idle minutes)"
    )
    return asyncio.run(_serve(config_path, args.port, banner))


def _cmd_apps_install(args: argparse.Namespace) -> int:
    from orchestrator.apps import install_app
    from orchestrator.config import load_config
    from sandbox.images import docker_client

    config_path = Path(args.config)
    cfg = load_config(config_path)
    client = docker_client()
    try:
        app = install_app(
            Path(args.dir),
            config_path,
            cfg.gateway.state_dir,
            client,
            lambda line: print(f"  {line}", file=sys.stderr),
            build_args={"BASE_IMAGE": cfg.gateway.base_image} if cfg.gateway.base_image else None,
        )
    finally:
        client.close()
    mode = "isolated (one sandbox per conversation)" if app.isolate_memory else "shared container"
    print(f"installed app {app.name} {app.version}: agent {app.agent}, {mode}, image {app.image}")
    return 0


def _progress(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def _apps_env(args: argparse.Namespace) -> tuple[Path, Path, dict[str, str] | None]:
    from orchestrator.config import load_config

    config_path = Path(args.config)
    cfg = load_config(config_path)
    base = cfg.gateway.base_image
    return config_path, cfg.gateway.state_dir, {"BASE_IMAGE": base} if base else None


def _cmd_apps_list(args: argparse.Namespace) -> int:
    from orchestrator.app_ops import list_apps

    _, state, _ = _apps_env(args)
    apps = list_apps(state)
    if args.json:
        print(json.dumps(apps, indent=2))
        return 0
    print(f"{'NAME':20} {'VERSION':10} {'AGENT':22} {'STATE':9} {'ISOLATED':9} IMAGE")
    for a in apps:
        print(f"{a['name']:20} {a.get('version', '-'):10} {a.get('agent', '-'):22} "
              f"{a['state']:9} {str(a.get('isolateMemory', '-')).lower():9} "
              f"{a.get('image', a.get('error', ''))}")  # fmt: skip
    return 0


def _cmd_apps_inspect(args: argparse.Namespace) -> int:
    from orchestrator.app_ops import inspect_target

    _, state, _ = _apps_env(args)
    print(json.dumps(inspect_target(state, args.target), indent=2))
    return 0


def _cmd_apps_update(args: argparse.Namespace) -> int:
    from orchestrator.app_ops import update_app
    from sandbox.images import docker_client

    config_path, state, build_args = _apps_env(args)
    client = docker_client()
    try:
        old, new = update_app(Path(args.dir), config_path, state, client, _progress, build_args)
    finally:
        client.close()
    print(f"updated app {new.name} {old.version} -> {new.version}: image {new.image}, "
          f"isolateMemory {str(new.isolate_memory).lower()}, "
          f"disableArchive {str(new.disable_archive).lower()}")  # fmt: skip
    return 0


def _key_values(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"cellgate: --env wants NAME=VALUE, got {pair!r}")
        out[name] = value
    return out


def _cmd_apps_reconfigure(args: argparse.Namespace) -> int:
    from orchestrator.app_ops import reconfigure_app
    from sandbox.images import docker_client

    config_path, state, _ = _apps_env(args)
    client = docker_client()
    try:
        app = reconfigure_app(args.name, config_path, state, set_env=_key_values(args.env or []),
                              unset_env=args.unset_env or [], docker=client,
                              progress=_progress)  # fmt: skip
    finally:
        client.close()
    print(f"reconfigured app {app.name}: agent {app.agent} entry rewritten from app.yaml")
    return 0


def _cmd_apps_state(args: argparse.Namespace) -> int:
    from orchestrator.app_ops import set_state
    from sandbox.images import docker_client

    config_path, state, _ = _apps_env(args)
    running = args.apps_command == "start"
    client = docker_client()
    try:
        app = set_state(args.name, config_path, state, running, docker=client, progress=_progress)
    finally:
        client.close()
    print(f"app {app.name} {app.state}")
    return 0


def _cmd_apps_uninstall(args: argparse.Namespace) -> int:
    from orchestrator.app_ops import uninstall_app
    from sandbox.images import docker_client

    config_path, state, _ = _apps_env(args)
    client = docker_client()
    try:
        archive = uninstall_app(args.name, config_path, state, client, _progress, purge=args.purge,
                                backup_to=Path(args.backup) if args.backup else None)  # fmt: skip
    finally:
        client.close()
    print(f"uninstalled app {args.name}" + (f"; its data was backed up to {archive} and deleted"
                                           if archive else "; its data is kept"))  # fmt: skip
    return 0


def _cmd_apps_backup(args: argparse.Namespace) -> int:
    from orchestrator.app_backup import backup_app, default_backup_path

    _, state, _ = _apps_env(args)
    target = Path(args.output) if args.output else default_backup_path(state, args.name)
    print(backup_app(args.name, state, target, _progress))
    return 0


def _cmd_apps_restore(args: argparse.Namespace) -> int:
    from orchestrator.app_backup import restore_app
    from sandbox.images import docker_client

    config_path, state, build_args = _apps_env(args)
    client = docker_client()
    try:
        app = restore_app(Path(args.archive), config_path, state, client, _progress, build_args)
    finally:
        client.close()
    print(f"restored app {app.name} {app.version}: agent {app.agent}")
    return 0


def _keys_store(config: str) -> Store:
    from orchestrator.config import load_config
    from orchestrator.store import Store

    return Store.open(load_config(Path(config)).gateway.state_dir)


def _cmd_keys_create(args: argparse.Namespace) -> int:
    from orchestrator.config import load_config
    from orchestrator.keys import create_operator_key
    from orchestrator.store import Store

    config = load_config(Path(args.config))
    with Store.open(config.gateway.state_dir) as store:
        key, secret = create_operator_key(
            store,
            args.name,
            args.agent or [],
            all_agents=args.all_agents,
            admin=args.admin,
            write=args.write,
            known={a.id for a in config.agents},
        )
    flags = ", ".join(f for f, on in (("admin", key.admin), ("write", key.write)) if on)
    print(f"created key {key.id} ({key.name}) for agents {','.join(key.agents)}"
          f"{f' [{flags}]' if flags else ''}", file=sys.stderr)  # fmt: skip
    print("the secret is shown only now; store it safely:", file=sys.stderr)
    print(secret)
    return 0


def _cmd_keys_list(args: argparse.Namespace) -> int:
    import time

    def when(t: float | None) -> str:
        return "-" if t is None else time.strftime("%Y-%m-%d %H:%M", time.gmtime(t))

    with _keys_store(args.config) as store:
        keys = store.list_keys(include_revoked=args.all)
    print(f"{'ID':22} {'NAME':20} {'PREFIX':12} {'AGENTS':20} {'FLAGS':12} "
          f"{'CREATED':16} {'LAST USED':16} REVOKED")  # fmt: skip
    for k in keys:
        flags = ",".join(f for f, on in (("admin", k.admin), ("write", k.write)) if on) or "-"
        print(f"{k.id:22} {k.name[:20]:20} {k.prefix:12} {','.join(k.agents)[:20]:20} "
              f"{flags:12} {when(k.created_at):16} {when(k.last_used_at):16} "
              f"{when(k.revoked_at)}")  # fmt: skip
    return 0


def _cmd_keys_revoke(args: argparse.Namespace) -> int:
    from orchestrator.store import KeyId

    with _keys_store(args.config) as store:
        key = store.revoke_key(KeyId(args.id))
    print(f"revoked key {key.id} ({key.name})")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from orchestrator.doctor import failed, render_json, render_table, run_checks

    checks = run_checks(Path(args.config) if args.config else None)
    print(render_json(checks) if args.json else render_table(checks))
    return 1 if failed(checks) else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cellgate", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the gateway")
    s.add_argument("--config", required=True, help="the gateway config file (JSON)")
    s.add_argument("--port", type=int, default=None, help="override gateway.listen.port")
    s.add_argument("--host", default=None, help="override gateway.listen.host (in a container)")
    s.set_defaults(func=_cmd_serve)

    d = sub.add_parser("demo", help="run the demo app on loopback")
    d.add_argument("--state-dir", default=str(_state_default()))
    d.add_argument("--port", type=int, default=8787)
    d.add_argument("--base-image", default=os.environ.get("CELLGATE_BASE_IMAGE"))
    d.add_argument("--once", action="store_true", help="play a short tour and exit")
    d.set_defaults(func=_cmd_demo)

    dr = sub.add_parser("doctor", help="check that the gateway can start here (O4)")
    dr.add_argument("--config", default=None, help="the gateway config file to check")
    dr.add_argument("--json", action="store_true", help="machine-readable output")
    dr.set_defaults(func=_cmd_doctor)

    a = sub.add_parser("apps", help="manage apps")
    asub = a.add_subparsers(dest="apps_command", required=True)
    ai = asub.add_parser("install", help="install the app in DIR")
    ai.add_argument("dir")
    ai.add_argument("--config", required=True)
    ai.set_defaults(func=_cmd_apps_install)
    al = asub.add_parser("list", help="the installed apps")
    al.add_argument("--json", action="store_true")
    al.set_defaults(func=_cmd_apps_list)
    ains = asub.add_parser("inspect", help="an app directory's or installed app's declaration")
    ains.add_argument("target", help="an app directory or an installed app's name")
    ains.set_defaults(func=_cmd_apps_inspect)
    au = asub.add_parser("update", help="install a new release from DIR (chats/, media/ kept)")
    au.add_argument("dir")
    au.set_defaults(func=_cmd_apps_update)
    arc = asub.add_parser("reconfigure", help="the app's environment; entry rewritten (L3)")
    arc.add_argument("name")
    arc.add_argument("--env", action="append", metavar="NAME=VALUE")
    arc.add_argument("--unset-env", action="append", metavar="NAME")
    arc.set_defaults(func=_cmd_apps_reconfigure)
    for verb, text in (("start", "serve the app again"), ("stop", "stop serving the app")):
        ast = asub.add_parser(verb, help=text)
        ast.add_argument("name")
        ast.set_defaults(func=_cmd_apps_state)
    aun = asub.add_parser("uninstall", help="sandboxes, image tag, agent entry; data on --purge")
    aun.add_argument("name")
    aun.add_argument("--purge", action="store_true", help="back up, then delete the data")
    aun.add_argument("--backup", default=None, help="where --purge writes its backup")
    aun.set_defaults(func=_cmd_apps_uninstall)
    ab = asub.add_parser("backup", help="one tar.gz of the workspace and store rows")
    ab.add_argument("name")
    ab.add_argument("-o", "--output", default=None)
    ab.set_defaults(func=_cmd_apps_backup)
    ar = asub.add_parser("restore", help="bring an app back from a backup archive")
    ar.add_argument("archive")
    ar.set_defaults(func=_cmd_apps_restore)
    for sp in (al, ains, au, arc, aun, ab, ar, *asub.choices.values()):
        if not any(a.dest == "config" for a in sp._actions):
            sp.add_argument("--config", required=True)

    k = sub.add_parser("keys", help="manage API keys (kept hashed in the state database)")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    kc = ksub.add_parser("create", help="mint a key; its secret is printed once")
    kc.add_argument("--config", required=True)
    kc.add_argument("--name", required=True, help="who or what the key is for")
    scope = kc.add_mutually_exclusive_group(required=True)
    scope.add_argument("--agent", action="append", help="an agent the key may use (repeatable)")
    scope.add_argument("--all-agents", action="store_true", help="every agent (*)")
    kc.add_argument("--admin", action="store_true", help="every chat of every agent (K3)")
    kc.add_argument("--write", action="store_true", help="may inject, share and revoke")
    kc.set_defaults(func=_cmd_keys_create)
    kl = ksub.add_parser("list", help="list keys (never their secrets)")
    kl.add_argument("--config", required=True)
    kl.add_argument("--all", action="store_true", help="include revoked keys")
    kl.set_defaults(func=_cmd_keys_list)
    kr = ksub.add_parser("revoke", help="revoke a key by its id")
    kr.add_argument("id")
    kr.add_argument("--config", required=True)
    kr.set_defaults(func=_cmd_keys_revoke)

    from orchestrator.cron.cli import register as register_cron

    register_cron(sub)  # cron add | list | pause | resume | delete (C1, C2)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    # one line per Bot API request (a long poll every few seconds) is noise, not news;
    # its URLs are redacted either way (channels.telegram.RedactBotTokens, W6)
    logging.getLogger("httpx").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    try:
        code: int = args.func(args)
    except CellgateError as exc:
        print(f"cellgate: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    raise SystemExit(main())
