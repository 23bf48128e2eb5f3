"""Warm pool (F1), resident runner (F2) and 64 at once (F3), each beside a raw baseline.

    python benchmarks/pool_start.py [--trials 20] [--burst 64] [--runtime runsc]

One run installs the sample app (shell harness) in a temporary state dir with
the warm pool on, runs the gateway (and its pool's background refill) on an
event loop of its own thread, and measures, in one run:

1. interleaved trials (case order shuffled per trial), text `true`:
   - pool: the first turn of a NEW conversation, its sandbox claimed from
     the pool (the pool is refilled between trials, untimed);
   - cold: the same with the pool bypassed (a cold create and start);
   - CLI run: `docker run --rm --network none IMAGE true`;
   - SDK run: docker-py `containers.run(IMAGE, "true", remove=True)`;
   - warm: a later turn of one conversation (its resident runner connected);
   - SDK exec: `exec_create` + `exec_start` of `true` in a plain container;
2. `--burst` new conversations at once (the pool filled to that many first,
   untimed): each one's first-turn latency (p50, p99) and the event loop's
   lag meanwhile (a 5 ms ticker on the gateway's loop: how late it woke, p99);
   the same burst once more with the pool off (cold) unless `--no-cold-burst`;
3. idle memory (cgroup usage less inactive page cache, as `docker stats`) of pooled
   sandboxes waiting for a claim, of claimed idle sandboxes (resident runner
   inside), and of plain `sleep infinity` containers of the same image.

Ratios printed: pool / CLI run, pool / SDK run, warm / SDK exec, burst p99 /
single cold p50, pooled idle memory / plain. Every container the run made is
removed at the end (its app and gateway id labels, or its bench label).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker.errors

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._setup import BENCH_LABEL, CHANNEL, BenchRun, GatewayService, bench_run, percentile
from orchestrator.config import load_config, write_config_document
from orchestrator.gateway import Gateway, TurnOutcome
from orchestrator.pool import WarmPool
from orchestrator.sandboxes import ConversationSandboxes, SandboxPool
from orchestrator.spare_quota import SparedQuota
from sandbox.latebind import LateBinder, detach_under

APP = "cgpool"
WARMUP = 2
POOL, COLD, CLI_RUN, SDK_RUN, WARM, SDK_EXEC = (
    "pool", "cold", "CLI run", "SDK run", "warm", "SDK exec",
)  # fmt: skip
DESCRIPTIONS = {
    POOL: "Gateway.turn `true`, new conversation, from pool",
    COLD: "Gateway.turn `true`, new conversation, cold",
    CLI_RUN: "docker run --rm --network none IMAGE true",
    SDK_RUN: "SDK containers.run(IMAGE, 'true', remove=True)",
    WARM: "Gateway.turn `true`, same conversation (runner)",
    SDK_EXEC: "SDK exec_create + exec_start `true`",
}


def configure(run: BenchRun, burst: int) -> None:
    """The pool and the resident runner on, and room for `burst` sandboxes under the cap."""
    doc = load_config(run.config_path).model_dump(by_alias=True, mode="json")
    gw = doc["gateway"]
    gw["pool"] = {"size": 4, "max": burst}
    gw["residentRunner"] = True  # both opt-in (F1, F2)
    gw["limits"]["maxSandboxes"] = 4 * burst + 16
    gw["maxConcurrentTurns"] = burst
    gw["admission"]["turnsPerSender"] = burst
    write_config_document(run.config_path, doc)


def _checked(outcome: TurnOutcome) -> TurnOutcome:
    if outcome.result.meta.get("exit_code") != 0:
        raise SystemExit(f"a gateway turn failed: {outcome.result.reply!r}")
    return outcome


class Bench:
    def __init__(self, run: BenchRun) -> None:
        self.run = run
        self.service = GatewayService(run)
        self.gateway: Gateway = self.service.gateway
        self.service.call(self._background())
        rt = self.gateway.agents[run.agent]
        assert rt.sandboxes is not None
        self.sandboxes: ConversationSandboxes = rt.sandboxes
        [self.pool] = self.gateway.pools.pools
        self.api = run.client.api

    async def _background(self) -> None:
        self.gateway.start_background()

    def wait_pool(self, n: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        self.service.call(_wake(self.pool))
        quota = self.sandboxes.quota
        agent = self.sandboxes.app.agent

        def spares() -> int:  # the quota images made ahead are part of a filled pool
            return quota.spares(agent) if isinstance(quota, SparedQuota) else n

        while len(self.pool.ready) < n or spares() < n or self.pool._creating:
            if time.monotonic() > deadline:
                raise SystemExit(f"the pool did not reach {n} ready (has {len(self.pool.ready)})")
            time.sleep(0.05)

    def set_pool(self, size: int) -> None:
        async def go() -> None:
            self.pool.settings = self.pool.settings.model_copy(update={"size": size})
            self.pool.wake.set()

        self.service.call(go())

    def without_pool(self, fn: Callable[[], Any]) -> Any:
        saved: SandboxPool | None = self.sandboxes.pool
        self.sandboxes.pool = None
        try:
            return fn()
        finally:
            self.sandboxes.pool = saved

    def turn(self, chat: str) -> TurnOutcome:
        return _checked(self.service.turn(self.run.agent, chat, "true"))

    def remove(self, name: str) -> None:
        """Remove a sandbox as the reaper would: the container, then the gateway's record."""
        with contextlib.suppress(docker.errors.NotFound):
            self.api.remove_container(name, force=True, v=True)
        self.service.call(self.gateway.sandboxes.removed(name))

    def close(self) -> None:
        try:
            self.service.close()
        finally:
            self.run.cleanup()  # the containers first, then the slots' mounts
            LateBinder(self.run.state / "pool" / self.run.gateway_id).teardown()
            detach_under(self.run.state)  # the quota images' mounts (R2) of its conversations


async def _wake(pool: WarmPool) -> None:
    pool.wake.set()


def trials(b: Bench, n: int, seed: int) -> dict[str, list[float]]:
    run, api = b.run, b.api
    image = run.app.image_id
    plain = run.plain_container()
    runtime = ["--runtime", run.runtime] if run.runtime else []
    cli = [
        "docker", "run", "--rm", "--network", "none",
        "--label", f"{BENCH_LABEL}={run.run_id}", *runtime, image, "true",
    ]  # fmt: skip
    warm_chat = run.new_chat("warm")
    b.wait_pool(1)
    first = b.turn(warm_chat)
    residents = b.gateway.runner.residents
    handle = b.pool.claimed.get(next(iter(b.pool.claimed)))
    if residents is not None and handle is not None:
        b.service.call(residents.wait_connected(handle.pooled.handle, 20))
    b.turn(warm_chat)
    print(f"  warm conversation's sandbox: {first.sandbox}", file=sys.stderr)

    def pool() -> None:
        b.wait_pool(b.pool.settings.size)  # refilled and quiet: no refill competes with it
        t0 = time.perf_counter()
        out = b.turn(run.new_chat("pool"))
        elapsed = time.perf_counter() - t0
        if "-agent-p-" not in out.sandbox:
            raise SystemExit(f"the pool case started cold ({out.sandbox})")
        b.remove(out.sandbox)
        timed.append(elapsed)

    def cold() -> None:
        t0 = time.perf_counter()
        out = b.without_pool(lambda: b.turn(run.new_chat("cold")))
        timed.append(time.perf_counter() - t0)
        b.remove(out.sandbox)

    def timing(fn: Callable[[], Any]) -> Callable[[], None]:
        def go() -> None:
            t0 = time.perf_counter()
            fn()
            timed.append(time.perf_counter() - t0)

        return go

    def sdk_exec() -> None:
        exec_id = api.exec_create(plain.id, ["true"])["Id"]
        api.exec_start(exec_id)

    kw = run.run_kwargs()
    timed: list[float] = []
    cases: dict[str, Callable[[], None]] = {
        POOL: pool,
        COLD: cold,
        CLI_RUN: timing(lambda: subprocess.run(cli, check=True, capture_output=True)),
        SDK_RUN: timing(lambda: run.client.containers.run(image, "true", remove=True, **kw)),
        WARM: timing(lambda: b.turn(warm_chat)),
        SDK_EXEC: timing(sdk_exec),
    }  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in cases}
    rng = random.Random(seed)
    for i in range(WARMUP + n):
        order = list(cases)
        rng.shuffle(order)
        for name in order:
            cases[name]()
            elapsed = timed.pop()
            if i >= WARMUP:
                times[name].append(elapsed)
        if sys.stderr.isatty():
            print(f"  trial {i + 1 - WARMUP}/{n} ", end="\r", file=sys.stderr)
    return times


async def _burst(gateway: Gateway, agent: str, chats: list[str]) -> tuple[list[float], list[float]]:
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            t0 = loop.time()
            await asyncio.sleep(0.005)
            lags.append(loop.time() - t0 - 0.005)

    async def one(chat: str) -> float:
        t0 = time.perf_counter()
        _checked(await gateway.turn(agent, CHANNEL, chat, "true"))
        return time.perf_counter() - t0

    tick = asyncio.create_task(ticker())
    try:
        latencies = await asyncio.gather(*(one(c) for c in chats))
    finally:
        stop.set()
        await tick
    return list(latencies), lags


def burst(b: Bench, n: int, pooled: bool) -> tuple[list[float], list[float], int]:
    chats = [b.run.new_chat("burst") for _ in range(n)]
    before = {s.name for s in b.service.call(b.gateway.sandboxes.live())}
    if pooled:
        b.set_pool(n)
        b.wait_pool(n)
        lat, lags = b.service.call(_burst(b.gateway, b.run.agent, chats))
    else:
        lat, lags = b.without_pool(lambda: b.service.call(_burst(b.gateway, b.run.agent, chats)))
    names = [s.name for s in b.service.call(b.gateway.sandboxes.live())]
    from_pool = sum(1 for s in names if "-agent-p-" in s and s not in before)  # the burst's own
    b.set_pool(4)
    for name in names:
        b.remove(name)
    return lat, lags, from_pool


def _memory(client: Any, ids: list[str]) -> float:
    values = []
    for cid in ids:
        try:
            stats = client.api.stats(cid, stream=False)
        except docker.errors.NotFound:
            continue
        mem = stats["memory_stats"]
        # as `docker stats` shows it: the page cache it could drop (inactive files) left out
        detail = mem.get("stats") or {}
        cache = detail.get("inactive_file", detail.get("total_inactive_file", 0))
        values.append(float(mem.get("usage", 0) - cache))
    return statistics.median(values) if values else 0.0


def memory(b: Bench, n: int) -> tuple[float, float, float]:
    b.set_pool(n)
    b.wait_pool(n)
    time.sleep(2)
    pooled = _memory(b.run.client, [p.handle.container_id for p in list(b.pool.ready)])
    plain = [b.run.plain_container().id for _ in range(n)]
    time.sleep(2)
    plain_mem = _memory(b.run.client, plain)
    claimed = [c.pooled.handle.container_id for c in b.pool.claimed.values()]
    claimed_mem = _memory(b.run.client, claimed) if claimed else 0.0
    return pooled, plain_mem, claimed_mem


def _ms(s: float) -> str:
    return f"{s * 1e3:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--runtime", default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-cold-burst", action="store_true")
    args = parser.parse_args()
    started = time.monotonic()
    with bench_run(APP, runtime=args.runtime, pool=args.burst + 16) as run:
        configure(run, args.burst)
        b = Bench(run)
        try:
            times = trials(b, args.trials, args.seed)
            mem = memory(b, min(8, args.burst))  # the pool holds at most --burst
            lat, lags, from_pool = burst(b, args.burst, pooled=True)
            cold_lat: list[float] = []
            if not args.no_cold_burst:
                cold_lat, cold_lags, _ = burst(b, args.burst, pooled=False)
        finally:
            b.close()
    p = {k: (percentile(v, 0.5), percentile(v, 0.95)) for k, v in times.items()}
    print(
        f"warm pool, runtime {run.runtime or 'engine default'}, image {run.app.image_id[7:19]}, "
        f"{args.trials} trials (interleaved, order shuffled per trial)"
    )
    print(f"  {'case':<9} {'what':<50} {'p50 ms':>8} {'p95 ms':>8}")
    for k, (p50, p95) in p.items():
        print(f"  {k:<9} {DESCRIPTIONS[k]:<50} {_ms(p50)} {_ms(p95)}")
    print("ratios:")
    for a, base in ((POOL, CLI_RUN), (POOL, SDK_RUN), (COLD, CLI_RUN), (WARM, SDK_EXEC)):
        print(
            f"  {a + ' / ' + base:<20} p50 {p[a][0] / p[base][0]:6.2f}x"
            f"   p95 {p[a][1] / p[base][1]:6.2f}x"
        )
    cold50 = p[COLD][0]
    print(f"{args.burst} new conversations at once, pool filled to {args.burst} first:")
    print(
        f"  from pool {from_pool}/{args.burst}: p50 {_ms(percentile(lat, 0.5))} ms, "
        f"p99 {_ms(percentile(lat, 0.99))} ms, loop lag p99 {_ms(percentile(lags, 0.99))} ms, "
        f"max {_ms(max(lags))} ms"
    )
    print(f"  burst p99 / single cold p50: {percentile(lat, 0.99) / cold50:6.2f}x")
    if cold_lat:
        print(
            f"  pool off (all cold): p50 {_ms(percentile(cold_lat, 0.5))} ms, "
            f"p99 {_ms(percentile(cold_lat, 0.99))} ms, "
            f"loop lag p99 {_ms(percentile(cold_lags, 0.99))} ms; "
            f"p99 / single cold p50 {percentile(cold_lat, 0.99) / cold50:6.2f}x"
        )
    pooled, plain, claimed = mem
    print("idle memory (median cgroup usage):")
    print(f"  pooled sandbox waiting {pooled / 2**20:7.2f} MiB")
    print(
        f"  plain `sleep infinity` {plain / 2**20:7.2f} MiB   pooled / plain {pooled / plain:5.2f}x"
    )
    if claimed:
        print(f"  claimed idle sandbox (resident runner inside) {claimed / 2**20:7.2f} MiB")
    print(f"(wall time {time.monotonic() - started:.0f}s, containers removed)")


if __name__ == "__main__":
    main()
