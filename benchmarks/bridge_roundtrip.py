"""Bridge tool-call round trip from inside a real sandbox, against a raw unix-socket echo.

    python benchmarks/bridge_roundtrip.py [--calls 300]

Installs the sample app (image on the local base, `cellgate-base:bookworm` or
$CELLGATE_BASE_IMAGE) under a temporary state directory, starts one sandbox,
opens its bridge, and puts an echo server (`echo.sock`) in the same bridge
directory. One python process inside the sandbox then times, with
time.perf_counter, `--calls` round trips of each (connect, one JSON line out,
one line back, close: what `cellgate-tool` does per call):

- echo: the raw socket baseline;
- bridge ping: a cheap registered tool, through the full dispatch (offer
  check, handler, refusal wrapper, JSON both ways);
- bridge reply: `reply` with its P1 decision into an in-memory outbox;
- client call(): the same `ping` through the real client's `call()`.

It prints p50/p95 for each and the bridge/echo ratio. Everything it created is removed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import docker
import docker.errors
import yaml

from cellgate.models import ConversationKey
from orchestrator.apps import install_app
from orchestrator.bridge import (
    BridgeLimits,
    BridgeScope,
    BridgeServer,
    BuiltinTools,
    PendingOutbox,
    StoreRefusals,
    ToolCall,
    ToolHandlers,
    install_client,
)
from orchestrator.config import load_config, write_config_document
from orchestrator.demo import sample_app_dir
from orchestrator.sandboxes import ConversationSandboxes
from orchestrator.store import Store
from policies.bridge import RateLimit
from sandbox.backends.docker import DockerBackend
from sandbox.gateway_id import load_gateway_id
from sandbox.spec import LABEL_APP, LABEL_GATEWAY

APP = "cgbench"

INSIDE = r"""
import importlib.machinery, json, socket, sys, time

N, WARM = int(sys.argv[1]), 20

def roundtrip(path, line):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(line)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    s.close()
    return buf

def measure(cases):
    # interleaved, so a noisy moment hits every case alike
    times = {name: [] for name in cases}
    for i in range(WARM + N):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            if i >= WARM:
                times[name].append(time.perf_counter() - t0)
    out = {}
    for name, ts in times.items():
        ts.sort()
        out[name] = {"p50": ts[len(ts) // 2], "p95": ts[int(len(ts) * 0.95) - 1], "n": len(ts)}
    return out

tool = importlib.machinery.SourceFileLoader(
    "cellgate_tool", "/run/cellgate/cellgate-tool").load_module()
ping = json.dumps({"id": "b", "tool": "ping", "args": {}}).encode() + b"\n"
reply = json.dumps({"id": "r", "tool": "reply", "args": {"text": "hi"}}).encode() + b"\n"
assert b'"ok":true' in roundtrip("/run/cellgate/bridge.sock", ping)
print(json.dumps(measure({
    "echo": lambda: roundtrip("/run/cellgate/echo.sock", ping),
    "bridge ping": lambda: roundtrip("/run/cellgate/bridge.sock", ping),
    "bridge reply": lambda: roundtrip("/run/cellgate/bridge.sock", reply),
    "client call()": lambda: tool.call("ping", {}),
})))
"""


def _bind_echo(directory: Path) -> socket.socket:
    """`echo.sock` beside `bridge.sock`, bound the same way (through the directory's fd)."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink("echo.sock", dir_fd=dfd)
        sock.bind(f"/proc/self/fd/{dfd}/echo.sock")
        os.chmod("echo.sock", 0o666, dir_fd=dfd)  # the sandbox's uid connects, as to the bridge
    finally:
        os.close(dfd)
    return sock


async def _echo_server(directory: Path) -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        writer.write(line)
        await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(echo, sock=_bind_echo(directory))


async def _ping(call: ToolCall) -> dict[str, Any]:
    return {}


def _install(state: Path, client: Any) -> Any:
    base = os.environ.get("CELLGATE_BASE_IMAGE", "cellgate-base:bookworm")
    config_path = state / "config.json"
    write_config_document(config_path, {"gateway": {"stateDir": str(state)}, "agents": []})
    src = state / "app-src"
    shutil.copytree(sample_app_dir(), src, symlinks=True)
    manifest = yaml.safe_load((src / "app.yaml").read_text())
    manifest["name"] = APP
    manifest["services"]["agent"]["name"] = f"{APP}-bot"
    (src / "app.yaml").write_text(yaml.safe_dump(manifest))
    app = install_app(
        src, config_path, state, client, lambda _: None, build_args={"BASE_IMAGE": base}
    )
    return app, load_config(config_path).gateway


async def main(calls: int) -> None:
    client = docker.from_env()
    state = Path(tempfile.mkdtemp(prefix="cgbench-"))
    backend = DockerBackend.from_env()
    gateway_id = load_gateway_id(state)  # R1: this run's sandboxes only
    try:
        app, settings = _install(state, client)
        store = Store.open(state)
        handlers = BuiltinTools(PendingOutbox(), store, state / "spool").install(
            ToolHandlers(refusals=StoreRefusals(store))
        )
        handlers.register("ping", _ping, description="does nothing")
        # the dispatch path is measured: lift the R4 call rate, which would answer most `busy`
        unlimited = RateLimit(per_second=1e9, burst=10**9)
        server = BridgeServer(handlers, BridgeLimits(rate=unlimited))
        key = ConversationKey(app.agent, "telegram", f"bench-{secrets.token_hex(4)}")
        sid = "s-bench"
        prepared = await ConversationSandboxes(
            app, settings, backend, gateway_id=gateway_id
        ).ensure(key, sid)
        conv = store.upsert_conversation(key)
        store.open_session(conv.id, "shell", session_id=sid)  # type: ignore[arg-type]
        install_client(prepared.paths.bridge_dir)
        await server.open(BridgeScope.for_conversation(key, sid, prepared.paths))
        echo = await _echo_server(prepared.paths.bridge_dir)
        try:
            r = await backend.exec(
                prepared.handle, ["python3", "-c", INSIDE, str(calls)], timeout=600
            )
        finally:
            echo.close()
            await server.close_all()
            store.close()
        if r.exit_code != 0:
            raise SystemExit(f"benchmark failed in the sandbox: {r.stderr.decode()}")
        results = json.loads(r.stdout)
        print(f"bridge round trip from inside sandbox {prepared.handle.name} ({calls} calls each)")
        for name, m in results.items():
            print(f"  {name:<14} p50 {m['p50'] * 1e6:8.1f} us   p95 {m['p95'] * 1e6:8.1f} us")
        echo_p50, echo_p95 = results["echo"]["p50"], results["echo"]["p95"]
        for name in ("bridge ping", "bridge reply", "client call()"):
            m = results[name]
            print(
                f"  ratio {name} / echo: p50 {m['p50'] / echo_p50:.2f}x   "
                f"p95 {m['p95'] / echo_p95:.2f}x"
            )
    finally:
        mine = [f"{LABEL_APP}={APP}", f"{LABEL_GATEWAY}={gateway_id}"]
        for c in client.containers.list(all=True, filters={"label": mine}):
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                c.remove(force=True)
        await backend.close()
        client.close()
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    asyncio.run(main(parser.parse_args().calls))
