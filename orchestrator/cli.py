"""`cellgate`: serve, demo, apps install."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from orchestrator.errors import CellgateError


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
    reaper = asyncio.create_task(gateway.run_reaper())
    if banner:
        print(banner, flush=True)
    try:
        await server.serve()
    finally:
        reaper.cancel()
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

    a = sub.add_parser("apps", help="manage apps")
    asub = a.add_subparsers(dest="apps_command", required=True)
    ai = asub.add_parser("install", help="install the app in DIR")
    ai.add_argument("dir")
    ai.add_argument("--config", required=True)
    ai.set_defaults(func=_cmd_apps_install)
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
