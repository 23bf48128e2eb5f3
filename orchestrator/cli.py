"""`cellgate`: serve, demo, doctor, apps install, keys, cron."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cellgate.errors import CellgateError

if TYPE_CHECKING:
    from orchestrator.store import Store


def _state_default() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "cellgate-demo"


async def _serve(config_path: Path, port: int | None = None, banner: str | None = None) -> int:
    import uvicorn

    from orchestrator.api import create_app
    from orchestrator.config import load_config
    from orchestrator.gateway import Gateway
    from sandbox.backends.docker import DockerBackend

    cfg = load_config(config_path)
    for reason in cfg.skipped_agents:
        print(f"warning: {reason}", file=sys.stderr)
    gateway = Gateway(cfg, DockerBackend.from_env())
    listen = cfg.gateway.listen
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(gateway),
            host=listen.host,
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


def _cmd_serve(args: argparse.Namespace) -> int:
    return asyncio.run(_serve(Path(args.config), args.port))


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


def _keys_store(config: str) -> Store:
    from orchestrator.config import load_config
    from orchestrator.store import Store

    return Store.open(load_config(Path(config)).gateway.state_dir)


def _cmd_keys_create(args: argparse.Namespace) -> int:
    from orchestrator.keys import create_operator_key

    with _keys_store(args.config) as store:
        key, secret = create_operator_key(
            store,
            args.name,
            args.agent or [],
            all_agents=args.all_agents,
            admin=args.admin,
            write=args.write,
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
