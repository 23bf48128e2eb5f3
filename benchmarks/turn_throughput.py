"""Turn throughput over many conversations through `Gateway.turn`, beside raw SDK exec.

    python benchmarks/turn_throughput.py [--chats 50] [--turns 6] [--rounds 3]
                                         [--concurrency 8] [--runtime runsc]

One run installs the sample app (shell harness) in a temporary state dir with
`gateway.maxConcurrentTurns` = `--concurrency`, runs the gateway on an event
loop of its own thread, and measures:

- cold: the first turn (`true`) of `--chats` new conversations, all submitted
  at once (each creates, starts and verifies its sandbox), beside `--chats`
  plain containers of the same image id each started (`containers.run`,
  detached, `sleep infinity`) and sent one `exec` of `true`, on
  `--concurrency` threads. These containers are the raw side's warm ones.
- warm: `--turns` more turns in each conversation, in `--rounds` rounds that
  alternate which side goes first. In a gateway round every chat sends its
  turns one after another (the next when the reply is back), all chats at
  once, and the gateway's bound runs `--concurrency` turns at a time; in a raw
  round `--concurrency` threads do the same number of `exec_create` +
  `exec_start` of `true`, each container's one after another.

It prints turns/s of each side (all turns over all their rounds' time), each
round's rate, per-turn latency p50/p95 under that load, and gateway/raw ratios.
Every container it made is removed at the end, also on error or ^C.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._setup import CHANNEL, BenchRun, GatewayService, bench_run, percentile
from orchestrator.gateway import Gateway

APP = "cgthru"


class Rate:
    """Turns and seconds of one side, over its rounds, with each turn's latency."""

    def __init__(self) -> None:
        self.turns = 0
        self.seconds = 0.0
        self.rounds: list[float] = []
        self.latencies: list[float] = []

    def add_round(self, turns: int, seconds: float, latencies: list[float]) -> None:
        self.turns += turns
        self.seconds += seconds
        self.rounds.append(turns / seconds)
        self.latencies.extend(latencies)

    @property
    def per_second(self) -> float:
        return self.turns / self.seconds


async def _gateway_round(gateway: Gateway, agent: str, chats: list[str], turns: int) -> list[float]:
    async def chat_turns(chat: str) -> list[float]:
        latencies = []
        for _ in range(turns):
            t0 = time.perf_counter()
            outcome = await gateway.turn(agent, CHANNEL, chat, "true")
            latencies.append(time.perf_counter() - t0)
            if outcome.result.meta.get("exit_code") != 0:
                raise SystemExit(f"a gateway turn in {chat} failed: {outcome.result.reply!r}")
        return latencies

    per_chat = await asyncio.gather(*(chat_turns(c) for c in chats))
    return [t for chat in per_chat for t in chat]


def _exec_true(api: Any, container_id: str) -> float:
    t0 = time.perf_counter()
    exec_id = api.exec_create(container_id, ["true"])["Id"]
    api.exec_start(exec_id)
    elapsed = time.perf_counter() - t0
    if api.exec_inspect(exec_id)["ExitCode"] != 0:
        raise SystemExit(f"the raw exec of `true` in {container_id[:12]} failed")
    return elapsed


def _raw_round(
    pool: ThreadPoolExecutor, api: Any, containers: list[Any], turns: int
) -> list[float]:
    def container_turns(container: Any) -> list[float]:
        return [_exec_true(api, container.id) for _ in range(turns)]

    return [t for per in pool.map(container_turns, containers) for t in per]


def _raw_cold(pool: ThreadPoolExecutor, run: BenchRun, n: int) -> tuple[list[Any], list[float]]:
    def start_and_exec(_: int) -> tuple[Any, float]:
        t0 = time.perf_counter()
        container = run.plain_container()
        _exec_true(run.client.api, container.id)
        return container, time.perf_counter() - t0

    done = list(pool.map(start_and_exec, range(n)))
    return [c for c, _ in done], [t for _, t in done]


def measure(run: BenchRun, args: argparse.Namespace) -> dict[str, Rate]:
    rates = {name: Rate() for name in ("gateway cold", "raw cold", "gateway warm", "raw warm")}
    service = GatewayService(run)
    per_round, extra = divmod(args.turns, args.rounds)
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            chats = [run.new_chat("chat") for _ in range(args.chats)]
            t0 = time.perf_counter()
            lat = service.call(_gateway_round(service.gateway, run.agent, chats, 1))
            rates["gateway cold"].add_round(args.chats, time.perf_counter() - t0, lat)
            t0 = time.perf_counter()
            containers, lat = _raw_cold(pool, run, args.chats)
            rates["raw cold"].add_round(args.chats, time.perf_counter() - t0, lat)
            for r in range(args.rounds):
                turns = per_round + (1 if r < extra else 0)
                sides = ["gateway", "raw"] if r % 2 == 0 else ["raw", "gateway"]
                for side in sides:
                    t0 = time.perf_counter()
                    if side == "gateway":
                        lat = service.call(_gateway_round(service.gateway, run.agent, chats, turns))
                    else:
                        lat = _raw_round(pool, run.client.api, containers, turns)
                    rates[f"{side} warm"].add_round(len(lat), time.perf_counter() - t0, lat)
                print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        service.close()
    return rates


def report(run: BenchRun, args: argparse.Namespace, rates: dict[str, Rate]) -> None:
    print(
        f"turn throughput, runtime {run.runtime or 'runc (engine default)'}, "
        f"image {run.app.image_id[7:19]}, {args.chats} conversations, concurrency "
        f"{args.concurrency} (gateway maxConcurrentTurns, raw threads), warm: "
        f"{args.turns} turns each in {args.rounds} alternating rounds"
    )
    head = ("side", "turns", "turns/s", "each round turns/s", "p50 ms", "p95 ms")
    print("  {:<13} {:>6} {:>8} {:<22} {:>7} {:>7}".format(*head))
    for name, rate in rates.items():
        rounds = " ".join(f"{x:.1f}" for x in rate.rounds)
        print(
            f"  {name:<13} {rate.turns:>6} {rate.per_second:>8.1f} {rounds:<22} "
            f"{percentile(rate.latencies, 0.5) * 1e3:>7.1f} "
            f"{percentile(rate.latencies, 0.95) * 1e3:>7.1f}"
        )
    print(
        "  (latency: from submit to reply; a gateway turn also waits for the bound, with every\n"
        "   chat's next turn in flight; a raw exec waits only for its thread)"
    )
    print("ratios (gateway / raw, turns/s):")
    for kind in ("warm", "cold"):
        g, r = rates[f"gateway {kind}"].per_second, rates[f"raw {kind}"].per_second
        print(f"  {kind}: {g / r:.2f}x   (raw is {r / g:.2f}x the gateway)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chats", type=int, default=50, help="conversations (and raw containers)")
    parser.add_argument("--turns", type=int, default=6, help="warm turns per conversation")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of warm turns")
    parser.add_argument("--concurrency", type=int, default=8, help="maxConcurrentTurns and threads")
    parser.add_argument("--runtime", default=None, help="OCI runtime for both sides, e.g. runsc")
    args = parser.parse_args()
    if min(args.chats, args.turns, args.rounds, args.concurrency) < 1 or args.rounds > args.turns:
        parser.error("--chats, --turns, --rounds, --concurrency >= 1 and --rounds <= --turns")
    started = time.monotonic()
    with bench_run(
        APP,
        runtime=args.runtime,
        max_concurrent_turns=args.concurrency,
        pool=args.concurrency + 8,
    ) as run:
        rates = measure(run, args)
    report(run, args, rates)
    print(f"(wall time {time.monotonic() - started:.0f}s, containers removed)")


if __name__ == "__main__":
    main()
