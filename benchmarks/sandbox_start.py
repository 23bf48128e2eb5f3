"""Cold and warm turn latency through `Gateway.turn`, each beside a raw Docker baseline.

    python benchmarks/sandbox_start.py [--trials 20] [--runtime runsc]

One run installs the sample app (shell harness) in a temporary state dir, runs
the gateway on an event loop of its own thread (as a service), and times, in
the same trials, with the order of the cases shuffled in each trial so a noisy
moment hits them all alike:

- cold: the first turn of a NEW conversation (fresh chat id each trial), text
  `true`: store, turn loop, directories, workspace scan and mount plan,
  container create and start, verification, bridge, exec of `true`. Its
  sandbox is removed after the trial (untimed), so every trial starts alike;
- SDK run: `containers.run(IMAGE, "true", remove=True, network_mode="none")`
  with the Docker SDK (create, start, wait, logs, remove);
- CLI run: `docker run --rm --network none IMAGE true`;
- warm: a later turn of one conversation whose sandbox is running;
- SDK exec: `api.exec_create` + `api.exec_start` of `true` in a plain running
  container (`sleep infinity`, no hardening, no mounts);
- sbx exec: the same two calls with what the shell harness sends, in the warm
  conversation's own sandbox (`timeout -k 2 30 /bin/sh -c true`, its user,
  env and workdir): warm / sbx exec is the gateway's own share of a turn.

IMAGE is the sandbox's own image id. With `--runtime runsc` the sandboxes and
every baseline container run under gVisor. It prints p50/p95 of each, the
ratios, and where a gateway turn's time goes (each phase's p50, timed by
wrapping the backend, the engine client and the store of this gateway).
Every container it made is removed at the end, also on error or ^C.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._setup import (
    BENCH_LABEL,
    CHANNEL,
    BenchRun,
    GatewayService,
    bench_run,
    percentile,
)
from cellgate.models import ConversationKey
from orchestrator import runner as gateway_module
from orchestrator.gateway import Gateway, TurnOutcome
from sandbox.backends.docker import EXEC_MARKER_ENV, KILL_AFTER
from sandbox.mountplan import HOME

T = TypeVar("T")
APP = "cgstart"
WARMUP = 2

COLD, SDK_RUN, CLI_RUN, WARM, SDK_EXEC = "cold", "SDK run", "CLI run", "warm", "SDK exec"
SANDBOX_EXEC = "sbx exec"
DESCRIPTIONS = {
    COLD: "Gateway.turn `true`, new conversation",
    SDK_RUN: "SDK containers.run(IMAGE, 'true', remove=True)",
    CLI_RUN: "docker run --rm --network none IMAGE true",
    WARM: "Gateway.turn `true`, same conversation",
    SDK_EXEC: "SDK exec_create + exec_start `true`",
    SANDBOX_EXEC: "same, with the harness's argv/user/env, in sandbox",
}
RATIOS = ((COLD, SDK_RUN), (COLD, CLI_RUN), (WARM, SDK_EXEC), (WARM, SANDBOX_EXEC))

# Phases of a gateway turn (top level, not overlapping) and engine calls inside them.
P_STORE = "store (sqlite, in threads)"
P_SPEC = "spec: dirs, workspace scan, mount plan"
P_ENSURE = "ensure: engine look-up, create, start"
P_VERIFY = "verify: inspect + compare (S4)"
P_EXEC = "exec `true` (create, start+stream, inspect)"
P_FILES = "host files: client, CLAUDE.md, history, transcript"
P_BRIDGE = "bridge: open the conversation's socket"
P_REST = "rest: turn loop, event loop and thread hops"
TOP = (P_STORE, P_SPEC, P_ENSURE, P_VERIFY, P_FILES, P_BRIDGE, P_EXEC)
HOST_FILES = ("install_client", "write_session_files", "load_session_id", "recent_history")
ENGINE = ("inspect_container", "create_container", "start", "exec_create", "exec_inspect")


class Phases:
    """Seconds spent per phase during the current trial (None: not recording)."""

    def __init__(self) -> None:
        self.current: dict[str, float] | None = None
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._depth = threading.local()

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            if self.current is not None:
                self.current[name] = self.current.get(name, 0.0) + seconds
                self.counts[name] = self.counts.get(name, 0) + 1

    @contextlib.contextmanager
    def trial(self) -> Iterator[dict[str, float]]:
        with self._lock:
            self.current = {}
            self.counts = {}
        recorded = self.current
        try:
            yield recorded
        finally:
            with self._lock:
                self.current = None

    def sync(self, name: str, fn: Callable[..., T], *, outermost: bool = False) -> Callable[..., T]:
        """`fn`, timed under `name`; with `outermost`, nested calls of the group count once."""

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> T:
            depth = getattr(self._depth, name, 0)
            setattr(self._depth, name, depth + 1)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self._depth, name, depth)
                if not (outermost and depth):
                    self.add(name, time.perf_counter() - t0)

        return timed

    def coro(
        self, name: str, fn: Callable[..., Coroutine[Any, Any, T]]
    ) -> Callable[..., Coroutine[Any, Any, T]]:
        @functools.wraps(fn)
        async def timed(*args: Any, **kwargs: Any) -> T:
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0)

        return timed


def instrument(gateway: Gateway, agent: str, phases: Phases) -> None:
    """Time this gateway's phases by wrapping its objects' bound methods (instance attributes)."""
    backend: Any = gateway.backend
    sandboxes: Any = gateway.agents[agent].sandboxes
    sandboxes.spec_for = phases.coro(P_SPEC, sandboxes.spec_for)
    backend._ensure = phases.coro(P_ENSURE, backend._ensure)
    backend.verify = phases.coro(P_VERIFY, backend.verify)
    backend._exec = phases.coro(P_EXEC, backend._exec)
    api = backend._client.api
    for name in ENGINE:
        setattr(api, name, phases.sync(f"engine {name}", getattr(api, name)))
    gw: Any = gateway
    gw.runner.compose = phases.sync(P_FILES, gw.runner.compose, outermost=True)
    gw.runner.save_turn = phases.sync(P_FILES, gw.runner.save_turn, outermost=True)
    for name in HOST_FILES:
        setattr(
            gateway_module,
            name,
            phases.sync(P_FILES, getattr(gateway_module, name), outermost=True),
        )
    gw.bridge.open = phases.coro(P_BRIDGE, gw.bridge.open)
    store: Any = gateway.store
    for name in dir(type(store)):
        attr = getattr(store, name)
        if not name.startswith("_") and callable(attr) and name != "close":
            setattr(store, name, phases.sync(P_STORE, attr, outermost=True))


def _checked(outcome: TurnOutcome) -> None:
    if outcome.result.meta.get("exit_code") != 0:
        raise SystemExit(f"a gateway turn failed: {outcome.result.reply!r}")


def run_trials(run: BenchRun, trials: int, seed: int) -> tuple[dict[str, list[float]], Any, str]:
    service = GatewayService(run)
    phases = Phases()
    plain = run.plain_container()
    api = run.client.api
    image = run.app.image_id
    runtime = ["--runtime", run.runtime] if run.runtime else []
    cli = [
        "docker", "run", "--rm", "--network", "none",
        "--label", f"{BENCH_LABEL}={run.run_id}", *runtime, image, "true",
    ]  # fmt: skip
    warm_chat = run.new_chat("warm")
    sandbox = api.inspect_container(service.turn(run.agent, warm_chat, "true").sandbox)
    # What the shell harness asks the backend for: `sh -c`, under coreutils `timeout`.
    sandbox_argv = ["timeout", "-k", str(KILL_AFTER), "30", "/bin/sh", "-c", "true"]
    sandbox_env = {
        **service.gateway.session_env(ConversationKey(run.agent, CHANNEL, warm_chat), str(HOME)),
        EXEC_MARKER_ENV: "0" * 24,
    }
    breakdown: dict[str, list[dict[str, float]]] = {COLD: [], WARM: []}

    cold_sandboxes: list[str] = []

    def cold() -> None:
        outcome = service.turn(run.agent, run.new_chat("cold"), "true")
        cold_sandboxes.append(outcome.sandbox)
        _checked(outcome)

    def cold_cleanup() -> None:
        api.remove_container(cold_sandboxes.pop(), force=True, v=True)

    def sdk_run() -> None:
        run.client.containers.run(image, "true", remove=True, **run.run_kwargs())

    def cli_run() -> None:
        subprocess.run(cli, check=True, capture_output=True)

    def warm() -> None:
        _checked(service.turn(run.agent, warm_chat, "true"))

    def sdk_exec() -> None:
        exec_id = api.exec_create(plain.id, ["true"])["Id"]
        api.exec_start(exec_id)
        last_exec.append(exec_id)

    def sandbox_exec() -> None:
        exec_id = api.exec_create(
            sandbox["Id"],
            sandbox_argv,
            user=sandbox["Config"]["User"],
            environment=sandbox_env,
            workdir=sandbox["Config"]["WorkingDir"],
        )["Id"]
        api.exec_start(exec_id)
        last_exec.append(exec_id)

    last_exec: list[str] = []
    cases: dict[str, Callable[[], None]] = {
        COLD: cold,
        SDK_RUN: sdk_run,
        CLI_RUN: cli_run,
        WARM: warm,
        SDK_EXEC: sdk_exec,
        SANDBOX_EXEC: sandbox_exec,
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    rng = random.Random(seed)
    plain.reload()
    runtimes = (
        f"sandbox {sandbox['HostConfig'].get('Runtime')}, "
        f"plain {plain.attrs['HostConfig'].get('Runtime')}"
    )
    try:
        instrument(service.gateway, run.agent, phases)
        for i in range(WARMUP + trials):
            order = list(cases)
            rng.shuffle(order)
            for name in order:
                with phases.trial() as spent:
                    t0 = time.perf_counter()
                    cases[name]()
                    elapsed = time.perf_counter() - t0
                if name == COLD:
                    cold_cleanup()
                if (
                    name in (SDK_EXEC, SANDBOX_EXEC)
                    and api.exec_inspect(last_exec.pop())["ExitCode"] != 0
                ):
                    raise SystemExit("the raw exec of `true` failed")
                if i >= WARMUP:
                    times[name].append(elapsed)
                    if name in breakdown:
                        breakdown[name].append({**spent, "total": elapsed})
            if sys.stderr.isatty():
                print(f"  trial {i + 1 - WARMUP}/{trials} ", end="\r", file=sys.stderr)
    finally:
        service.close()
    return times, breakdown, runtimes


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f}"


def report(
    run: BenchRun,
    trials: int,
    times: dict[str, list[float]],
    breakdown: dict[str, list[dict[str, float]]],
    runtimes: str,
) -> None:
    p = {name: (percentile(ts, 0.5), percentile(ts, 0.95)) for name, ts in times.items()}
    print(
        f"sandbox start, runtime {run.runtime or 'engine default'} ({runtimes}), "
        f"image {run.app.image_id[7:19]}, {trials} trials "
        "(interleaved, order shuffled per trial)"
    )
    print(f"  {'case':<9} {'what':<48} {'p50 ms':>8} {'p95 ms':>8}")
    for name, (p50, p95) in p.items():
        print(f"  {name:<9} {DESCRIPTIONS[name]:<48} {_ms(p50)} {_ms(p95)}")
    print("ratios (gateway / raw baseline):")
    for measured, base in RATIOS:
        label = f"{measured} / {base}"
        print(
            f"  {label:<20} p50 {p[measured][0] / p[base][0]:6.2f}x"
            f"   p95 {p[measured][1] / p[base][1]:6.2f}x"
        )
    print("where a gateway turn's time goes (p50 of each phase over the trials, ms):")
    for name, rows in breakdown.items():
        total = percentile([r["total"] for r in rows], 0.5)
        print(f"  {name} turn, total p50 {_ms(total)}")
        for phase in TOP:
            print(f"    {phase:<50} {_ms(percentile([r.get(phase, 0.0) for r in rows], 0.5))}")
        rest = [r["total"] - sum(r.get(ph, 0.0) for ph in TOP) for r in rows]
        print(f"    {P_REST:<50} {_ms(percentile(rest, 0.5))}")
        engine = [
            f"{call} {percentile([r.get(f'engine {call}', 0.0) for r in rows], 0.5) * 1e3:.1f}"
            for call in ENGINE
        ]
        print(f"    engine calls (summed per turn): {', '.join(engine)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="timed trials per case (>= 20)")
    parser.add_argument("--runtime", default=None, help="OCI runtime for both sides, e.g. runsc")
    parser.add_argument("--seed", type=int, default=1, help="seed of the per-trial case order")
    args = parser.parse_args()
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    started = time.monotonic()
    with bench_run(APP, runtime=args.runtime) as run:
        times, breakdown, runtimes = run_trials(run, args.trials, args.seed)
    report(run, args.trials, times, breakdown, runtimes)
    print(f"(wall time {time.monotonic() - started:.0f}s, containers removed)")


if __name__ == "__main__":
    main()
