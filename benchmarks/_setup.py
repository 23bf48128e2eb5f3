"""Shared setup for the sandbox benchmarks (`sandbox_start.py`, `turn_throughput.py`).

A benchmark run gets a temporary state directory with the sample app installed
under a name of its own (`<prefix>-<random>`, image built on the local base,
`cellgate-base:bookworm` or $CELLGATE_BASE_IMAGE), a gateway config with the
runtime and turn bound asked for, and plain containers of the same image id
for the baselines. Cleanup removes exactly what the run made: the sandboxes of
its app made by its own gateway (the app and gateway id labels, R1), the plain
containers it labelled with its run id, its image tag (the image id stays,
other tags share it) and the state dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
import shutil
import sys
import tempfile
import threading
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import docker
import docker.errors
import yaml

from orchestrator.apps import InstalledApp, install_app
from orchestrator.config import load_config, write_config_document
from orchestrator.demo import sample_app_dir
from orchestrator.gateway import Gateway, TurnOutcome
from sandbox.backends.docker import DockerBackend
from sandbox.gateway_id import load_gateway_id
from sandbox.latebind import detach_under
from sandbox.quota import release_all
from sandbox.spec import LABEL_APP, LABEL_GATEWAY

T = TypeVar("T")
BENCH_LABEL = "io.cellgate.bench"
CHANNEL = "api"
CLEANUP_THREADS = 8


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1): p95 of 20 trials is the 19th smallest."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class BenchRun:
    """One benchmark run: its state directory, installed app, and what it created."""

    name: str
    state: Path
    config_path: Path
    app: InstalledApp
    client: Any
    runtime: str | None
    run_id: str
    gateway_id: str
    _chats: int = 0

    @property
    def agent(self) -> str:
        return self.app.agent

    def gateway(self) -> Gateway:
        return Gateway(load_config(self.config_path), DockerBackend.from_env())

    def new_chat(self, prefix: str) -> str:
        """A chat id no other conversation of this run has."""
        self._chats += 1
        return f"{prefix}-{self._chats}"

    def labels(self) -> dict[str, str]:
        return {BENCH_LABEL: self.run_id}

    def run_kwargs(self) -> dict[str, Any]:
        """What every baseline container gets: this run's label, no network, the runtime."""
        kwargs: dict[str, Any] = {"labels": self.labels(), "network_mode": "none"}
        if self.runtime:
            kwargs["runtime"] = self.runtime
        return kwargs

    def plain_container(self) -> Any:
        """A plain running container of the sandbox image (no hardening, no mounts)."""
        return self.client.containers.run(
            self.app.image_id, ["sleep", "infinity"], detach=True, **self.run_kwargs()
        )

    def plain_containers(self, n: int, threads: int) -> list[Any]:
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(lambda _: self.plain_container(), range(n)))

    def leftovers(self) -> list[Any]:
        """Every container this run made that still exists."""
        mine = [f"{LABEL_APP}={self.app.name}", f"{LABEL_GATEWAY}={self.gateway_id}"]
        sandboxes = self.client.containers.list(all=True, filters={"label": mine})
        plain = self.client.containers.list(
            all=True, filters={"label": f"{BENCH_LABEL}={self.run_id}"}
        )
        return sandboxes + plain

    def cleanup(self) -> None:
        """Force-remove what the run made; say which ones could not be removed."""
        failed: list[str] = []

        def remove(container: Any) -> None:
            try:
                container.remove(force=True, v=True)
            except docker.errors.NotFound:
                return
            except docker.errors.APIError as exc:
                failed.append(f"{container.name} ({exc.explanation or exc})")

        with ThreadPoolExecutor(CLEANUP_THREADS) as pool:
            list(pool.map(remove, self.leftovers()))
        try:
            self.client.images.remove(self.app.image)  # only the tag: the id has others
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            failed.append(f"image tag {self.app.image} ({exc.explanation or exc})")
        if failed:
            print(
                "could not remove, do it by hand (`docker rm -f NAME`): " + ", ".join(failed),
                file=sys.stderr,
            )


class GatewayService:
    """The gateway on an event loop in its own thread; turns are submitted from this one."""

    def __init__(self, run: BenchRun) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.gateway = self.call(self._open(run))

    @staticmethod
    async def _open(run: BenchRun) -> Gateway:
        gateway = run.gateway()
        await gateway.start()
        return gateway

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def turn(self, agent: str, chat: str, text: str) -> TurnOutcome:
        return self.call(self.gateway.turn(agent, CHANNEL, chat, text))

    def close(self) -> None:
        try:
            self.call(self.gateway.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)
            self.loop.close()


def _install(
    state: Path, client: Any, name: str, runtime: str | None, max_concurrent_turns: int
) -> tuple[Path, InstalledApp]:
    base = os.environ.get("CELLGATE_BASE_IMAGE", "cellgate-base:bookworm")
    config_path = state / "config.json"
    gateway: dict[str, Any] = {
        "stateDir": str(state),
        "maxConcurrentTurns": max_concurrent_turns,
        # admission stays on the path, with limits no benchmark reaches
        "admission": {
            "chatPerMinute": 1e6,
            "senderPerMinute": 1e6,
            "burst": 1e6,
            "maxQueuedPerChat": 10_000,
        },
    }
    if runtime:
        gateway["runtime"] = runtime
    write_config_document(config_path, {"gateway": gateway, "agents": []})
    src = state / "app-src"
    shutil.copytree(sample_app_dir(), src, symlinks=True)
    manifest = yaml.safe_load((src / "app.yaml").read_text())
    manifest["name"] = name
    manifest["services"]["agent"]["name"] = f"{name}-bot"
    (src / "app.yaml").write_text(yaml.safe_dump(manifest))
    app = install_app(
        src, config_path, state, client, lambda _: None, build_args={"BASE_IMAGE": base}
    )
    return config_path, app


@contextlib.contextmanager
def bench_run(
    prefix: str, *, runtime: str | None, max_concurrent_turns: int = 8, pool: int = 16
) -> Iterator[BenchRun]:
    """Install the sample app as `<prefix>-<random>` in a temporary state dir; remove all after."""
    run_id = secrets.token_hex(4)
    name = f"{prefix}-{run_id}"
    client = docker.from_env(max_pool_size=pool)
    state = Path(tempfile.mkdtemp(prefix=f"cgbench-{name}-"))
    run: BenchRun | None = None
    try:
        config_path, app = _install(state, client, name, runtime, max_concurrent_turns)
        gateway_id = load_gateway_id(state)  # the id its gateways will read back (R1)
        run = BenchRun(name, state, config_path, app, client, runtime, run_id, gateway_id)
        yield run
    finally:
        if run is not None:
            run.cleanup()
        client.close()
        # the quota images' and the pool slots' mounts, before their files go (a mount
        # left behind keeps a loop device and a kernel thread until the host reboots)
        detach_under(state)
        release_all(state)
        shutil.rmtree(state, ignore_errors=True)
