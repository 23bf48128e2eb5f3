"""What the gateway counts for Prometheus (O2), in a registry of its own.

    Metrics(store_path, clock)          one per Gateway (tests start many)
      .turn(run_turn) -> run_turn       wraps the turn loop's turn function
      .delivery(deliver) -> deliver     wraps the reply delivery
      .observe(stage, agent, seconds)   a stage of a turn (sandbox_ensure, harness)
      .reaped(agent)                    a sandbox was removed
      .watch_loop()                     a task measuring event-loop lag
      .render() -> bytes                the text format

Counters kept in memory: turns by agent, channel and outcome; latency
histograms; deliveries, retries and errors by channel; sandboxes reaped. Read
from the store at scrape time (durable, so they survive a restart): live
sandboxes by agent, queue depth by state, refusals by rule and action.
Labels are agent ids, channel names, rule ids and fixed words: never a chat
id, a sender, a token or a message's text.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cellgate.errors import EngineUnavailable

if TYPE_CHECKING:
    from orchestrator.store import Conversation, Message, Reply
    from orchestrator.turns import TurnAnswer

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LAG_INTERVAL = 0.5
_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_FAILED_KEYS_MAX = 4096

Stage = Literal["sandbox_ensure", "harness"]
RunTurn = Callable[["Conversation", "Message"], Awaitable["TurnAnswer"]]
Deliver = Callable[["Conversation", "Reply"], Awaitable[None]]


class _StoreCollector(Collector):
    """Series read from the state database at scrape time, over a read-only connection."""

    def __init__(self, path: Path) -> None:
        self._path = path

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(f"file:{self._path}?mode=ro", uri=True, timeout=2)
        try:
            yield conn
        finally:
            conn.close()

    def collect(self) -> Iterator[Metric]:
        live = GaugeMetricFamily(
            "cellgate_sandboxes_live", "Sandboxes this gateway runs now", labels=["agent"]
        )
        queue = GaugeMetricFamily(
            "cellgate_queue_depth",
            "Messages accepted and not yet answered, by state",
            labels=["state"],
        )
        refusals = CounterMetricFamily(
            "cellgate_refusals",
            "Refusals recorded in the audit table, by rule and action",
            labels=["rule", "action"],
        )
        if self._path.exists():
            with self._db() as db:
                for agent, n in db.execute("SELECT agent, count(*) FROM sandboxes GROUP BY agent"):
                    live.add_metric([str(agent)], float(n))
                counts = dict(
                    db.execute(
                        "SELECT state, count(*) FROM messages"
                        " WHERE state IN ('accepted', 'running') GROUP BY state"
                    ).fetchall()
                )
                for rule, action, n in db.execute(
                    "SELECT rule, action, count(*) FROM refusals GROUP BY rule, action"
                ):
                    refusals.add_metric([str(rule)[:40], str(action)[:120]], float(n))
        else:
            counts = {}
        for state in ("accepted", "running"):
            queue.add_metric([state], float(counts.get(state, 0)))
        yield from (live, queue, refusals)


class Metrics:
    def __init__(self, store_path: Path, clock: Callable[[], float] = time.time) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._clock = clock
        r = self.registry
        self.turns = Counter(
            "cellgate_turns", "Turns run, by outcome", ["agent", "channel", "outcome"], registry=r
        )
        self.queue_wait = Histogram(
            "cellgate_turn_queue_wait_seconds",
            "From a message's arrival to the start of its turn",
            ["agent"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.stage = Histogram(
            "cellgate_turn_stage_seconds",
            "Time in a stage of a turn (sandbox_ensure, harness)",
            ["agent", "stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.turn_seconds = Histogram(
            "cellgate_turn_seconds",
            "A whole turn, from its start to its answer",
            ["agent", "channel"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.deliveries = Counter(
            "cellgate_channel_deliveries",
            "Replies delivered into a channel, by outcome",
            ["channel", "outcome"],
            registry=r,
        )
        self.retries = Counter(
            "cellgate_channel_delivery_retries",
            "Delivery attempts after a failed one",
            ["channel"],
            registry=r,
        )
        self.reaped_total = Counter(
            "cellgate_sandboxes_reaped", "Sandboxes removed (idle, evicted)", ["agent"], registry=r
        )
        self.loop_lag = Histogram(
            "cellgate_event_loop_lag_seconds",
            "How late the event loop woke a sleeping task",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.loop_lag_last = Gauge(
            "cellgate_event_loop_lag_last_seconds", "The latest lag measured", registry=r
        )
        r.register(_StoreCollector(store_path))
        self._failed_keys: OrderedDict[str, None] = OrderedDict()

    def turn(self, run_turn: RunTurn) -> RunTurn:
        async def counted(conv: Conversation, message: Message) -> TurnAnswer:
            self.queue_wait.labels(conv.agent).observe(
                max(0.0, self._clock() - message.received_at)
            )
            outcome = "error"
            start = time.perf_counter()
            try:
                answer = await run_turn(conv, message)
                outcome = "ok" if answer.ok else "failed"
                return answer
            except EngineUnavailable:
                outcome = "engine_unavailable"
                raise
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            finally:
                self.turns.labels(conv.agent, conv.channel, outcome).inc()
                self.turn_seconds.labels(conv.agent, conv.channel).observe(
                    time.perf_counter() - start
                )

        return counted

    def observe(self, stage: Stage, agent: str, seconds: float) -> None:
        self.stage.labels(agent, stage).observe(seconds)

    def delivery(self, deliver: Deliver) -> Deliver:
        async def counted(conv: Conversation, reply: Reply) -> None:
            if reply.outbound_key in self._failed_keys:
                self.retries.labels(conv.channel).inc()
            try:
                await deliver(conv, reply)
            except asyncio.CancelledError:
                raise
            except Exception:
                self.deliveries.labels(conv.channel, "error").inc()
                self._failed_keys[reply.outbound_key] = None
                while len(self._failed_keys) > _FAILED_KEYS_MAX:
                    self._failed_keys.popitem(last=False)
                raise
            self._failed_keys.pop(reply.outbound_key, None)
            self.deliveries.labels(conv.channel, "ok").inc()

        return counted

    def reaped(self, agent: str) -> None:
        self.reaped_total.labels(agent).inc()

    async def watch_loop(self, interval: float = LAG_INTERVAL) -> None:
        """Sleep `interval` again and again; how late each wake-up came is the lag."""
        while True:
            start = time.perf_counter()
            await asyncio.sleep(interval)
            lag = max(0.0, time.perf_counter() - start - interval)
            self.loop_lag.observe(lag)
            self.loop_lag_last.set(lag)

    def render(self) -> bytes:
        return generate_latest(self.registry)
